"""The client without a server: the server's own app in this process (`InProcessClient`), on the real
SmolLM2. Its answers stream as the app sends them, and closing the client's iterator stops the
generation, as hanging up on a server does."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import httpx
import pytest

pytest.importorskip("llama_cpp")

from localrt.client import InProcessClient  # noqa: E402
from localrt.client import InProcessTransport  # noqa: E402
from localrt.store.importer import import_gguf  # noqa: E402
from localrt.store.store import Store  # noqa: E402

MODEL = "smollm2:135m"
THREADS = int(os.environ.get("LOCALRT_TEST_THREADS", "1"))
LONG = [{"role": "user", "content": "Count from one to one thousand, one number per line."}]


@pytest.fixture
def store(tmp_path: Path, smollm2_gguf: Path) -> Store:
    s = Store(tmp_path / "models")
    params = {"temperature": 0, "num_ctx": 1024, "num_thread": THREADS}
    import_gguf(s, MODEL, smollm2_gguf, params=params, system="You are a helpful assistant.")
    return s


def test_an_answer_streams_and_closing_it_stops_the_generation(store: Store) -> None:
    async def scenario() -> tuple[dict[str, int], dict[str, int], int]:
        client = InProcessClient(store)
        try:
            chunks = client.chat(MODEL, LONG, options={"num_predict": 200})
            await anext(chunks)
            running = client.runtime.queue_depth()  # the first chunk came while the model generates
            for _ in range(3):
                await anext(chunks)
            await chunks.aclose()  # the client hangs up
            after = client.runtime.queue_depth()
            [loaded] = await client.ps()
            return running, after, loaded.context_length
        finally:
            await client.close()

    running, after, context = asyncio.run(scenario())
    assert running == {MODEL: 1}
    assert after == {}
    assert context == 1024


def test_httpx_own_asgi_transport_would_not_stream(store: Store) -> None:
    """Why the client has a transport of its own: through httpx's ASGITransport the same answer's first
    line arrives only once the whole answer is done."""
    from localrt.api.app import create_app
    from localrt.runtime.front import Runtime

    async def first_line_while_running(transport_of: type) -> dict[str, int]:
        runtime = Runtime(store)
        app = create_app(store=store, runtime=runtime, api_key="")
        body = {"model": MODEL, "messages": LONG, "options": {"num_predict": 24}}
        try:
            async with httpx.AsyncClient(transport=transport_of(app), base_url="http://127.0.0.1") as http:
                async with http.stream("POST", "/api/chat", json=body, timeout=300) as answer:
                    async for _ in answer.aiter_lines():
                        return runtime.queue_depth()
        finally:
            await runtime.close()
        raise AssertionError("no answer")

    assert asyncio.run(first_line_while_running(InProcessTransport)) == {MODEL: 1}
    assert asyncio.run(first_line_while_running(lambda app: httpx.ASGITransport(app=app))) == {}
