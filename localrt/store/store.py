"""The model store, laid out exactly as Ollama's so `LOCALRT_MODELS=~/.ollama/models` works in place.

    <root>/manifests/<host>/<namespace>/<model>/<tag>   Docker v2 manifest JSON
    <root>/blobs/sha256-<hex>                           content-addressed layers
    <root>/blobs/sha256-<hex>-partial                   a resumable download in progress
    <root>/.locks/                                      our file locks (Ollama ignores the folder)

Invariants: a blob is only ever renamed into place after its sha256 matched and its bytes were
fsynced; a manifest is only written (temp file, fsync, rename, fsync of its folder) once every blob it
names is in place; `remove` makes the manifest's removal durable before it collects unreferenced blobs.
So a crash or a power cut at any instant leaves each model either as it was or as it was going to be:
no manifest names a missing or partial blob, and no blob is stored under a digest it does not hash to.
What a killed write leaves behind (temporary files and folders, partial downloads) is found by
`Store.recover`, which runs when `localrt serve` starts and before the CLI works on the store itself.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from dataclasses import field
from pathlib import Path
from typing import Any
from typing import BinaryIO

from filelock import FileLock
from filelock import Timeout

from localrt import config
from localrt import faults
from localrt.errors import DigestMismatch
from localrt.errors import LocalrtError
from localrt.errors import ModelNotFound
from localrt.format import format_bytes
from localrt.store import files
from localrt.store.names import ModelName
from localrt.store.names import normalize_digest
from localrt.store.names import parse_name

MANIFEST_MEDIA_TYPE = "application/vnd.docker.distribution.manifest.v2+json"
CONFIG_MEDIA_TYPE = "application/vnd.docker.container.image.v1+json"
MEDIA_PREFIX = "application/vnd.ollama.image."
MEDIA_MODEL = MEDIA_PREFIX + "model"
MEDIA_TEMPLATE = MEDIA_PREFIX + "template"
MEDIA_SYSTEM = MEDIA_PREFIX + "system"
MEDIA_PARAMS = MEDIA_PREFIX + "params"
MEDIA_LICENSE = MEDIA_PREFIX + "license"
MEDIA_DRAFT = MEDIA_PREFIX + "draft"
REMOTE_FORMAT = "remote"  # config `model_format` of a remote model (localrt/store/remote.py)
MEDIA_PROJECTOR = MEDIA_PREFIX + "projector"  # Ollama's: a vision model's multimodal projector GGUF
MEDIA_MESSAGES = MEDIA_PREFIX + "messages"  # Ollama's: a Modelfile's MESSAGE turns, a JSON list
MEDIA_ADAPTER = MEDIA_PREFIX + "adapter"  # Ollama's: a LoRA adapter GGUF (a Modelfile's ADAPTER), in order
MAX_MANIFEST_BYTES = 4 << 20
# left free after an upload: the store's disk is usually the system's too, and a full disk stops more
# than this server
FREE_SPACE_MARGIN = 1 << 30
HASH_CHUNK = 1 << 20
# folders a write works in, inside the store (the same filesystem as blobs/, so their output moves
# into place by a rename): a Hub download, a quantization, a conversion, an adapter, a wheel
SCRATCH_PREFIXES = (".hf-", ".quantize-", ".convert-", ".peft-", ".lora-", ".pypi-")
INCOMING_PREFIX = ".incoming-"  # a blob being written, in blobs/
MANIFEST_TEMP_PREFIX = ".manifest-"  # a manifest being written, beside its target
REMOVING_PREFIX = ".removing-"  # a manifest being removed: its blobs are being collected
PARTIAL_SUFFIX = "-partial"


def sha256_file(path: Path, chunk: int = HASH_CHUNK) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return "sha256:" + h.hexdigest()


@dataclass
class ModelEntry:
    """One row of `localrt list`."""

    name: ModelName
    manifest_digest: str
    size: int
    modified: float

    @property
    def id(self) -> str:
        return self.manifest_digest.split(":", 1)[1][:12]


@dataclass
class ResolvedModel:
    """Everything the runtime needs to load and prompt a stored model."""

    name: ModelName
    model_path: Path
    manifest: dict[str, Any]
    manifest_digest: str
    template: str | None = None  # a TEMPLATE layer (jinja or Ollama Go template text)
    system: str | None = None
    params: dict[str, Any] = field(default_factory=dict)
    license: str | None = None
    draft_path: Path | None = None
    config: dict[str, Any] = field(default_factory=dict)
    # a remote model (localrt/store/remote.py): its endpoints; model_path is then its config blob
    remote: dict[str, Any] | None = None
    projector_path: Path | None = None  # the mmproj GGUF of a vision model
    # a Modelfile's MESSAGE turns ({role, content}): the few-shot history every prompt starts with
    messages: list[dict[str, Any]] = field(default_factory=list)
    # LoRA adapter GGUFs (ADAPTER lines), applied over the weights in this order at scale 1.0
    adapter_paths: list[Path] = field(default_factory=list)

    @property
    def size(self) -> int:
        return sum(int(layer.get("size", 0)) for layer in self.manifest.get("layers", []))


@dataclass
class Leftover:
    """Something a killed write left in the store, and what `Store.recover` did with it."""

    path: Path
    size: int
    kept: bool  # a partial download, kept because the same pull resumes from it
    why: str

    def line(self) -> str:
        """One line for the log or the terminal: what was found, what was done, the room it takes."""
        done = "kept" if self.kept else "removed"
        return f"{done} {self.path} ({format_bytes(self.size)}): {self.why}"


class Store:
    def __init__(self, root: Path | str | None = None) -> None:
        self.root = Path(root) if root is not None else config.models_dir()
        self.blobs = self.root / "blobs"
        self.manifests = self.root / "manifests"
        self.locks = self.root / ".locks"

    # ---- paths and locks -------------------------------------------------------------------
    def _ensure(self) -> None:
        for d in (self.blobs, self.manifests, self.locks):
            if not d.is_dir():
                files.make_dirs(d)

    def blob_path(self, digest: str) -> Path:
        return self.blobs / normalize_digest(digest).replace(":", "-")

    def partial_path(self, digest: str) -> Path:
        return self.blob_path(digest).with_name(self.blob_path(digest).name + PARTIAL_SUFFIX)

    def has_blob(self, digest: str) -> bool:
        return self.blob_path(digest).is_file()

    def manifest_path(self, name: ModelName) -> Path:
        path = self.manifests.joinpath(*name.manifest_parts)
        # names are validated already; this is the belt to those braces
        if self.manifests.resolve() not in path.resolve().parents:
            raise LocalrtError(f"model name {name} escapes the store")
        return path

    @contextlib.contextmanager
    def lock(self, key: str, timeout: float = -1) -> Iterator[None]:
        """An inter-process lock; keys are digests or names, hashed into a safe file name."""
        self._ensure()
        lock_name = hashlib.sha256(key.encode()).hexdigest()[:32] + ".lock"
        with FileLock(str(self.locks / lock_name), timeout=timeout):
            yield

    # ---- temporary files and folders ---------------------------------------------------------
    def temp_file(self, folder: Path, prefix: str) -> tuple[int, Path]:
        """A new temporary file in `folder`, held (files.hold) from the moment it exists: the scratch
        lock keeps a recovery from taking it for a leftover in between."""
        self._ensure()
        with self.lock("scratch"):
            fd, tmp = tempfile.mkstemp(dir=folder, prefix=prefix)
            files.hold(fd)
        return fd, Path(tmp)

    @contextlib.contextmanager
    def scratch(self, prefix: str) -> Iterator[Path]:
        """A folder inside the store to work in (one of SCRATCH_PREFIXES), held while in use and removed
        afterwards; a file made there becomes a blob by a rename (`adopt`)."""
        if prefix not in SCRATCH_PREFIXES:
            raise ValueError(f"not a scratch prefix: {prefix}")
        self._ensure()
        with self.lock("scratch"):
            path = Path(tempfile.mkdtemp(dir=self.root, prefix=prefix))
            fd = files.hold_folder(path)
        try:
            yield path
        finally:
            shutil.rmtree(path, ignore_errors=True)
            if fd is not None:
                os.close(fd)

    def is_scratch(self, path: Path) -> bool:
        """Whether `path` lies in one of this store's scratch folders (so it may be moved, not copied)."""
        parent = path.resolve().parent
        return parent.parent == self.root.resolve() and parent.name.startswith(SCRATCH_PREFIXES)

    # ---- blobs -----------------------------------------------------------------------------
    def finalize_partial(self, digest: str) -> Path:
        """Verify a finished `-partial` download and rename it into place, or delete it and raise."""
        digest = normalize_digest(digest)
        partial, final = self.partial_path(digest), self.blob_path(digest)
        files.sync_file(partial)
        actual = sha256_file(partial)
        if actual != digest:
            partial.unlink(missing_ok=True)
            raise DigestMismatch(
                f"digest mismatch for {digest}: downloaded bytes hash to {actual}; "
                "the file was discarded and must be downloaded again"
            )
        faults.reach("blob.synced")
        files.place(partial, final)
        faults.reach("blob.placed")
        return final

    def adopt(self, path: Path, digest: str | None = None) -> tuple[str, int]:
        """Move a finished file from a scratch folder into blobs/ (hashed, synced, renamed: no copy, so
        a quantized model needs its own size on disk, not twice it); verify against `digest` if given."""
        if not self.is_scratch(path):
            raise ValueError(f"{path} is not in a scratch folder of the store")
        files.sync_file(path)
        actual = sha256_file(path)
        if digest is not None and normalize_digest(digest) != actual:
            raise DigestMismatch(f"digest mismatch: expected {digest}, content hashes to {actual}")
        size = path.stat().st_size
        final = self.blob_path(actual)
        faults.reach("blob.synced")
        if final.exists():
            path.unlink()
        else:
            files.place(path, final)
            faults.reach("blob.placed")
        return actual, size

    def begin_blob(self, size: int | None = None) -> BlobWriter:
        """A blob being written from chunks (HTTP uploads, wheel members, copies); `size`, when known,
        is what a full disk's error says is needed. See BlobWriter."""
        self._ensure()
        return BlobWriter(self, size)

    def add_blob_stream(
        self, stream: BinaryIO, digest: str | None = None, size: int | None = None
    ) -> tuple[str, int]:
        """Copy a stream into the store, hashing on the way; verify against `digest` when given."""
        with self.begin_blob(size) as writer:
            while block := stream.read(HASH_CHUNK):
                writer.write(block)
            return writer.commit(digest)

    def add_blob_file(self, path: Path, digest: str | None = None) -> tuple[str, int]:
        """Copy a file into the store (a file in a scratch folder is moved instead: `adopt`)."""
        if self.is_scratch(path):
            return self.adopt(path, digest)
        with open(path, "rb") as f:
            return self.add_blob_stream(f, digest, os.fstat(f.fileno()).st_size)

    def add_blob_bytes(self, data: bytes) -> tuple[str, int]:
        import io

        return self.add_blob_stream(io.BytesIO(data))

    # ---- manifests -------------------------------------------------------------------------
    @staticmethod
    def build_manifest(config_layer: dict[str, Any], layers: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "schemaVersion": 2,
            "mediaType": MANIFEST_MEDIA_TYPE,
            "config": config_layer,
            "layers": layers,
        }

    def write_manifest(self, name: ModelName, manifest: dict[str, Any] | bytes) -> str:
        """Write a manifest atomically after checking that every blob it names is stored."""
        raw = (
            manifest if isinstance(manifest, bytes) else json.dumps(manifest, separators=(",", ":")).encode()
        )
        parsed = parse_manifest(raw)
        for layer in manifest_layers(parsed):
            if not self.has_blob(layer["digest"]):
                raise LocalrtError(f"cannot write manifest for {name}: blob {layer['digest']} is missing")
        path = self.manifest_path(name)
        files.make_dirs(path.parent)
        fd, tmp = self.temp_file(path.parent, MANIFEST_TEMP_PREFIX)
        try:
            with os.fdopen(fd, "wb") as out:
                out.write(raw)
                out.flush()
                os.fsync(out.fileno())
            faults.reach("manifest.synced")
            files.place(tmp, path)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            if e.errno == errno.ENOSPC:
                raise disk_full(path, len(raw), "nothing was written") from None
            raise
        faults.reach("manifest.placed")
        return "sha256:" + hashlib.sha256(raw).hexdigest()

    def find_manifest(self, name: ModelName) -> Path:
        path = self.manifest_path(name)
        if path.is_file():
            return path
        # Ollama compares names case-insensitively
        for entry_name, entry_path in self.walk_manifests():
            if entry_name.same_model(name):
                return entry_path
        raise ModelNotFound(f"model '{name.display}' not found, try pulling it first")

    def read_manifest(self, name: ModelName) -> tuple[dict[str, Any], str]:
        raw = self.manifest_bytes(name)
        return parse_manifest(raw), "sha256:" + hashlib.sha256(raw).hexdigest()

    def manifest_bytes(self, name: ModelName) -> bytes:
        """The manifest exactly as stored (what push uploads, so its digest stays the same)."""
        return self.find_manifest(name).read_bytes()

    def exists(self, name: ModelName) -> bool:
        try:
            self.find_manifest(name)
            return True
        except ModelNotFound:
            return False

    def walk_manifests(self) -> Iterator[tuple[ModelName, Path]]:
        if not self.manifests.is_dir():
            return
        for path in sorted(self.manifests.glob("*/*/*/*")):
            if not path.is_file() or path.name.startswith("."):
                continue
            rel = path.relative_to(self.manifests).parts
            try:
                yield parse_name(f"{rel[0]}/{rel[1]}/{rel[2]}:{rel[3]}"), path
            except LocalrtError:
                continue  # a stray file that is no valid name

    def list_models(self) -> list[ModelEntry]:
        entries = []
        for name, path in self.walk_manifests():
            try:
                raw = path.read_bytes()
                manifest = parse_manifest(raw)
            except (OSError, LocalrtError):
                continue
            size = sum(int(layer.get("size", 0)) for layer in manifest_layers(manifest))
            digest = "sha256:" + hashlib.sha256(raw).hexdigest()
            entries.append(ModelEntry(name, digest, size, path.stat().st_mtime))
        entries.sort(key=lambda e: e.modified, reverse=True)
        return entries

    def resolve(self, name: ModelName | str) -> ResolvedModel:
        """Find a model's GGUF blob and its template/system/params/license layers."""
        if isinstance(name, str):
            name = parse_name(name)
        manifest, digest = self.read_manifest(name)
        extras = self._layer_fields(manifest)
        cfg: dict[str, Any] = {}
        cfg_layer = manifest.get("config") or {}
        if cfg_layer.get("digest") and self.has_blob(cfg_layer["digest"]):
            with contextlib.suppress(ValueError, OSError):
                cfg = json.loads(self.blob_path(cfg_layer["digest"]).read_text())
        remote = remote_section(cfg)
        if remote is not None:  # no weights: the backend reads the endpoints from the config blob
            extras.update(model_path=self.blob_path(cfg_layer["digest"]), remote=remote)
        if "model_path" not in extras:
            raise LocalrtError(f"model '{name.display}' has no GGUF model layer")
        if not extras["model_path"].is_file():
            raise LocalrtError(f"model '{name.display}' is damaged: its model blob is missing; pull it again")
        if "projector_path" in extras and not extras["projector_path"].is_file():
            raise LocalrtError(
                f"model '{name.display}' is damaged: its projector blob is missing; pull it again"
            )
        if not all(path.is_file() for path in extras.get("adapter_paths", [])):
            raise LocalrtError(
                f"model '{name.display}' is damaged: an adapter blob is missing; pull it again"
            )
        return ResolvedModel(name=name, manifest=manifest, manifest_digest=digest, config=cfg, **extras)

    def _layer_fields(self, manifest: dict[str, Any]) -> dict[str, Any]:
        """ResolvedModel's fields from the manifest's layers: blob paths, texts and JSON."""
        paths = {MEDIA_DRAFT: "draft_path"}
        first_paths = {MEDIA_MODEL: "model_path", MEDIA_PROJECTOR: "projector_path"}
        readers: dict[str, tuple[str, Any]] = {
            MEDIA_TEMPLATE: ("template", lambda b: b.read_text(encoding="utf-8")),
            MEDIA_SYSTEM: ("system", lambda b: b.read_text(encoding="utf-8")),
            MEDIA_LICENSE: ("license", lambda b: b.read_text(encoding="utf-8", errors="replace")),
            MEDIA_PARAMS: ("params", lambda b: json.loads(b.read_text(encoding="utf-8"))),
            MEDIA_MESSAGES: ("messages", lambda b: read_messages(b.read_bytes())),
        }
        extras: dict[str, Any] = {}
        for layer in manifest.get("layers", []):
            media, blob = layer.get("mediaType", ""), self.blob_path(layer["digest"])
            if media in first_paths:
                extras.setdefault(first_paths[media], blob)
            elif media == MEDIA_ADAPTER:
                extras.setdefault("adapter_paths", []).append(blob)
            elif media in paths:
                extras[paths[media]] = blob
            elif media in readers:
                key, read = readers[media]
                extras[key] = read(blob)
        return extras

    # ---- copy / remove / gc ----------------------------------------------------------------
    def copy(self, src: ModelName, dst: ModelName) -> None:
        raw = self.find_manifest(src).read_bytes()
        with self.lock("manifest:" + str(dst.manifest_relpath()).lower()):
            self.write_manifest(dst, raw)

    def remove(self, name: ModelName) -> None:
        """The manifest is renamed aside first (the model is gone from that instant, durably, before any
        blob goes), then the blobs nothing else names are collected, then the renamed manifest goes.
        A kill in between leaves the renamed manifest, and `recover` finishes the collection."""
        path = self.find_manifest(name)
        with self.lock("gc"):
            fd, marker = self.temp_file(path.parent, REMOVING_PREFIX)
            os.close(fd)
            os.replace(path, marker)
            files.fsync_dir(path.parent)
            faults.reach("rm.aside")
            self._gc_locked()
            self._forget(marker)

    def _forget(self, marker: Path) -> None:
        """The renamed-aside manifest of a finished removal goes, with the folders it leaves empty."""
        marker.unlink(missing_ok=True)
        files.fsync_dir(marker.parent)
        parent = marker.parent
        while parent != self.manifests and parent.is_dir() and not any(parent.iterdir()):
            parent.rmdir()  # a leftover empty folder would be harmless; this keeps the tree tidy
            parent = parent.parent

    def gc(self) -> list[str]:
        with self.lock("gc"):
            return self._gc_locked()

    def referenced_digests(self) -> set[str]:
        used: set[str] = set()
        for _, path in self.walk_manifests():
            try:
                manifest = parse_manifest(path.read_bytes())
            except (OSError, LocalrtError):
                continue
            used.update(normalize_digest(layer["digest"]) for layer in manifest_layers(manifest))
        return used

    def _gc_locked(self) -> list[str]:
        """Delete complete blobs no manifest references; partial downloads stay for resuming."""
        used = self.referenced_digests()
        removed = []
        if not self.blobs.is_dir():
            return removed
        for blob in self.blobs.iterdir():
            if not blob.name.startswith("sha256-") or blob.name.endswith("-partial"):
                continue
            try:
                digest = normalize_digest(blob.name)
            except LocalrtError:
                continue
            if digest not in used:
                blob.unlink(missing_ok=True)
                removed.append(digest)
                faults.reach("rm.collected")
        if removed:
            files.fsync_dir(self.blobs)
        return removed

    # ---- after a crash ---------------------------------------------------------------------
    def recover(self) -> list[Leftover]:
        """Find what killed writes left behind: temporary files and folders no live process holds are
        removed (nothing resumes from them), partial downloads are kept for the pull that resumes them
        (unless their blob is complete already). Returns what was found; in use means not a leftover."""
        if not self.root.is_dir():
            return []
        found: list[Leftover] = self._finish_removals()
        with self.lock("scratch"):
            for path, why in self._temporaries():
                if files.in_use(path):
                    continue
                size = files.size_of(path)
                if path.is_dir():
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    path.unlink(missing_ok=True)
                found.append(Leftover(path, size, False, why))
        for partial in sorted(self.blobs.glob("sha256-*" + PARTIAL_SUFFIX)) if self.blobs.is_dir() else []:
            try:
                digest = normalize_digest(partial.name[: -len(PARTIAL_SUFFIX)])
            except LocalrtError:
                continue
            try:
                with self.lock(digest, timeout=0):  # held: a pull is downloading it now
                    size = files.size_of(partial)
                    if self.has_blob(digest):
                        partial.unlink(missing_ok=True)
                        found.append(Leftover(partial, size, False, "its blob is complete"))
                    elif partial.exists():
                        found.append(
                            Leftover(partial, size, True, "a partial download: pull again to resume")
                        )
            except Timeout:
                continue
        return found

    def _finish_removals(self) -> list[Leftover]:
        """Each `rm` cut short after its manifest was renamed aside: the blobs that manifest named and
        no other names are collected now, as the rm would have. Skipped while an rm holds the gc lock."""
        markers = sorted(self.manifests.rglob(REMOVING_PREFIX + "*")) if self.manifests.is_dir() else []
        if not markers:
            return []
        found = []
        try:
            with self.lock("gc", timeout=0):
                used = self.referenced_digests()
                for marker in markers:
                    try:
                        named = {
                            layer["digest"] for layer in manifest_layers(parse_manifest(marker.read_bytes()))
                        }
                    except (OSError, LocalrtError):
                        named = set()  # an empty or torn rename target: nothing it names can be told
                    collected = [d for d in sorted(named - used) if self.has_blob(d)]
                    size = sum(files.size_of(self.blob_path(d)) for d in collected)
                    for digest in collected:
                        self.blob_path(digest).unlink(missing_ok=True)
                    if collected:
                        files.fsync_dir(self.blobs)
                    self._forget(marker)
                    why = f"an rm that was cut short, finished: {len(collected)} blob(s) collected"
                    found.append(Leftover(marker, size, False, why))
        except Timeout:
            return []
        return found

    def _temporaries(self) -> Iterator[tuple[Path, str]]:
        for entry in sorted(self.root.iterdir()):
            if entry.is_dir() and entry.name.startswith(SCRATCH_PREFIXES):
                yield entry, "the work folder of a create, convert or pull that was cut short"
        if self.blobs.is_dir():
            for entry in sorted(self.blobs.glob(INCOMING_PREFIX + "*")):
                yield entry, "a blob whose write was cut short"
        if self.manifests.is_dir():
            for entry in sorted(self.manifests.rglob(MANIFEST_TEMP_PREFIX + "*")):
                yield entry, "a manifest whose write was cut short"

    def disk_usage(self) -> int:
        return sum(p.stat().st_size for p in self.blobs.glob("sha256-*")) if self.blobs.is_dir() else 0


