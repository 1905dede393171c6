"""The engine protocol, one for the llama.cpp, torch and MLX engines.

An adapter hands its engine `EngineRequest`s: a prompt and what to do with it (`task`): generate tokens
after it, or, prompt-only, pool its hidden states (`embed`), give each of its tokens' logprobs
(`score`), or rate a (query, document) pair with a reranker's head (`rank`, llama.cpp only). A prompt-only request is a sequence like any other: chunked as a prefill is, batched with
the decodes of the same step, its pooled vector or its scores its last output. Each engine step returns
`EngineOutput`s: what the step did to each request. The engine writes its account of a request (when it
was admitted, its first token, the tokens it made, its speculation) on the request itself.

The adapter's side, written once: `EngineStreams` hands each output to its request's queue on the
request's event loop; `OutputStream` turns a request's outputs into the protocol's events there (text,
stop strings, timings: never on the engine thread); `EngineModel` is what a loaded model does the same
way over any engine (checks, generate, score, embed, unload).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import threading
import time
from collections.abc import AsyncIterator
from collections.abc import Callable
from collections.abc import Iterable
from collections.abc import Sequence
from dataclasses import dataclass
from dataclasses import field
from itertools import count
from typing import Any
from typing import Literal
from typing import Protocol

import numpy as np

from localrt.backends.base import CancelToken
from localrt.backends.base import Capabilities
from localrt.backends.base import DoneEvent
from localrt.backends.base import Event
from localrt.backends.base import GenerateRequest
from localrt.backends.base import ModelLifetime
from localrt.backends.base import ScoreResult
from localrt.backends.base import TextAssembler
from localrt.backends.base import Timings
from localrt.backends.checks import check_loaded
from localrt.backends.checks import check_prompt
from localrt.backends.checks import check_scored
from localrt.backends.checks import check_speculative
from localrt.backends.engine_thread import EngineThread
from localrt.backends.grammar import Grammar
from localrt.backends.outputs import embedding_tokens
from localrt.backends.outputs import empty_score
from localrt.backends.outputs import token_logprob
from localrt.backends.outputs import unit_vector
from localrt.backends.speculation import SpecState
from localrt.backends.speculation import speculative_method
from localrt.errors import LocalrtError

Task = Literal["generate", "embed", "score", "rank"]
LogprobValues = tuple[float, list[tuple[int, float]]]  # a token's logprob and the best (id, logprob)

_request_ids = count()


class _Closable(Protocol):
    def close(self) -> None: ...


@dataclass(eq=False)  # a request is itself: engines find and remove requests in their lists by identity
class EngineRequest:
    """One request as every engine takes it. `req` carries the prompt, sampling, limits, stop strings,
    speculation and the cancel token; `prompt` is the prompt as the engine evaluates it (the token ids,
    or on llama.cpp prompt items with images); `method` the speculation method it runs, as the adapter
    resolved it; `grammar` its constraint (torch and MLX; llama.cpp builds its own from `req.format`);
    `scores` the result a `score` request fills. The fields after `id` are the engine's account of it,
    written on the engine thread."""

    req: GenerateRequest
    task: Task = "generate"
    method: str = "off"
    grammar: Grammar | None = None
    prompt: list[Any] = field(default_factory=list)
    scores: ScoreResult | None = None
    # closed once the engine has let go of the request (its grammar, its images)
    resources: list[_Closable] = field(default_factory=list)
    id: int = field(default_factory=lambda: next(_request_ids))
    spec: SpecState | None = None  # its speculation (None: it runs without), made at admission
    timings: Timings = field(default_factory=Timings)  # the counts: prompt evaluated, cached, image cells
    admitted_ns: int = 0
    first_token_ns: int = 0
    generated: int = 0  # tokens sampled (an end token included)
    error: BaseException | None = None
    released: bool = False  # the engine has let go of it
    # the reader ended it at a stop string: the cancel that follows is an end (its cache is kept)
    stopped_by_text: bool = False

    def __post_init__(self) -> None:
        if not self.prompt:
            self.prompt = list(self.req.prompt_tokens)

    @property
    def cancel(self) -> CancelToken:
        return self.req.cancel

    @property
    def prompt_only(self) -> bool:
        """Nothing is generated: the prompt's hidden states or logprobs are the answer."""
        return self.task != "generate"

    @property
    def top_logprobs(self) -> int:
        """-1: no logprobs; n >= 0: each token's and its n best alternatives."""
        return self.req.top_logprobs if self.req.wants_logprobs else -1


