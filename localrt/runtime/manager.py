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
import functools
import re
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, ClassVar

from localrt import config
from localrt.backends import registry
from localrt.backends.base import (
    GBNF,
    IMAGE_TOKEN,
    CancelToken,
    DoneEvent,
    GenerateRequest,
    ImageInput,
    LoadedModel,
    ScoreResult,
    TextEvent,
    Timings,
    TokenLogprob,
)
from localrt.errors import LocalrtError, ModelNotFound, OptionError, ServerBusy
from localrt.runtime import images as image_input
from localrt.runtime import remote, thinking
from localrt.runtime.options import Options, num_parallel
from localrt.runtime.templates import ChatTemplate, RenderedPrompt, select_template, tokenize_rendered
from localrt.runtime.thinking import ModelFormat, Piece, ReplyParser, Think
from localrt.runtime.toolcalls import required_grammar
from localrt.runtime.truncate import drop_oldest, fit_tokens
from localrt.store.store import ResolvedModel, Store

BUSY_MESSAGE = "server busy, please try again.  maximum pending requests exceeded"


class ContextLengthError(LocalrtError):
    status = 400


@dataclass
class Metrics(Timings):
    """Ollama's final-chunk numbers, in nanoseconds: the backend's timings plus the request's total."""

    total_ns: int = 0
    # the whole prompt, a reused (cached) prefix included: prompt_eval_count counts only what was
    # evaluated; OpenAI's and Anthropic's usage count the whole input
    prompt_tokens: int = 0
    reasoning_tokens: int = 0  # of eval_count: generated inside the thinking (Responses' reasoning_tokens)

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
    stop_sequence: str | None = None  # done_reason "stop" because this stop string matched (not an end token)
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
class RerankResult:
    model: str
    scores: list[float]  # per document, in the order given
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
    format: ModelFormat = field(default_factory=ModelFormat)  # how it thinks and calls tools
    preserve_tokens: frozenset[int] = frozenset()  # special tokens the reply parser must see
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
        think: Any = None,
        tool_choice: Any = None,
        parallel_tool_calls: bool | None = None,
        truncate: bool = True,
        shift: bool = True,
    ) -> AsyncIterator[Chunk]:
        """Answer a conversation. Empty `messages` only loads the model (or unloads with keep_alive 0).

        `think`: Ollama's value (None, bool, "low"|"medium"|"high") or a Think; `tool_choice`: OpenAI's
        (None/"auto", "none", "required", {"type": "function", "function": {"name": ...}})."""
        start = time.perf_counter_ns()
        resolved, opts = self._prepare(model, options)
        format = _check_format(format)
        _check_logprobs(top_logprobs)
        wanted = think if isinstance(think, Think) else thinking.parse_think(think)
        tools, required = _tool_choice(tool_choice, tools)
        keep = self._keep_alive(keep_alive)
        if not messages:
            async for chunk in self._load_only(resolved, opts, keep, start):
                yield chunk
            return
        msgs = [dict(m) for m in messages]
        if resolved.system and not any(m.get("role") == "system" for m in msgs):
            msgs.insert(0, {"role": "system", "content": resolved.system})
        msgs, pictures = image_input.place_images(msgs)  # decoded and checked before any load
        _check_vision(resolved, pictures)
        async with self._use(resolved, opts, keep) as (entry, load_ns):
            turn = _Turn.make(entry, model, wanted, tools, required, parallel_tool_calls)
            upstream = remote.chat_prompt(msgs, tools) if remote.is_remote(resolved) else None
            tokens: list[int] = []
            if upstream is None:  # a remote model's upstream templates, tokenizes and fits it itself
                tokens = await self._render_chat(entry, msgs, turn, pictures)
                if truncate and not pictures and len(tokens) >= entry.model.context_length:
                    tokens = await self._fit_chat(entry, msgs, turn, tokens)
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
                turn=turn,
                shift=shift,
                upstream=upstream,
                images=pictures,
            ):
                yield chunk

    async def _render_chat(
        self,
        entry: _Entry,
        msgs: list[dict[str, Any]],
        turn: _Turn,
        pictures: list[ImageInput],
        add_bos: bool = True,
    ) -> list[int]:
        """The prompt through the template, with the turn's tools and thinking switch, as tokens."""
        msgs = turn.prepare_messages(msgs)
        render = functools.partial(
            entry.template.render, msgs, tools=turn.tools, add_generation_prompt=True, extra=turn.variables()
        )
        rendered = turn.close_prompt(await asyncio.to_thread(render))
        tokens = self._tokenize_prompt(entry, rendered, add_bos=add_bos, images=bool(pictures))
        if pictures and tokens.count(IMAGE_TOKEN) != len(pictures):
            # a vision model's template may read content only as a list of parts (SmolVLM's does)
            rendered = turn.close_prompt(await asyncio.to_thread(render, typed_content=True))
            tokens = self._tokenize_prompt(entry, rendered, add_bos=add_bos, images=True)
        if pictures and tokens.count(IMAGE_TOKEN) != len(pictures):
            raise image_input.ImageError(
                f'the chat template of "{entry.key}" does not render the messages\' text, so the images '
                "have no place in the prompt"
            )
        return tokens

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
        images: Sequence[Any] | None = None,
        think: Any = None,
        truncate: bool = True,
        shift: bool = True,
    ) -> AsyncIterator[Chunk]:
        """Complete a prompt (templated as one user turn unless raw). Empty prompt: load / unload only.

        `images`: base64 strings or bytes, placed at `[img]` in the prompt or in front of it."""
        start = time.perf_counter_ns()
        resolved, opts = self._prepare(model, options)
        format = _check_format(format)
        _check_logprobs(top_logprobs)
        wanted = think if isinstance(think, Think) else thinking.parse_think(think)
        keep = self._keep_alive(keep_alive)
        if not prompt and not context:
            async for chunk in self._load_only(resolved, opts, keep, start):
                yield chunk
            return
        if raw and (system or context):
            raise LocalrtError("raw mode does not support template, system, or context")
        pictures: list[ImageInput] = []
        if images:
            (marked,), pictures = image_input.place_images([{"content": prompt, "images": list(images)}])
            prompt = marked["content"]
        _check_vision(resolved, pictures)
        async with self._use(resolved, opts, keep) as (entry, load_ns):
            m = entry.model
            turn: _Turn | None = None
            upstream = remote.generate_prompt(resolved, prompt, system, raw, context)
            if upstream is not None:  # a remote model: the upstream templates and tokenizes
                tokens = []
            elif raw:  # the text as given: no template, so no thinking switch and no parsing
                tokenize = image_input.split_markers(
                    lambda text, add, special: m.tokenize(text, add_special=add, parse_special=special)
                )
                tokens = tokenize(prompt, True, True)
            else:
                msgs: list[dict[str, Any]] = []
                sys_text = system if system is not None else resolved.system
                if sys_text:
                    msgs.append({"role": "system", "content": sys_text})
                msgs.append({"role": "user", "content": prompt})
                turn = _Turn.make(entry, model, wanted, None, False, None)
                tokens = await self._render_chat(entry, msgs, turn, pictures, add_bos=not context)
                tokens = [*(context or []), *tokens]
            if truncate and not pictures and upstream is None:
                tokens = fit_tokens(tokens, m.context_length, opts.num_keep)
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
                turn=turn,
                want_context=not raw and not pictures and upstream is None,  # image cells have no token ids
                shift=shift,
                upstream=upstream,
                images=pictures,
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
            if remote.is_remote(resolved):  # the upstream tokenizes and counts
                vectors, count = await m.embed_counted(texts)  # type: ignore[attr-defined]
                return EmbedResult(
                    resolved.name.display, vectors, count, time.perf_counter_ns() - start, load_ns
                )
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

    async def rerank(
        self,
        model: str,
        query: str,
        documents: Sequence[str],
        *,
        options: Mapping[str, Any] | None = None,
        keep_alive: str | float | None = None,
    ) -> RerankResult:
        """Relevance of each document to the query, from a reranker model (rank pooling)."""
        start = time.perf_counter_ns()
        if not isinstance(query, str) or not query:
            raise LocalrtError("query is required (a string)")
        if not isinstance(documents, (list, tuple)) or not all(isinstance(d, str) for d in documents):
            raise LocalrtError("documents must be a list of strings")
        resolved, opts = self._prepare(model, options)
        keep = self._keep_alive(keep_alive)
        async with self._use(resolved, opts, keep) as (entry, load_ns):
            m = entry.model
            if not m.capabilities.rerank or not hasattr(m, "rerank"):
                raise LocalrtError(f'"{resolved.name.display}" does not support reranking')
            scores, n_tokens = await m.rerank(query, documents) if documents else ([], 0)
        return RerankResult(resolved.name.display, scores, n_tokens, time.perf_counter_ns() - start, load_ns)

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
            if remote.is_remote(resolved):  # an HTTP round trip: off the event loop
                return await asyncio.to_thread(entry.model.tokenize, text, add_special, parse_special)
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
            if remote.is_remote(resolved):
                return await asyncio.to_thread(entry.model.detokenize, tokens)
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
        think: Any = None,
    ) -> tuple[str, list[int]]:
        """The prompt text and tokens a chat request would use (debugging, `_debug_render_only`, and
        Anthropic's count_tokens, which must match the answer's input_tokens)."""
        resolved, opts = self._prepare(model, options)
        wanted = think if isinstance(think, Think) else thinking.parse_think(think)
        msgs = [dict(m) for m in messages]
        if resolved.system and not any(m.get("role") == "system" for m in msgs):
            msgs.insert(0, {"role": "system", "content": resolved.system})
        async with self._use(resolved, opts, self._keep_alive(None), exclusive=False) as (entry, _):
            turn = _Turn.make(entry, model, wanted, _tool_choice(None, tools)[0], False, None)
            rendered = await asyncio.to_thread(
                entry.template.render,
                turn.prepare_messages(msgs),
                tools=turn.tools,
                extra=turn.variables(),
            )
            rendered = turn.close_prompt(rendered)
            return rendered.text, self._tokenize_prompt(entry, rendered)

    def ps(self) -> list[LoadedInfo]:
        rows = []
        for e in sorted(self._entries.values(), key=lambda e: -e.last_used):
            on_gpu = bool(getattr(e.model, "on_gpu", False))
            size = int(e.model.memory_bytes)
            details = {
                "format": e.resolved.config.get("model_format", "gguf"),
                "family": e.model.metadata.get("general.architecture", ""),
            }
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
                    processor=getattr(e.model, "processor", None) or f"100% {'GPU' if on_gpu else 'CPU'}",
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
        remote.check_options(resolved, opts)
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

    def _tokenize_prompt(
        self, entry: _Entry, rendered: RenderedPrompt, add_bos: bool = True, images: bool = False
    ) -> list[int]:
        m = entry.model

        def tokenize(text: str, add: bool, special: bool) -> list[int]:
            return m.tokenize(text, add_special=add, parse_special=special)

        return tokenize_rendered(
            rendered,
            image_input.split_markers(tokenize) if images else tokenize,
            m.bos_token_id,
            add_bos and m.add_bos,
        )

    async def _fit_chat(
        self, entry: _Entry, msgs: list[dict[str, Any]], turn: _Turn | None, tokens: list[int]
    ) -> list[int]:
        """`truncate`: the conversation without its oldest turns, so that the prompt fits the context."""
        kept: list[dict[str, Any]] | None = msgs
        while len(tokens) >= entry.model.context_length:
            kept = drop_oldest(kept or [])
            if kept is None:
                break  # only system messages and the last one left: the 400 follows
            tokens = await self._render_chat(entry, kept, turn, [])
        return tokens

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
        backend = remote.BACKEND if remote.is_remote(resolved) else registry.resolve(opts.backend)
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
            str(resolved.projector_path),
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
                if backend != remote.BACKEND and self._local_count() >= self.max_loaded:
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

    def _local_count(self) -> int:
        """Models held in this process's memory; remote ones do not count toward the limit."""
        return sum(e.backend != remote.BACKEND for e in self._entries.values()) + len(self._loading)

    def _lru_idle(self) -> _Entry | None:
        idle = [e for e in self._entries.values() if e.refs == 0 and e.backend != remote.BACKEND]
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
        load_opts = dataclasses.replace(
            opts.load_options(draft_path=draft), projector=resolved.projector_path
        )
        model: LoadedModel = await asyncio.to_thread(backend.load, resolved.model_path, load_opts)
        try:
            template = self._make_template(resolved, model)
            fmt = thinking.model_format(template.source, model.special_tokens())
            preserve = _preserved_tokens(model, fmt.markers)
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
            format=fmt,
            preserve_tokens=preserve,
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
    def _request(
        self,
        entry: _Entry,
        tokens: list[int],
        opts: Options,
        format: Any,
        logprobs: bool,
        top_logprobs: int,
        turn: _Turn | None,
    ) -> GenerateRequest:
        m = entry.model
        if len(tokens) >= m.context_length:
            raise ContextLengthError(
                f"the prompt is {len(tokens)} tokens, which does not fit the context length of "
                f"{m.context_length} tokens (raise num_ctx or shorten the input)"
            )
        constraint: Any = format
        if opts.grammar:
            if format is not None:
                raise LocalrtError("format and grammar cannot be used together")
            _check_token_refs(m, opts.grammar)
            constraint = GBNF(opts.grammar)
        if turn is not None and turn.required:
            if constraint is not None:
                raise LocalrtError("tool_choice 'required' cannot be combined with format or grammar")
            constraint = GBNF(turn.grammar())
        if constraint is not None and not m.capabilities.grammar:
            raise LocalrtError(f"the {entry.backend} backend does not support format (JSON output)")
        return GenerateRequest(
            prompt_tokens=tokens,
            sampling=opts.sampling(),
            num_predict=opts.max_new_tokens(len(tokens), m.context_length),
            stop=list(opts.stop),
            logprobs=logprobs or top_logprobs > 0,
            top_logprobs=top_logprobs,
            format=constraint,
            speculative=opts.speculative,
            num_draft=opts.num_draft,
            preserve_tokens=entry.preserve_tokens if turn is not None else frozenset(),
        )

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
        turn: _Turn | None = None,
        want_context: bool = False,
        shift: bool = True,
        upstream: dict[str, Any] | None = None,
        images: Sequence[ImageInput] = (),
    ) -> AsyncIterator[Chunk]:
        """Generate, and split the reply (thinking, content, tool calls) as it streams: each chunk carries
        only what the parser has decided; held text (a tag or call still arriving) waits for the next."""
        m = entry.model
        name = entry.key
        if images and not m.capabilities.vision:
            raise image_input.ImageError(
                f"the {entry.backend} backend does not support images yet; use the llama.cpp backend "
                f'for "{name}"'
            )
        request = self._request(entry, tokens, opts, format, logprobs, top_logprobs, turn)
        request.images = list(images)
        if shift and m.capabilities.context_shift:  # an explicit num_predict may go past the context end
            request.num_predict = opts.max_new_tokens(len(tokens), m.context_length, True)
        request.shift, request.num_keep = shift, opts.num_keep
        request = remote.with_upstream(request, opts, upstream)  # a remote model: messages or text
        # a remote upstream has parsed thinking and tool calls already
        parser = turn.parser() if turn is not None and upstream is None else None
        reply = _Reply()
        budget = turn.thinking_budget(request, format) if turn is not None and parser is not None else None
        wanted = request.num_predict
        if budget is not None:  # first up to the budget; a cut inside the thinking closes it and goes on
            request.num_predict = budget
        while True:
            async for chunk in self._generate(m, name, request, parser, reply, stream):
                yield chunk
            if budget is None or reply.dones[-1].finish_reason != "length" or parser is None:
                break
            assert turn is not None
            request, piece = self._after_budget(entry, turn, request, tokens, reply, parser, wanted)
            budget = None  # one cut per reply
            if stream and piece:
                yield _piece_chunk(name, piece, None)
            elif piece:
                reply.whole.add(piece)
            if request.num_predict <= 0:
                break
        done = reply.dones[-1]
        last = parser.finish() if parser is not None else Piece()
        if not stream:
            reply.whole.add(last)
            last = reply.whole
        metrics = Metrics(
            **{
                **dataclasses.asdict(_merged_timings(reply.dones)),
                "load_ns": load_ns,
                "total_ns": time.perf_counter_ns() - start,
                "prompt_tokens": len(tokens),
                "reasoning_tokens": reply.reasoning,
            }
        )
        yield Chunk(
            model=name,
            content=last.content,
            thinking=last.thinking,
            done=True,
            done_reason=done.finish_reason,
            stop_sequence=done.stop_sequence,
            tool_calls=last.tool_calls or done.tool_calls or None,  # a remote upstream parsed its own
            logprobs=(reply.lps or None) if not stream else None,
            metrics=metrics,
            context=[*tokens, *reply.ids] if want_context else None,
        )

    async def _generate(
        self,
        m: LoadedModel,
        name: str,
        request: GenerateRequest,
        parser: ReplyParser | None,
        reply: _Reply,
        stream: bool,
    ) -> AsyncIterator[Chunk]:
        """One generation of the backend into `reply`: streamed chunks out, its done event kept."""
        events = m.generate(request)
        async with contextlib.aclosing(events):  # type: ignore[type-var]
            async for event in events:
                if isinstance(event, DoneEvent):
                    reply.dones.append(event)
                    return
                assert isinstance(event, TextEvent)
                reply.ids.extend(event.token_ids)
                piece_lps = [_ollama_logprob(lp) for lp in event.logprobs] if event.logprobs else None
                if piece_lps:
                    reply.lps.extend(piece_lps)
                thinking_before = parser is not None and parser.thinking_now
                piece = parser.feed(event.text) if parser is not None else Piece(content=event.text)
                if thinking_before or (parser is not None and parser.thinking_now):
                    reply.reasoning += len(event.token_ids)  # tokens generated inside the thinking
                if not stream:
                    reply.whole.add(piece)
                elif piece or piece_lps:
                    yield _piece_chunk(name, piece, piece_lps)
        # the backend ended without a final event: treat as cancelled
        raise LocalrtError("generation ended unexpectedly")

    def _after_budget(
        self,
        entry: _Entry,
        turn: _Turn,
        request: GenerateRequest,
        tokens: list[int],
        reply: _Reply,
        parser: ReplyParser,
        wanted: int,
    ) -> tuple[GenerateRequest, Piece]:
        """The thinking budget is spent: the rest of the reply, as a new generation after what was generated
        (the model's cache still holds it, so only the new tokens are evaluated). Cut inside the thinking,
        the family's end-of-thinking text goes in first, so the answer follows; the parser reads it too."""
        piece = Piece()
        if parser.thinking_now:
            closing = thinking.end_of_thinking(turn.fmt)
            reply.ids.extend(entry.model.tokenize(closing, add_special=False, parse_special=True))
            piece = parser.feed(closing)
        # a user grammar (the one constraint a budgeted reply may have: format and a required call turn
        # the budget off) spelled a whole reply and would start over here, so the rest is free
        generated = sum(d.timings.eval_count for d in reply.dones)
        rest = dataclasses.replace(
            request,
            prompt_tokens=[*tokens, *reply.ids],
            num_predict=wanted - generated,
            format=None,
            cancel=CancelToken(),  # the first generation's stream set its own when it closed
        )
        return rest, piece


