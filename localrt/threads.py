"""Blocking work streamed to async code: `run_in_thread_stream` runs `work(emit)` in a thread of its own
and yields what it emits on the event loop (the store's pulls, pushes and creates, which report progress
as they go, behind the API's routes and the in-process client)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from collections.abc import Callable
from typing import Any
from typing import TypeVar

T = TypeVar("T")


async def run_in_thread_stream(
    work: Callable[[Callable[[T], None]], None], *, name: str = "localrt-worker"
) -> AsyncIterator[T]:
    """Run blocking `work(emit)` in a thread of its own and yield what it emits, without blocking the loop.

    A thread of its own rather than the loop's executor: a pull can run for minutes, and that pool's few
    workers are shared with everything else. When the consumer stops early (client gone, `aclose()`) the
    work runs on and what it emits is dropped. An error in `work` is raised in the consumer.
    """
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()

    def post(item: tuple[str, Any]) -> None:
        try:
            loop.call_soon_threadsafe(queue.put_nowait, item)
        except RuntimeError:  # the loop has closed (a pull still running at exit): nobody is listening
            pass

    def target() -> None:
        try:
            work(lambda item: post(("item", item)))
            post(("done", None))
        except BaseException as e:
            post(("error", e))

    threading.Thread(target=target, daemon=True, name=name).start()
    while True:
        kind, value = await queue.get()
        if kind == "item":
            yield value
        elif kind == "error":
            raise value
        else:
            return


# Set when the process is stopping (a server's grace period is over): long store work in a thread of its
# own (a download) ends at its next resumable point instead of running on for nobody.
stopping = threading.Event()
