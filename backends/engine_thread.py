"""An engine's own thread and the streams of its outputs, written once for the torch, MLX and llama.cpp
engines.

`EngineThread`: an engine steps on a thread of its own; requests (`submit`) and jobs (`call`: load,
score, embed) come from any thread and are taken between two steps; each step's outputs go to a sink
on that thread. `EngineStreams`: the
adapter's side, that sink: every output goes to its request's asyncio queue on the request's event
loop, where the text is assembled (`OutputStream`, `text_events`: for every engine, never on the
engine thread). `EngineModel`: what the torch and MLX adapters do the same way over such an engine
(request checks, score and embed as jobs on its thread, unload).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
from collections import deque
from collections.abc import AsyncIterator
from collections.abc import Callable
from collections.abc import Iterable
from collections.abc import Iterator
from collections.abc import Sequence
from typing import Any
from typing import Protocol
from typing import TypeVar

import numpy as np

from localrt.backends.base import CancelToken
from localrt.backends.base import Capabilities
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
from localrt.backends.grammar import Grammar
from localrt.backends.outputs import embedding_tokens
from localrt.backends.outputs import empty_score
from localrt.backends.outputs import token_logprob
from localrt.backends.outputs import unit_vector
from localrt.backends.speculation import speculative_method
from localrt.errors import LocalrtError

Sink = Callable[[list[Any]], None]
T = TypeVar("T")


def on_a_thread_of_its_own(fn: Callable[[], T], name: str) -> T:
    """fn's result, run on a new thread that then ends (its exception raised here). libgomp keeps a pool
    of workers for every thread that runs a parallel region, and the pool lives as long as the thread:
    work done once (loading torch weights, a benchmark's raw loop) on a thread that lives on would leave
    a pool that slows every engine thread after it (see `EngineThread.idle_end`)."""
    result: list[T] = []
    failure: list[BaseException] = []

    def target() -> None:
        try:
            result.append(fn())
        except BaseException as e:  # re-raised on the caller's thread
            failure.append(e)

    thread = threading.Thread(target=target, name=name)
    thread.start()
    thread.join()
    if failure:
        raise failure[0]
    return result[0]


class RequestQueues:
    """An engine's requests in two lists: `waiting` (taken in, not admitted yet) and `running`; there is
    work while either holds one. The llama.cpp step loop and torch's scheduler keep theirs this way."""

    waiting: Any  # a list or a deque: appended to, admitted from the front
    running: list[Any]

    def add(self, request: Any) -> None:
        self.waiting.append(request)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)


