"""What the command modules share: the handler type and running one client call to completion."""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Awaitable
from collections.abc import Callable
from typing import TYPE_CHECKING
from typing import Any
from typing import TypeVar

if TYPE_CHECKING:
    from localrt.client import Client

T = TypeVar("T")
Handler = Callable[[argparse.Namespace], int]
Subparsers = Any  # argparse._SubParsersAction, private in typeshed


def with_client(work: Callable[[Client], Awaitable[T]]) -> T:
    """Run `work(client)` on a fresh event loop: the server at LOCALRT_HOST when one answers, else
    the store and runtime in this process; the client is closed afterwards either way."""
    from localrt.client import connect

    async def go() -> T:
        client = connect()
        if client.kind != "server":
            recover_store()
        try:
            return await work(client)
        finally:
            await client.close()

    return asyncio.run(go())


def recover_store(say: Callable[[str], None] | None = None) -> None:
    """Before this process works on the store itself: what killed writes left there, cleaned up or
    kept for resuming, one line each to `say` (default: stderr). A store it cannot write (an Ollama
    store mounted read-only) is left as it is."""
    import logging

    from localrt.store.store import Store

    try:
        found = Store().recover()
    except OSError as e:
        logging.getLogger("localrt").debug("store recovery skipped: %s", e)
        return
    for leftover in found:
        line = f"store: {leftover.line()}"
        if say is None:
            print(f"localrt: {line}", file=sys.stderr)
        else:
            say(line)


def add_tool_options(p: argparse.ArgumentParser) -> None:
    """The tool loop's options, the same for `run --tools` and `chat`: the MCP servers to start, approving
    every call, and the tool choice of each answer's first request."""
    p.add_argument(
        "--mcp",
        default=None,
        metavar="FILE",
        help="MCP servers to start (default ~/.config/localrt/mcp.json)",
    )
    p.add_argument("--yes", action="store_true", help="approve every tool call without asking")
    p.add_argument(
        "--tool-choice",
        default=None,
        metavar="CHOICE",
        help="auto, required, none, or a tool's name, for each answer's first request",
    )
