"""Model lifecycle: models loaded on demand, kept alive, evicted least-recently-used, and requests
queued per model. `ModelPool.use` is the one door a request goes through to hold a loaded model.

The pool holds every kind of model the same way (queue, slots, keep-alive, `ps`, `stop`); what a kind
loads, and whether it holds memory in this process, comes from its `Loader`. `LocalLoader` (here) loads a
stored GGUF into a backend and builds its prompt machinery; a model served elsewhere brings its own loader
from its own path, so nothing here knows about it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator
from collections.abc import Mapping
from dataclasses import dataclass
from dataclasses import field
from pathlib import Path
from typing import Any
from typing import Protocol
from typing import TypedDict
from typing import TypeVar
from typing import Unpack

from localrt import config
from localrt.backends import registry
from localrt.backends.base import LoadedModel
from localrt.backends.base import LoadOptions
from localrt.backends.memory import MemoryEstimate
from localrt.errors import LocalrtError
from localrt.errors import ModelNotFound
from localrt.errors import OptionError
from localrt.errors import ServerBusy
from localrt.runtime import fim
from localrt.runtime import memory
from localrt.runtime import thinking
from localrt.runtime.options import Options
from localrt.runtime.options import set_names
from localrt.runtime.prompt import Prompter
from localrt.runtime.prompt import make_template
from localrt.runtime.prompt import preserved_tokens
from localrt.store.gguf import check_blob
from localrt.store.names import DIGEST_RE
from localrt.store.names import normalize_digest
from localrt.store.store import ResolvedModel
from localrt.store.store import Store

BUSY_MESSAGE = "server busy, please try again.  maximum pending requests exceeded"


@dataclass
class LoadedInfo:
    """A row of `ps` / `GET /api/ps`."""

    name: str
    digest: str
    size: int
    size_vram: int
    backend: str
    processor: str
    context_length: int
    expires_at: float | None  # epoch seconds; None = kept until stopped
    details: dict[str, Any] = field(default_factory=dict)


@dataclass(kw_only=True)
class Entry:
    """One loaded model, as the pool holds it whatever its kind."""

    key: str
    resolved: ResolvedModel
    backend: str
    load_key: tuple[Any, ...]
    draft_path: Path | None
    # what `ps`, `stop` and shutdown use: memory_bytes, context_length, capabilities.parallel_slots,
    # cancel(), unload(); each path reaches the rest of its own kind of model through its own entry type
    model: Any
    family: str = ""  # what `ps` shows as the model's family
    in_memory: bool = True  # held in this process: counts toward LOCALRT_MAX_LOADED_MODELS and the memory
    slots: asyncio.Semaphore = field(default_factory=asyncio.Semaphore)  # sized by the backend; FIFO, so fair
    refs: int = 0  # requests holding or waiting for this entry
    last_used: float = field(default_factory=time.monotonic)
    keep_alive: float = 300.0
    expires_at: float | None = None  # epoch
    timer: asyncio.TimerHandle | None = None
    stop_requested: bool = False  # `localrt stop`: unload as soon as the running requests finish
    own_bytes: int = 0  # what the load was estimated to take beside shared weights (0: not estimated)
    # the weights it shares with the other loads of the same file (the backend's `shares_weights`: llama.cpp),
    # and their bytes in RAM, which count once however many loads share them; None: its own weights
    base: tuple[Any, ...] | None = None
    base_bytes: int = 0


@dataclass(kw_only=True)
class LocalEntry(Entry):
    """A model loaded into a local backend, with its prompt machinery."""

    model: LoadedModel
    prompter: Prompter  # its template, how it thinks and calls tools
    preserve_tokens: frozenset[int] = frozenset()  # special tokens the reply parser must see
    # fill-in-the-middle: the vocabulary's FIM tokens, and a Go TEMPLATE's {{ if .Suffix }} branch
    fim_tokens: fim.FimTokens | None = None
    fim_template: list[tuple[str, bool]] | None = None

    @property
    def can_insert(self) -> bool:
        return self.fim_tokens is not None or self.fim_template is not None


E = TypeVar("E", bound=Entry)
E_co = TypeVar("E_co", bound=Entry, covariant=True)


@dataclass(frozen=True)
class LoadSpec:
    """What the pool settled for one load, handed to the kind's loader."""

    key: str
    resolved: ResolvedModel
    backend: str
    load_opts: LoadOptions
    load_key: tuple[Any, ...]
    draft: Path | None
    own_bytes: int  # bytes the load was estimated to take beside shared weights (0: not estimated)
    base: tuple[Any, ...] | None = None  # Entry.base
    base_bytes: int = 0


