"""Load: 32 concurrent streaming clients against a real server with a small queue.

Every request either streams a non-empty answer to `done` or gets a clean 503 with Ollama's message;
nothing hangs (each client has a deadline), the server stays up, and its memory comes back down.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from localrt.store.importer import import_gguf
from localrt.store.store import Store
from tests.servers.serve import LocalrtServer

MODEL = "smollm2:135m"
CLIENTS = 32
QUEUE = 8


@pytest.fixture(scope="module")
def server(smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalrtServer]:
    root = tmp_path_factory.mktemp("api-load")
    import_gguf(Store(root / "models"), MODEL, smollm2_gguf, system="You are a helpful assistant.")
    srv = LocalrtServer(root / "models", root / "serve.log", env={"LOCALRT_MAX_QUEUE": str(QUEUE)})
    yield srv
    srv.stop()


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def one_client(url: str, i: int, results: list[tuple[int, str]]) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"Say a word about the number {i}."}],
        "options": {"temperature": 0, "num_predict": 6, "num_ctx": 1024},
    }
    try:
        with httpx.stream("POST", url + "/api/chat", json=body, timeout=httpx.Timeout(240, connect=10)) as r:
            if r.status_code != 200:
                r.read()
                results[i] = (r.status_code, r.json().get("error", ""))
                return
            text, done = "", False
            for line in r.iter_lines():
                chunk = json.loads(line)
                assert "error" not in chunk, chunk
                text += chunk["message"]["content"]
                done = chunk["done"]
            results[i] = (200 if done and text.strip() else -1, text)
    except Exception as e:  # recorded, then asserted on below
        results[i] = (-2, repr(e))


def test_32_concurrent_streaming_clients(server: LocalrtServer) -> None:
    warm = httpx.post(
        server.url + "/api/generate",
        json={
            "model": MODEL,
            "prompt": "Hi",
            "stream": False,
            "options": {"num_predict": 1, "num_ctx": 1024},
        },
        timeout=240,
    )
    assert warm.status_code == 200
    baseline = rss_bytes(server.proc.pid)

    results: list[tuple[int, str]] = [(0, "")] * CLIENTS
    threads = [
        threading.Thread(target=one_client, args=(server.url, i, results), daemon=True)
        for i in range(CLIENTS)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not any(t.is_alive() for t in threads), "a client hung"

    statuses = [status for status, _ in results]
    assert set(statuses) <= {200, 503}, results
    assert statuses.count(200) >= 1
    busy = [msg for status, msg in results if status == 503]
    assert all("server busy" in msg for msg in busy)
    assert server.alive()
    # the model, its KV cache and the request bookkeeping are all that should remain
    assert rss_bytes(server.proc.pid) < baseline * 1.25 + (64 << 20)
    metrics = httpx.get(server.url + "/metrics").text
    assert f'localrt_requests_total{{route="/api/chat",status="200"}} {statuses.count(200)}' in metrics
