"""Local generation: chat, generate, embed, rerank, score and tokenize on a model this process loads.

`Runtime` (`front.py`) hands a request here, planned (`plan.py`), once it knows the model is local. Chat,
generate and fill-in-the-middle differ only in what they ask of the held model (`_Chat`, `_Text`,
`_Infill`: their checks before any load, then their prompt); one loop (`_run`) holds the model through
`ModelPool.use`, renders the prompt, generates and streams `Chunk`s. All methods run on one event loop;
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
from typing import Protocol

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
from localrt.runtime import plan
from localrt.runtime import tenants
from localrt.runtime import thinking
from localrt.runtime.answers import Chunk
from localrt.runtime.answers import ContextLengthError
from localrt.runtime.answers import EmbedResult
from localrt.runtime.answers import Metrics
from localrt.runtime.answers import RerankResult
from localrt.runtime.lifecycle import LOCAL
from localrt.runtime.lifecycle import LocalEntry
from localrt.runtime.lifecycle import ModelPool
from localrt.runtime.plan import Plan
from localrt.runtime.prompt import Turn
from localrt.runtime.prompt import with_history
from localrt.runtime.thinking import Piece
from localrt.runtime.thinking import ReplyParser
from localrt.runtime.truncate import fit_tokens


class LocalRuntime:
    """The request paths of local models (`front.Runtime` picks this path for them), over the shared pool."""

    loader = LOCAL

    def __init__(self, pool: ModelPool) -> None:
        self.pool = pool
        self.prefixes = tenants.PrefixRecord()

    # ---- chat, generate and fill-in-the-middle ----------------------------------------------------
    def answer(self, p: Plan, asked: plan.Asked) -> AsyncIterator[Chunk]:
        """A conversation through the model's chat template, a prompt as one user turn (or as given when
        raw), or the text between two (fill-in-the-middle), answered and parsed as it streams."""
        prompt: _Asked = (
            _Chat(p, asked)
            if isinstance(asked, plan.ChatAsked)
            else _Text(p, asked)
            if isinstance(asked, plan.TextAsked)
            else _Infill(p, asked)
        )
        return self._run(p, prompt)

    @contextlib.asynccontextmanager
    async def _held(self, p: Plan) -> AsyncIterator[tuple[LocalEntry, int]]:
        """The request's model, held (loaded and its slot taken), with the request announced to it while
        its prompt is prepared (`LoadedModel.expecting`): an idle engine waits for requests sent together."""
        async with self.pool.use(p.resolved, p.opts, p.keep_alive) as (entry, load_ns):
            with entry.model.expecting(p.cancel):
                yield entry, load_ns

    def _request(self, p: Plan, entry: LocalEntry, prompt: _Prompt) -> GenerateRequest:
        """The backend's request: the prompt checked against the context, the output constraint chosen."""
        m, opts, tokens, turn = entry.model, p.opts, prompt.tokens, prompt.turn
        if prompt.pictures and not m.capabilities.vision:
            raise image_input.ImageError(
                f"the {entry.backend} backend does not support images yet; use the llama.cpp backend "
                f'for "{entry.key}"'
            )
        if len(tokens) >= m.context_length:
            raise ContextLengthError(
                f"the prompt is {len(tokens)} tokens, which does not fit the context length of "
                f"{m.context_length} tokens (raise num_ctx or shorten the input)",
                len(tokens),
                m.context_length,
            )
        constraint: Any = p.format
        if opts.grammar:
            if p.format is not None:
                raise LocalrtError("format and grammar cannot be used together")
            _check_token_refs(m, opts.grammar)
            constraint = GBNF(opts.grammar)
        if turn is not None and turn.required:
            if constraint is not None:
                raise LocalrtError("tool_choice 'required' cannot be combined with format or grammar")
            constraint = GBNF(turn.grammar())
        if constraint is not None and not m.capabilities.grammar:
            raise LocalrtError(f"the {entry.backend} backend does not support format (JSON output)")
        lora_scales.check_backend(p.lora, entry.backend)
        # with a context shift an answer may go past the context end (-1: up to 10 contexts, as Ollama)
        shifting = p.shift and m.capabilities.context_shift
        return GenerateRequest(
            prompt_tokens=tokens,
            sampling=opts.sampling(),
            num_predict=opts.max_new_tokens(len(tokens), m.context_length, shifting),
            stop=list(opts.stop),
            logprobs=p.logprobs or p.top_logprobs > 0,
            top_logprobs=p.top_logprobs,
            format=constraint,
            speculative=opts.speculative,
            num_draft=opts.num_draft,
            preserve_tokens=entry.preserve_tokens if turn is not None else frozenset(),
            lora=p.lora,
            cancel=p.cancel,
            images=list(prompt.pictures),
            shift=p.shift,
            num_keep=opts.num_keep,
        )

    async def _run(self, p: Plan, asked: _Asked) -> AsyncIterator[Chunk]:
        """The one loop of a local answer: the request's own checks before any load, then, holding the
        model, its prompt rendered and generated, the reply split (thinking, content, tool calls) as it
        streams: each chunk carries only what the parser has decided; held text (a tag or a call still
        arriving) waits for the next. A thinking budget runs the reply as two generations."""
        await asked.check()
        async with self._held(p) as (entry, load_ns):
            prompt = await asked.render(entry)
            m, name, turn = entry.model, entry.key, prompt.turn
            request = self._request(p, entry, prompt)
            parser = turn.parser() if turn is not None else None
            reply = _Reply()
            budget = (
                turn.thinking_budget(request, p.format) if turn is not None and parser is not None else None
            )
            wanted = request.num_predict
            if budget is not None:  # first up to the budget; a cut inside the thinking closes it, goes on
                request.num_predict = budget
            while True:
                events = m.generate(request)
                async with contextlib.aclosing(events):  # type: ignore[type-var]
                    async for event in events:
                        if isinstance(event, DoneEvent):
                            reply.dones.append(event)
                            break
                        piece = reply.add(event, parser)
                        if not p.stream:
                            reply.whole.add(piece)
                        elif piece or event.logprobs:
                            yield _piece_chunk(name, piece, event.logprobs or None)
                    else:  # the backend ended without a final event: treat as cancelled
                        raise LocalrtError("generation ended unexpectedly")
                if budget is None or reply.dones[-1].finish_reason != "length" or parser is None:
                    break
                assert turn is not None
                request, piece = _after_budget(m, turn, request, prompt.tokens, reply, parser, wanted)
                budget = None  # one cut per reply
                if p.stream and piece:
                    yield _piece_chunk(name, piece, None)
                elif piece:
                    reply.whole.add(piece)
                if request.num_predict <= 0:
                    break
            yield await self._last(p, name, load_ns, prompt, reply, parser)

    async def _last(
        self,
        p: Plan,
        name: str,
        load_ns: int,
        prompt: _Prompt,
        reply: _Reply,
        parser: ReplyParser | None,
    ) -> Chunk:
        """The done chunk: what the parser still held (or, not streamed, the whole reply), the timings."""
        done = reply.dones[-1]
        last = parser.finish(cut=done.finish_reason == "length") if parser is not None else Piece()
        if not p.stream:
            reply.whole.add(last)
            last = reply.whole
        timings = _merged_timings(reply.dones)
        # hashing a long prompt takes a while: not on the event loop
        await asyncio.to_thread(
            self._own_cache_only, p, name, prompt.tokens, prompt.pictures, reply.ids, timings
        )
        metrics = Metrics(
            **{
                **dataclasses.asdict(timings),
                "load_ns": load_ns,
                "total_ns": time.perf_counter_ns() - p.start,
                "prompt_tokens": len(prompt.tokens),
                "reasoning_tokens": reply.reasoning,
            }
        )
        return Chunk(
            model=name,
            content=last.content,
            thinking=last.thinking,
            done=True,
            done_reason=done.finish_reason,
            stop_sequence=done.stop_sequence,
            tool_calls=last.tool_calls or done.tool_calls or None,
            logprobs=(reply.lps or None) if not p.stream else None,
            metrics=metrics,
            context=[*prompt.tokens, *reply.ids] if prompt.want_context else None,
        )

    def _own_cache_only(
        self,
        p: Plan,
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
        visible = self.prefixes.visible_cached(p.tenant, prompt, timings.cached_count, reply)
        timings.prompt_eval_count += timings.cached_count - visible
        timings.cached_count = visible

    # ---- the other paths ---------------------------------------------------------------------
    def _use(
        self, p: Plan, exclusive: bool = True
    ) -> contextlib.AbstractAsyncContextManager[tuple[LocalEntry, int]]:
        return self.pool.use(p.resolved, p.opts, p.keep_alive, exclusive)

    async def embed(self, p: Plan, texts: list[str], truncate: bool) -> EmbedResult:
        async with self._use(p) as (entry, load_ns):
            m = entry.model
            if not m.capabilities.embedding:
                raise LocalrtError(f'"{p.name}" does not support embeddings')
            # once, off the event loop: a batch of passages takes long enough to tokenize to hold up the
            # tokens the loop is streaming to other clients
            tokens = await asyncio.to_thread(lambda: [m.tokenize(t) for t in texts])
            counts = [len(ids) for ids in tokens]
            if not truncate and any(c > m.context_length for c in counts):
                raise ContextLengthError(
                    f"input length exceeds the context length of {m.context_length} tokens"
                )
            vectors = await m.embed(tokens)
        count = sum(min(c, m.context_length) for c in counts)
        return EmbedResult(p.name, vectors, count, 0, load_ns)

    async def rerank(self, p: Plan, query: str, documents: Sequence[str]) -> RerankResult:
        """Relevance of each document to the query, from a reranker model (rank pooling)."""
        async with self._use(p) as (entry, load_ns):
            m = entry.model
            if not m.capabilities.rerank or not hasattr(m, "rerank"):
                raise LocalrtError(f'"{p.name}" does not support reranking')
            scores, n_tokens = await m.rerank(query, documents) if documents else ([], 0)
        return RerankResult(p.name, scores, n_tokens, 0, load_ns)

    async def tokenize(self, p: Plan, text: str, add_special: bool, parse_special: bool) -> list[int]:
        async with self._use(p, exclusive=False) as (entry, _):
            return entry.model.tokenize(text, add_special=add_special, parse_special=parse_special)

    async def detokenize(self, p: Plan, tokens: Sequence[int]) -> str:
        async with self._use(p, exclusive=False) as (entry, _):
            bad = [
                t
                for t in tokens
                if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < entry.model.n_vocab
            ]
            if bad:
                raise LocalrtError(f"invalid token id {bad[0]!r}")
            return entry.model.detokenize(tokens)

    async def score(self, p: Plan, tokens: Sequence[int] | str, return_logits: bool) -> ScoreResult:
        """Per-position log p(token_i | prefix) for perplexity / KL (a text is tokenized with BOS)."""
        async with self._use(p) as (entry, _):
            ids = entry.model.tokenize(tokens, add_special=True) if isinstance(tokens, str) else list(tokens)
            if len(ids) > entry.model.context_length:
                raise ContextLengthError(
                    f"{len(ids)} tokens do not fit the context length of {entry.model.context_length}"
                )
            return await entry.model.score(ids, return_logits=return_logits)

    async def render(self, p: Plan, messages: list[dict[str, Any]]) -> tuple[str, list[int]]:
        """The prompt text and tokens a chat request would use."""
        async with self._use(p, exclusive=False) as (entry, _):
            _check_tools(entry, p.tools)
            turn = entry.prompter.turn(p.model, p.think, p.tools)
            return await entry.prompter.render_text(messages, turn)


# ---- what each kind of request asks of the held model ----------------------------------------------
@dataclass
class _Prompt:
    """What the held model is asked: the prompt's tokens, the turn that parses the reply (None: the text
    is not a turn), the images, and whether the answer carries `context` (its tokens, for a next call)."""

    tokens: list[int]
    turn: Turn | None = None
    pictures: Sequence[ImageInput] = ()
    want_context: bool = False


class _Asked(Protocol):
    async def check(self) -> None:
        """What is checked before any load."""

    async def render(self, entry: LocalEntry) -> _Prompt:
        """The prompt, once the model is held."""
        ...


class _Chat:
    """A conversation, through the model's chat template, truncated to the context where allowed."""

    def __init__(self, p: Plan, asked: plan.ChatAsked) -> None:
        self.p, self.messages, self.parallel = p, asked.messages, asked.parallel_tool_calls
        self.pending: list[image_input.PendingImage] = []

    async def check(self) -> None:
        self.messages, self.pending = await plan.conversation(self.p, self.messages)

    async def render(self, entry: LocalEntry) -> _Prompt:
        p = self.p
        _check_generates(entry, "chat")
        pictures = await image_input.decode_all(self.pending)
        prompter = entry.prompter
        _check_tools(entry, p.tools)
        turn = prompter.turn(p.model, p.think, p.tools, p.required, self.parallel)
        tokens = await prompter.render(self.messages, turn, pictures)
        if p.truncate and not pictures and len(tokens) >= entry.model.context_length:
            tokens = await prompter.fit(self.messages, turn, tokens)
        return _Prompt(tokens, turn, pictures)


class _Text:
    """A prompt as one user turn of the template (after `context`, an earlier answer's tokens), or as
    given when raw: no template, so no thinking switch and no parsing."""

    def __init__(self, p: Plan, asked: plan.TextAsked) -> None:
        self.p, self.prompt, self.system, self.raw = p, asked.prompt, asked.system, asked.raw
        self.context, self.images = list(asked.context or []), asked.images
        self.pending: list[image_input.PendingImage] = []

    async def check(self) -> None:
        self.prompt, self.pending = await plan.prompt_images(self.p, self.prompt, self.images)

    async def render(self, entry: LocalEntry) -> _Prompt:
        p, m = self.p, entry.model
        _check_generates(entry, "generate")
        pictures = await image_input.decode_all(self.pending)
        turn: Turn | None = None
        if self.raw:
            tokenize = image_input.split_markers(
                lambda text, add, special: m.tokenize(text, add_special=add, parse_special=special)
            )
            tokens = tokenize(self.prompt, True, True)
        else:
            sys_text = self.system if self.system is not None else p.resolved.system
            # a continued conversation (`context`) has had the model's history already
            history = p.resolved.messages if not self.context else []
            msgs = with_history([{"role": "user", "content": self.prompt}], sys_text, history)
            turn = entry.prompter.turn(p.model, p.think)
            tokens = await entry.prompter.render(msgs, turn, pictures, add_bos=not self.context)
            tokens = [*self.context, *tokens]
        if p.truncate and not pictures:
            tokens = fit_tokens(tokens, m.context_length, p.opts.num_keep)
        # image cells have no token ids
        return _Prompt(tokens, turn, pictures, want_context=not self.raw and not pictures)


class _Infill:
    """Fill-in-the-middle: the model's FIM template branch, else its FIM tokens around the two texts."""

    def __init__(self, p: Plan, asked: plan.InfillAsked) -> None:
        self.p, self.prefix, self.suffix, self.context = (
            p,
            asked.prefix,
            asked.suffix,
            list(asked.context or []),
        )

    async def check(self) -> None:
        pass

    async def render(self, entry: LocalEntry) -> _Prompt:
        m = entry.model
        fim.check_insert(self.p.name, entry.can_insert, False, False)
        bos = m.bos_token_id if m.add_bos and not self.context else None

        def tokenize(text: str, special: bool = False) -> list[int]:
            return m.tokenize(text, add_special=False, parse_special=special) if text else []

        if entry.fim_template is not None:
            tokens = fim.template_tokens(entry.fim_template, self.prefix, self.suffix, tokenize, bos)
        else:
            assert entry.fim_tokens is not None
            n_ctx = m.context_length - len(self.context)
            tokens = fim.infill_tokens(
                entry.fim_tokens, self.prefix, self.suffix, tokenize, bos, n_ctx, self.p.opts.num_batch
            )
        return _Prompt([*self.context, *tokens], want_context=True)


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

    def add(self, event: TextEvent, parser: ReplyParser | None) -> Piece:
        """One text event of the backend: its tokens and logprobs kept, its text through the parser."""
        self.ids.extend(event.token_ids)
        if event.logprobs:
            self.lps.extend(event.logprobs)
        if parser is None:
            return Piece(content=event.text)
        thinking_before = parser.thinking_now
        piece = parser.feed(event.text)
        if thinking_before or parser.thinking_now:
            self.reasoning += len(event.token_ids)  # tokens generated inside the thinking
        return piece


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


def _check_generates(entry: LocalEntry, route: str) -> None:
    """An embedding model asked to chat or complete is a 400 in Ollama's words ('"x" does not support
    chat'), not a stream of whatever its head makes of a prompt."""
    if thinking.embedding_only(entry.model.metadata):
        raise LocalrtError(f'"{entry.resolved.name.display}" does not support {route}')


def _check_tools(entry: LocalEntry, tools: Sequence[Mapping[str, Any]] | None) -> None:
    """Tools for a model whose template cannot show them are a 400 naming it (as Ollama answers), never
    dropped: the model would answer as if it had none."""
    if tools and not entry.prompter.format.renders_tools:
        raise LocalrtError(f'"{entry.resolved.name.display}" does not support tools')