class Loader(Protocol[E_co]):
    """A kind of model the pool can hold."""

    @property
    def in_memory(self) -> bool:
        """Whether its models hold memory in this process (the count limit and the memory ladder)."""
        ...

    def backend(self, opts: Options) -> str: ...

    def check(self, resolved: ResolvedModel, opts: Options, given: Mapping[str, Any]) -> None:
        """What this kind of model refuses of a request's options (`given`: those the request or the
        Modelfile set), raised before any load."""
        ...

    async def load(self, spec: LoadSpec) -> E_co: ...


class LocalLoader:
    """A stored GGUF into the backend the options choose, with its template, reply format and FIM."""

    in_memory = True

    def backend(self, opts: Options) -> str:
        return registry.resolve(opts.backend)

    def check(self, resolved: ResolvedModel, opts: Options, given: Mapping[str, Any]) -> None:
        """Every option applies to a local model (the backend refuses what it cannot do at its turn)."""

    async def load(self, spec: LoadSpec) -> LocalEntry:
        resolved = spec.resolved
        backend = registry.get(spec.backend)
        await asyncio.to_thread(_check_blobs, resolved, spec.draft)
        model: LoadedModel = await asyncio.to_thread(backend.load, resolved.model_path, spec.load_opts)
        try:
            template = make_template(resolved, model)
            fmt = parser_format(thinking.model_format(template.source, model.special_tokens()), resolved)
            preserve = preserved_tokens(model, fmt.markers)
            infill = model_fim_tokens(model)
        except BaseException:
            await asyncio.to_thread(model.unload)
            raise
        return LocalEntry(
            key=spec.key,
            resolved=resolved,
            backend=spec.backend,
            load_key=spec.load_key,
            draft_path=spec.draft,
            model=model,
            family=model.metadata.get("general.architecture", ""),
            prompter=Prompter(spec.key, model, template, fmt),
            preserve_tokens=preserve,
            slots=asyncio.Semaphore(max(1, model.capabilities.parallel_slots)),
            own_bytes=spec.own_bytes,
            base=spec.base,
            base_bytes=spec.base_bytes,
            fim_tokens=infill,
            fim_template=fim.suffix_branch(resolved.template),
        )


LOCAL = LocalLoader()


class PoolLimits(TypedDict, total=False):
    """A pool's limits where they are not the environment's: models loaded at once, requests waiting per
    model, and how long an idle model stays loaded (seconds)."""

    max_loaded: int | None
    max_queue: int | None
    keep_alive: float | None


