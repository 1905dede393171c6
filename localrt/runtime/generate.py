"""Local generation: chat, generate, embed, rerank, score and tokenize on a model this process loads.

`Runtime` (`front.py`) hands a request here once it knows the model is local. A request is checked once
(`_begin`), holds a loaded model through `ModelPool.use`, has its prompt rendered by the model's
`Prompter`, and streams `Chunk`s from one loop (`_run`). All methods are coroutines of one event loop;
blocking backend work runs in worker threads.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import re
import time
from collections.abc import AsyncIterator
from collections.abc import Mapping
from collections.abc import Sequence
from dataclasses import dataclass
from dataclasses import field
from typing import Any
from typing import Unpack

from localrt.backends.base import GBNF
from localrt.backends.base import CancelToken
from localrt.backends.base import DoneEvent
from localrt.backends.base import GenerateRequest
from localrt.backends.base import ImageInput
from localrt.backends.base import LoadedModel
from localrt.backends.base import ScoreResult
from localrt.backends.base import TextEvent
from localrt.backends.base import Timings
from localrt.backends.base import TokenLogprob
from localrt.errors import LocalrtError
from localrt.runtime import fim
from localrt.runtime import images as image_input
from localrt.runtime import lora as lora_scales
from localrt.runtime import tenants
from localrt.runtime import thinking
from localrt.runtime.answers import Chunk
from localrt.runtime.answers import ContextLengthError
from localrt.runtime.answers import EmbedResult
from localrt.runtime.answers import Metrics
from localrt.runtime.answers import RerankResult
from localrt.runtime.answers import Settings
from localrt.runtime.answers import asked
from localrt.runtime.lifecycle import LocalEntry as Entry
from localrt.runtime.lifecycle import ModelPool
from localrt.runtime.options import Options
from localrt.runtime.prompt import Turn
from localrt.runtime.prompt import tool_choice
from localrt.runtime.prompt import with_history
from localrt.runtime.thinking import Piece
from localrt.runtime.thinking import ReplyParser
from localrt.runtime.thinking import Think
from localrt.runtime.truncate import fit_tokens
from localrt.store.store import ResolvedModel


@dataclass
class _Call:
    """What a chat or generate request settles before any load: checked once, used by every step."""

    model: str  # as the request named it
    resolved: ResolvedModel
    opts: Options
    format: str | dict[str, Any] | None
    logprobs: bool
    top_logprobs: int
    stream: bool
    think: Think
    tools: list[dict[str, Any]] | None  # what the template renders (tool_choice applied)
    required: bool  # tool_choice asks for a call
    keep_alive: float
    truncate: bool
    shift: bool
    start: int  # perf_counter_ns at arrival
    tenant: str | None  # whose prompt prefixes a reported cache hit may cover (tenants.py)
    lora: tuple[float, ...] | None = None  # one scale per adapter; None: the model's default
    # the request's, made before its prompt is rendered: the model is told it is coming (`_held`)
    cancel: CancelToken = field(default_factory=CancelToken)


class LocalRuntime:
    """The request paths of local models (`front.Runtime` picks this path for them), over the shared pool."""

    def __init__(self, pool: ModelPool) -> None:
        self.pool = pool
        self.prefixes = tenants.PrefixRecord()

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
        """Answer a conversation. Empty `messages` only loads the model (or unloads with keep_alive 0).

        `tool_choice`: OpenAI's (None/"auto", "none", "required", {"type": "function", "function":
        {"name": ...}}); `settings`: what chat and generate share (`Settings`)."""
        call = self._begin(resolved, model, settings, tools=tools, choice=tool_choice)
        if not messages:
            async for chunk in self._load_only(call):
                yield chunk
            return
        msgs = with_history(messages, call.resolved.system, call.resolved.messages)
        # counted, typed and sized from their headers before any load; decoded only once a slot is held,
        # so the decoded pixels in memory are bounded by the slots, not by the requests waiting
        msgs, pending = await image_input.check_images(msgs)
        _check_vision(call.resolved, pending)
        async with self._held(call) as (entry, load_ns):
            _check_generates(entry, "chat")
            pictures = await image_input.decode_all(pending)
            prompter = entry.prompter
            _check_tools(entry, call.tools)
            turn = prompter.turn(model, call.think, call.tools, call.required, parallel_tool_calls)
            tokens = await prompter.render(msgs, turn, pictures)
            if call.truncate and not pictures and len(tokens) >= entry.model.context_length:
                tokens = await prompter.fit(msgs, turn, tokens)
            async for chunk in self._run(call, entry, load_ns, tokens, turn, pictures):
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
        """Complete a prompt (templated as one user turn unless raw). Empty prompt: load / unload only.

        `images`: base64 strings or bytes, placed at `[img]` in the prompt or in front of it;
        `suffix`: the text after the completion (fill-in-the-middle, `prompt` is the text before);
        `settings`: what chat and generate share (`Settings`)."""
        call = self._begin(resolved, model, settings)
        if suffix:
            fim.check_insert(call.resolved.name.display, True, raw, bool(images))
            async for chunk in self._infill(call, prompt, suffix, context):
                yield chunk
            return
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
        _check_vision(call.resolved, pending)
        async with self._held(call) as (entry, load_ns):
            _check_generates(entry, "generate")
            pictures = await image_input.decode_all(pending)
            m = entry.model
            turn: Turn | None = None
            if raw:  # the text as given: no template, so no thinking switch and no parsing
                tokenize = image_input.split_markers(
                    lambda text, add, special: m.tokenize(text, add_special=add, parse_special=special)
                )
                tokens = tokenize(prompt, True, True)
            else:
                sys_text = system if system is not None else resolved.system
                # a continued conversation (`context`) has had the model's history already
                history = call.resolved.messages if not context else []
                msgs = with_history([{"role": "user", "content": prompt}], sys_text, history)
                turn = entry.prompter.turn(model, call.think)
                tokens = await entry.prompter.render(msgs, turn, pictures, add_bos=not context)
                tokens = [*(context or []), *tokens]
            if call.truncate and not pictures:
                tokens = fit_tokens(tokens, m.context_length, call.opts.num_keep)
            want_context = not raw and not pictures  # image cells have no token ids
            async for chunk in self._run(call, entry, load_ns, tokens, turn, pictures, want_context):
                yield chunk

    async def _infill(
        self, call: _Call, prefix: str, suffix: str, context: Sequence[int] | None
    ) -> AsyncIterator[Chunk]:
        """Fill-in-the-middle: the prompt from the model's FIM template branch or FIM tokens, no chat
        template and no reply parsing (the answer is code, not a turn)."""
        async with self._held(call) as (entry, load_ns):
            m = entry.model
            fim.check_insert(call.resolved.name.display, entry.can_insert, False, False)
            bos = m.bos_token_id if m.add_bos and not context else None

            def tokenize(text: str, special: bool = False) -> list[int]:
                return m.tokenize(text, add_special=False, parse_special=special) if text else []

            if entry.fim_template is not None:
                tokens = fim.template_tokens(entry.fim_template, prefix, suffix, tokenize, bos)
            else:
                assert entry.fim_tokens is not None
                n_ctx = m.context_length - len(context or ())
                tokens = fim.infill_tokens(
                    entry.fim_tokens, prefix, suffix, tokenize, bos, n_ctx, call.opts.num_batch
                )
            tokens = [*(context or []), *tokens]
            async for chunk in self._run(call, entry, load_ns, tokens, None, (), True):
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
        """The checks chat and generate share, done once before any load."""
        start = time.perf_counter_ns()
        opts = self.pool.options(resolved, settings.get("options"))
        return _Call(
            model=model,
            resolved=resolved,
            opts=opts,
            **asked(settings, tools, choice),
            keep_alive=self.pool.keep_alive(settings.get("keep_alive")),
            truncate=settings.get("truncate", True),
            shift=settings.get("shift", True),
            start=start,
            tenant=tenants.current_tenant.get(),
            lora=lora_scales.scales(settings.get("lora"), resolved, opts.backend),
        )

    @contextlib.asynccontextmanager
    async def _held(self, call: _Call) -> AsyncIterator[tuple[Entry, int]]:
        """The call's model, held (loaded and its slot taken), with the call announced to it while the
        request is prepared (`LoadedModel.expecting`): an idle engine waits for requests sent together."""
        async with self.pool.use(call.resolved, call.opts, call.keep_alive) as (entry, load_ns):
            with entry.model.expecting(call.cancel):
                yield entry, load_ns

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
        async with self.pool.use(call.resolved, call.opts, call.keep_alive, exclusive=False) as (
            _,
            load_ns,
        ):
            pass
        yield Chunk(
            model=name,
            done=True,
            done_reason="load",
            metrics=Metrics(total_ns=time.perf_counter_ns() - call.start, load_ns=load_ns),
        )

    def _request(self, call: _Call, entry: Entry, tokens: list[int], turn: Turn | None) -> GenerateRequest:
        """The backend's request: the prompt checked against the context, the output constraint chosen."""
        m, opts = entry.model, call.opts
        if len(tokens) >= m.context_length:
            raise ContextLengthError(
                f"the prompt is {len(tokens)} tokens, which does not fit the context length of "
                f"{m.context_length} tokens (raise num_ctx or shorten the input)",
                len(tokens),
                m.context_length,
            )
        constraint: Any = call.format
        if opts.grammar:
            if call.format is not None:
                raise LocalrtError("format and grammar cannot be used together")
            _check_token_refs(m, opts.grammar)
            constraint = GBNF(opts.grammar)
        if turn is not None and turn.required:
            if constraint is not None:
                raise LocalrtError("tool_choice 'required' cannot be combined with format or grammar")
            constraint = GBNF(turn.grammar())
        if constraint is not None and not m.capabilities.grammar:
            raise LocalrtError(f"the {entry.backend} backend does not support format (JSON output)")
        lora_scales.check_backend(call.lora, entry.backend)
        # with a context shift an answer may go past the context end (-1: up to 10 contexts, as Ollama)
        shifting = call.shift and m.capabilities.context_shift
        return GenerateRequest(
            prompt_tokens=tokens,
            sampling=opts.sampling(),
            num_predict=opts.max_new_tokens(len(tokens), m.context_length, shifting),
            stop=list(opts.stop),
            logprobs=call.logprobs or call.top_logprobs > 0,
            top_logprobs=call.top_logprobs,
            format=constraint,
            speculative=opts.speculative,
            num_draft=opts.num_draft,
            preserve_tokens=entry.preserve_tokens if turn is not None else frozenset(),
            lora=call.lora,
            cancel=call.cancel,
        )

    async def _run(
        self,
        call: _Call,
        entry: Entry,
        load_ns: int,
        tokens: list[int],
        turn: Turn | None,
        images: Sequence[ImageInput] = (),
        want_context: bool = False,
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
        request = self._request(call, entry, tokens, turn)
        request.images = list(images)
        request.shift, request.num_keep = call.shift, call.opts.num_keep
        parser = turn.parser() if turn is not None else None
        reply = _Reply()
        budget = (
            turn.thinking_budget(request, call.format) if turn is not None and parser is not None else None
        )
        wanted = request.num_predict
        if budget is not None:  # first up to the budget; a cut inside the thinking closes it and goes on
            request.num_predict = budget
        while True:
            async for chunk in self._generate(m, name, request, parser, reply, call.stream):
                yield chunk
            if budget is None or reply.dones[-1].finish_reason != "length" or parser is None:
                break
            assert turn is not None
            request, piece = _after_budget(m, turn, request, tokens, reply, parser, wanted)
            budget = None  # one cut per reply
            if call.stream and piece:
                yield _piece_chunk(name, piece, None)
            elif piece:
                reply.whole.add(piece)
            if request.num_predict <= 0:
                break
        done = reply.dones[-1]
        last = parser.finish(cut=done.finish_reason == "length") if parser is not None else Piece()
        if not call.stream:
            reply.whole.add(last)
            last = reply.whole
        timings = _merged_timings(reply.dones)
        # hashing a long prompt takes a while: not on the event loop
        await asyncio.to_thread(self._own_cache_only, call, name, tokens, images, reply.ids, timings)
        metrics = Metrics(
            **{
                **dataclasses.asdict(timings),
                "load_ns": load_ns,
                "total_ns": time.perf_counter_ns() - call.start,
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
            tool_calls=last.tool_calls or done.tool_calls or None,
            logprobs=(reply.lps or None) if not call.stream else None,
            metrics=metrics,
            context=[*tokens, *reply.ids] if want_context else None,
        )

    def _own_cache_only(
        self,
        call: _Call,
        name: str,
        tokens: list[int],
        images: Sequence[ImageInput],
        reply: list[int],
        timings: Timings,
    ) -> None:
        """Report as cached only what this request's tenant evaluated before; the rest of the engine's
        cache hit counts as evaluated, so no count tells one client what another sent."""
        cells = timings.prompt_eval_count + timings.cached_count
        prompt = tenants.Prompt(name, tokens, [image.digest for image in images], cells)
        visible = self.prefixes.visible_cached(call.tenant, prompt, timings.cached_count, reply)
        timings.prompt_eval_count += timings.cached_count - visible
        timings.cached_count = visible

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
                piece_lps = event.logprobs or None
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
        start = time.perf_counter_ns()
        opts = self.pool.options(resolved, options)
        keep = self.pool.keep_alive(keep_alive)
        async with self.pool.use(resolved, opts, keep) as (entry, load_ns):
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

    async def rerank(
        self,
        resolved: ResolvedModel,
        query: str,
        documents: Sequence[str],
        *,
        options: Mapping[str, Any] | None = None,
        keep_alive: str | float | None = None,
    ) -> RerankResult:
        """Relevance of each document to the query, from a reranker model (rank pooling)."""
        start = time.perf_counter_ns()
        opts = self.pool.options(resolved, options)
        keep = self.pool.keep_alive(keep_alive)
        async with self.pool.use(resolved, opts, keep) as (entry, load_ns):
            m = entry.model
            if not m.capabilities.rerank or not hasattr(m, "rerank"):
                raise LocalrtError(f'"{resolved.name.display}" does not support reranking')
            scores, n_tokens = await m.rerank(query, documents) if documents else ([], 0)
        return RerankResult(resolved.name.display, scores, n_tokens, time.perf_counter_ns() - start, load_ns)

    async def tokenize(
        self,
        resolved: ResolvedModel,
        text: str,
        *,
        add_special: bool = True,
        parse_special: bool = False,
        options: Mapping[str, Any] | None = None,
    ) -> list[int]:
        opts = self.pool.options(resolved, options)
        keep = self.pool.keep_alive(None)
        async with self.pool.use(resolved, opts, keep, exclusive=False) as (entry, _):
            return entry.model.tokenize(text, add_special=add_special, parse_special=parse_special)

    async def detokenize(
        self, resolved: ResolvedModel, tokens: Sequence[int], *, options: Mapping[str, Any] | None = None
    ) -> str:
        opts = self.pool.options(resolved, options)
        keep = self.pool.keep_alive(None)
        async with self.pool.use(resolved, opts, keep, exclusive=False) as (entry, _):
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
        resolved: ResolvedModel,
        tokens: Sequence[int] | str,
        *,
        return_logits: bool = False,
        options: Mapping[str, Any] | None = None,
    ) -> ScoreResult:
        """Per-position log p(token_i | prefix) for perplexity / KL (a text is tokenized with BOS)."""
        opts = self.pool.options(resolved, options)
        async with self.pool.use(resolved, opts, self.pool.keep_alive(None)) as (entry, _):
            ids = entry.model.tokenize(tokens, add_special=True) if isinstance(tokens, str) else list(tokens)
            if len(ids) > entry.model.context_length:
                raise ContextLengthError(
                    f"{len(ids)} tokens do not fit the context length of {entry.model.context_length}"
                )
            return await entry.model.score(ids, return_logits=return_logits)

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
        """The prompt text and tokens a chat request would use (debugging, `_debug_render_only`, and
        Anthropic's count_tokens, which must match the answer's input_tokens)."""
        opts = self.pool.options(resolved, options)
        wanted = think if isinstance(think, Think) else thinking.parse_think(think)
        msgs = with_history(messages, resolved.system, resolved.messages)
        keep = self.pool.keep_alive(None)
        async with self.pool.use(resolved, opts, keep, exclusive=False) as (entry, _):
            listed = tool_choice(None, tools)[0]
            _check_tools(entry, listed)
            turn = entry.prompter.turn(model, wanted, listed)
            return await entry.prompter.render_text(msgs, turn)


def _after_budget(
    m: LoadedModel,
    turn: Turn,
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
        reply.ids.extend(m.tokenize(closing, add_special=False, parse_special=True))
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
    lps: list[TokenLogprob] = field(default_factory=list)
    reasoning: int = 0  # tokens generated inside the thinking
    dones: list[DoneEvent] = field(default_factory=list)


def _merged_timings(dones: Sequence[DoneEvent]) -> Timings:
    """One reply's timings over its generations: the first one's prompt; a later one's prompt (the
    end-of-thinking text and what the cache lacked) is generation time, its tokens are no prompt."""
    merged = dataclasses.replace(dones[0].timings)
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


def _piece_chunk(name: str, piece: Piece, logprobs: list[TokenLogprob] | None) -> Chunk:
    return Chunk(
        model=name,
        content=piece.content,
        thinking=piece.thinking,
        tool_calls=piece.tool_calls or None,
        logprobs=logprobs,
    )


def _check_generates(entry: Entry, route: str) -> None:
    """An embedding model asked to chat or complete is a 400 in Ollama's words ('"x" does not support
    chat'), not a stream of whatever its head makes of a prompt."""
    if thinking.embedding_only(entry.model.metadata):
        raise LocalrtError(f'"{entry.resolved.name.display}" does not support {route}')


def _check_tools(entry: Entry, tools: Sequence[Mapping[str, Any]] | None) -> None:
    """Tools for a model whose template cannot show them are a 400 naming it (as Ollama answers), never
    dropped: the model would answer as if it had none."""
    if tools and not entry.prompter.format.renders_tools:
        raise LocalrtError(f'"{entry.resolved.name.display}" does not support tools')


def _check_vision(resolved: ResolvedModel, pictures: Sequence[image_input.PendingImage]) -> None:
    if pictures and resolved.projector_path is None:
        raise image_input.ImageError(f'"{resolved.name.display}" does not support images')
