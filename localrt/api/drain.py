"""Stopping without losing a word: the server's drain, from the first signal to the last byte.

Once `localrt serve` is told to stop (SIGTERM, SIGINT; `begin`), every new request is answered 503 with
`Retry-After` and `Connection: close` (`DrainMiddleware`), while the requests in flight run on, streams
included, for up to LOCALRT_SHUTDOWN_GRACE (`finish`). When the grace is over (`expire`), each stream still
running ends with its protocol's error chunk (an Ollama `{"error": ...}` line, an OpenAI `data:` error, an
Anthropic or Responses `error` event), written by the stream helpers of `streaming.py` from the
`ShuttingDown` raised here; a request whose answer has not started gets a 503; a pull stops at its next
resumable point (`threads.stopping`). Engines and models are freed by the app's shutdown afterwards.

A stream is ended by cancelling its task only while it waits for its next item inside `until_stopped` (where
the cancellation is caught and becomes the error chunk); one caught elsewhere (sending a chunk) ends at its
next item. Between requests the drain costs a flag check per item.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from collections.abc import AsyncIterator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from typing import TypeVar

from starlette.types import ASGIApp
from starlette.types import Message
from starlette.types import Receive
from starlette.types import Scope
from starlette.types import Send

from localrt import threads
from localrt.api.security import error_style
from localrt.api.security import reply
from localrt.errors import LocalrtError

log = logging.getLogger("localrt")

RETRY_AFTER_S = 5  # a restarted server usually answers again within seconds
END_S = 5.0  # after the grace: how long the error chunks and 503s may take to go out
POLL_S = 0.05
T = TypeVar("T")


class ShuttingDown(LocalrtError):
    status = 503


@dataclass(eq=False)
class _Work:
    """One request or stream in flight: its task, and whether the drain has ended it."""

    task: asyncio.Task[Any] | None
    started: bool = False  # a request: its answer has started (a stream ends itself)
    waiting: bool = False  # a stream: awaiting its next item inside until_stopped
    ended: bool = False


class Drain:
    def __init__(self, grace: float) -> None:
        self.grace = grace
        self.draining = False
        self.expired = False
        self.requests: set[_Work] = set()
        self.streams: set[_Work] = set()

    # ---- the stop, as the server drives it -------------------------------------------------------
    def begin(self) -> None:
        """The first signal: from now on, new requests are refused (safe from a signal handler)."""
        self.draining = True

    async def finish(self, forced: Callable[[], bool]) -> None:
        """Wait until nothing is in flight or the grace is over, then end what still runs and give its
        answers up to END_S to go out. `forced()`: a second signal came; stop waiting at once."""
        if self.requests and not forced():
            log.info(
                "stopping: %d request(s) in flight may finish within %s (a second signal stops at once)",
                len(self.requests),
                _seconds(self.grace),
            )
        deadline = time.monotonic() + self.grace
        while self.requests and time.monotonic() < deadline and not forced():
            await asyncio.sleep(POLL_S)
        if self.requests and not forced():
            log.warning("stopping: the grace period is over; ending %d request(s)", len(self.requests))
            self.expire()
            deadline = time.monotonic() + END_S
            while self.requests and time.monotonic() < deadline and not forced():
                await asyncio.sleep(POLL_S)

    def expire(self) -> None:
        """End each stream still running (its error chunk) and each request not yet answered (a 503)."""
        self.expired = True
        threads.stopping.set()
        for stream in list(self.streams):
            self._end(stream)
        for request in list(self.requests):
            if not request.started:
                self._end(request)

    @staticmethod
    def _end(work: _Work) -> None:
        if work.ended:
            return
        work.ended = True
        # a stream that is elsewhere (sending its last chunk) sees `ended` at its next item
        if work.task is not None and (work.waiting or not work.started):
            work.task.cancel()

    # ---- what the middleware and the stream helpers call --------------------------------------------
    def message(self) -> str:
        return f"the server is shutting down (LOCALRT_SHUTDOWN_GRACE {_seconds(self.grace)} is over)"


_current: contextvars.ContextVar[Drain | None] = contextvars.ContextVar("localrt_drain", default=None)


def _uncancel(task: asyncio.Task[Any] | None) -> None:
    """The drain's own cancellation was caught: the task goes on (Python 3.11+ counts cancellations)."""
    if task is not None and hasattr(task, "uncancel"):
        task.uncancel()


async def until_stopped(items: AsyncIterator[T]) -> AsyncIterator[T]:
    """`items`, unless the server's grace runs out first: then the source is closed (its generation
    cancelled, its sequence freed) and ShuttingDown is raised, which the stream helpers write as their
    protocol's error chunk. Outside a stopping server, `items` as they are."""
    drain = _current.get()
    if drain is None:
        async for item in items:
            yield item
        return
    stream = _Work(asyncio.current_task(), started=True)  # a stream is cancelled only while it waits
    drain.streams.add(stream)
    iterator = aiter(items)
    try:
        while True:
            if stream.ended:
                await _close(iterator)
                raise ShuttingDown(drain.message())
            stream.waiting = True
            try:
                item = await anext(iterator)
            except StopAsyncIteration:
                return
            except asyncio.CancelledError:
                if not stream.ended:
                    raise
                _uncancel(stream.task)
                raise ShuttingDown(drain.message()) from None
            finally:
                stream.waiting = False
            yield item
    finally:
        drain.streams.discard(stream)


async def _close(iterator: AsyncIterator[Any]) -> None:
    closer = getattr(iterator, "aclose", None)
    if closer is not None:
        await closer()


class DrainMiddleware:
    """Refuses requests once the server is stopping, and tracks those in flight for the drain."""

    def __init__(self, app: ASGIApp, drain: Drain) -> None:
        self.app = app
        self.drain = drain

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        drain = self.drain
        style = error_style(scope.get("path", ""))
        if drain.draining:
            await refuse(send, "the server is shutting down; try again shortly", style)
            return
        request = _Work(asyncio.current_task())

        async def tracked(message: Message) -> None:
            if message["type"] == "http.response.start":
                request.started = True
            await send(message)

        drain.requests.add(request)
        token = _current.set(drain)
        try:
            await self.app(scope, receive, tracked)
        except asyncio.CancelledError:
            if not (request.ended and not request.started):
                raise
            _uncancel(request.task)
            await refuse(send, drain.message(), style)
        finally:
            _current.reset(token)
            drain.requests.discard(request)


async def refuse(send: Send, message: str, style: str) -> None:
    await reply(
        send,
        503,
        message,
        style,
        [(b"retry-after", str(RETRY_AFTER_S).encode()), (b"connection", b"close")],
    )


def _seconds(value: float) -> str:
    return "no limit" if value == float("inf") else f"{value:g}s"
