"""The runtime every interface shares (CLI, HTTP server, TUI): models loaded on demand, kept alive,
evicted least-recently-used, requests queued per model, prompts templated and tokenized once here.

    rt = Runtime()
    async for chunk in rt.chat("smollm2:135m", [{"role": "user", "content": "Hi"}]):
        print(chunk.content, end="")

All methods are coroutines of one event loop; blocking backend work runs in worker threads.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, ClassVar

from localrt import config
from localrt.backends import registry
from localrt.backends.base import (
    DoneEvent,
    GenerateRequest,
    LoadedModel,
    ScoreResult,
    TextEvent,
    Timings,
    TokenLogprob,
)
from localrt.errors import LocalrtError, ModelNotFound, OptionError, ServerBusy
from localrt.runtime.options import Options, num_parallel
from localrt.runtime.templates import ChatTemplate, RenderedPrompt, select_template, tokenize_rendered
from localrt.runtime.toolcalls import could_be_tool_call, parse_tool_calls
from localrt.store.store import ResolvedModel, Store

BUSY_MESSAGE = "server busy, please try again.  maximum pending requests exceeded"


class ContextLengthError(LocalrtError):
    status = 400


@dataclass
class Metrics(Timings):
    """Ollama's final-chunk numbers, in nanoseconds: the backend's timings plus the request's total."""

    total_ns: int = 0

    # our field -> the name on Ollama's wire (the draft counts are ours, sent only when speculating)
    WIRE: ClassVar[dict[str, str]] = {
        "total_ns": "total_duration",
        "load_ns": "load_duration",
        "prompt_eval_count": "prompt_eval_count",
        "prompt_eval_ns": "prompt_eval_duration",
        "eval_count": "eval_count",
        "eval_ns": "eval_duration",
        "draft_count": "draft_count",
        "draft_accepted_count": "draft_accepted_count",
    }

    def to_ollama(self) -> dict[str, int]:
        out = {wire: getattr(self, name) for name, wire in self.WIRE.items()}
        if not self.draft_count:
            del out["draft_count"], out["draft_accepted_count"]
        return out

    @classmethod
    def from_ollama(cls, item: Mapping[str, Any]) -> Metrics:
        return cls(**{name: int(item.get(wire) or 0) for name, wire in cls.WIRE.items()})


@dataclass
class Chunk:
    """One streamed piece of a chat or generate answer; the last one has done=True and metrics."""

    model: str
    content: str = ""
    thinking: str = ""  # a reasoning model's thinking, split out of content (Ollama's message.thinking)
    done: bool = False
    done_reason: str | None = None  # stop | length | cancel | load | unload
    tool_calls: list[dict[str, Any]] | None = None
    logprobs: list[dict[str, Any]] | None = None
    metrics: Metrics | None = None
    context: list[int] | None = None  # generate only: prompt + answer tokens, for the next call
    created_at: str = field(default_factory=lambda: _now_rfc3339())


@dataclass
class EmbedResult:
    model: str
    embeddings: list[list[float]]
    prompt_eval_count: int
    total_ns: int
    load_ns: int


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


def _now_rfc3339() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


# ---- one loaded model --------------------------------------------------------------------------
@dataclass
class _Entry:
    key: str
    resolved: ResolvedModel
    backend: str
    load_key: tuple[Any, ...]
    draft_path: Path | None
    model: LoadedModel
    template: ChatTemplate
    slots: asyncio.Semaphore = field(default_factory=asyncio.Semaphore)  # sized by the backend; FIFO, so fair
    refs: int = 0  # requests holding or waiting for this entry
    last_used: float = field(default_factory=time.monotonic)
    keep_alive: float = 300.0
    expires_at: float | None = None  # epoch
    timer: asyncio.TimerHandle | None = None
    stop_requested: bool = False  # `localrt stop`: unload as soon as the running requests finish