@dataclass
class _Reply:
    """One reply across its generations (a thinking budget makes two): what the caller gets at the end."""

    whole: Piece = field(default_factory=Piece)  # everything, for a reply that is not streamed
    ids: list[int] = field(default_factory=list)  # its tokens, the runtime's end-of-thinking text included
    lps: list[dict[str, Any]] = field(default_factory=list)
    reasoning: int = 0  # tokens generated inside the thinking
    dones: list[DoneEvent] = field(default_factory=list)


def _merged_timings(dones: Sequence[DoneEvent]) -> Timings:
    """One reply's timings over its generations: the first one's prompt; a later one's prompt (the
    end-of-thinking text and what the cache lacked) is generation time, its tokens are no prompt."""
    first = dones[0].timings
    merged = dataclasses.replace(first)
    for done in dones[1:]:
        t = done.timings
        merged.eval_count += t.eval_count
        merged.eval_ns += t.eval_ns + t.prompt_eval_ns
        merged.draft_count += t.draft_count
        merged.draft_accepted_count += t.draft_accepted_count
    return merged


_TOKEN_REF = re.compile(r"<\[(\d+)\]>")


def _check_token_refs(model: LoadedModel, grammar: str) -> None:
    """A grammar's `<[id]>` token references must name whole-character tokens of this vocabulary:
    llama.cpp aborts the process on one that names a partial UTF-8 byte (seen with byte tokens)."""
    for match in _TOKEN_REF.finditer(grammar):
        token = int(match.group(1))
        if token >= model.n_vocab or "\ufffd" in model.token_text(token):
            raise LocalrtError(f"grammar: token {match.group(0)} is not a whole-text token of this model")


