"""The model pool takes its lock back after estimating a load off the lock, even when the request is cancelled
while it waits for the lock (a client that hangs up during another model's unload).

The 10-minute soak (benchmarks/soak.py) met it: `RuntimeError: Lock is not acquired` from the pool's
`async with`, a 500 that the departed client never saw.
"""

from __future__ import annotations

import asyncio

import pytest

from localrt.runtime.lifecycle import _relock
from tests.conftest import async_test


@async_test
async def test_a_request_cancelled_while_it_waits_for_the_lock_leaves_it_consistent() -> None:
    cond = asyncio.Condition()
    released = asyncio.Event()

    async def request() -> None:
        async with cond:
            cond.release()  # as the pool does around the estimate
            try:
                released.set()
                await asyncio.sleep(0)
            finally:
                await _relock(cond)

    task = asyncio.ensure_future(request())
    await released.wait()
    await cond.acquire()  # another request holds it (an unload under the lock)
    await asyncio.sleep(0)  # the first is waiting for the lock now
    task.cancel()
    await asyncio.sleep(0)
    cond.release()
    with pytest.raises(asyncio.CancelledError):
        await task  # not RuntimeError('Lock is not acquired.')
    assert not cond.locked()