class BlobWriter:
    """Hash while writing to a temp file in blobs/, then fsync it and rename it into place only if the
    digest matches.

    Used as a context manager: leaving without `commit` (an error, a dropped upload, a full disk)
    removes the temp file, so a failed write never leaves a half blob behind; a killed one leaves a
    temp file that `Store.recover` removes. `expected` (the size, when known) is what a full disk's
    error says is needed.
    """

    def __init__(self, store: Store, expected: int | None = None) -> None:
        self.store = store
        self.expected = expected
        fd, self.tmp_path = store.temp_file(store.blobs, INCOMING_PREFIX)
        self.file = os.fdopen(fd, "wb")
        self.hash = hashlib.sha256()
        self.size = 0
        self.committed = False

    def write(self, block: bytes) -> None:
        self.hash.update(block)
        try:
            self.file.write(block)
        except OSError as e:
            raise self._full(e) from None
        faults.reach("write", self.size, self.size + len(block))
        self.size += len(block)

    def _full(self, e: OSError) -> Exception:
        if e.errno != errno.ENOSPC:
            return e
        needed = self.expected - self.size if self.expected is not None else None
        return disk_full(self.tmp_path, needed, "the partial file was removed")

    def commit(self, digest: str | None = None) -> tuple[str, int]:
        try:
            self.file.flush()  # the last buffered bytes: where a full disk may show first
            os.fsync(self.file.fileno())
        except OSError as e:
            raise self._full(e) from None
        actual = "sha256:" + self.hash.hexdigest()
        if digest is not None and normalize_digest(digest) != actual:
            raise DigestMismatch(f"digest mismatch: expected {digest}, content hashes to {actual}")
        faults.reach("blob.synced")
        final = self.store.blob_path(actual)
        if final.exists():
            os.unlink(self.tmp_path)
        else:
            files.place(self.tmp_path, final)
            faults.reach("blob.placed")
        self.file.close()  # the hold ends only now: until the rename the temp file is in use
        self.committed = True
        return actual, self.size

    def __enter__(self) -> BlobWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        if not self.committed:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.tmp_path)
            with contextlib.suppress(OSError):  # closing flushes what a full disk refused once already
                self.file.close()