class Runtime:
    def __init__(
        self,
        store: Store | None = None,
        *,
        max_loaded: int | None = None,
        max_queue: int | None = None,
        keep_alive: float | None = None,
    ) -> None:
        self.store = store or Store()
        self.max_loaded = (
            max_loaded if max_loaded is not None else max(1, config.env_int("LOCALRT_MAX_LOADED_MODELS", 2))
        )
        self.max_queue = (
            max_queue if max_queue is not None else max(0, config.env_int("LOCALRT_MAX_QUEUE", 512))
        )
        self.default_keep_alive = keep_alive if keep_alive is not None else config.keep_alive_default()
        self._entries: dict[str, _Entry] = {}
        self._pending: dict[str, int] = {}  # waiting for their model, per model
        self._inflight: dict[str, int] = {}  # waiting or running, per model
        self._loading: set[str] = set()
        self._cond = asyncio.Condition()  # guards the tables above; notified on every change
        self._tasks: set[asyncio.Task[Any]] = set()

    # ---- public API ------------------------------------------------------------------------
    async def chat(
        self,
        model: str,
        messages: Sequence[Mapping[str, Any]],
        *,
        options: Mapping[str, Any] | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        format: str | dict[str, Any] | None = None,
        keep_alive: str | float | None = None,
        logprobs: bool = False,
        top_logprobs: int = 0,
        stream: bool = True,
    ) -> AsyncIterator[Chunk]:
        """Answer a conversation. Empty `messages` only loads the model (or unloads with keep_alive 0)."""
        start = time.perf_counter_ns()
        resolved, opts = self._prepare(model, options)
        format = _check_format(format)
        _check_logprobs(top_logprobs)
        keep = self._keep_alive(keep_alive)
        if not messages:
            async for chunk in self._load_only(resolved, opts, keep, start):
                yield chunk
            return
        msgs = [dict(m) for m in messages]
        if resolved.system and not any(m.get("role") == "system" for m in msgs):
            msgs.insert(0, {"role": "system", "content": resolved.system})
        async with self._use(resolved, opts, keep) as (entry, load_ns):
            rendered = await asyncio.to_thread(
                entry.template.render, msgs, tools=tools, add_generation_prompt=True
            )
            tokens = self._tokenize_prompt(entry, rendered)
            async for chunk in self._run(
                entry, tokens, opts, format, logprobs, top_logprobs, stream, start, load_ns, tools=bool(tools)
            ):
                yield chunk

    async def generate(
        self,
        model: str,
        prompt: str = "",
        *,
        system: str | None = None,
        raw: bool = False,
        context: Sequence[int] | None = None,
        options: Mapping[str, Any] | None = None,
        format: str | dict[str, Any] | None = None,
        keep_alive: str | float | None = None,
        logprobs: bool = False,
        top_logprobs: int = 0,
        stream: bool = True,
    ) -> AsyncIterator[Chunk]:
        """Complete a prompt (templated as one user turn unless raw). Empty prompt: load / unload only."""
        start = time.perf_counter_ns()
        resolved, opts = self._prepare(model, options)
        format = _check_format(format)
        _check_logprobs(top_logprobs)
        keep = self._keep_alive(keep_alive)
        if not prompt and not context:
            async for chunk in self._load_only(resolved, opts, keep, start):
                yield chunk
            return
        if raw and (system or context):
            raise LocalrtError("raw mode does not support template, system, or context")
        async with self._use(resolved, opts, keep) as (entry, load_ns):
            m = entry.model
            if raw:
                tokens = m.tokenize(prompt, add_special=True, parse_special=True)
            else:
                msgs: list[dict[str, Any]] = []
                sys_text = system if system is not None else resolved.system
                if sys_text:
                    msgs.append({"role": "system", "content": sys_text})
                msgs.append({"role": "user", "content": prompt})
                rendered = await asyncio.to_thread(entry.template.render, msgs, add_generation_prompt=True)
                tokens = self._tokenize_prompt(entry, rendered, add_bos=not context)
                tokens = [*(context or []), *tokens]
            async for chunk in self._run(
                entry,
                tokens,
                opts,
                format,
                logprobs,
                top_logprobs,
                stream,
                start,
                load_ns,
                want_context=not raw,
            ):
                yield chunk

    async def embed(
        self,
        model: str,
        inputs: str | Sequence[str],
        *,
        options: Mapping[str, Any] | None = None,
        keep_alive: str | float | None = None,
        truncate: bool = True,
    ) -> EmbedResult:
        start = time.perf_counter_ns()
        texts = [inputs] if isinstance(inputs, str) else list(inputs)
        if not all(isinstance(t, str) for t in texts):
            raise LocalrtError("input must be a string or a list of strings")
        resolved, opts = self._prepare(model, options)
        keep = self._keep_alive(keep_alive)
        async with self._use(resolved, opts, keep) as (entry, load_ns):
            m = entry.model
            if not m.capabilities.embedding:
                raise LocalrtError(f'"{resolved.name.display}" does not support embeddings')
            counts = [len(m.tokenize(t)) for t in texts]
            if not truncate and any(c > m.context_length for c in counts):
                raise ContextLengthError(
                    f"input length exceeds the context length of {m.context_length} tokens"
                )
            vectors = await m.embed(texts)
        return EmbedResult(
            resolved.name.display,
            vectors,
            sum(min(c, m.context_length) for c in counts),
            time.perf_counter_ns() - start,
            load_ns,
        )

    async def tokenize(
        self,
        model: str,
        text: str,
        *,
        add_special: bool = True,
        parse_special: bool = False,
        options: Mapping[str, Any] | None = None,
    ) -> list[int]:
        resolved, opts = self._prepare(model, options)
        async with self._use(resolved, opts, self._keep_alive(None), exclusive=False) as (entry, _):
            return entry.model.tokenize(text, add_special=add_special, parse_special=parse_special)

    async def detokenize(
        self, model: str, tokens: Sequence[int], *, options: Mapping[str, Any] | None = None
    ) -> str:
        resolved, opts = self._prepare(model, options)
        async with self._use(resolved, opts, self._keep_alive(None), exclusive=False) as (entry, _):
            bad = [
                t
                for t in tokens
                if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < entry.model.n_vocab
            ]
            if bad:
                raise LocalrtError(f"invalid token id {bad[0]!r}")
            return entry.model.detokenize(tokens)

    async def score(
        self,
        model: str,
        tokens: Sequence[int] | str,
        *,
        return_logits: bool = False,
        options: Mapping[str, Any] | None = None,
    ) -> ScoreResult:
        """Per-position log p(token_i | prefix) for perplexity / KL (a text is tokenized with BOS)."""
        resolved, opts = self._prepare(model, options)
        async with self._use(resolved, opts, self._keep_alive(None)) as (entry, _):
            ids = entry.model.tokenize(tokens, add_special=True) if isinstance(tokens, str) else list(tokens)
            if len(ids) > entry.model.context_length:
                raise ContextLengthError(
                    f"{len(ids)} tokens do not fit the context length of {entry.model.context_length}"
                )
            return await entry.model.score(ids, return_logits=return_logits)

    async def render(
        self,
        model: str,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        options: Mapping[str, Any] | None = None,
    ) -> tuple[str, list[int]]:
        """The prompt text and tokens a chat request would use (debugging, `_debug_render_only`)."""
        resolved, opts = self._prepare(model, options)
        async with self._use(resolved, opts, self._keep_alive(None), exclusive=False) as (entry, _):
            rendered = await asyncio.to_thread(entry.template.render, list(messages), tools=tools)
            return rendered.text, self._tokenize_prompt(entry, rendered)

    def ps(self) -> list[LoadedInfo]:
        rows = []
        for e in sorted(self._entries.values(), key=lambda e: -e.last_used):
            on_gpu = bool(getattr(e.model, "on_gpu", False))
            size = int(e.model.memory_bytes)
            details = {"format": "gguf", "family": e.model.metadata.get("general.architecture", "")}
            weights = getattr(e.model, "weight_bytes", None)  # backends that report their resident weights
            if callable(weights):
                details["weight_bytes"] = int(weights())
            rows.append(
                LoadedInfo(
                    name=e.key,
                    digest=e.resolved.manifest_digest,
                    size=size,
                    size_vram=size if on_gpu else 0,
                    backend=e.backend,
                    processor=f"100% {'GPU' if on_gpu else 'CPU'}",
                    context_length=e.model.context_length,
                    expires_at=None if e.expires_at is None or e.expires_at == float("inf") else e.expires_at,
                    details=details,
                )
            )
        return rows

    def queue_depth(self) -> dict[str, int]:
        """Requests waiting or running, per model (for /metrics)."""
        return {name: n for name, n in self._inflight.items() if n > 0}

    async def unload(self, model: str) -> bool:
        """Unload now if idle, else as soon as its running requests finish. False when not loaded."""
        key = self._key(model)
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

    # ---- preparation -----------------------------------------------------------------------
    def _key(self, model: str) -> str:
        from localrt.store.names import parse_name

        return parse_name(model).display

    def _prepare(self, model: str, options: Mapping[str, Any] | None) -> tuple[ResolvedModel, Options]:
        if not isinstance(model, str) or not model.strip():
            raise LocalrtError("model is required")
        resolved = self.store.resolve(model)
        if options is not None and not isinstance(options, Mapping):
            raise OptionError("options must be an object of name: value pairs")
        opts = Options.merge(resolved.params, options, lenient=(True, False))
        return resolved, opts

    def _keep_alive(self, value: str | float | None) -> float:
        if value is None:
            return self.default_keep_alive
        return config.parse_duration(value, self.default_keep_alive)

    def _draft_path(self, resolved: ResolvedModel, opts: Options) -> Path | None:
        if opts.speculative == "off":
            return None
        if opts.draft_model:
            path = Path(opts.draft_model).expanduser()
            if path.suffix == ".gguf" and path.is_file():
                return path
            try:
                return self.store.resolve(opts.draft_model).model_path
            except ModelNotFound:
                raise ModelNotFound(
                    f"draft model '{opts.draft_model}' not found, try pulling it first"
                ) from None
        if opts.speculative in ("auto", "draft"):
            return resolved.draft_path
        return None

    def _tokenize_prompt(self, entry: _Entry, rendered: RenderedPrompt, add_bos: bool = True) -> list[int]:
        m = entry.model
        return tokenize_rendered(
            rendered,
            lambda text, add, special: m.tokenize(text, add_special=add, parse_special=special),
            m.bos_token_id,
            add_bos and m.add_bos,
        )

    # ---- scheduling ------------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def _use(
        self, resolved: ResolvedModel, opts: Options, keep_alive: float, exclusive: bool = True
    ) -> AsyncIterator[tuple[_Entry, int]]:
        """Hold a loaded model for one request: queue, load or reuse, then release with keep-alive."""
        key = resolved.name.display
        waiting = self._pending.get(key, 0)
        if waiting >= self.max_queue:
            raise ServerBusy(BUSY_MESSAGE)
        self._pending[key] = waiting + 1
        self._inflight[key] = self._inflight.get(key, 0) + 1
        started = time.perf_counter_ns()
        entry: _Entry | None = None
        locked = False
        try:
            try:
                entry, loaded_now = await self._acquire(resolved, opts)
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
                yield entry, load_ns
            finally:
                if locked:
                    entry.slots.release()
                await self._release(entry, keep_alive)
        finally:
            self._inflight[key] -= 1

    async def _acquire(self, resolved: ResolvedModel, opts: Options) -> tuple[_Entry, bool]:
        key = resolved.name.display
        backend = registry.resolve(opts.backend)
        draft = self._draft_path(resolved, opts)
        load_key = (
            backend,
            str(resolved.model_path),
            opts.num_ctx,
            opts.num_thread,
            opts.num_gpu,
            opts.kv_cache_type,
            opts.flash_attn,
            opts.num_batch,
            num_parallel(),
        )
        async with self._cond:
            while True:
                entry = self._entries.get(key)
                if key in self._loading:
                    await self._cond.wait()  # someone is loading it right now
                    continue
                if entry is not None and (
                    entry.load_key != load_key or (draft is not None and entry.draft_path != draft)
                ):
                    # other load-time options: reload once its running requests are done, as Ollama does
                    if entry.refs == 0:
                        await self._unload_locked(entry)
                    else:
                        await self._cond.wait()
                    continue
                if entry is not None:
                    self._grab(entry)
                    return entry, False
                if len(self._entries) + len(self._loading) >= self.max_loaded:
                    victim = self._lru_idle()
                    if victim is None:
                        await self._cond.wait()  # every loaded model is busy
                    else:
                        await self._unload_locked(victim)
                    continue
                self._loading.add(key)
                break
        # load outside the lock, so requests for other (loaded) models keep flowing
        try:
            entry = await self._load(key, resolved, opts, backend, load_key, draft)
        finally:
            async with self._cond:
                self._loading.discard(key)
                self._cond.notify_all()
        async with self._cond:
            self._entries[key] = entry
            self._grab(entry)
        return entry, True

    def _grab(self, entry: _Entry) -> None:
        entry.refs += 1
        entry.last_used = time.monotonic()
        if entry.timer is not None:
            entry.timer.cancel()
            entry.timer = None
        entry.expires_at = None

    async def _release(self, entry: _Entry, keep_alive: float) -> None:
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

    def _spawn_expire(self, entry: _Entry) -> None:
        task = asyncio.ensure_future(self._expire(entry))
        self._tasks.add(task)  # keep a reference until it finishes
        task.add_done_callback(self._tasks.discard)

    async def _expire(self, entry: _Entry) -> None:
        async with self._cond:
            if entry.refs == 0 and self._entries.get(entry.key) is entry:
                await self._unload_locked(entry)

    def _lru_idle(self) -> _Entry | None:
        idle = [e for e in self._entries.values() if e.refs == 0]
        return min(idle, key=lambda e: e.last_used) if idle else None

    async def _load(
        self,
        key: str,
        resolved: ResolvedModel,
        opts: Options,
        backend_name: str,
        load_key: tuple[Any, ...],
        draft: Path | None,
    ) -> _Entry:
        backend = registry.get(backend_name)
        load_opts = opts.load_options(draft_path=draft)
        model: LoadedModel = await asyncio.to_thread(backend.load, resolved.model_path, load_opts)
        try:
            template = self._make_template(resolved, model)
        except BaseException:
            await asyncio.to_thread(model.unload)
            raise
        slots = asyncio.Semaphore(max(1, model.capabilities.parallel_slots))
        return _Entry(
            key=key,
            resolved=resolved,
            backend=backend_name,
            load_key=load_key,
            draft_path=draft,
            model=model,
            template=template,
            slots=slots,
        )

    def _make_template(self, resolved: ResolvedModel, model: LoadedModel) -> ChatTemplate:
        source = select_template(
            resolved.template,
            model.metadata.get("tokenizer.chat_template"),
            model.metadata.get("general.architecture"),
            model.special_tokens(),
        ).source
        bos = model.token_text(model.bos_token_id) if model.bos_token_id is not None else ""
        eos = model.token_text(model.eos_token_ids[0]) if model.eos_token_ids else ""
        return ChatTemplate(source, bos_token=bos, eos_token=eos, special_tokens=model.special_tokens())

    async def _unload_locked(self, entry: _Entry) -> None:
        """Unload while holding self._cond."""
        if entry.timer is not None:
            entry.timer.cancel()
            entry.timer = None
        if self._entries.get(entry.key) is entry:
            del self._entries[entry.key]
        await asyncio.to_thread(entry.model.unload)
        self._cond.notify_all()

    async def _load_only(
        self, resolved: ResolvedModel, opts: Options, keep_alive: float, start: int
    ) -> AsyncIterator[Chunk]:
        name = resolved.name.display
        if keep_alive <= 0:
            await self.unload(name)
            yield Chunk(
                model=name,
                done=True,
                done_reason="unload",
                metrics=Metrics(total_ns=time.perf_counter_ns() - start),
            )
            return
        async with self._use(resolved, opts, keep_alive, exclusive=False) as (_, load_ns):
            pass
        yield Chunk(
            model=name,
            done=True,
            done_reason="load",
            metrics=Metrics(total_ns=time.perf_counter_ns() - start, load_ns=load_ns),
        )

    # ---- one generation --------------------------------------------------------------------
    async def _run(
        self,
        entry: _Entry,
        tokens: list[int],
        opts: Options,
        format: Any,
        logprobs: bool,
        top_logprobs: int,
        stream: bool,
        start: int,
        load_ns: int,
        *,
        tools: bool = False,
        want_context: bool = False,
    ) -> AsyncIterator[Chunk]:
        m = entry.model
        name = entry.key
        if len(tokens) >= m.context_length:
            raise ContextLengthError(
                f"the prompt is {len(tokens)} tokens, which does not fit the context length of "
                f"{m.context_length} tokens (raise num_ctx or shorten the input)"
            )
        if format is not None and not m.capabilities.grammar:
            raise LocalrtError(f"the {entry.backend} backend does not support format (JSON output)")
        request = GenerateRequest(
            prompt_tokens=tokens,
            sampling=opts.sampling(),
            num_predict=opts.max_new_tokens(len(tokens), m.context_length),
            stop=list(opts.stop),
            logprobs=logprobs or top_logprobs > 0,
            top_logprobs=top_logprobs,
            format=format,
            speculative=opts.speculative,
            num_draft=opts.num_draft,
        )
        full: list[str] = []
        held: list[str] = []  # output that may turn into a tool call
        answer_ids: list[int] = []
        lps: list[dict[str, Any]] = []
        holding = tools
        done: DoneEvent | None = None
        events = m.generate(request)
        async with contextlib.aclosing(events):  # type: ignore[type-var]
            async for event in events:
                if isinstance(event, DoneEvent):
                    done = event
                    break
                assert isinstance(event, TextEvent)
                full.append(event.text)
                answer_ids.extend(event.token_ids)
                piece_lps = [_ollama_logprob(lp) for lp in event.logprobs] if event.logprobs else None
                if piece_lps:
                    lps.extend(piece_lps)
                if not stream:
                    continue
                if holding:
                    held.append(event.text)
                    if could_be_tool_call("".join(held)):
                        continue
                    holding, text = False, "".join(held)
                    held = []
                    yield Chunk(model=name, content=text, logprobs=piece_lps)
                    continue
                if event.text or piece_lps:
                    yield Chunk(model=name, content=event.text, logprobs=piece_lps)
        if done is None:  # the backend ended without a final event: treat as cancelled
            raise LocalrtError("generation ended unexpectedly")
        text = "".join(full)
        content, calls = parse_tool_calls(text) if tools else (text, [])
        if not stream:
            final_content = content
        elif holding:  # never released: everything is still here
            final_content = content if calls else "".join(held)
        else:
            final_content = ""
        metrics = Metrics(
            **{
                **dataclasses.asdict(done.timings),
                "load_ns": load_ns,
                "total_ns": time.perf_counter_ns() - start,
            }
        )
        yield Chunk(
            model=name,
            content=final_content,
            done=True,
            done_reason=done.finish_reason,
            tool_calls=calls or None,
            logprobs=(lps or None) if not stream else None,
            metrics=metrics,
            context=[*tokens, *answer_ids] if want_context else None,
        )


def _ollama_logprob(lp: TokenLogprob) -> dict[str, Any]:
    return {
        "token": lp.token,
        "logprob": lp.logprob,
        "bytes": list(lp.token.encode("utf-8")),
        "top_logprobs": [
            {"token": t.token, "logprob": t.logprob, "bytes": list(t.token.encode("utf-8"))} for t in lp.top
        ],
    }


def _check_format(format: Any) -> str | dict[str, Any] | None:
    if format is None or format == "":
        return None
    if format == "json" or isinstance(format, dict):
        return format
    raise LocalrtError(f'invalid format {format!r}: use "json" or a JSON schema object')


def _check_logprobs(top_logprobs: Any) -> None:
    if isinstance(top_logprobs, bool) or not isinstance(top_logprobs, int) or not 0 <= top_logprobs <= 20:
        raise LocalrtError("top_logprobs must be between 0 and 20")