class EngineThread:
    """The thread, request inbox and job queue of an engine. The engine gives `has_work`, `step`
    (one iteration's outputs), `_take` (queued requests join it, on its thread), `_fail_step` (a step
    raised: the outputs of the requests that fail with it) and `_unload` (stopped: the outputs of every
    request still in it, the queued ones included)."""

    thread_name = "engine"
    # Seconds the thread waits without work before it ends (None: it lives until `stop`); the next
    # request or job starts a new one. libgomp (llama.cpp's and torch's OpenMP) keeps a pool of workers
    # for each thread that runs a parallel region, and while more of its threads exist than cores it
    # stops spinning at barriers: an idle model's thread kept its pool, and a second llama.cpp model
    # loaded beside the first made the first 60% slower per token (5.6 -> 9.1 ms, 2 threads each on 2
    # cores) until it was unloaded. A thread that ends takes its pool with it. The linger keeps one
    # thread across back-to-back requests.
    idle_end: float | None = 0.1
    # Seconds an idle engine holds its first step for requests the front end has announced
    # (`expecting`) and not submitted yet. Requests sent together reach the engine a few milliseconds
    # apart (each prompt is rendered in turn), and the first would otherwise start a prefill step alone:
    # four bench clients got their first tokens one step apart (about 40 then 120 ms) instead of in one
    # step. A lone request announces nothing else and never waits.
    gather_s = 0.01

    def _init_thread(self) -> None:
        self._cv = threading.Condition()
        self._expected: set[Any] = set()  # keys of the announced requests not submitted yet
        self._inbox: deque[Any] = deque()
        self._jobs: deque[tuple[Callable[[], Any], concurrent.futures.Future[Any]]] = deque()
        self._thread: threading.Thread | None = None
        self._started = False
        self._sink: Sink | None = None
        self._stopping = False

    # ---- what the engine gives ------------------------------------------------------------------
    @property
    def has_work(self) -> bool:
        raise NotImplementedError

    def step(self) -> list[Any]:
        raise NotImplementedError

    def _take(self, queued: list[Any]) -> None:
        """Queued requests join the engine, on its thread (`add` each, unless the engine does more)."""
        for request in queued:
            self.add(request)

    def _fail_step(self, error: Exception) -> list[Any]:
        raise NotImplementedError

    def _unload(self, queued: list[Any]) -> list[Any]:
        raise NotImplementedError

    def _thread_context(self) -> contextlib.AbstractContextManager[Any]:
        """Entered by the thread around its whole life (torch: inference mode)."""
        return contextlib.nullcontext()

    def add(self, request: Any) -> None:
        """Queue a request in the engine itself (synchronous use, on the caller's thread: `run`)."""
        raise NotImplementedError

    # ---- synchronous use (tests, benchmarks): no thread -------------------------------------------
    def run(self, requests: Iterable[Any] = ()) -> list[Any]:
        """Queue `requests` (`add`) and step until nothing is left; returns every step's outputs."""
        for request in requests:
            self.add(request)
        outputs: list[Any] = []
        while self.has_work:
            outputs.extend(self.step())
        return outputs

    # ---- from any thread ------------------------------------------------------------------------
    def start(self, sink: Sink | None = None) -> None:
        """Step on the engine's thread; `sink` receives each step's outputs there (keep it quick)."""
        self._sink = sink
        with self._cv:
            self._started = True
            self._spawn()

    def _spawn(self) -> None:
        """A new engine thread (the caller holds the lock)."""
        self._thread = threading.Thread(target=self._loop, name=self.thread_name, daemon=True)
        self._thread.start()

    def submit(self, request: Any, key: Any = None) -> None:
        """Queue a request; it joins the engine between two steps. `key`: what it was announced under
        (`expecting`), if it was."""
        self._put(self._inbox, request, key)

    @contextlib.contextmanager
    def expecting(self, key: Any) -> Iterator[None]:
        """A request that the front end is preparing, announced under `key` until it is submitted with
        that key or the block ends: an idle engine holds its first step for it (`gather_s`)."""
        with self._cv:
            self._expected.add(key)
        try:
            yield
        finally:
            with self._cv:
                self._expected.discard(key)
                self._cv.notify()

    def call(self, fn: Callable[[], Any]) -> concurrent.futures.Future[Any]:
        """Run fn on the engine thread between steps."""
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._put(self._jobs, (fn, future))
        return future

    async def job(self, fn: Callable[[], T]) -> T:
        """`call`, awaited on an event loop: fn's result or its exception. Every graph of a model runs on
        its engine thread (scores and embeddings too), so no other thread leaves an OpenMP pool behind
        (`idle_end`): one embedding computed on a worker thread left every later llama.cpp token a third
        slower (6.1 -> 7.9 ms, 2 threads on 2 cores)."""
        return await asyncio.wrap_future(self.call(fn))

    def _put(self, queue: deque[Any], item: Any, key: Any = None) -> None:
        with self._cv:
            if self._stopping:  # nothing would take it
                raise LocalrtError("the model was unloaded")
            queue.append(item)
            self._expected.discard(key)
            if self._started and self._thread is None:  # it ended, idle
                self._spawn()
            self._cv.notify()

    def stop(self) -> None:
        """The thread ends after its step; the requests still in the engine end (`_unload`), the jobs
        still queued fail."""
        with self._cv:
            self._stopping = True
            self._cv.notify()
            thread = self._thread
        if thread is None:  # never started, or ended idle: nothing else ends them
            self._shut_down()
        elif thread is not threading.current_thread():
            thread.join()

    # ---- on the engine thread -------------------------------------------------------------------
    def _deliver(self, outputs: list[Any]) -> None:
        if outputs and self._sink is not None:
            self._sink(outputs)

    def _loop(self) -> None:
        with self._thread_context():
            while True:
                with self._cv:
                    if not self._cv.wait_for(self._ready, self.idle_end):
                        self._thread = None  # under the lock: the next `_put` starts another
                        return
                    if self._stopping:
                        break
                    if self._inbox and self._expected and not self.has_work:
                        self._cv.wait_for(self._gathered, self.gather_s)
                    queued, jobs = self._queued()
                self._take(queued)
                for fn, future in jobs:
                    if future.set_running_or_notify_cancel():
                        try:
                            future.set_result(fn())
                        except BaseException as e:
                            future.set_exception(e)
                if self.has_work:
                    try:
                        outputs = self.step()
                    except Exception as e:  # the requests learn of it; the engine keeps serving
                        outputs = self._fail_step(e)
                    self._deliver(outputs)
            self._shut_down()

    def _ready(self) -> bool:
        return bool(self._stopping or self._inbox or self._jobs or self.has_work)

    def _gathered(self) -> bool:
        return self._stopping or not self._expected

    def _queued(self) -> tuple[list[Any], list[tuple[Callable[[], Any], concurrent.futures.Future[Any]]]]:
        """Takes the requests and jobs queued so far (the caller holds the lock)."""
        queued, jobs = list(self._inbox), list(self._jobs)
        self._inbox.clear()
        self._jobs.clear()
        return queued, jobs

    def _shut_down(self) -> None:
        with self._cv:
            queued, jobs = self._queued()
        for _, future in jobs:
            if future.set_running_or_notify_cancel():
                future.set_exception(LocalrtError("the model was unloaded"))
        self._deliver(self._unload(queued))