def parse_manifest(raw: bytes) -> dict[str, Any]:
    """Parse and validate a manifest: size-capped, every digest well-formed (no path games)."""
    if len(raw) > MAX_MANIFEST_BYTES:
        raise LocalrtError("manifest is too large")
    try:
        manifest = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise LocalrtError("manifest is not valid JSON") from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("layers"), list):
        raise LocalrtError("manifest has no layers list")
    for layer in manifest_layers(manifest):
        if not isinstance(layer, dict) or not isinstance(layer.get("digest"), str):
            raise LocalrtError("manifest layer has no digest")
        layer["digest"] = normalize_digest(layer["digest"])
        size = layer.get("size", 0)
        if not isinstance(size, int) or size < 0:
            raise LocalrtError(f"manifest layer {layer['digest']} has an invalid size")
    return manifest


def read_messages(raw: bytes) -> list[dict[str, Any]]:
    """A messages layer: Ollama's JSON list of {role, content}; a malformed one is a clear error."""
    try:
        items = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise LocalrtError("the model's messages layer is not valid JSON") from None
    if not isinstance(items, list) or not all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content", ""), str)
        for m in items
    ):
        raise LocalrtError("the model's messages layer is not a list of {role, content}")
    return [{"role": m["role"], "content": m.get("content", "")} for m in items]


