"""The remote path: every request for a remote model, from the runtime's entrance to the upstream.

A remote model is a stored manifest naming OpenAI-compatible endpoints (vLLM, SGLang, llama-server,
another localrt). `front.Runtime` tells it apart once per request and hands the whole request here. The
upstream templates, tokenizes, fits the context, samples with its own defaults and parses thinking and
tool calls itself, so this path has no vocabulary, no chat template and no reply parser, and sends no
setting the request did not make:

- an OpenAI request is forwarded (`forward`): its body as the client wrote it, `model` renamed (and the
  model's own Modelfile applied where the request leaves it open), the upstream's bytes back as they come;
- an Ollama or Anthropic chat or completion is translated once into OpenAI's shape (`upstream.chat_body`,
  `completion_body`: the messages, and only the options the request or the model's Modelfile set) and its
  answer read back into the runtime's `Chunk`s (text, thinking, tool calls with their ids, logprobs).

Options no OpenAI-compatible server takes are refused with a 400 instead of being dropped. The model
pool holds remote models beside local ones (queue, slots, keep-alive, `ps`, `stop`) through
`RemoteLoader`, which marks them as holding no memory here.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator
from collections.abc import Callable
from collections.abc import Mapping
from collections.abc import Sequence
from dataclasses import dataclass
from dataclasses import field
from typing import Any

from localrt.backends import registry
from localrt.backends.base import DoneEvent
from localrt.backends.base import Timings
from localrt.backends.base import TokenLogprob
from localrt.backends.remote import Opened
from localrt.backends.remote import RemoteModel
from localrt.backends.remote import upstream
from localrt.errors import LocalrtError
from localrt.errors import OptionError
from localrt.runtime import fim
from localrt.runtime import plan
from localrt.runtime import thinking
from localrt.runtime.answers import Chunk
from localrt.runtime.answers import EmbedResult
from localrt.runtime.answers import Metrics
from localrt.runtime.answers import RerankResult
from localrt.runtime.lifecycle import Entry
from localrt.runtime.lifecycle import LoadSpec
from localrt.runtime.lifecycle import ModelPool
from localrt.runtime.options import Options
from localrt.runtime.plan import Plan
from localrt.runtime.prompt import with_history
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
    "kv_pool",
    "kv_cache_type",
    "flash_attn",
    "numerics",
    "draft_model",
    "num_draft",
    "backend",
    "grammar",
)
# The routes an OpenAI request may be forwarded on, by the upstream path they take
ROUTES = {
    "chat/completions": upstream.CHAT,
    "completions": upstream.COMPLETIONS,
    "embeddings": upstream.EMBEDDINGS,
}


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

    def check(self, resolved: ResolvedModel, opts: Options, given: Mapping[str, Any]) -> None:
        check_options(resolved, opts)

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
            own_bytes=spec.own_bytes,
        )


LOADER = RemoteLoader()


@dataclass
class Forwarded:
    """An OpenAI request's answer from the upstream: its media type and its bytes as they come (the
    model's slot is held until they end or the iterator is closed); once they have ended, `metrics`."""

    model: str  # the stored model's name
    media_type: str = ""
    chunks: AsyncIterator[bytes] = field(init=False)
    tally: upstream.Tally = field(default_factory=upstream.Tally)
    load_ns: int = 0
    # called once the whole answer has passed (not on a cancel), before the response ends
    ended: Callable[[], None] | None = None

    def metrics(self) -> Metrics:
        """The answer's counts and durations, from its usage (where the client asked for it)."""
        timings = self.tally.timings(time.perf_counter_ns())
        return Metrics(**{**dataclasses.asdict(timings), "load_ns": self.load_ns})


