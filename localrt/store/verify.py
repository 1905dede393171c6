"""`localrt verify`: check the store the way a pull checks what it downloads, after a crash or a disk error.

Every manifest is parsed and every blob it names must be there, of the size the manifest says, and hash to
its digest; with no model named, every other blob is re-hashed too (a blob no model names is reported,
not removed: an upload waiting for its create looks the same). What killed writes left behind is
recovered first (`Store.recover`). `repair` removes what is broken: each damaged blob, and each model
whose manifest is unreadable or names a missing or damaged blob (its other blobs stay, so pulling it
again fetches only what was lost); the report names the models to pull again.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from dataclasses import field
from pathlib import Path

from localrt.errors import LocalrtError
from localrt.store import files
from localrt.store.names import ModelName
from localrt.store.names import normalize_digest
from localrt.store.store import HASH_CHUNK
from localrt.store.store import Leftover
from localrt.store.store import Store
from localrt.store.store import manifest_layers
from localrt.store.store import parse_manifest

# (bytes hashed so far, bytes to hash in all)
VerifyProgressFn = Callable[[int, int], None]


@dataclass
class Problem:
    """One thing found broken, in one line, and the models it breaks."""

    text: str
    models: list[str] = field(default_factory=list)


@dataclass
class Report:
    models: int = 0
    blobs: int = 0
    bytes: int = 0
    problems: list[Problem] = field(default_factory=list)
    leftovers: list[Leftover] = field(default_factory=list)
    unreferenced: list[tuple[str, int]] = field(default_factory=list)  # (digest, size)
    removed: list[str] = field(default_factory=list)  # what --repair removed, one line each
    broken_models: list[str] = field(default_factory=list)  # to pull (or create) again

    @property
    def ok(self) -> bool:
        return not self.problems


@dataclass
class _Model:
    name: ModelName
    path: Path
    layers: dict[str, int | None] = field(default_factory=dict)  # digest -> size the manifest names
    error: str | None = None  # the manifest itself is unreadable


def verify(
    store: Store,
    name: ModelName | None = None,
    *,
    repair: bool = False,
    progress: VerifyProgressFn | None = None,
) -> Report:
    """Check `name` (or the whole store); with `repair`, remove what is broken. See the module's text."""
    report = Report(leftovers=store.recover())
    models = _read_manifests(store, name)
    report.models = len(models)
    wanted: dict[str, list[str]] = {}  # digest -> the models that name it
    for model in models:
        for digest in model.layers:
            wanted.setdefault(digest, []).append(model.name.display)
    everything = _stored_digests(store) if name is None else set()
    to_hash = sorted(d for d in set(wanted) | everything if store.has_blob(d))
    sizes = {d: store.blob_path(d).stat().st_size for d in to_hash}
    report.blobs, report.bytes = len(to_hash), sum(sizes.values())
    damaged = _hash_all(store, to_hash, sizes, progress or (lambda done, total: None))
    broken: dict[str, str] = {}  # model -> the first reason it is broken
    for model in models:
        reasons = _model_problems(model, sizes, damaged)
        if reasons:
            broken[model.name.display] = reasons[0]
        for reason in reasons:
            if "damaged" not in reason:  # a damaged blob is one line of its own, naming its models
                report.problems.append(Problem(f"{model.name.display}: {reason}", [model.name.display]))
    for digest, actual in damaged.items():
        names = wanted.get(digest, [])
        named = f"named by {', '.join(names)}" if names else "no model names it"
        report.problems.append(
            Problem(f"damaged: blob {digest} ({_size(sizes[digest])}) hashes to {actual} ({named})", names)
        )
    report.broken_models = sorted(broken)
    report.unreferenced = [(d, sizes[d]) for d in to_hash if d not in wanted and d not in damaged]
    if repair and report.problems:
        _repair(store, report, models, damaged, broken)
    return report


def _read_manifests(store: Store, name: ModelName | None) -> list[_Model]:
    if name is not None:
        paths = [(name, store.find_manifest(name))]
    else:
        paths = list(store.walk_manifests())
    models = []
    for model_name, path in paths:
        model = _Model(model_name, path)
        try:
            manifest = parse_manifest(path.read_bytes())
            for layer in manifest_layers(manifest):
                size = layer.get("size")
                model.layers[layer["digest"]] = size if isinstance(size, int) else None
        except (OSError, LocalrtError) as e:
            model.error = str(e) or type(e).__name__
        models.append(model)
    return models


def _stored_digests(store: Store) -> set[str]:
    out = set()
    if store.blobs.is_dir():
        for path in store.blobs.iterdir():
            if path.name.startswith("sha256-") and path.is_file():
                try:
                    out.add(normalize_digest(path.name))
                except LocalrtError:
                    continue  # a partial download or a stray file: not a blob
    return out


def _hash_all(
    store: Store, digests: list[str], sizes: dict[str, int], progress: VerifyProgressFn
) -> dict[str, str]:
    """Re-hash each blob; returns digest -> what it actually hashes to, for the damaged ones."""
    total, done = sum(sizes.values()), 0
    damaged = {}
    progress(0, total)
    for digest in digests:
        h = hashlib.sha256()
        try:
            with open(store.blob_path(digest), "rb") as f:
                while block := f.read(HASH_CHUNK):
                    h.update(block)
                    done += len(block)
                    progress(min(done, total), total)
        except OSError as e:  # an unreadable sector is as damaged as a flipped bit
            damaged[digest] = f"nothing: it cannot be read ({e.strerror or e})"
            continue
        actual = "sha256:" + h.hexdigest()
        if actual != digest:
            damaged[digest] = actual
    progress(total, total)
    return damaged


def _model_problems(model: _Model, sizes: dict[str, int], damaged: dict[str, str]) -> list[str]:
    if model.error is not None:
        return [f"its manifest {model.path} is unreadable ({model.error})"]
    out = []
    for digest, size in model.layers.items():
        if digest in damaged:
            out.append(f"blob {digest} is damaged")
        elif digest not in sizes:
            out.append(f"blob {digest} is missing")
        elif size is not None and size != sizes[digest]:
            out.append(f"blob {digest} has {sizes[digest]} bytes, its manifest says {size}")
    return out


def _repair(
    store: Store, report: Report, models: list[_Model], damaged: dict[str, str], broken: dict[str, str]
) -> None:
    """Each broken model's manifest goes first (durably), then the damaged blobs: no step leaves a
    manifest naming a blob that is gone."""
    with store.lock("gc"):
        for model in models:
            reason = broken.get(model.name.display)
            if reason is None:
                continue
            with store.lock("manifest:" + str(model.name.manifest_relpath()).lower()):
                model.path.unlink(missing_ok=True)
                files.fsync_dir(model.path.parent)
            report.removed.append(f"removed model {model.name.display}: {reason}")
        for digest in damaged:
            store.blob_path(digest).unlink(missing_ok=True)
            report.removed.append(f"removed damaged blob {digest}")
        if damaged:
            files.fsync_dir(store.blobs)


def _size(n: int) -> str:
    from localrt.format import format_bytes

    return format_bytes(n)
