"""The engine thread shared by the torch, MLX and llama.cpp engines (backends/engine_thread.py), on a small
engine of its own: requests are countdowns, a step takes one from each."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from localrt import faults
from localrt.backends.engine_thread import EngineThread
from localrt.errors import EngineFailure
from localrt.errors import LocalrtError


class Countdown(EngineThread):
    thread_name = "countdown-engine"

    def __init__(self, fail_at: int | None = None) -> None:
        self.running: dict[str, int] = {}
        self.fail_at = fail_at  # a step fails when a countdown reaches this value
        self.step_threads: set[str] = set()
        self._init_thread()

    @property
    def has_work(self) -> bool:
        return bool(self.running)

    def step(self) -> list[Any]:
        self.step_threads.add(threading.current_thread().name)
        out = []
        for name in list(self.running):
            self.running[name] -= 1
            if self.running[name] == self.fail_at:
                raise RuntimeError("bad step")
            if self.running[name] == 0:
                del self.running[name]
                out.append((name, "done"))
        return out

    def _take(self, queued: list[Any]) -> None:
        for name, n in queued:
            self.running[name] = n

    def _fail_step(self, error: Exception) -> list[Any]:
        failed = [(name, f"error: {error}") for name in self.running]
        self.running.clear()
        return failed

    def _unload(self, queued: list[Any], error: LocalrtError) -> list[Any]:
        # a request taken from the inbox may be running already: it ends once
        ended = [(name, str(error)) for name in dict.fromkeys([*self.running, *(n for n, _ in queued)])]
        self.running.clear()
        return ended


class Sink:
    def __init__(self) -> None:
        self.outputs: list[Any] = []
        self.changed = threading.Condition()

    def __call__(self, outputs: list[Any]) -> None:
        with self.changed:
            self.outputs += outputs
            self.changed.notify_all()

    def wait_for(self, n: int) -> list[Any]:
        with self.changed:
            assert self.changed.wait_for(lambda: len(self.outputs) >= n, timeout=30)
            return list(self.outputs)


def test_requests_step_on_the_engine_thread_and_jobs_run_there_too() -> None:
    engine, sink = Countdown(), Sink()
    engine.start(sink)
    try:
        engine.submit(("a", 3))
        engine.submit(("b", 1))
        assert sorted(sink.wait_for(2)) == [("a", "done"), ("b", "done")]
        assert engine.step_threads == {"countdown-engine"}
        assert engine.call(lambda: threading.current_thread().name).result(timeout=30) == "countdown-engine"
    finally:
        engine.stop()


def test_a_failed_step_fails_its_requests_and_the_engine_goes_on() -> None:
    engine, sink = Countdown(fail_at=1), Sink()
    engine.start(sink)
    try:
        engine.submit(("a", 2))
        assert sink.wait_for(1) == [("a", "error: bad step")]
        engine.submit(("b", 1))
        assert sink.wait_for(2)[1] == ("b", "done")
    finally:
        engine.stop()


def test_stopping_ends_the_requests_and_refuses_new_work() -> None:
    engine, sink = Countdown(), Sink()
    engine.start(sink)
    started, gate = threading.Event(), threading.Event()
    blocked = engine.call(lambda: started.set() or gate.wait())  # holds the thread: what follows stays queued
    assert started.wait(timeout=30)
    engine.submit(("a", 5))
    queued_job = engine.call(lambda: "never")
    stopper = threading.Thread(target=engine.stop)
    stopper.start()
    while not engine._stopping:  # the stop is asked for before the thread is free again
        threading.Event().wait(0.01)
    gate.set()
    stopper.join(timeout=30)
    assert blocked.result(timeout=30) is True
    with pytest.raises(LocalrtError, match="unloaded"):
        queued_job.result(timeout=30)
    assert sink.wait_for(1) == [("a", "the model was unloaded")]
    with pytest.raises(LocalrtError, match="unloaded"):
        engine.submit(("b", 1))
    with pytest.raises(LocalrtError, match="unloaded"):
        engine.call(lambda: None)


def test_an_error_outside_a_step_fails_every_request_and_the_engine_refuses_the_rest(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(faults, "_seen", {})
    monkeypatch.setenv("LOCALRT_TEST_FAULT", "engine")  # the loop raises once it has taken the requests
    engine, sink = Countdown(), Sink()
    engine.submit(("a", 3))
    engine.submit(("b", 1))
    queued_job = engine.call(lambda: "never")
    engine.start(sink)
    stopped = "the model's engine stopped on an error: a fault injected by LOCALRT_TEST_FAULT"
    assert sorted(sink.wait_for(2)) == [("a", stopped), ("b", stopped)]
    with pytest.raises(EngineFailure, match="engine stopped on an error"):
        queued_job.result(timeout=30)
    assert engine.died is not None
    with pytest.raises(EngineFailure, match="engine stopped on an error"):
        engine.submit(("c", 1))
    engine.stop()  # the thread has ended: the stop does not wait for it
    assert sink.outputs == [("a", stopped), ("b", stopped)]


def test_an_engine_never_started_ends_its_requests_on_stop() -> None:
    engine, sink = Countdown(), Sink()
    engine._sink = sink
    engine.submit(("a", 2))
    engine.stop()
    assert sink.outputs == [("a", "the model was unloaded")]


class IdleEndingCountdown(Countdown):
    idle_end = 0.01


def first_thread_joined(engine: Countdown) -> threading.Thread:
    """The engine's first thread, waited for (up to 30 s) to end for want of work."""
    first = engine._thread
    assert first is not None
    first.join(timeout=30)
    return first