class _Closable(Protocol):
    def close(self) -> None: ...


class EngineStreams:
    """An adapter's side of its engine thread: `route` (the engine's sink) hands each output to its
    request's queue; `open` is a request's stream around that queue."""

    def __init__(self, request_of: Callable[[Any], int]) -> None:
        self._request_of = request_of  # an output -> the id of its request
        self._lock = threading.Lock()
        self._queues: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Queue[Any]]] = {}

    def route(self, outputs: list[Any]) -> None:
        """The engine thread's sink: each output to its request's queue, nothing else done here. One
        wake-up per event loop and step, however many of its requests the step served (each wake-up
        writes to the loop's socket and hands it the GIL)."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue[Any], Any]]] = {}
        with self._lock:
            for out in outputs:
                target = self._queues.get(self._request_of(out))
                if target is not None:
                    by_loop.setdefault(target[0], []).append((target[1], out))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_each, items)
            except RuntimeError:  # that event loop has closed: nobody is listening
                pass

    @contextlib.asynccontextmanager
    async def open(
        self,
        model: ModelLifetime,
        request_id: int,
        cancel: CancelToken,
        ended: Callable[[], bool],
        grammar: _Closable | None,
    ) -> AsyncIterator[asyncio.Queue[Any]]:
        """The queue of one request's outputs, while the body submits it and reads them. On the way out
        (done, a stop string, or the consumer left early) a request the engine still runs is cancelled
        and waited for (`ended`), so its grammar is closed only once the engine has let go of it."""
        queue: asyncio.Queue[Any] = asyncio.Queue()
        with self._lock:
            self._queues[request_id] = (asyncio.get_running_loop(), queue)
        model._active.add(cancel)
        try:
            yield queue
        finally:
            model._active.discard(cancel)
            with self._lock:
                self._queues.pop(request_id, None)
            if not ended():
                cancel.cancel()
                while not ended() and not model._closed:
                    await asyncio.sleep(0.005)
            if grammar is not None and (ended() or model._closed):
                grammar.close()


def _put_each(items: list[tuple[asyncio.Queue[Any], Any]]) -> None:
    for target, out in items:
        target.put_nowait(out)


def text_events(
    vocab: Any,
    detokenize: Callable[[Sequence[int]], str],
    tokens: Sequence[int],
    logprobs: Iterable[tuple[float, list[tuple[int, float]]] | None],
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
    (`text_events`), then the end, at a stop string or when the engine ends the request. The engine's
    outputs give `tokens`, `logprobs` (per token None or (logprob, the best (id, logprob))) and `finish`;
    the adapter gives `timings(generated)`, the done event's timings: `generated` is the tokens the answer
    took up to a stop string, or None when the engine ended the request (its own count then)."""

    def __init__(
        self, model: Any, request: GenerateRequest, timings: Callable[[int | None], Timings]
    ) -> None:
        self.model, self.timings = model, timings
        self.text = TextAssembler(request.stop)
        self.preserve = request.preserve_tokens
        self.generated = 0
        self.done = False

    async def read(
        self, queue: asyncio.Queue[Any], error: Callable[[], BaseException | None]
    ) -> AsyncIterator[Event]:
        """The events of the outputs arriving in `queue` until the end; `error`: the request's failure,
        raised when the engine ends it with one."""
        while not self.done:
            out = await queue.get()
            for event in self.events(out.tokens, out.logprobs, out.finish, error()):
                yield event

    def events(
        self,
        tokens: Sequence[int],
        logprobs: Iterable[tuple[float, list[tuple[int, float]]] | None],
        finish: str | None,
        error: BaseException | None = None,
    ) -> list[Event]:
        events, taken = text_events(
            self.model.vocab, self.model.detokenize, tokens, logprobs, self.text, self.preserve
        )
        if taken is not None:  # a stop string: the tokens after it are not the answer
            self.generated += taken
            self.done = True
            return [*events, *self.text.end("stop", self.timings(self.generated))]
        self.generated += len(tokens)
        if finish is not None:
            self.done = True
            if error is not None:
                raise error
            events.extend(self.text.end(finish, self.timings(None)))
        return events