def _piece_chunk(name: str, piece: Piece, logprobs: list[dict[str, Any]] | None) -> Chunk:
    return Chunk(
        model=name,
        content=piece.content,
        thinking=piece.thinking,
        tool_calls=piece.tool_calls or None,
        logprobs=logprobs,
    )


@dataclass
class _Turn:
    """One request's reply settings on one model: its format, the think setting in force, the tools the
    template renders and whether a call is required."""

    fmt: ModelFormat
    think: Think
    tools: list[dict[str, Any]] | None
    required: bool
    parallel: bool
    prompt_text: str = ""

    @classmethod
    def make(
        cls,
        entry: _Entry,
        model: str,
        think: Think,
        tools: list[dict[str, Any]] | None,
        required: bool,
        parallel: bool | None,
    ) -> _Turn:
        fmt = entry.format
        return cls(fmt, thinking.check_think(fmt, think, model), tools, required, parallel is not False)

    def prepare_messages(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        msgs = thinking.history_messages(self.fmt, messages)
        if self.fmt.tool_style == "mistral":
            _mistral_ids(msgs)
        return msgs

    def variables(self) -> dict[str, Any]:
        return thinking.template_variables(self.fmt, self.think)

    def close_prompt(self, rendered: RenderedPrompt) -> RenderedPrompt:
        """Think off on a prompt that opened thinking anyway: close the block, so the reply is the answer."""
        if self.think.enabled is False:
            tail = thinking.close_thinking(self.fmt, rendered.text)
            if tail:
                rendered = RenderedPrompt([*rendered.segments, (tail, True)])
        self.prompt_text = rendered.text
        return rendered

    def thinking_budget(self, request: GenerateRequest, format: Any) -> int | None:
        """The reply tokens thinking may take before the runtime closes it, when that can be enforced:
        a model that thinks in tags or harmony channels, thinking on, and no output constraint that a
        second generation would have to start over (`format`, a required call)."""
        budget = self.think.budget
        if budget is None or not self.think.enabled or not self.fmt.can_think:
            return None
        if format is not None or self.required or budget >= request.num_predict:
            return None
        return max(1, budget)

    def parser(self) -> ReplyParser:
        return ReplyParser(
            self.fmt,
            think=self.think,
            prompt_text=self.prompt_text,
            tools=self.tools,
            parallel_tool_calls=self.parallel,
        )

    def grammar(self) -> str:
        from localrt.backends.grammar import grammar_for

        think_tags = None
        if self.fmt.thinking == "tags" and self.think.enabled:
            opened = thinking.prompt_opens_thinking(self.fmt, self.prompt_text)
            think_tags = ("" if opened else self.fmt.open_tag, self.fmt.close_tag)
        return required_grammar(
            self.fmt.tool_style,
            self.tools or [],
            parallel=self.parallel,
            schema_gbnf=grammar_for,
            thinking=think_tags,
        )


def _tool_choice(
    choice: Any, tools: Sequence[Mapping[str, Any]] | None
) -> tuple[list[dict[str, Any]] | None, bool]:
    """(the tools the template renders, whether a call is required) for OpenAI's `tool_choice`."""
    if tools and not all(isinstance(t, Mapping) for t in tools):
        raise LocalrtError("tools must be a list of objects")
    listed = [dict(t) for t in tools] if tools else None
    if choice is None or choice == "auto":
        return listed, False
    if choice == "none":
        return None, False
    if choice == "required":
        if not listed:
            raise LocalrtError("tool_choice 'required' needs tools")
        return listed, True
    if isinstance(choice, Mapping) and choice.get("type") == "function":
        fn = choice.get("function") if isinstance(choice.get("function"), Mapping) else choice
        wanted = fn.get("name")
        chosen = [t for t in listed or [] if thinking.tool_name(t) == wanted]
        if not chosen:
            raise LocalrtError(f"tool_choice names the function {wanted!r}, which is not in tools")
        return chosen, True
    raise LocalrtError('tool_choice must be "none", "auto", "required" or {"type": "function", ...}')


def _mistral_ids(messages: list[dict[str, Any]]) -> None:
    """Mistral's templates refuse tool-call ids that are not 9 alphanumerics: map each id to one that is,
    the same way in the assistant's calls and in the tool results that answer them."""
    import hashlib

    def short(call_id: Any) -> Any:
        if not isinstance(call_id, str) or (len(call_id) == 9 and call_id.isalnum()):
            return call_id
        return hashlib.sha256(call_id.encode()).hexdigest()[:9]

    for msg in messages:
        if isinstance(msg.get("tool_calls"), list):
            msg["tool_calls"] = [
                {**c, "id": short(c.get("id"))} if isinstance(c, Mapping) and c.get("id") else c
                for c in msg["tool_calls"]
            ]
        if msg.get("tool_call_id"):
            msg["tool_call_id"] = short(msg["tool_call_id"])


def _preserved_tokens(model: LoadedModel, markers: Sequence[str]) -> frozenset[int]:
    """The special tokens spelling the format's markers (a marker that is plain text needs nothing)."""
    specials = set(model.special_tokens())
    ids = set()
    for marker in markers:
        if marker in specials:
            tokens = model.tokenize(marker, add_special=False, parse_special=True)
            if len(tokens) == 1:
                ids.add(tokens[0])
    return frozenset(ids)


def _check_vision(resolved: ResolvedModel, pictures: Sequence[ImageInput]) -> None:
    if pictures and resolved.projector_path is None:
        raise image_input.ImageError(f'"{resolved.name.display}" does not support images')


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
