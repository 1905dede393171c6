"""Room for a model before it loads: the backend's estimate against the memory left, and the settings
that fit when the asked ones do not (a smaller KV pool, fewer parallel sequences, then a shorter
context), or a clear refusal naming the numbers. A load the machine cannot hold would otherwise be
killed by the kernel, taking every loaded model and every request in flight with it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from dataclasses import replace
from pathlib import Path
from typing import Any

from localrt import config
from localrt.backends import registry
from localrt.backends.base import LoadOptions
from localrt.backends.memory import MemoryEstimate
from localrt.backends.memory import available_memory
from localrt.backends.memory import human_bytes
from localrt.errors import InsufficientMemory
from localrt.runtime.options import Options
from localrt.store.remote import is_remote
from localrt.store.store import Store

# a fitted context stops here: shorter would refuse most chat prompts anyway
MIN_FIT_CONTEXT = 2048


@dataclass(frozen=True)
class Fit:
    """The settings a load gets, what they hold, and what was changed to get there."""

    opts: LoadOptions
    estimate: MemoryEstimate
    changes: tuple[str, ...] = ()


def estimate(backend: str, path: Path, opts: LoadOptions) -> MemoryEstimate | None:
    """The backend's estimate, or None for a backend that holds no weights here (remote)."""
    fn = getattr(registry.get(backend), "estimate", None)
    return fn(path, opts) if fn is not None else None


def ladder(backend: str, path: Path, opts: LoadOptions) -> list[Fit]:
    """The settings to try, largest first: as asked; where the sequences share a KV pool, halving the
    pool down to one context (the sequences it cannot hold at once wait for cells); then halving the
    parallel sequences down to one, then the context down to MIN_FIT_CONTEXT (never below what was
    asked)."""
    first = estimate(backend, path, opts)
    if first is None:
        return []
    fits = [Fit(opts, first)]
    asked_parallel, asked_context = first.parallel, first.context_length
    parallel, context = asked_parallel, asked_context
    cells = first.pool
    while first.pool and cells > context:
        cells = max(context, cells // 2)
        o = replace(opts, num_parallel=parallel, kv_pool=cells)
        fits.append(Fit(o, estimate(backend, path, o), (f"KV pool {first.pool} -> {cells} cells",)))
    while parallel > 1:
        parallel //= 2
        o = replace(opts, num_parallel=parallel)
        fits.append(Fit(o, estimate(backend, path, o), (f"parallel {asked_parallel} -> {parallel}",)))
    floor = min(asked_context, MIN_FIT_CONTEXT)
    while context > floor:
        context = max(floor, context // 2)
        o = replace(opts, num_parallel=parallel, num_ctx=context)
        changes = (f"parallel {asked_parallel} -> {parallel}",) if parallel != asked_parallel else ()
        fits.append(Fit(o, estimate(backend, path, o), (*changes, f"context {asked_context} -> {context}")))
    last = fits[-1]
    if opts.num_gpu > 0 and last.estimate.gpu_free is not None and last.estimate.gpu > last.estimate.gpu_free:
        # the layers asked for do not fit the GPUs even at the smallest settings: as many as fit
        o = replace(last.opts, num_gpu=-1)
        fitted = estimate(backend, path, o)
        fits.append(
            Fit(o, fitted, (*last.changes, f"GPU layers {opts.num_gpu} -> as many as fit ({fitted.device})"))
        )
    return fits


def room(held: int) -> tuple[int, str]:
    """Bytes a new load may take, given what loaded models and loads under way hold: LOCALRT_MAX_MEMORY
    less that, else the free RAM now (which already excludes what is loaded) less the loads not yet
    resident. With the limit's source, for the error."""
    limit = config.max_memory()
    if limit is not None:
        return limit - held, "LOCALRT_MAX_MEMORY"
    return available_memory(), "free memory"


def refusal(fits: list[Fit], available: int, source: str, unloaded: int) -> InsufficientMemory:
    """Ollama's words, then what was tried."""
    need = fits[0].estimate.ram
    smallest = fits[-1]
    tried = [f"unloaded {unloaded} idle model{'s' * (unloaded != 1)}"] if unloaded else []
    tried += list(smallest.changes)
    detail = f"; tried {', '.join(tried)} (still {human_bytes(smallest.estimate.ram)})" if tried else ""
    return InsufficientMemory(
        f"model requires more system memory ({human_bytes(need)}) than is available "
        f"({human_bytes(max(0, available))}, {source}){detail}"
    )


def for_model(store: Store, model: str, options: Mapping[str, Any] | None = None) -> MemoryEstimate | None:
    """The estimate for a stored model with its Modelfile's parameters and `options` over them, on the
    backend a load would choose; None for a remote model. Nothing is loaded."""
    resolved = store.resolve(model)
    if is_remote(resolved):  # its weights live upstream
        return None
    opts = Options.merge(resolved.params, options, lenient=(True, False))
    draft = resolved.draft_path if opts.speculative in ("auto", "draft") else None
    load_opts = replace(
        opts.load_options(draft_path=draft),
        projector=resolved.projector_path,
        adapters=tuple(resolved.adapter_paths),
    )
    fits = ladder(registry.resolve(opts.backend), resolved.model_path, load_opts)
    return fits[0].estimate if fits else None


def fits_now(estimate: MemoryEstimate) -> tuple[bool, int, str]:
    """Whether the estimate fits what this machine (or LOCALRT_MAX_MEMORY) leaves now."""
    available, source = room(0)
    return estimate.fits(available), available, source


HEAP_ARENAS = 2
_M_ARENA_MAX = -8  # glibc's mallopt parameter


def fewer_heap_arenas() -> None:
    """At most HEAP_ARENAS glibc malloc arenas for the threads this process starts from now on (a server:
    its loads, unloads, prompts and engines run on many threads). With glibc's default of eight a core, a
    server switching models under load grew 16% in six minutes with nothing leaked (memory freed on one
    thread stays in that thread's arena); with one or two it stayed within 3% (benchmarks/soak.py). The
    environment's MALLOC_ARENA_MAX, when set, is glibc's own and is left to it."""
    if config.setting("MALLOC_ARENA_MAX"):
        return
    libc = _libc()
    if libc is not None and hasattr(libc, "mallopt"):
        libc.mallopt(_M_ARENA_MAX, HEAP_ARENAS)


def _libc() -> Any:
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    return ctypes.CDLL(name) if name else None


def return_freed_heap() -> None:
    """Hand the heap an unloaded model freed back to the system. glibc keeps freed memory in the arena of
    the thread that freed it (loads and unloads run on worker threads, each with its own arena), so a
    server switching models grew by about 20% in three minutes of a soak (benchmarks/soak.py) with
    nothing leaked. A no-op where there is no glibc."""
    global _malloc_trim
    if _malloc_trim is None:
        libc = _libc()
        _malloc_trim = getattr(libc, "malloc_trim", False) if libc is not None else False
    if _malloc_trim:
        _malloc_trim(0)


_malloc_trim: Any = None