class ModelPool:
    """The loaded models of one process and the queue in front of each."""

    def __init__(self, store: Store | None = None, **limits: Unpack[PoolLimits]) -> None:
        max_loaded, max_queue = limits.get("max_loaded"), limits.get("max_queue")
        keep_alive = limits.get("keep_alive")
        self.store = store or Store()
        self.max_loaded = (
            max_loaded if max_loaded is not None else max(1, config.env_int("LOCALRT_MAX_LOADED_MODELS"))
        )
        self.max_queue = max_queue if max_queue is not None else max(0, config.env_int("LOCALRT_MAX_QUEUE"))
        self.default_keep_alive = keep_alive if keep_alive is not None else config.keep_alive_default()
        self._entries: dict[str, Entry] = {}
        self._pending: dict[str, int] = {}  # waiting for their model, per model
        self._inflight: dict[str, int] = {}  # waiting or running, per model
        self._loading: set[str] = set()
        self._reserved: dict[str, int] = {}  # loads under way: the bytes each was estimated to take
        self._unloaded_for_room = 0  # idle models unloaded to make room for the load being placed
        self._cond = asyncio.Condition()  # guards the tables above; notified on every change
        self._tasks: set[asyncio.Task[Any]] = set()

    # ---- what a request asks for ---------------------------------------------------------------
    def resolve(self, model: str) -> ResolvedModel:
        """The stored model a request names."""
        if not isinstance(model, str) or not model.strip():
            raise LocalrtError("model is required")
        return self.store.resolve(model)

    @staticmethod
    def options(resolved: ResolvedModel, options: Mapping[str, Any] | None) -> Options:
        """The options in force: the model's Modelfile parameters, then the request's."""
        if options is not None and not isinstance(options, Mapping):
            raise OptionError("options must be an object of name: value pairs")
        return Options.merge(resolved.params, options, lenient=(True, False))

    @classmethod
    def options_given(
        cls,
        resolved: ResolvedModel,
        options: Mapping[str, Any] | None,
        defaults: Mapping[str, Any] | None = None,
    ) -> tuple[Options, dict[str, Any]]:
        """The options in force, and those of them that the Modelfile or the request set (typed).
        `defaults`: a protocol's own defaults (OpenAI's temperature 1.0), in force under the request's
        options, never among those set."""
        given = cls.options(resolved, options)
        names = set_names(resolved.params) | set_names(options)
        values = {name: getattr(given, name) for name in names}
        if not defaults:
            return given, values
        return cls.options(resolved, {**defaults, **(options or {})}), values

    def keep_alive(self, value: str | float | None) -> float:
        if value is None:
            return self.default_keep_alive
        return config.parse_duration(value, self.default_keep_alive)

    # ---- what `ps`, `stop` and shutdown see ------------------------------------------------------
    def ps(self) -> list[LoadedInfo]:
        entries = sorted(self._entries.values(), key=lambda e: -e.last_used)
        return [
            _loaded_info(e, [o.key for o in entries if o is not e and _same_weights(o, e)]) for e in entries
        ]

    def queue_depth(self) -> dict[str, int]:
        """Requests waiting or running, per model (for /metrics)."""
        return {name: n for name, n in self._inflight.items() if n > 0}

    async def unload(self, model: str) -> bool:
        """Unload now if idle, else as soon as its running requests finish. False when not loaded."""
        from localrt.store.names import parse_name

        key = parse_name(model).display
        async with self._cond:
            entry = self._entries.get(key)
            if entry is None:
                return False
            entry.stop_requested = True
            if entry.refs == 0:
                await self._unload_locked(entry)
        return True

    async def close(self) -> None:
        """Cancel what runs and unload everything (server shutdown, end of `localrt run`)."""
        for entry in list(self._entries.values()):
            with contextlib.suppress(Exception):
                entry.model.cancel()
        async with self._cond:
            for entry in list(self._entries.values()):
                await self._unload_locked(entry)

    # ---- scheduling ------------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def use(
        self,
        resolved: ResolvedModel,
        opts: Options,
        keep_alive: float,
        exclusive: bool = True,
        loader: Loader[E] = LOCAL,  # type: ignore[assignment]
    ) -> AsyncIterator[tuple[E, int]]:
        """Hold a loaded model for one request: queue, load or reuse, then release with keep-alive.
        Yields the entry (of the loader's kind) and the load time in ns (0 when it was loaded already)."""
        key = resolved.name.display
        waiting = self._pending.get(key, 0)
        if waiting >= self.max_queue:
            raise ServerBusy(BUSY_MESSAGE)
        self._pending[key] = waiting + 1
        self._inflight[key] = self._inflight.get(key, 0) + 1
        started = time.perf_counter_ns()
        entry: Entry | None = None
        locked = False
        try:
            try:
                entry, loaded_now = await self._acquire(resolved, opts, loader)
                if exclusive:
                    await entry.slots.acquire()  # as many generations at once as the model has slots
                    locked = True
            except BaseException:
                if entry is not None:
                    await self._release(entry, keep_alive)
                raise
            finally:
                self._pending[key] -= 1
            load_ns = time.perf_counter_ns() - started if loaded_now else 0
            try:
                yield entry, load_ns  # type: ignore[misc]
            finally:
                if locked:
                    entry.slots.release()
                await self._release(entry, keep_alive)
        finally:
            self._inflight[key] -= 1

    def _draft_path(self, resolved: ResolvedModel, opts: Options) -> Path | None:
        if opts.speculative == "off":
            return None
        if opts.draft_model:  # a stored model or blob, never a path (options.py refuses those)
            if DIGEST_RE.match(opts.draft_model):
                digest = normalize_digest(opts.draft_model)
                if not self.store.has_blob(digest):
                    raise ModelNotFound(f"draft model blob {digest} is not in the store")
                return self.store.blob_path(digest)
            try:
                return self.store.resolve(opts.draft_model).model_path
            except ModelNotFound:
                raise ModelNotFound(
                    f"draft model '{opts.draft_model}' not found, try pulling it first"
                ) from None
        if opts.speculative in ("auto", "draft"):
            return resolved.draft_path
        return None

    async def _acquire(self, resolved: ResolvedModel, opts: Options, loader: Loader[E]) -> tuple[Entry, bool]:
        key = resolved.name.display
        backend = loader.backend(opts)
        draft = self._draft_path(resolved, opts)
        load_opts = dataclasses.replace(
            opts.load_options(draft_path=draft),
            projector=resolved.projector_path,
            adapters=tuple(resolved.adapter_paths),
        )
        # the settings to try are estimated only when a load is due: a loaded model's requests skip it
        fits: list[memory.Fit] | None = None if loader.in_memory else []
        base = _weights_key(backend, resolved, opts) if loader.in_memory else None
        base_bytes = own_bytes = 0
        load_key = (
            backend,
            str(resolved.model_path),
            opts.num_ctx,
            opts.num_thread,
            opts.num_gpu,
            opts.kv_cache_type,
            opts.flash_attn,
            opts.num_batch,
            opts.kv_pool,
            opts.numerics,
            config.load_key(),  # the environment a load reads (LOCALRT_NUM_PARALLEL, ...)
            str(resolved.projector_path),
            tuple(map(str, resolved.adapter_paths)),  # other adapters over the same weights: another load
        )
        async with self._cond:
            while True:
                entry = self._entries.get(key)
                if key in self._loading:
                    await self._cond.wait()  # someone is loading it right now
                    continue
                if entry is not None and (
                    entry.load_key != load_key
                    or (draft is not None and entry.draft_path != draft)
                    or entry.model.dead
                ):
                    # other load-time options, or an engine stopped on an error (its requests have failed):
                    # reload once its running requests are done, as Ollama does
                    if entry.refs == 0:
                        await self._unload_locked(entry)
                    else:
                        await self._cond.wait()
                    continue
                if entry is not None:
                    self._grab(entry)
                    return entry, False
                if loader.in_memory and self._local_count() >= self.max_loaded:
                    await self._make_room()
                    continue
                if fits is None:  # estimated off the lock (it reads the file's header), then look again
                    self._cond.release()
                    try:
                        fits = await asyncio.to_thread(memory.ladder, backend, resolved.model_path, load_opts)
                    finally:
                        await _relock(self._cond)
                    continue
                fit = self._fit(fits, base)
                if fits and fit is None:
                    await self._make_room(fits)
                    continue
                if fit is not None:
                    load_opts = fit.opts
                    self._reserved[key] = self._adds(fit.estimate, base).ram
                    # shared weights count in base_bytes, once for all their loads
                    base_bytes = fit.estimate.weights_ram if base is not None else 0
                    own_bytes = fit.estimate.ram - base_bytes
                self._unloaded_for_room = 0
                self._loading.add(key)
                break
        # load outside the lock, so requests for other (loaded) models keep flowing
        spec = LoadSpec(key, resolved, backend, load_opts, load_key, draft, own_bytes, base, base_bytes)
        load: asyncio.Future[Entry] = asyncio.ensure_future(loader.load(spec))
        try:
            await asyncio.wait((load,))  # a cancelled wait leaves the load running
        except asyncio.CancelledError:
            # the caller left (its client hung up) mid-load; a loading thread cannot stop halfway, so the
            # pool adopts the model rather than leak it, and the caller is free at once
            self._keep(self._adopt(key, load))
            raise
        try:
            entry = load.result()
        finally:
            async with self._cond:
                self._loading.discard(key)
                self._reserved.pop(key, None)
                self._cond.notify_all()
        async with self._cond:
            self._entries[key] = entry
            self._grab(entry)
        return entry, True

    async def _adopt(self, key: str, load: asyncio.Future[Entry]) -> None:
        """A load whose caller left: registered idle under the default keep-alive once it is done."""
        try:
            await asyncio.wait((load,))
        finally:
            async with self._cond:
                self._loading.discard(key)
                self._reserved.pop(key, None)
                self._cond.notify_all()
        if load.cancelled() or load.exception() is not None:
            return  # a failed load has nobody left to tell
        entry = load.result()
        async with self._cond:
            self._entries[key] = entry
            self._grab(entry)
        await self._release(entry, self.default_keep_alive)

    def _keep(self, work: Any) -> None:
        """Run `work` as a task the pool holds a reference to until it finishes."""
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _grab(self, entry: Entry) -> None:
        entry.refs += 1
        entry.last_used = time.monotonic()
        if entry.timer is not None:
            entry.timer.cancel()
            entry.timer = None
        entry.expires_at = None

    async def _release(self, entry: Entry, keep_alive: float) -> None:
        async with self._cond:
            entry.refs -= 1
            entry.last_used = time.monotonic()
            if not entry.stop_requested:
                entry.keep_alive = keep_alive
            self._cond.notify_all()
            if entry.refs > 0 or self._entries.get(entry.key) is not entry:
                return
            if entry.stop_requested or entry.keep_alive <= 0:
                await self._unload_locked(entry)
            elif entry.keep_alive == float("inf"):
                entry.expires_at = float("inf")
            else:
                loop = asyncio.get_running_loop()
                entry.expires_at = time.time() + entry.keep_alive
                entry.timer = loop.call_later(entry.keep_alive, self._spawn_expire, entry)

    def _spawn_expire(self, entry: Entry) -> None:
        self._keep(self._expire(entry))

    async def _expire(self, entry: Entry) -> None:
        async with self._cond:
            if entry.refs == 0 and self._entries.get(entry.key) is entry:
                await self._unload_locked(entry)

    async def _make_room(self, fits: list[memory.Fit] | None = None) -> None:
        """Unload the least recently used idle model, else wait for a busy one to finish (under the lock).
        A load that would not fit even with every other model unloaded is refused at once, and so is one
        that does not fit with nothing else loaded."""
        victim = self._lru_idle()
        if fits is not None:
            available, source = self._available()
            hopeless = not fits[-1].estimate.fits(available + self._estimated())
            if hopeless or (victim is None and not self._local_count()):
                unloaded, self._unloaded_for_room = self._unloaded_for_room, 0
                raise memory.refusal(fits, available, source, unloaded)
        if victim is not None:
            await self._unload_locked(victim)
            self._unloaded_for_room += 1
        else:
            await self._cond.wait()  # every loaded model is busy

    def _fit(self, fits: list[memory.Fit], base: tuple[Any, ...] | None = None) -> memory.Fit | None:
        """The first settings on the ladder that fit the room left, or None."""
        available, _ = self._available()
        return next((f for f in fits if self._adds(f.estimate, base).fits(available)), None)

    def _shares(self, base: tuple[Any, ...] | None) -> bool:
        """Whether a loaded model holds the weights a load on `base` would share."""
        return base is not None and any(e.base == base for e in self._entries.values())

    def _adds(self, estimate: MemoryEstimate, base: tuple[Any, ...] | None) -> MemoryEstimate:
        """What a load adds: without the weights where a loaded model already holds them."""
        return estimate.without_weights() if self._shares(base) else estimate

    def _available(self) -> tuple[int, str]:
        """Bytes a new load may take now, and where the figure comes from. The free RAM already excludes
        what loaded models hold, but not the loads still under way."""
        available, source = memory.room(self._estimated())
        if config.max_memory() is None:
            available -= sum(self._reserved.values())
        return available, source

    def _estimated(self) -> int:
        """What loaded models and loads under way were estimated to hold."""
        loaded = sum(e.own_bytes for e in self._entries.values())
        shared = {e.base: e.base_bytes for e in self._entries.values() if e.base is not None}
        return loaded + sum(shared.values()) + sum(self._reserved.values())

    def _local_count(self) -> int:
        """Models held in this process's memory; models served elsewhere do not count toward the limit."""
        return sum(e.in_memory for e in self._entries.values()) + len(self._loading)

    def _lru_idle(self) -> Entry | None:
        idle = [e for e in self._entries.values() if e.refs == 0 and e.in_memory]
        return min(idle, key=lambda e: e.last_used) if idle else None

    async def _unload_locked(self, entry: Entry) -> None:
        """Unload while holding self._cond."""
        if entry.timer is not None:
            entry.timer.cancel()
            entry.timer = None
        if self._entries.get(entry.key) is entry:
            del self._entries[entry.key]
        await asyncio.to_thread(_unload, entry.model)
        self._cond.notify_all()


