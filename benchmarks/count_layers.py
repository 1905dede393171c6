"""Count the async generators a token climbs from the engine to the answer's bytes.

A streamed `/api/chat` and `/v1/chat/completions` on SmolLM2, through the server's own app in this
process. Where the engine's tokens become text events (`engine.text_events`, called once per step
inside the request's stream), the stack of awaiting frames is walked and each async generator on it is
named; the last token's chain is printed (the first one is pulled before the response starts, so its chain
is shorter).

    python benchmarks/count_layers.py [--gguf PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import sys
import tempfile
from pathlib import Path
from typing import Any

import httpx

from localrt.api.app import create_app
from localrt.backends import engine
from localrt.client import InProcessTransport
from localrt.runtime.front import Runtime
from localrt.store.importer import import_gguf
from localrt.store.store import Store

GGUF = Path.home() / ".cache" / "localrt-tests" / "SmolLM2-135M-Instruct.Q4_1.gguf"
ASKED = [{"role": "user", "content": "Hi"}]
ROUTES = {
    "/api/chat": {"model": "smol", "messages": ASKED, "options": {"num_predict": 4}},
    "/v1/chat/completions": {"model": "smol", "messages": ASKED, "max_tokens": 4, "stream": True},
}


def chain_here() -> list[str]:
    """The async generators awaiting this frame, innermost first."""
    frame, chain = sys._getframe(2), []
    while frame is not None:
        if frame.f_code.co_flags & inspect.CO_ASYNC_GENERATOR:
            chain.append(f"{Path(frame.f_code.co_filename).name}:{frame.f_code.co_qualname}")
        frame = frame.f_back
    return chain


async def measure(gguf: Path, root: Path) -> dict[str, list[str]]:
    store = Store(root)
    import_gguf(store, "smol", gguf, params={"temperature": 0, "num_ctx": 512, "num_thread": 1})
    seen: dict[str, list[str]] = {}
    route = ""
    real = engine.text_events

    def spy(*args: Any, **kwargs: Any) -> Any:
        seen[route] = chain_here()
        return real(*args, **kwargs)

    engine.text_events = spy  # type: ignore[assignment]
    runtime = Runtime(store)
    transport = InProcessTransport(create_app(store=store, runtime=runtime, api_key=""))
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1", timeout=300) as client:
            for route, body in ROUTES.items():  # noqa: B007  (`spy` reads `route`)
                async with client.stream("POST", route, json=body) as answer:
                    async for _ in answer.aiter_lines():
                        pass
    finally:
        engine.text_events = real
        await runtime.close()
    return seen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", type=Path, default=GGUF)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="localrt-layers-") as tmp:
        seen = asyncio.run(measure(args.gguf, Path(tmp)))
    for route, chain in seen.items():
        print(f"{route}: {len(chain)} async generators, innermost first")
        for name in chain:
            print(f"    {name}")


if __name__ == "__main__":
    main()
