"""NDJSON and SSE responses that start only after the first item, so early errors get a real status.

Ollama's rule: an error before any byte is written is a status code with a JSON body; an error
mid-stream is one more line (`{"error": ...}`) and the status stays 200. A server that stops ends a
stream still running after its grace the same way (`drain.until_stopped`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from collections.abc import Awaitable
from collections.abc import Callable
from typing import Any
from typing import TypeVar

from fastapi import Request
from fastapi.responses import Response
from fastapi.responses import StreamingResponse

from localrt.api.drain import until_stopped
from localrt.errors import ClientClosed
from localrt.errors import LocalrtError

log = logging.getLogger("localrt.api")

# json.dumps(item, ensure_ascii=False) without building an encoder per call: streams encode one item a token
encode = json.JSONEncoder(ensure_ascii=False).encode

T = TypeVar("T")


async def unless_client_leaves(request: Request, work: Awaitable[T]) -> T:
    """`work` (what a route computes before the first byte of its answer: a whole non-streamed reply, or
    a stream's first item), cancelled as soon as the client hangs up, so its generation stops and frees
    its sequence instead of running to its token cap for nobody; then ClientClosed (a 499 nobody reads).
    A streamed answer is watched by Starlette's StreamingResponse once it starts. The request body must
    have been read: the only message left to receive is the disconnect."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnect(request))
    try:
        await asyncio.wait((task, gone), return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # the server shuts down: nothing waits for the answer either
        task.cancel()
        raise
    finally:
        gone.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task  # the generation unwinds (its sequence freed) before the route returns
    raise ClientClosed("the client closed the connection before the answer was ready")


async def _disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def first_of(items: AsyncIterator[T]) -> tuple[T, AsyncIterator[T]]:
    """The first item, pulled now (so errors raise before any byte), and the iterator of the rest."""
    iterator = aiter(items)
    return await anext(iterator), iterator


def _same(item: Any) -> list[Any]:
    return [item]


def ndjson_response(
    first: T, rest: AsyncIterator[T], to_wire: Callable[[T], list[dict[str, Any]]] = _same
) -> StreamingResponse:
    """NDJSON of `first` and the `rest`, each item written as the lines `to_wire` makes of it (in the
    body's one loop: no layer between the items' source and the bytes)."""

    async def body() -> AsyncIterator[bytes]:
        try:
            for line in to_wire(first):
                yield (encode(line) + "\n").encode()
            async for item in until_stopped(rest):  # a stopping server ends it with an error
                for line in to_wire(item):
                    yield (encode(line) + "\n").encode()
        except LocalrtError as e:
            yield (json.dumps({"error": str(e)}) + "\n").encode()

    return StreamingResponse(body(), media_type="application/x-ndjson")


def sse_response(
    first: T,
    rest: AsyncIterator[T],
    on_error: Callable[[LocalrtError], dict[str, Any]],
    to_wire: Callable[[T], list[dict[str, Any]]] = _same,
) -> StreamingResponse:
    """SSE `data:` events of `first` and the `rest` (each item as the events `to_wire` makes of it),
    then `[DONE]`."""

    async def body() -> AsyncIterator[bytes]:
        try:
            for event in to_wire(first):
                yield f"data: {encode(event)}\n\n".encode()
            async for item in until_stopped(rest):  # a stopping server ends it with an error
                for event in to_wire(item):
                    yield f"data: {encode(event)}\n\n".encode()
        except LocalrtError as e:
            yield f"data: {json.dumps(on_error(e))}\n\n".encode()
        yield b"data: [DONE]\n\n"

    return StreamingResponse(
        body(),
        media_type="text/event-stream",
        headers={"cache-control": "no-cache", "x-accel-buffering": "no"},
    )


def typed_sse_response(
    items: AsyncIterator[dict[str, Any]], on_error: Callable[[LocalrtError], dict[str, Any]]
) -> StreamingResponse:
    """SSE with an `event:` line naming each item's `type` (OpenAI Responses, Anthropic Messages); those
    clients dispatch on the name and end on their own terminal event, so there is no `[DONE]`."""

    def frame(item: dict[str, Any]) -> bytes:
        return f"event: {item['type']}\ndata: {encode(item)}\n\n".encode()

    async def body() -> AsyncIterator[bytes]:
        try:
            async for item in until_stopped(items):  # a stopping server ends it with an error
                yield frame(item)
        except LocalrtError as e:
            yield frame(on_error(e))

    return StreamingResponse(
        body(),
        media_type="text/event-stream",
        headers={"cache-control": "no-cache", "x-accel-buffering": "no"},
    )


WARNING_HEADER = "x-localrt-warning"


def with_warnings(response: Response, warnings: list[str]) -> Response:
    """What a request asked for that was accepted but not done, said in a header and the log, so
    an agent's request is answered rather than refused and its user can still find out."""
    if warnings:
        text = "; ".join(warnings)
        log.warning("%s", text)
        response.headers[WARNING_HEADER] = text.encode("ascii", "replace").decode()
    return response
