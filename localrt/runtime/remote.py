"""The remote path: every request for a remote model, from the runtime's entrance to its chunks.

A remote model is a stored manifest naming OpenAI-compatible endpoints (vLLM, SGLang, llama-server,
another localrt). `front.Runtime` checks `is_remote` once per request and hands the whole request here.
The upstream templates, tokenizes, fits the context and parses thinking and tool calls itself, so this
path has no vocabulary, no chat template and no `Prompter`: it sends the conversation (chat, templated
generate) or the raw text (raw generate, OpenAI completions) as a `RemoteRequest` and turns the backend's
events into the runtime's `Chunk`s. Options no OpenAI-compatible server takes are refused with a 400
instead of being dropped. The model pool holds remote models beside local ones (queue, slots,
keep-alive, `ps`, `stop`) through `RemoteLoader`, which marks them as holding no memory here.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator
from collections.abc import Mapping
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from typing import Unpack

from localrt.backends import registry
from localrt.backends.base import DoneEvent
from localrt.backends.base import TextEvent
from localrt.backends.base import TokenLogprob
from localrt.backends.remote import RemoteModel
from localrt.backends.remote import RemoteRequest
from localrt.errors import LocalrtError
from localrt.errors import OptionError
from localrt.runtime import fim
from localrt.runtime import images as image_input
from localrt.runtime import lora as lora_scales
from localrt.runtime import thinking
from localrt.runtime.answers import Chunk
from localrt.runtime.answers import EmbedResult
from localrt.runtime.answers import Metrics
from localrt.runtime.answers import RerankResult
from localrt.runtime.answers import Settings
from localrt.runtime.answers import asked
from localrt.runtime.lifecycle import Entry
from localrt.runtime.lifecycle import LoadSpec
from localrt.runtime.lifecycle import ModelPool
from localrt.runtime.options import Options
from localrt.runtime.prompt import tool_choice as parse_tool_choice
from localrt.runtime.prompt import with_history
from localrt.runtime.thinking import Think
from localrt.store.remote import is_remote as is_remote
from localrt.store.store import ResolvedModel

BACKEND = "remote"
# Options an OpenAI-compatible upstream has no field for (load-time settings belong to the upstream's
# own launch; typical_p, mirostat and the penalty window are not in vLLM's or SGLang's API).
UNSUPPORTED = (
    "typical_p",
    "repeat_last_n",
    "mirostat",
    "mirostat_tau",
    "mirostat_eta",
    "num_ctx",
    "num_keep",
    "num_thread",
    "num_gpu",
    "num_batch",
    "kv_cache_type",
    "flash_attn",
    "numerics",
    "draft_model",
    "num_draft",
    "backend",
    "grammar",
)


def check_options(resolved: ResolvedModel, opts: Options) -> None:
    """A 400 naming the first option (from the request or the model's parameters) a remote model
    cannot honour; the defaults (and the environment's) pass."""
    if resolved.remote is None:
        return
    defaults = Options()
    bad = [name for name in UNSUPPORTED if getattr(opts, name) != getattr(defaults, name)]
    if opts.speculative not in ("auto", "off"):
        bad.append("speculative")
    if bad:
        where = ", ".join(resolved.remote.get("endpoints") or [])
        raise OptionError(
            f"option {bad[0]!r} does not apply to remote model '{resolved.name.display}' "
            f"(served by {where}: the upstream sets it)"
        )


# Token ids are the upstream's: it checks them against its vocabulary; here only their range.
MAX_TOKEN_ID = 2**31 - 1
# The upstream's template decides whether the model thinks; a request that insists on thinking is refused
# as on a local model that cannot think (an optional ask is answered without).
_NO_THINKING = thinking.ModelFormat()


@dataclass(kw_only=True)
class RemoteEntry(Entry):
    """A remote model as the pool holds it."""

    model: RemoteModel


class RemoteLoader:
    """The pool's loader for remote models: the config blob into a `RemoteModel` (endpoints probed), no
    GGUF, no template, no memory held here."""

    in_memory = False

    def backend(self, opts: Options) -> str:
        return BACKEND

    async def load(self, spec: LoadSpec) -> RemoteEntry:
        backend = registry.get(BACKEND)
        model: RemoteModel = await asyncio.to_thread(backend.load, spec.resolved.model_path, spec.load_opts)
        return RemoteEntry(
            key=spec.key,
            resolved=spec.resolved,
            backend=BACKEND,
            load_key=spec.load_key,
            draft_path=spec.draft,
            model=model,
            family=BACKEND,
            in_memory=False,
            slots=asyncio.Semaphore(max(1, model.capabilities.parallel_slots)),
            held_bytes=spec.held,
        )


LOADER = RemoteLoader()


@dataclass
class _Call:
    """What a chat or generate request for a remote model settles before any load."""

    model: str  # as the request named it
    resolved: ResolvedModel
    opts: Options
    format: str | dict[str, Any] | None
    logprobs: bool
    top_logprobs: int
    stream: bool
    think: Think
    tools: list[dict[str, Any]] | None  # tool_choice applied
    required: bool  # tool_choice asks for a call
    keep_alive: float
    start: int  # perf_counter_ns at arrival


class RemoteRuntime:
    """The request paths of remote models, over the shared pool: chat and generate as the upstream's
    chat and completions, embed, tokenize and detokenize by the upstream; no scoring or reranking."""

    def __init__(self, pool: ModelPool) -> None:
        self.pool = pool

    def _options(self, resolved: ResolvedModel, options: Mapping[str, Any] | None) -> Options:
        opts = self.pool.options(resolved, options)
        check_options(resolved, opts)
        return opts

    def _use(
        self, resolved: ResolvedModel, opts: Options, keep_alive: float, exclusive: bool = True
    ) -> contextlib.AbstractAsyncContextManager[tuple[RemoteEntry, int]]:
        return self.pool.use(resolved, opts, keep_alive, exclusive, loader=LOADER)

    # ---- chat and generate -----------------------------------------------------------------------
    async def chat(
        self,
        resolved: ResolvedModel,
        model: str,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        tool_choice: Any = None,
        parallel_tool_calls: bool | None = None,
        **settings: Unpack[Settings],
    ) -> AsyncIterator[Chunk]:
        """The conversation (with the model's system prompt and history) to the upstream's chat."""
        call = self._begin(resolved, model, settings, tools=tools, choice=tool_choice)
        if not messages:
            async for chunk in self._load_only(call):
                yield chunk
            return
        msgs = with_history(messages, resolved.system, resolved.messages)
        msgs, pending = await image_input.check_images(msgs)
        _check_vision(resolved, pending)
        async with self._use(resolved, call.opts, call.keep_alive) as (entry, load_ns):
            thinking.check_think(_NO_THINKING, call.think, model)
            _check_required(call)
            request = self._request(call, messages=[dict(m) for m in msgs], tools=call.tools)
            async for chunk in self._run(call, entry, load_ns, request):
                yield chunk

    async def generate(
        self,
        resolved: ResolvedModel,
        model: str,
        prompt: str = "",
        *,
        system: str | None = None,
        raw: bool = False,
        context: Sequence[int] | None = None,
        images: Sequence[Any] | None = None,
        suffix: str | None = None,
        **settings: Unpack[Settings],
    ) -> AsyncIterator[Chunk]:
        """Raw text to the upstream's completions, else one user turn (with the system prompt) to its
        chat. No fill-in-the-middle and no `context`: the upstream's token ids are not ours."""
        call = self._begin(resolved, model, settings)
        name = resolved.name.display
        if suffix:
            fim.check_insert(name, True, raw, bool(images))
            async with self._use(resolved, call.opts, call.keep_alive):
                fim.check_insert(name, False, False, False)
        if not prompt and not context:
            async for chunk in self._load_only(call):
                yield chunk
            return
        if raw and (system or context):
            raise LocalrtError("raw mode does not support template, system, or context")
        pending: list[image_input.PendingImage] = []
        if images:
            (marked,), pending = await image_input.check_images([{"content": prompt, "images": list(images)}])
            prompt = marked["content"]
        _check_vision(resolved, pending)
        async with self._use(resolved, call.opts, call.keep_alive) as (entry, load_ns):
            if context:
                raise LocalrtError(
                    "context (token ids of an earlier answer) is not supported for remote models"
                )
            if raw:
                request = self._request(call, prompt=prompt)
            else:
                thinking.check_think(_NO_THINKING, call.think, model)
                sys_text = system if system is not None else resolved.system
                turns = [{"role": "system", "content": sys_text}] if sys_text else []
                request = self._request(call, messages=[*turns, {"role": "user", "content": prompt}])
            async for chunk in self._run(call, entry, load_ns, request):
                yield chunk

    def _begin(
        self,
        resolved: ResolvedModel,
        model: str,
        settings: Settings,
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        choice: Any = None,
    ) -> _Call:
        start = time.perf_counter_ns()
        opts = self._options(resolved, settings.get("options"))
        lora_scales.scales(settings.get("lora"), resolved, BACKEND)  # a 400: the upstream has its own
        return _Call(
            model=model,
            resolved=resolved,
            opts=opts,
            **asked(settings, tools, choice),
            keep_alive=self.pool.keep_alive(settings.get("keep_alive")),
            start=start,
        )

    async def _load_only(self, call: _Call) -> AsyncIterator[Chunk]:
        name = call.resolved.name.display
        if call.keep_alive <= 0:
            await self.pool.unload(name)
            yield Chunk(
                model=name,
                done=True,
                done_reason="unload",
                metrics=Metrics(total_ns=time.perf_counter_ns() - call.start),
            )
            return
        async with self._use(call.resolved, call.opts, call.keep_alive, exclusive=False) as (_, load_ns):
            pass
        yield Chunk(
            model=name,
            done=True,
            done_reason="load",
            metrics=Metrics(total_ns=time.perf_counter_ns() - call.start, load_ns=load_ns),
        )

    @staticmethod
    def _request(call: _Call, **prompt: Any) -> RemoteRequest:
        """The upstream's request; it bounds an answer by its own context, so num_predict -1 and -2 both
        mean no max_tokens."""
        opts = call.opts
        return RemoteRequest(
            **prompt,
            sampling=opts.sampling(),
            num_predict=opts.num_predict if opts.num_predict >= 0 else -1,
            stop=list(opts.stop),
            logprobs=call.logprobs or call.top_logprobs > 0,
            top_logprobs=call.top_logprobs,
            format=call.format,
        )

    async def _run(
        self, call: _Call, entry: RemoteEntry, load_ns: int, request: RemoteRequest
    ) -> AsyncIterator[Chunk]:
        """The upstream's answer as chunks: its text as it comes (or all at once at the end), then one
        done chunk with the tool calls it parsed and its timings."""
        name = entry.key
        content: list[str] = []
        lps: list[TokenLogprob] = []
        done: DoneEvent | None = None
        events = entry.model.generate(request)
        async with contextlib.aclosing(events):
            async for event in events:
                if isinstance(event, DoneEvent):
                    done = event
                    break
                assert isinstance(event, TextEvent)
                piece_lps = event.logprobs or None
                if piece_lps:
                    lps.extend(piece_lps)
                if not call.stream:
                    content.append(event.text)
                elif event.text or piece_lps:
                    yield Chunk(model=name, content=event.text, logprobs=piece_lps)
        if done is None:  # the backend ended without a final event
            raise LocalrtError("generation ended unexpectedly")
        metrics = Metrics(
            **{
                **dataclasses.asdict(done.timings),
                "load_ns": load_ns,
                "total_ns": time.perf_counter_ns() - call.start,
            }
        )
        yield Chunk(
            model=name,
            content="".join(content),
            done=True,
            done_reason=done.finish_reason,
            stop_sequence=done.stop_sequence,
            tool_calls=done.tool_calls or None,
            logprobs=(lps or None) if not call.stream else None,
            metrics=metrics,
        )

    # ---- the other paths ---------------------------------------------------------------------
    async def embed(
        self,
        resolved: ResolvedModel,
        texts: list[str],
        *,
        options: Mapping[str, Any] | None = None,
        keep_alive: str | float | None = None,
        truncate: bool = True,
    ) -> EmbedResult:
        """The upstream's `/v1/embeddings`; it tokenizes, truncates and counts."""
        start = time.perf_counter_ns()
        opts = self._options(resolved, options)
        async with self._use(resolved, opts, self.pool.keep_alive(keep_alive)) as (entry, load_ns):
            vectors, count = await entry.model.embed_counted(texts)
        return EmbedResult(resolved.name.display, vectors, count, time.perf_counter_ns() - start, load_ns)

    async def rerank(
        self,
        resolved: ResolvedModel,
        query: str,
        documents: Sequence[str],
        *,
        options: Mapping[str, Any] | None = None,
        keep_alive: str | float | None = None,
    ) -> RerankResult:
        opts = self._options(resolved, options)
        async with self._use(resolved, opts, self.pool.keep_alive(keep_alive)):
            raise LocalrtError(f'"{resolved.name.display}" does not support reranking')

    async def tokenize(
        self,
        resolved: ResolvedModel,
        text: str,
        *,
        add_special: bool = True,
        parse_special: bool = False,
        options: Mapping[str, Any] | None = None,
    ) -> list[int]:
        """The upstream's tokenizer (an HTTP round trip: off the event loop)."""
        opts = self._options(resolved, options)
        async with self._use(resolved, opts, self.pool.keep_alive(None), exclusive=False) as (entry, _):
            return await asyncio.to_thread(entry.model.tokenize, text, add_special, parse_special)

    async def detokenize(
        self, resolved: ResolvedModel, tokens: Sequence[int], *, options: Mapping[str, Any] | None = None
    ) -> str:
        opts = self._options(resolved, options)
        async with self._use(resolved, opts, self.pool.keep_alive(None), exclusive=False) as (entry, _):
            bad = [
                t
                for t in tokens
                if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < MAX_TOKEN_ID
            ]
            if bad:
                raise LocalrtError(f"invalid token id {bad[0]!r}")
            return await asyncio.to_thread(entry.model.detokenize, tokens)

    async def score(
        self,
        resolved: ResolvedModel,
        tokens: Sequence[int] | str,
        *,
        return_logits: bool = False,
        options: Mapping[str, Any] | None = None,
    ) -> Any:
        opts = self._options(resolved, options)
        async with self._use(resolved, opts, self.pool.keep_alive(None)) as (entry, _):
            raise LocalrtError(
                f"remote model {entry.model.upstream_model} cannot score tokens: perplexity and KL need a "
                "local model"
            )

    async def render(
        self,
        resolved: ResolvedModel,
        model: str,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        options: Mapping[str, Any] | None = None,
        think: Any = None,
    ) -> tuple[str, list[int]]:
        """The conversation's text (each turn's content, one per line) and the upstream's tokens of it:
        the upstream's chat template is its own, so this counts the content, not the template's markup."""
        opts = self._options(resolved, options)
        wanted = think if isinstance(think, Think) else thinking.parse_think(think)
        msgs = with_history(messages, resolved.system, resolved.messages)
        parse_tool_choice(None, tools)
        thinking.check_think(_NO_THINKING, wanted, model)
        text = "\n".join(str(m.get("content") or "") for m in msgs)
        async with self._use(resolved, opts, self.pool.keep_alive(None), exclusive=False) as (entry, _):
            return text, await asyncio.to_thread(entry.model.tokenize, text, True, False)


def _check_vision(resolved: ResolvedModel, pending: Sequence[image_input.PendingImage]) -> None:
    if pending:
        raise image_input.ImageError(f'"{resolved.name.display}" does not support images')


def _check_required(call: _Call) -> None:
    """tool_choice 'required' is a grammar on a local model; an OpenAI-compatible upstream takes none."""
    if call.required:
        if call.format is not None:
            raise LocalrtError("tool_choice 'required' cannot be combined with format or grammar")
        raise OptionError("grammars (and tool_choice 'required') are not available for remote models")
