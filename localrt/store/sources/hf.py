"""Hugging Face Hub GGUF repos: `hf.co/<org>/<repo>[:QUANT]` through `huggingface_hub`.

The repo listing (with LFS sha256s) picks the `.gguf` file for the quant; `hf_hub_download` fetches it
into a scratch folder inside the store (same filesystem, so moving it into `blobs/` is a rename) and
its sha256 is checked against the Hub's LFS metadata and the catalog's, when either is known.
"""

from __future__ import annotations

import errno
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from localrt import config
from localrt.errors import LocalrtError
from localrt.errors import ModelNotFound
from localrt.errors import PullError
from localrt.store.names import ModelName
from localrt.store.sources.common import Progress
from localrt.store.sources.common import ProgressFn
from localrt.store.sources.common import as_digest
from localrt.store.sources.common import check_free_space
from localrt.store.split import part_name
from localrt.store.split import series_names
from localrt.store.split import split_series
from localrt.store.store import Store
from localrt.store.store import disk_full

DEFAULT_ENDPOINT = "https://huggingface.co"
DEFAULT_QUANT = "Q4_K_M"  # what `latest` means, as on the Hub's own Ollama endpoint
METADATA_TIMEOUT = 10.0


def endpoint() -> str:
    return (config.hf_endpoint() or DEFAULT_ENDPOINT).rstrip("/")


def pick_gguf(files: list[str], quant: str, repo: str) -> str:
    """The GGUF file for `quant` (case-insensitive); `latest` -> Q4_K_M if present, else the first."""
    ggufs = sorted(f for f in files if f.lower().endswith(".gguf") and "mmproj" not in f.lower())
    if not ggufs:
        raise ModelNotFound(f"hf.co/{repo} has no .gguf files")
    wanted = DEFAULT_QUANT if quant.lower() == "latest" else quant
    q = wanted.lower()
    # a whole-token match first, so Q4_K does not silently pick Q4_K_M over Q4_K_S, nor F16 pick BF16
    token = re.compile(rf"(?<![a-z0-9]){re.escape(q)}(?![a-z0-9_])")
    exact = [f for f in ggufs if token.search(f.lower())]
    loose = [f for f in ggufs if q in f.lower()]
    if exact:
        choice = exact[0]
    elif len(loose) == 1:
        choice = loose[0]
    elif quant.lower() == "latest":
        choice = ggufs[0]
    elif loose:
        raise PullError(f"hf.co/{repo}: quant {quant!r} is ambiguous: {', '.join(loose)}")
    else:
        raise ModelNotFound(
            f"hf.co/{repo} has no GGUF file for quant {quant!r}; available: {', '.join(ggufs)}"
        )
    folder, _, base = choice.rpartition("/")
    series = split_series(base)
    if series is not None:  # a split model is named by its first part; the rest follow it
        prefix, _, count = series
        choice = f"{folder}/{part_name(prefix, 1, count)}" if folder else part_name(prefix, 1, count)
    return choice


PROJECTOR_PREFERENCE = ("f16", "bf16", "q8_0", "f32")  # a projector is small: keep it precise


def pick_mmproj(files: list[str], chosen: str) -> str | None:
    """The repo's multimodal projector (`mmproj*.gguf`) for the chosen GGUF: beside it in the same folder,
    of the same quant when there is one, else the most precise; None for a text-only repo."""
    folder = chosen.rpartition("/")[0]
    projs = sorted(
        f for f in files if f.lower().endswith(".gguf") and "mmproj" in f.rpartition("/")[2].lower()
    )
    near = [f for f in projs if f.rpartition("/")[0] == folder] or projs
    if not near:
        return None
    quant = re.search(r"(?i)[-._](i?q\d\w*|bf16|f16|f32)\.gguf$", chosen)

    def rank(f: str) -> tuple[int, str]:
        low = f.lower()
        if quant and low.endswith(quant.group(1).lower() + ".gguf"):
            return (0, f)
        for i, q in enumerate(PROJECTOR_PREFERENCE):
            if re.search(rf"(?<![a-z0-9]){q}(?![a-z0-9_])", low):
                return (1 + i, f)
        return (len(PROJECTOR_PREFERENCE) + 1, f)

    return min(near, key=rank)