class RemoteRuntime:
    """The request paths of remote models, over the shared pool: chat and generate by the upstream's
    chat and completions, OpenAI requests forwarded, embed, tokenize and detokenize by the upstream; no
    scoring or reranking."""

    loader = LOADER

    def __init__(self, pool: ModelPool) -> None:
        self.pool = pool

    def _use(
        self, p: Plan, exclusive: bool = True
    ) -> contextlib.AbstractAsyncContextManager[tuple[RemoteEntry, int]]:
        return self.pool.use(p.resolved, p.opts, p.keep_alive, exclusive, loader=LOADER)

    # ---- an OpenAI request, forwarded --------------------------------------------------------
    async def forward(self, p: Plan, route: str, body: Mapping[str, Any]) -> Forwarded:
        """The request to the upstream as its client wrote it; errors before its first byte raise here."""
        path = ROUTES[route]
        sent = dict(body)
        if path == upstream.CHAT and isinstance(sent.get("messages"), list):
            sent["messages"] = with_history(sent["messages"], p.resolved.system, p.resolved.messages)
        for name, value in upstream.sampling_fields(p.given).items():
            sent.setdefault(name, value)  # the model's Modelfile, where the request leaves a field open
        forwarded = Forwarded(p.name)
        stream = self._forwarding(p, path, sent, forwarded)
        opened = await anext(stream)  # started: closing or collecting it releases the slot
        assert isinstance(opened, Opened)
        forwarded.media_type = opened.media_type
        forwarded.chunks = stream  # type: ignore[assignment]
        return forwarded

    async def _forwarding(
        self, p: Plan, path: str, body: dict[str, Any], forwarded: Forwarded
    ) -> AsyncIterator[Opened | bytes]:
        """The model held while its upstream's bytes pass, each one tallied for the metrics."""
        async with self._use(p) as (entry, load_ns):
            forwarded.load_ns = load_ns
            stream = entry.model.forward(path, body)
            async with contextlib.aclosing(stream):
                opened = await anext(stream)
                assert isinstance(opened, Opened)
                forwarded.tally.start(opened.media_type, opened.length)
                yield opened
                told = False
                async for data in stream:
                    assert isinstance(data, bytes)
                    forwarded.tally.see(data)
                    if forwarded.tally.complete and not told:  # told before the client can see the end
                        told = True
                        self._tell(forwarded)
                    yield data
                if not told:
                    self._tell(forwarded)

    @staticmethod
    def _tell(forwarded: Forwarded) -> None:
        if forwarded.ended is not None:
            forwarded.ended()

    # ---- chat and generate, translated once --------------------------------------------------
    def answer(self, p: Plan, asked: plan.Asked) -> AsyncIterator[Chunk]:
        """A conversation (with the model's system prompt and history) to the upstream's chat; a prompt
        as one user turn to its chat, or as given (raw) to its completions. No `context` (the upstream's
        token ids are not ours) and no fill-in-the-middle (its completions take no suffix in one
        agreed form)."""
        if isinstance(asked, plan.InfillAsked):
            return self._no_infill(p)
        return self._run(p, _Chat(p, asked) if isinstance(asked, plan.ChatAsked) else _Text(p, asked))

    async def _no_infill(self, p: Plan) -> AsyncIterator[Chunk]:
        async with self._use(p):
            fim.check_insert(p.name, False, False, False)
        yield Chunk(model=p.name)  # not reached: a generator, so that it fails where its chunks are read

    async def _run(self, p: Plan, asked: _Asked) -> AsyncIterator[Chunk]:
        """The upstream's answer as chunks: its text and thinking as they come (or all at once at the
        end), then one done chunk with the tool calls it made and its timings."""
        path, body = await asked.body()
        async with self._use(p) as (entry, load_ns):
            name = entry.key
            content: list[str] = []
            reasoning: list[str] = []
            lps: list[TokenLogprob] = []
            done: DoneEvent | None = None
            if p.given.get("num_predict") == 0:  # nothing to ask for
                done = DoneEvent("length", Timings())
            else:
                events = entry.model.generate(path, body, p.cancel)
                async with contextlib.aclosing(events):
                    async for event in events:
                        if isinstance(event, DoneEvent):
                            done = event
                            break
                        if event.logprobs:
                            lps.extend(event.logprobs)
                        if not p.stream:
                            content.append(event.content)
                            reasoning.append(event.reasoning)
                        else:
                            yield Chunk(
                                model=name,
                                content=event.content,
                                thinking=event.reasoning,
                                logprobs=event.logprobs or None,
                            )
            if done is None:  # the backend ended without a final event
                raise LocalrtError("generation ended unexpectedly")
            metrics = Metrics(
                **{
                    **dataclasses.asdict(done.timings),
                    "load_ns": load_ns,
                    "total_ns": time.perf_counter_ns() - p.start,
                }
            )
            yield Chunk(
                model=name,
                content="".join(content),
                thinking="".join(reasoning),
                done=True,
                done_reason=done.finish_reason,
                stop_sequence=done.stop_sequence,
                tool_calls=done.tool_calls or None,
                logprobs=(lps or None) if not p.stream else None,
                metrics=metrics,
            )

    # ---- the other paths ---------------------------------------------------------------------
    async def embed(self, p: Plan, texts: list[str], truncate: bool) -> EmbedResult:
        """The upstream's `/v1/embeddings`; it tokenizes, truncates and counts."""
        async with self._use(p) as (entry, load_ns):
            vectors, count = await entry.model.embed_counted(texts)
        return EmbedResult(p.name, vectors, count, 0, load_ns)

    async def rerank(self, p: Plan, query: str, documents: Sequence[str]) -> RerankResult:
        async with self._use(p):
            raise LocalrtError(f'"{p.name}" does not support reranking')

    async def tokenize(self, p: Plan, text: str, add_special: bool, parse_special: bool) -> list[int]:
        """The upstream's tokenizer (an HTTP round trip: off the event loop)."""
        async with self._use(p, exclusive=False) as (entry, _):
            return await asyncio.to_thread(entry.model.tokenize, text, add_special, parse_special)

    async def detokenize(self, p: Plan, tokens: Sequence[int]) -> str:
        async with self._use(p, exclusive=False) as (entry, _):
            bad = [
                t
                for t in tokens
                if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < MAX_TOKEN_ID
            ]
            if bad:
                raise LocalrtError(f"invalid token id {bad[0]!r}")
            return await asyncio.to_thread(entry.model.detokenize, tokens)

    async def score(self, p: Plan, tokens: Sequence[int] | str, return_logits: bool) -> Any:
        async with self._use(p) as (entry, _):
            raise LocalrtError(
                f"remote model {entry.model.upstream_model} cannot score tokens: perplexity and KL need a "
                "local model"
            )

    async def render(self, p: Plan, messages: list[dict[str, Any]]) -> tuple[str, list[int]]:
        """The conversation's text (each turn's content, one per line) and the upstream's tokens of it:
        the upstream's chat template is its own, so this counts the content, not the template's markup."""
        thinking.check_think(_NO_THINKING, p.think, p.model)
        text = "\n".join(str(m.get("content") or "") for m in messages)
        async with self._use(p, exclusive=False) as (entry, _):
            return text, await asyncio.to_thread(entry.model.tokenize, text, True, False)