async def _relock(lock: asyncio.Condition) -> None:
    """Take back a lock released inside its `async with`, even when the task is cancelled meanwhile (a
    client that leaves): a cancelled `acquire` would leave the block's exit releasing a lock it does not
    hold. The cancellation is raised once the lock is held, as Condition.wait does."""
    cancelled: asyncio.CancelledError | None = None
    while True:
        try:
            await lock.acquire()
            break
        except asyncio.CancelledError as e:
            cancelled = e
    if cancelled is not None:
        raise cancelled


def _unload(model: Any) -> None:
    model.unload()
    memory.return_freed_heap()


def model_fim_tokens(model: LoadedModel) -> fim.FimTokens | None:
    """The loaded model's FIM tokens: ids from its metadata, else its special tokens found by text."""
    specials = set(model.special_tokens())

    def find(text: str) -> int | None:
        if text not in specials:
            return None
        ids = model.tokenize(text, add_special=False, parse_special=True)
        return ids[0] if len(ids) == 1 else None

    return fim.fim_tokens(model.metadata, find, model.n_vocab)


def parser_format(fmt: thinking.ModelFormat, resolved: ResolvedModel) -> thinking.ModelFormat:
    """The format read from the template, with a Modelfile PARSER's families in force: whether the model
    thinks (and in which markup) and, where we parse it, its tool-call style."""
    from localrt.runtime.toolcalls import style_markers
    from localrt.store.modelfile import PARSER_FORMATS

    name = resolved.config.get("parser")
    if not name or name not in PARSER_FORMATS:
        return fmt
    think, style = PARSER_FORMATS[name]
    if think == "harmony":
        return dataclasses.replace(
            fmt, thinking="harmony", tool_style="harmony", markers=thinking.HARMONY_MARKERS
        )
    style = style or fmt.tool_style
    tags = (fmt.open_tag or "<think>", fmt.close_tag or "</think>") if think == "tags" else ("", "")
    markers = tuple(m for m in (*tags, *style_markers(style)) if m)
    return dataclasses.replace(
        fmt,
        thinking=think,
        open_tag=tags[0],
        close_tag=tags[1],
        hybrid=fmt.hybrid and think == "tags",
        tool_style=style,
        markers=markers,
    )