def _bridge(emit: ProgressFn, status: str, digest: str | None, total: int | None) -> type:
    """A tqdm class for hf_hub_download that turns its byte counts into our Progress events."""
    from tqdm.auto import tqdm

    class Bridge(tqdm):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs.pop("name", None)
            kwargs["disable"] = True  # no terminal bar of its own: the CLI draws ours
            super().__init__(*args, **kwargs)
            self.done = int(kwargs.get("initial") or 0)

        def update(self, n: float | None = 1) -> bool | None:
            self.done += int(n or 0)
            emit(Progress(status, digest, total, self.done))
            return super().update(n)

    return Bridge


def _hub_error(e: Exception, repo: str, host: str) -> LocalrtError:
    from huggingface_hub import errors

    if isinstance(e, errors.RepositoryNotFoundError):
        return ModelNotFound(f"hf.co/{repo} not found on {host} (or it is private and no token is set)")
    if isinstance(e, errors.RevisionNotFoundError):
        return ModelNotFound(f"hf.co/{repo}: revision not found on {host}")
    if isinstance(e, errors.EntryNotFoundError):
        return ModelNotFound(f"hf.co/{repo}: file not found on {host}")
    if isinstance(e, errors.GatedRepoError):
        return PullError(f"hf.co/{repo} is gated: accept its terms on the Hub and set HF_TOKEN")
    if isinstance(e, errors.LocalEntryNotFoundError):  # the HEAD request could not reach the Hub
        return PullError(f"cannot reach {host}: {e.__cause__ or e}".splitlines()[0])
    text = str(e).splitlines()[0] if str(e) else type(e).__name__
    if type(e).__name__ in ("ConnectError", "ConnectTimeout"):
        return PullError(f"cannot reach {host}: {text}")
    return PullError(f"hf.co/{repo} on {host}: {text}")


def fetch_hf_gguf(
    ref: ModelName,
    store: Store,
    *,
    filename: str | None = None,
    revision: str | None = None,
    sha256: str | None = None,
    progress: ProgressFn | None = None,
) -> str:
    """Put the repo's GGUF for `ref.tag` (or `filename`) into the store; return its digest."""
    from huggingface_hub import HfApi

    emit = progress or (lambda _: None)
    repo, base = f"{ref.namespace}/{ref.model}", endpoint()
    host = base.split("://", 1)[-1]
    expected = as_digest(sha256) if sha256 else None
    emit(Progress("pulling manifest"))
    try:
        info = HfApi(endpoint=base).model_info(
            repo, revision=revision, files_metadata=True, timeout=METADATA_TIMEOUT
        )
    except Exception as e:  # huggingface_hub and httpx raise many types; each becomes one clear line
        raise _hub_error(e, repo, host) from None
    siblings = {s.rfilename: s for s in info.siblings or []}
    if filename is not None:
        if filename not in siblings:
            names = ", ".join(sorted(f for f in siblings if f.lower().endswith(".gguf"))) or "none"
            raise ModelNotFound(f"hf.co/{repo} has no file {filename!r}; GGUF files: {names}")
        chosen = filename
    else:
        chosen = pick_gguf(list(siblings), ref.tag, repo)
    where = _Where(repo, base, host, info.sha or revision)
    if split_series(chosen.rpartition("/")[2]) is not None:
        return _fetch_split(store, chosen, siblings, where, expected, emit)
    return _fetch_file(store, chosen, siblings[chosen], where, expected, emit)


@dataclass
class _Where:
    """The repo a pull reads: its id, the Hub's base URL and host, the revision."""

    repo: str
    base: str
    host: str
    revision: str | None