# ---- what each kind of request sends upstream ------------------------------------------------------
class _Asked:
    """A chat or generate request's checks, then its body for the upstream (path, OpenAI body)."""

    def __init__(self, p: Plan) -> None:
        self.p = p

    def _top_logprobs(self) -> int | None:
        return self.p.top_logprobs if self.p.logprobs or self.p.top_logprobs > 0 else None

    async def body(self) -> tuple[str, dict[str, Any]]: ...


class _Chat(_Asked):
    def __init__(self, p: Plan, asked: plan.ChatAsked) -> None:
        super().__init__(p)
        self.asked = asked

    async def body(self) -> tuple[str, dict[str, Any]]:
        p = self.p
        msgs, _ = await plan.conversation(p, self.asked.messages)
        thinking.check_think(_NO_THINKING, p.think, p.model)
        body = upstream.chat_body(
            msgs,
            p.given,
            tools=p.tools,
            tool_choice=p.choice if p.required else None,
            parallel_tool_calls=self.asked.parallel_tool_calls,
            fmt=p.format,
            top_logprobs=self._top_logprobs(),
        )
        return upstream.CHAT, body


class _Text(_Asked):
    def __init__(self, p: Plan, asked: plan.TextAsked) -> None:
        super().__init__(p)
        self.asked = asked

    async def body(self) -> tuple[str, dict[str, Any]]:
        p, asked = self.p, self.asked
        prompt, _ = await plan.prompt_images(p, asked.prompt, asked.images)
        if asked.context:
            raise LocalrtError("context (token ids of an earlier answer) is not supported for remote models")
        if asked.raw:
            return upstream.COMPLETIONS, upstream.completion_body(
                prompt, p.given, fmt=p.format, top_logprobs=self._top_logprobs()
            )
        thinking.check_think(_NO_THINKING, p.think, p.model)
        sys_text = asked.system if asked.system is not None else p.resolved.system
        messages = with_history([{"role": "user", "content": prompt}], sys_text, p.resolved.messages)
        body = upstream.chat_body(messages, p.given, fmt=p.format, top_logprobs=self._top_logprobs())
        return upstream.CHAT, body