def _weights_key(backend: str, resolved: ResolvedModel, opts: Options) -> tuple[Any, ...] | None:
    """What a load on `backend` shares with the other loads of the same file, where the backend shares
    weights (Entry.base); None where each load holds its own."""
    if not getattr(registry.get(backend), "shares_weights", False):
        return None
    return (backend, str(resolved.model_path), opts.num_gpu)


def _same_weights(a: Entry, b: Entry) -> bool:
    """Whether two loaded models run on one copy of the weights (the backend says so)."""
    weights = getattr(a.model, "shared_weights", None)
    return weights is not None and weights is getattr(b.model, "shared_weights", None)


def _loaded_info(e: Entry, sharing: list[str]) -> LoadedInfo:
    """`sharing`: the other loaded models on the same weights; the first of them loaded counts the
    weights in its size, so the sizes add up to what is held."""
    on_gpu = bool(getattr(e.model, "on_gpu", False))
    size = int(e.model.memory_bytes)
    details: dict[str, Any] = {
        "format": e.resolved.config.get("model_format", "gguf"),
        "family": e.family,
    }
    if sharing:
        details["shares_weights_with"] = sharing
    weights = getattr(e.model, "weight_bytes", None)  # backends that report their resident weights
    if callable(weights):
        details["weight_bytes"] = int(weights())
    numerics = getattr(e.model, "numerics", None)  # the torch engine: weights kept quantized or not
    if isinstance(numerics, str):
        details["numerics"] = numerics
    capabilities = getattr(e.model, "capabilities", None)
    if capabilities is not None:
        details["parallel"] = int(capabilities.parallel_slots)
    pool = getattr(e.model, "pool", 0)  # llama.cpp: the KV cells its sequences share (0: a context each)
    if isinstance(pool, int) and pool > 0:
        details["kv_pool"] = pool
    return LoadedInfo(
        name=e.key,
        digest=e.resolved.manifest_digest,
        size=size,
        size_vram=size if on_gpu else 0,
        backend=e.backend,
        processor=getattr(e.model, "processor", None) or f"100% {'GPU' if on_gpu else 'CPU'}",
        context_length=e.model.context_length,
        expires_at=None if e.expires_at is None or e.expires_at == float("inf") else e.expires_at,
        details=details,
    )


def _check_blobs(resolved: ResolvedModel, draft: Path | None) -> None:
    """Every GGUF a backend is about to open has passed the bounded reader (once per blob: cached)."""
    check_blob(resolved.model_path, "model")
    if resolved.projector_path is not None:
        check_blob(resolved.projector_path, "projector")
    if draft is not None:
        check_blob(draft, "draft model")
    for adapter in resolved.adapter_paths:
        check_blob(adapter, "adapter")