def _fetch_split(
    store: Store, first: str, siblings: dict[str, Any], where: _Where, expected: str | None, emit: ProgressFn
) -> str:
    """Every part of a split GGUF, each verified against the Hub's sha256 and kept as a blob (so an
    interrupted pull resumes from the parts it has), then merged into one blob; the parts go after."""
    from localrt.store.split import store_merged

    names = series_names(first)
    missing = [n for n in names if n not in siblings]
    if missing:
        raise PullError(f"hf.co/{where.repo}: split GGUF {first} lacks part(s) {', '.join(missing)}")
    parts = [_fetch_file(store, n, siblings[n], where, None, emit) for n in names]
    emit(Progress(f"merging {len(parts)} parts"))
    with store.lock("gc"):  # a concurrent `rm` must not collect the parts while they merge
        digest, _ = store_merged(store, [store.blob_path(d) for d in parts])
        used = store.referenced_digests()
        for part in parts:
            if part not in used and part != digest:
                store.blob_path(part).unlink(missing_ok=True)
    if expected and expected != digest:
        raise PullError(
            f"digest mismatch: merged hf.co/{where.repo}/{first} is {digest}, the catalog expects {expected}"
        )
    return digest


def _fetch_file(
    store: Store, chosen: str, sibling: Any, where: _Where, expected: str | None, emit: ProgressFn
) -> str:
    """One file of the repo into the store, verified; returns its digest."""
    from huggingface_hub import hf_hub_download

    repo, base, host = where.repo, where.base, where.host
    size = sibling.lfs.size if sibling.lfs else sibling.size
    hub_digest = f"sha256:{sibling.lfs.sha256}" if sibling.lfs else None
    if expected and hub_digest and expected != hub_digest:
        raise PullError(
            f"digest mismatch: hf.co/{repo}/{chosen} has {hub_digest}, the catalog expects {expected}"
        )
    digest = expected or hub_digest
    status = f"pulling {digest.split(':', 1)[1][:12]}" if digest else f"pulling {chosen}"
    if digest and store.has_blob(digest):
        emit(Progress(status, digest, size, size))
        emit(Progress("verifying sha256 digest"))
        return digest
    check_free_space(store, size or 0)
    with store.scratch(".hf-") as scratch:
        try:
            path = Path(
                hf_hub_download(
                    repo,
                    chosen,
                    revision=where.revision,
                    endpoint=base,
                    local_dir=scratch,
                    cache_dir=scratch / ".cache",
                    tqdm_class=_bridge(emit, status, digest, size),
                )
            )
        except OSError as e:
            if e.errno == errno.ENOSPC:
                raise disk_full(scratch / chosen, size, "the partial file was removed") from None
            raise _hub_error(e, repo, host) from None
        except Exception as e:
            raise _hub_error(e, repo, host) from None
        emit(Progress("verifying sha256 digest"))
        with store.lock("gc"):  # a concurrent `rm` must not collect the blob before its manifest names it
            return store.adopt(path, digest)[0]  # hashed again: DigestMismatch leaves it to the scratch


def pull_hf(ref: ModelName, store: Store, *, dest: ModelName, progress: ProgressFn | None = None) -> str:
    """`pull hf.co/org/repo:QUANT`: fetch the GGUF and import it (its chat template travels inside)."""
    from localrt.store.importer import import_gguf

    emit = progress or (lambda _: None)
    digest = fetch_hf_gguf(ref, store, progress=emit)
    projector = _fetch_projector(ref, store, emit)
    emit(Progress("writing manifest"))
    manifest_digest = import_gguf(store, dest, digest, projector=projector)
    emit(Progress("success"))
    return manifest_digest


def _fetch_projector(ref: ModelName, store: Store, emit: ProgressFn) -> str | None:
    """A vision repo's projector beside the chosen GGUF (its digest once stored), None for text-only repos."""
    from huggingface_hub import HfApi

    repo, base = f"{ref.namespace}/{ref.model}", endpoint()
    try:
        info = HfApi(endpoint=base).model_info(repo, timeout=METADATA_TIMEOUT)
    except Exception as e:
        raise _hub_error(e, repo, base.split("://", 1)[-1]) from None
    files = [s.rfilename for s in info.siblings or []]
    proj = pick_mmproj(files, pick_gguf(files, ref.tag, repo))
    return fetch_hf_gguf(ref, store, filename=proj, progress=emit) if proj else None