@dataclass(eq=False)
class EngineOutput:
    """What one step did to one request: the tokens it gained (an end token is not one), their logprob
    values when asked, `finish` once it ended ("stop", "length", "cancel", or "error": `request.error`),
    and a prompt-only request's answer with its finish (`result`: the pooled vector, the filled
    `ScoreResult`, or a rank's relevance)."""

    request: EngineRequest
    tokens: list[int] = field(default_factory=list)
    logprobs: list[LogprobValues | None] = field(default_factory=list)
    finish: str | None = None
    result: Any = None


class OfRequest:
    """An engine's record of a request (a sequence, a row), through which the request's own settings
    and the engine's account of it are read: its id, prompt, cancel token, speculation, error."""

    request: EngineRequest

    @property
    def id(self) -> int:
        return self.request.id

    @property
    def req(self) -> GenerateRequest:
        return self.request.req

    @property
    def prompt(self) -> list[Any]:
        return self.request.prompt

    @property
    def cancel(self) -> CancelToken:
        return self.request.cancel

    @property
    def top_logprobs(self) -> int:
        return self.request.top_logprobs

    @property
    def prompt_only(self) -> bool:
        return self.request.prompt_only

    @property
    def spec(self) -> SpecState | None:
        return self.request.spec

    @spec.setter
    def spec(self, spec: SpecState | None) -> None:
        self.request.spec = spec

    @property
    def error(self) -> BaseException | None:
        return self.request.error

    @error.setter
    def error(self, error: BaseException | None) -> None:
        self.request.error = error


class StepOutputs:
    """A step's outputs, one per request, made on first use (`of`)."""

    def __init__(self) -> None:
        self._by_request: dict[EngineRequest, EngineOutput] = {}

    def of(self, request: EngineRequest) -> EngineOutput:
        out = self._by_request.get(request)
        if out is None:
            out = self._by_request[request] = EngineOutput(request)
        return out

    def end(self, request: EngineRequest, reason: str, error: BaseException | None = None) -> None:
        """The request ends (the engine has let go of it)."""
        if error is not None:
            request.error = error
        request.released = True
        self.of(request).finish = reason

    def take(self) -> list[EngineOutput]:
        outputs = list(self._by_request.values())
        self._by_request = {}
        return outputs


class EngineStreams:
    """An adapter's side of its engine thread: `route` (the engine's sink) hands each output to its
    request's queue; `open` is a request's stream around that queue."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._queues: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Queue[EngineOutput]]] = {}

    def route(self, outputs: list[EngineOutput]) -> None:
        """The engine thread's sink: each output to its request's queue, nothing else done here. One
        wake-up per event loop and step, however many of its requests the step served (each wake-up
        writes to the loop's socket and hands it the GIL)."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue[EngineOutput], EngineOutput]]] = {}
        with self._lock:
            for out in outputs:
                target = self._queues.get(out.request.id)
                if target is not None:
                    by_loop.setdefault(target[0], []).append((target[1], out))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_each, items)
            except RuntimeError:  # that event loop has closed: nobody is listening
                pass

    @contextlib.asynccontextmanager
    async def open(
        self, model: ModelLifetime, request: EngineRequest
    ) -> AsyncIterator[asyncio.Queue[EngineOutput]]:
        """The queue of one request's outputs, while the body submits it and reads them. On the way out
        (done, a stop string, or the consumer left early) a request the engine still runs is cancelled
        and waited for, so that its resources (grammar, images) are closed only once the engine has let
        go of them."""
        queue: asyncio.Queue[EngineOutput] = asyncio.Queue()
        with self._lock:
            self._queues[request.id] = (asyncio.get_running_loop(), queue)
        model._active.add(request.cancel)
        try:
            yield queue
        finally:
            model._active.discard(request.cancel)
            with self._lock:
                self._queues.pop(request.id, None)
            if not request.released:
                request.cancel.cancel()
                while not request.released and not model._closed:
                    await asyncio.sleep(0.005)
            if request.released or model._closed:
                for resource in request.resources:
                    resource.close()


def _put_each(items: list[tuple[asyncio.Queue[EngineOutput], EngineOutput]]) -> None:
    for target, out in items:
        target.put_nowait(out)