def ended_idle(engine: Countdown) -> None:
    """Wait until the engine's first thread has ended idle (the tests below start from there)."""
    if first_thread_joined(engine).is_alive():
        raise RuntimeError("the engine thread did not end idle")


def test_an_idle_thread_ends() -> None:
    engine, sink = IdleEndingCountdown(), Sink()
    engine.start(sink)
    engine.submit(("a", 2))
    sink.wait_for(1)
    try:
        first = first_thread_joined(engine)
        assert not first.is_alive()  # before `stop`, which would end it anyway
    finally:
        engine.stop()


def test_work_after_an_idle_end_is_served() -> None:
    engine, sink = IdleEndingCountdown(), Sink()
    engine.start(sink)
    ended_idle(engine)
    engine.submit(("b", 2))
    try:
        assert sink.wait_for(1) == [("b", "done")]
    finally:
        engine.stop()


def test_stopping_after_an_idle_end_refuses_new_work() -> None:
    engine, sink = IdleEndingCountdown(), Sink()
    engine.start(sink)
    ended_idle(engine)
    engine.stop()
    with pytest.raises(LocalrtError, match="unloaded"):
        engine.submit(("c", 1))


class GatheringCountdown(Countdown):
    """Records what each step ran; an idle engine holds its first step for announced requests as long as
    any test here lasts, so whether it waited never depends on timing."""

    gather_s = 60.0

    def __init__(self) -> None:
        super().__init__()
        self.stepped: list[list[str]] = []

    def step(self) -> list[Any]:
        self.stepped.append(sorted(self.running))
        return super().step()


@contextlib.contextmanager
def gathering() -> Iterator[tuple[GatheringCountdown, Sink]]:
    engine, sink = GatheringCountdown(), Sink()
    engine.start(sink)
    try:
        yield engine, sink
    finally:
        engine.stop()


def test_an_idle_engine_waits_for_announced_requests_and_steps_them_together() -> None:
    with gathering() as (engine, sink):
        with engine.expecting("b's key"):
            engine.submit(("a", 1))
            threading.Event().wait(0.05)  # an engine that did not wait would step `a` alone meanwhile
            engine.submit(("b", 1), "b's key")
            sink.wait_for(2)
        assert engine.stepped == [["a", "b"]]


def test_an_announcement_withdrawn_unsubmitted_lets_the_engine_go_on() -> None:
    with gathering() as (engine, sink):
        with engine.expecting("never submitted"):
            engine.submit(("a", 1))
            threading.Event().wait(0.05)  # the engine is holding its step by now
        assert sink.wait_for(1) == [("a", "done")]  # within 30 s: the 60 s hold ended with the block


def test_a_request_submitted_under_its_own_announcement_does_not_wait() -> None:
    with gathering() as (engine, sink), engine.expecting("a's key"):
        engine.submit(("a", 1), "a's key")
        assert sink.wait_for(1) == [("a", "done")]  # inside the block, within 30 s of a 60 s hold