def remote_section(config: dict[str, Any]) -> dict[str, Any] | None:
    """The remote part of a model's config blob (its endpoints), or None for a local model."""
    if config.get("model_format") != REMOTE_FORMAT:
        return None
    section = config.get("remote")
    if not isinstance(section, dict) or not isinstance(section.get("endpoints"), list):
        raise LocalrtError("remote model config names no endpoints")
    return section


def manifest_layers(manifest: dict[str, Any]) -> list[dict[str, Any]]:
    """The layers plus the config blob, which is stored and referenced like a layer."""
    layers = list(manifest.get("layers") or [])
    cfg = manifest.get("config")
    if isinstance(cfg, dict) and cfg.get("digest"):
        layers.append(cfg)
    return layers


class StorageFull(LocalrtError):
    status = 507  # Insufficient Storage


def disk_full(path: Path, needed: int | None, partial: str) -> StorageFull:
    """The error for a write that met a full disk (ENOSPC): the path, the room it still needed, the room
    there is, and what became of the partial file (`partial`)."""
    have = free_space(path.parent)
    need = f"need {format_bytes(needed)} more, " if needed is not None else ""
    return StorageFull(
        f"not enough disk space for {path}: {need}have {format_bytes(have)} "
        f"(no space left on device; {partial})"
    )


def check_room(store: Store, size: int) -> None:
    """Refuse a write of `size` bytes that would leave less than the spare room free on the store's disk
    (FREE_SPACE_MARGIN, or a twentieth of a small disk)."""
    have = free_space(store.blobs)
    spare = min(FREE_SPACE_MARGIN, shutil.disk_usage(store.blobs).total // 20)
    if size > have - spare:
        raise StorageFull(
            f"not enough disk space for {format_bytes(size)} in {store.blobs}: {format_bytes(have)} are free "
            f"and the store keeps {format_bytes(spare)} spare"
        )


def free_space(path: Path) -> int:
    path.mkdir(parents=True, exist_ok=True)
    return shutil.disk_usage(path).free