def text_events(
    vocab: Any,
    detokenize: Callable[[Sequence[int]], str],
    tokens: Sequence[int],
    logprobs: Iterable[LogprobValues | None],
    text: TextAssembler,
    preserve: frozenset[int],
) -> tuple[list[Event], int | None]:
    """A step's tokens for one request -> text events, on the event loop, for every engine (pieces,
    incremental UTF-8 and stop strings never run on an engine thread). Second: None, or the tokens taken
    up to a stop string that matched (the rest of the step's tokens are not the answer). `logprobs`: per
    token, None or (its logprob, the best (id, logprob)); `preserve`: special tokens whose text stays in
    the output (thinking markers)."""
    events: list[Event] = []
    for taken, (token, lp) in enumerate(zip(tokens, logprobs), 1):
        logprob = None if lp is None else token_logprob(token, *lp, detokenize)
        event, stopped = text.add(token, vocab.piece(token, token in preserve), logprob)
        if event is not None:
            events.append(event)
        if stopped:
            return events, taken
    return events, None


class OutputStream:
    """One request's engine outputs -> its protocol events, on the event loop, for every engine: the text
    (`text_events`), then the end, at a stop string or when the engine ends the request, with the done
    event's timings from the engine's account of the request."""

    def __init__(self, model: Any, request: EngineRequest) -> None:
        self.model, self.request = model, request
        self.text = TextAssembler(request.req.stop)
        self.start_ns = time.perf_counter_ns()
        self.generated = 0
        self.done = False

    async def read(self, queue: asyncio.Queue[EngineOutput]) -> AsyncIterator[Event]:
        """The events of the outputs arriving in `queue` until the end (the request's error is raised
        when the engine ends it with one)."""
        while not self.done:
            for event in self.events(await queue.get()):
                yield event

    def events(self, out: EngineOutput) -> list[Event]:
        request = self.request
        events, taken = text_events(
            self.model.vocab,
            self.model.detokenize,
            out.tokens,
            out.logprobs,
            self.text,
            request.req.preserve_tokens,
        )
        if taken is not None:  # a stop string: the tokens after it are not the answer
            self.generated += taken
            self.done = True
            request.stopped_by_text = True
            return [*events, *self.text.end("stop", self.timings(self.generated))]
        self.generated += len(out.tokens)
        if out.finish is not None:
            self.done = True
            if out.finish == "error":
                raise request.error or LocalrtError("the request failed")
            events.extend(self.text.end(out.finish, self.timings(None)))
        return events

    def timings(self, generated: int | None) -> Timings:
        """The done event's timings: the engine's counts, `generated` tokens (None: the engine ended the
        request, and its own count has the end token), the prompt's time from its admission to its first
        token and the generation's from there to now."""
        request = self.request
        timings = dataclasses.replace(request.timings)
        timings.eval_count = request.generated if generated is None else generated
        if request.spec is not None:
            timings.draft_count = request.spec.drafted
            timings.draft_accepted_count = request.spec.accepted
        start = request.admitted_ns or self.start_ns
        return timings.set_durations(start, request.first_token_ns, time.perf_counter_ns())


def failed(request: EngineRequest, error: BaseException) -> EngineOutput:
    """The output of a request that ends with `error` before it ran."""
    request.error = error
    request.released = True
    return EngineOutput(request, finish="error")


def take_each(add: Callable[[EngineRequest], Any], queued: list[EngineRequest]) -> list[EngineOutput]:
    """Queued requests join an engine (`add`, on its thread); the outputs of those that could not."""
    refused: list[EngineOutput] = []
    for request in queued:
        try:
            add(request)
        except Exception as e:  # this request's fault (its sampler could not be made): it alone fails
            refused.append(failed(request, e))
    return refused


