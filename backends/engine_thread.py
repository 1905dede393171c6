"""An engine's own thread, written once for the torch, MLX and llama.cpp engines.

`EngineThread`: an engine steps on a thread of its own; requests (`submit`) come from any thread and
join it between two steps, and so do calls (`call`: MLX loads its model there); each step's outputs go
to a sink on that thread (the adapter's `engine.EngineStreams`).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import threading
from collections import deque
from collections.abc import Callable
from collections.abc import Iterable
from collections.abc import Iterator
from typing import Any
from typing import TypeVar

from localrt import faults
from localrt.errors import EngineFailure
from localrt.errors import LocalrtError

log = logging.getLogger("localrt.backends")

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
    """The thread, request inbox and call queue of an engine. The engine gives `has_work`, `step`
    (one iteration's outputs), `add` (a request joins it, on its thread; `_take` adds each queued one),
    `_fail_step` (a step raised: the outputs of the requests that fail with it) and `_unload` (stopped:
    the outputs of every request still in it, the queued ones included, failing with the reason). An error
    that escapes the loop outside a step stops the thread for good (`died`): every request in it or queued
    fails with that error, and what comes later is refused, so that the runtime loads the model again.
    Every graph of a model runs on its engine thread, embeddings and scores too: another thread would
    leave libgomp a pool of workers behind (`idle_end`; benchmarks/README.md has the measurement)."""

    thread_name = "engine"
    # Seconds the thread waits without work before it ends (None: it lives until `stop`); the next
    # request or call starts a new one. libgomp (llama.cpp's and torch's OpenMP) keeps a pool of workers
    # for each thread that runs a parallel region, and while more of its threads exist than cores it
    # stops spinning at barriers, which slows every other model's steps (benchmarks/README.md, "An idle
    # engine's thread"). A thread that ends takes its pool with it. The linger keeps one thread across
    # back-to-back requests.
    idle_end: float | None = 0.1
    # Seconds an idle engine holds its first step for requests the front end has announced
    # (`expecting`) and not submitted yet. Requests sent together reach the engine a few milliseconds
    # apart (each prompt is rendered in turn), and the first would otherwise start a prefill step alone,
    # a step ahead of the others. A lone request announces nothing else and never waits.
    gather_s = 0.01

    def _init_thread(self) -> None:
        self._cv = threading.Condition()
        self._expected: set[Any] = set()  # keys of the announced requests not submitted yet
        self._inbox: deque[Any] = deque()
        self._calls: deque[tuple[Callable[[], Any], concurrent.futures.Future[Any]]] = deque()
        self._thread: threading.Thread | None = None
        self._started = False
        self._sink: Sink | None = None
        self._stopping = False
        self.died: EngineFailure | None = None  # why the thread stopped on an error; nothing runs after it

    # ---- what the engine gives ------------------------------------------------------------------
    @property
    def has_work(self) -> bool:
        raise NotImplementedError

    def step(self) -> list[Any]:
        raise NotImplementedError

    def _take(self, queued: list[Any]) -> list[Any]:
        """Queued requests join the engine, on its thread (`add` each); the outputs of those that could
        not join (the engines: `engine.failed`)."""
        for request in queued:
            self.add(request)
        return []

    def _fail_step(self, error: Exception) -> list[Any]:
        raise NotImplementedError

    def _unload(self, queued: list[Any], error: LocalrtError) -> list[Any]:
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
        self._put(self._calls, (fn, future))
        return future

    def _put(self, queue: deque[Any], item: Any, key: Any = None) -> None:
        with self._cv:
            if self._stopping:  # nothing would take it
                raise LocalrtError("the model was unloaded")
            if self.died is not None:
                raise EngineFailure(str(self.died))
            queue.append(item)
            self._expected.discard(key)
            if self._started and self._thread is None:  # it ended, idle
                self._spawn()
            self._cv.notify()

    def stop(self) -> None:
        """The thread ends after its step; the requests still in the engine end (`_unload`), the calls
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
        # taken from the inbox last: they fail too if the loop dies before they joined or ran
        queued: list[Any] = []
        calls: list[tuple[Callable[[], Any], concurrent.futures.Future[Any]]] = []
        try:
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
                        queued, calls = self._queued()
                    self._deliver(self._take(queued))
                    if queued and faults.injected("engine"):
                        raise RuntimeError("a fault injected by LOCALRT_TEST_FAULT")
                    self._serve(calls)
                self._shut_down()
        except Exception as e:  # outside a step: left alone, its requests would wait forever
            self._die(e, queued, calls)

    def _serve(self, calls: list[tuple[Callable[[], Any], concurrent.futures.Future[Any]]]) -> None:
        """The calls taken, then a step if there is work."""
        for fn, future in calls:
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

    def _die(
        self,
        error: Exception,
        queued: list[Any],
        calls: list[tuple[Callable[[], Any], concurrent.futures.Future[Any]]],
    ) -> None:
        """The loop raised outside a step: the thread ends for good. Every request in the engine or
        queued (`queued`, `calls`: the last taken, which may not have joined or run) fails with the error,
        and so does every call not run; later ones are refused (`died`)."""
        log.error("the engine thread %s stopped", self.thread_name, exc_info=error)
        failure = EngineFailure(f"the model's engine stopped on an error: {error}")
        with self._cv:
            self.died = failure
            inbox, waiting_calls = self._queued()
        for _, future in [*calls, *waiting_calls]:
            if not future.done() and future.set_running_or_notify_cancel():
                future.set_exception(failure)
        try:
            self._deliver(self._unload([*queued, *inbox], failure))
        except Exception:  # the engine's state or the sink is broken too: the log is all that is left
            log.exception("the requests of the stopped engine thread %s could not be ended", self.thread_name)

    def _ready(self) -> bool:
        return bool(self._stopping or self._inbox or self._calls or self.has_work)

    def _gathered(self) -> bool:
        return self._stopping or not self._expected

    def _queued(self) -> tuple[list[Any], list[tuple[Callable[[], Any], concurrent.futures.Future[Any]]]]:
        """Takes the requests and calls queued so far (the caller holds the lock)."""
        queued, calls = list(self._inbox), list(self._calls)
        self._inbox.clear()
        self._calls.clear()
        return queued, calls

    def _shut_down(self) -> None:
        with self._cv:
            queued, calls = self._queued()
        for _, future in calls:
            if future.set_running_or_notify_cancel():
                future.set_exception(LocalrtError("the model was unloaded"))
        self._deliver(self._unload(queued, LocalrtError("the model was unloaded")))
