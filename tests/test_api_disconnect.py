"""A client that hangs up mid-answer frees its sequence, on every generation route, streamed or not.

A real `localrt serve` on 127.0.0.1 runs a tiny random-weight model whose default answer is open-ended
(num_predict -1: up to 10 x num_ctx tokens with the context shifting, far longer than the test): a
raw socket sends the request and closes once the generation runs. The server's queue gauge (requests
waiting or running per model; a generation leaves it only after the backend has freed its sequence)
must drop back to nothing, and the token counter (fed by finished answers) must not move: the
generation was cut, not run to its cap for nobody.
"""

from __future__ import annotations

import json
import re
import signal
import socket
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from localrt.store.importer import import_gguf
from localrt.store.store import Store
from tests.gguf_factory import write_tiny_llama
from tests.servers.serve import LocalrtServer

MODEL = "tiny:latest"
CONTEXT = 2048  # the default answer's cap is 10 x this: minutes of tokens, cut after about a second
LIVENESS = 60.0  # seconds: a bound for a loaded machine, not a speed target
QUESTION = "Tell me a very long story."

CHAT = [{"role": "user", "content": QUESTION}]
# Greedy: the random model then never reaches an end token within the cap (sampled, it might).
ROUTES: dict[str, Any] = {
    "ollama-generate": (
        "/api/generate",
        lambda s: {"prompt": QUESTION, "options": {"temperature": 0}, "stream": s},
    ),
    "ollama-chat": ("/api/chat", lambda s: {"messages": CHAT, "options": {"temperature": 0}, "stream": s}),
    "openai-chat": ("/v1/chat/completions", lambda s: {"messages": CHAT, "temperature": 0, "stream": s}),
    "openai-completions": ("/v1/completions", lambda s: {"prompt": QUESTION, "temperature": 0, "stream": s}),
    # Anthropic requires max_tokens: the largest it takes, which the runtime caps at 10 x num_ctx
    "anthropic-messages": (
        "/v1/messages",
        lambda s: {"messages": CHAT, "max_tokens": 10 << 20, "temperature": 0, "stream": s},
    ),
    "openai-responses": ("/v1/responses", lambda s: {"input": QUESTION, "temperature": 0, "stream": s}),
}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalrtServer]:
    root = tmp_path_factory.mktemp("api-disconnect")
    gguf = write_tiny_llama(root / "tiny.gguf", context_length=CONTEXT)
    import_gguf(Store(root / "models"), MODEL, gguf)
    srv = LocalrtServer(root / "models", root / "serve.log", env={"LOCALRT_KEEP_ALIVE": "10m"})
    yield srv
    assert srv.stop() in (0, -signal.SIGTERM)
    log = srv.log_path.read_text(errors="replace")
    assert "Traceback" not in log, log[-4000:]


def metrics(server: LocalrtServer) -> tuple[int, int]:
    """(requests waiting or running on the model, tokens of finished answers) from /metrics."""
    text = httpx.get(server.url + "/metrics", timeout=30).text
    depth = re.search(rf'^localrt_queue_depth{{model="{re.escape(MODEL)}"}} (\d+)$', text, re.M)
    tokens = re.search(r"^localrt_generated_tokens_total (\d+)$", text, re.M)
    assert tokens is not None, text
    return (int(depth.group(1)) if depth else 0), int(tokens.group(1))


def wait_for_depth(server: LocalrtServer, depth: int) -> float:
    """Poll until the model's queue depth is `depth`; the seconds it took."""
    start = time.monotonic()
    while metrics(server)[0] != depth:
        assert time.monotonic() - start < LIVENESS, f"queue depth never reached {depth}"
        time.sleep(0.05)
    return time.monotonic() - start


def send(server: LocalrtServer, path: str, body: dict[str, Any]) -> socket.socket:
    """The request over a plain socket, which the test closes to hang up."""
    data = json.dumps({"model": MODEL, **body}).encode()
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=LIVENESS)
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    )
    sock.sendall(head.encode() + data)
    return sock


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("route", list(ROUTES))
def test_a_client_that_hangs_up_frees_its_sequence(server: LocalrtServer, route: str, stream: bool) -> None:
    path, body = ROUTES[route]
    wait_for_depth(server, 0)
    _, tokens_before = metrics(server)
    sock = send(server, path, body(stream))
    try:
        if stream:
            assert sock.recv(4096).startswith(b"HTTP/1.1 200")  # the answer is streaming
        else:
            wait_for_depth(server, 1)
            time.sleep(0.5)  # into the generation: a whole answer sends nothing before it is done
    finally:
        sock.close()
    wait_for_depth(server, 0)
    assert metrics(server)[1] == tokens_before  # no answer finished: the generation was cut


def test_the_server_still_answers_after_the_hang_ups(server: LocalrtServer) -> None:
    r = httpx.post(
        server.url + "/api/generate",
        json={"model": MODEL, "prompt": QUESTION, "stream": False, "options": {"num_predict": 4}},
        timeout=LIVENESS,
    )
    assert r.json()["eval_count"] == 4