class EngineModel:
    """What a loaded model does the same way over its engine (llama.cpp, torch, MLX): a request is checked
    here, submitted to the engine's thread and read back through its stream; `score` and `embed` are
    prompt-only requests batched with the rest; unloading stops the engine and frees the vocabulary. The
    model gives `_prepare` (a checked request -> its `EngineRequest`)."""

    engine: EngineThread
    vocab: Any  # llamacpp.vocab.Vocab
    context_length: int
    n_vocab: int
    eos_token_ids: Sequence[int]
    capabilities: Capabilities
    _closed: bool
    _active: set[CancelToken]
    _streams: EngineStreams
    tokenize: Callable[[str], list[int]]  # the model's vocabulary (VocabMethods)
    detokenize: Callable[[Sequence[int]], str]

    # ---- what each model gives ----------------------------------------------------------------
    async def _prepare(self, request: GenerateRequest) -> EngineRequest:
        raise NotImplementedError

    def _embedding_tokens(self, text: str | list[int]) -> list[int]:
        tokens = self.tokenize(text) if isinstance(text, str) else text
        return embedding_tokens(tokens, self.context_length, self.eos_token_ids)

    # ---- shared parts ---------------------------------------------------------------------------
    def _check(self, request: GenerateRequest, has_draft_model: bool, backend: str) -> str:
        """Refuses what this model cannot run; returns the speculation method the request runs."""
        check_loaded(self._closed)
        check_speculative(request.speculative, self.capabilities.speculative, has_draft_model, backend)
        check_prompt(request.prompt_tokens, self.context_length, self.n_vocab)
        return speculative_method(
            request.speculative, has_draft_model=has_draft_model, constrained=request.format is not None
        )

    def _grammar(self, request: GenerateRequest) -> Grammar | None:
        """The request's `format` as a grammar (built before any work: a schema it cannot express fails
        here); the request's stream closes it."""
        if request.format is None:
            return None
        return Grammar(self.vocab.lib, self.vocab.vocab, self.n_vocab, request.format)

    async def generate(self, request: GenerateRequest) -> AsyncIterator[Event]:
        prepared = await self._prepare(request)
        if request.num_predict == 0:  # nothing to generate: the prompt was checked, and that is all
            for resource in prepared.resources:
                resource.close()
            yield DoneEvent("length", Timings())
            return
        async with self._streams.open(self, prepared) as queue:
            self._submit(prepared, request.cancel)
            async for event in OutputStream(self, prepared).read(queue):
                yield event

    def _submit(self, request: EngineRequest, key: Any = None) -> None:
        """The request to the engine thread; one it refuses (unloaded, or stopped on an error) was never
        held by it, so its stream does not wait for the engine to let it go."""
        try:
            self.engine.submit(request, key)
        except LocalrtError:
            request.released = True
            raise

    async def _answer(self, request: EngineRequest) -> Any:
        """A prompt-only request's result, once the engine has run it beside the others."""
        async with self._streams.open(self, request) as queue:
            self._submit(request)
            while True:
                out = await queue.get()
                if out.finish == "error":
                    raise request.error or LocalrtError("the request failed")
                if out.finish is not None:
                    return out.result

    async def score(self, tokens: Sequence[int], return_logits: bool = False) -> ScoreResult:
        ids = list(tokens)
        check_loaded(self._closed)
        check_scored(ids, self.context_length, self.n_vocab)
        result = empty_score(len(ids), self.n_vocab, return_logits)
        if len(ids) < 2:  # nothing is predicted
            return result
        return await self._answer(EngineRequest(GenerateRequest(ids), "score", scores=result))  # type: ignore[no-any-return]

    async def embed(self, texts: Sequence[str | list[int]]) -> list[list[float]]:
        check_loaded(self._closed)
        tokens = await asyncio.to_thread(lambda: [self._embedding_tokens(t) for t in texts])
        requests = [EngineRequest(GenerateRequest(ids), "embed") for ids in tokens]
        pooled = await asyncio.gather(*(self._answer(r) for r in requests))
        return [unit_vector(np.asarray(vector, dtype=np.float64)) for vector in pooled]

    def _free(self) -> None:
        self.engine.stop()  # the requests still running end (EngineThread._unload)
        self.vocab.close()


class Pooled:
    """An `embed` request's pooled vector, built up chunk by chunk from its final-normed hidden rows:
    their mean (as llama.cpp's mean pooling, and Ollama's for models that declare none), or its first
    or last row where the model declares CLS or LAST pooling."""

    def __init__(self, pooling: str = "mean") -> None:
        self.pooling = pooling
        self.total: np.ndarray | None = None
        self.rows = 0
        self.first: np.ndarray | None = None
        self.last: np.ndarray | None = None

    def add(self, rows: np.ndarray) -> None:
        """The next rows [n, dim] of the prompt, in order."""
        rows = np.asarray(rows, dtype=np.float64)
        if not len(rows):
            return
        if self.first is None:
            self.first = rows[0].copy()
        self.last = rows[-1].copy()
        chunk = rows.sum(0)
        self.total = chunk if self.total is None else self.total + chunk
        self.rows += len(rows)

    def vector(self) -> np.ndarray:
        if self.total is None:
            raise LocalrtError("nothing was pooled")
        if self.pooling == "cls":
            assert self.first is not None
            return self.first
        if self.pooling == "last":
            assert self.last is not None
            return self.last
        return self.total / self.rows