class EngineModel:
    """What a loaded model does the same way over an engine with its own thread (torch, MLX): `score`
    and `embed` run there as jobs between two steps, and unloading stops the engine and frees the
    vocabulary. The model gives `_score(ids, result)` (fills the empty result, 2+ tokens) and
    `_hidden_rows(ids)` (final-normed hidden states [n, dim] on the host)."""

    engine: EngineThread
    vocab: Any  # llamacpp.vocab.Vocab
    context_length: int
    n_vocab: int
    eos_token_ids: Sequence[int]
    _closed: bool
    tokenize: Callable[[str], list[int]]  # the model's vocabulary (VocabMethods)
    detokenize: Callable[[Sequence[int]], str]
    capabilities: Capabilities

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
        here); whoever gets it closes it."""
        if request.format is None:
            return None
        return Grammar(self.vocab.lib, self.vocab.vocab, self.n_vocab, request.format)

    def _text_events(self, *args: Any) -> tuple[list[Event], int | None]:
        """`text_events` with this model's vocabulary (tokens, logprobs, text, preserve)."""
        return text_events(self.vocab, self.detokenize, *args)

    def _score(self, ids: list[int], result: ScoreResult) -> ScoreResult:
        raise NotImplementedError

    def _hidden_rows(self, ids: list[int]) -> np.ndarray:
        raise NotImplementedError

    async def _run(self, fn: Callable[[], T]) -> T:
        """Run fn on the engine's thread, between two steps."""
        check_loaded(self._closed)
        return await self.engine.job(fn)

    async def score(self, tokens: Sequence[int], return_logits: bool = False) -> ScoreResult:
        ids = list(tokens)
        check_loaded(self._closed)
        check_scored(ids, self.context_length, self.n_vocab)
        result = empty_score(len(ids), self.n_vocab, return_logits)
        if len(ids) < 2:  # nothing is predicted
            return result
        return await self._run(lambda: self._score(ids, result))

    async def embed(self, texts: Sequence[str]) -> list[list[float]]:
        check_loaded(self._closed)
        batches = [embedding_tokens(self.tokenize, t, self.context_length, self.eos_token_ids) for t in texts]
        return await self._run(lambda: [self._embed(ids) for ids in batches])

    def _embed(self, ids: list[int]) -> list[float]:
        # mean over tokens of the final-normed hidden states, as llama.cpp's mean pooling
        return unit_vector(np.asarray(self._hidden_rows(ids), dtype=np.float64).mean(0))

    def _free(self) -> None:
        self.engine.stop()  # the requests still running end (EngineThread._unload)
        self.vocab.close()
