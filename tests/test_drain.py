"""Stopping `localrt serve` with SIGTERM: streams in flight finish, new requests are refused, and what outlives
LOCALRT_SHUTDOWN_GRACE ends with its protocol's error chunk; the exit is clean; a second signal is final.

A real server runs a tiny random-weight model whose greedy answer never reaches an end token (num_predict
-1: up to 10 x num_ctx tokens), so a stream runs exactly as long as its token cap says.
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from localrt.store.importer import import_gguf
from localrt.store.names import parse_name
from localrt.store.pull import pull
from localrt.store.store import Store
from tests.gguf_factory import write_tiny_llama
from tests.servers.registry import Registry
from tests.servers.serve import LocalrtServer

MODEL = "tiny:latest"
LIVENESS = 120.0  # seconds: a bound for a loaded machine, not a speed target
QUESTION = "Tell me a very long story."
CHAT = [{"role": "user", "content": QUESTION}]


def start_server(tmp_path: Path, **env: str) -> LocalrtServer:
    gguf = write_tiny_llama(tmp_path / "tiny.gguf", context_length=2048)
    import_gguf(Store(tmp_path / "models"), MODEL, gguf)
    return LocalrtServer(
        tmp_path / "models", tmp_path / "serve.log", env={"LOCALRT_NUM_PARALLEL": "8", **env}
    )


STREAMS: dict[str, tuple[str, Callable[[int], dict[str, Any]]]] = {
    "ollama": (
        "/api/chat",
        lambda n: {"model": MODEL, "messages": CHAT, "options": {"temperature": 0, "num_predict": n}},
    ),
    "openai": (
        "/v1/chat/completions",
        lambda n: (
            {"model": MODEL, "messages": CHAT, "temperature": 0, "stream": True}
            | ({"max_tokens": n} if n > 0 else {})
        ),
    ),
    "anthropic": (
        "/v1/messages",
        lambda n: {
            "model": MODEL,
            "messages": CHAT,
            "temperature": 0,
            "stream": True,
            "max_tokens": n if n > 0 else 10 << 20,
        },
    ),
    "responses": (
        "/v1/responses",
        lambda n: (
            {"model": MODEL, "input": QUESTION, "temperature": 0, "stream": True}
            | ({"max_output_tokens": n} if n > 0 else {})
        ),
    ),
}


class Stream(threading.Thread):
    """One streamed request in a thread: `first` is set at its first chunk; `lines` is what it read."""

    def __init__(self, server: LocalrtServer, kind: str, tokens: int, pace: float = 0.0) -> None:
        super().__init__(daemon=True)
        self.server, self.kind, self.tokens = server, kind, tokens
        self.pace = pace  # seconds this client waits after each line it reads (a slow reader)
        self.first = threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None

    def run(self) -> None:
        path, body = STREAMS[self.kind]
        try:
            with httpx.stream("POST", self.server.url + path, json=body(self.tokens), timeout=LIVENESS) as r:
                assert r.status_code == 200, r.read()
                out = []
                for line in r.iter_lines():
                    if line:
                        self.first.set()
                        out.append(line)
                        time.sleep(self.pace)
                self.result = out
        except BaseException as e:  # surfaced by the assertions in the test
            self.error = e
            self.first.set()

    def parsed(self) -> list[Any]:
        assert self.error is None, self.error
        if self.kind == "ollama":
            return [json.loads(line) for line in self.result]
        events, name = [], ""
        for line in self.result:
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                events.append((name, line[6:]))
                name = ""
        return events


def ending(stream: Stream) -> str:
    """How a stream ended: "done" for its protocol's normal end (Ollama done, OpenAI finish_reason then
    [DONE], Anthropic message_stop, Responses response.completed or .incomplete), else its last lines."""
    items = stream.parsed()
    if stream.kind == "ollama":
        normal = items[-1].get("done") is True and "error" not in items[-1]
    elif stream.kind == "openai":
        normal = items[-1][1] == "[DONE]" and '"finish_reason":"length"' in items[-2][1].replace(" ", "")
    elif stream.kind == "anthropic":
        normal = items[-1][0] == "message_stop"
    else:
        normal = items[-1][0] in ("response.completed", "response.incomplete")
    return "done" if normal else repr(items[-2:])


def ended_with_error(stream: Stream, message: str) -> bool:
    items = stream.parsed()
    if stream.kind == "ollama":
        return items[-1] == {"error": message}
    if stream.kind == "openai":
        return items[-1][1] == "[DONE]" and json.loads(items[-2][1])["error"]["message"] == message
    name, data = items[-1]
    if stream.kind == "anthropic":
        return name == "error" and json.loads(data)["error"]["message"] == message
    return name == "error" and json.loads(data)["message"] == message


def wait_in_flight(server: LocalrtServer, n: int) -> None:
    """Until `n` requests run on the model (its queue gauge in /metrics)."""
    deadline = time.monotonic() + LIVENESS
    pattern = re.compile(rf'^localrt_queue_depth{{model="{re.escape(MODEL)}"}} (\d+)$', re.M)
    while time.monotonic() < deadline:
        m = pattern.search(httpx.get(server.url + "/metrics", timeout=LIVENESS).text)
        if m and int(m[1]) >= n:
            return
        time.sleep(0.05)
    raise AssertionError(f"{n} requests never ran at once")


def stop_code(server: LocalrtServer) -> int:
    code = server.proc.wait(LIVENESS)
    server.log.close()
    return code


# ---- the tests ----------------------------------------------------------------------------------------------------
def test_sigterm_lets_eight_streams_finish_and_refuses_new_requests(tmp_path: Path) -> None:
    server = start_server(tmp_path, LOCALRT_SHUTDOWN_GRACE="10m")  # room for a loaded machine
    kept_open = httpx.Client(base_url=server.url, timeout=LIVENESS)  # a keep-alive connection, idle
    assert kept_open.get("/api/version").status_code == 200
    kinds = ["ollama", "ollama", "openai", "openai", "anthropic", "anthropic", "responses", "responses"]
    # slow readers: a tiny model makes 120 tokens in well under a second, and the streams must still be in
    # flight when the signal comes and a new request is refused
    streams = [Stream(server, kind, 120, pace=0.05) for kind in kinds]
    for s in streams:
        s.start()
    for s in streams:
        assert s.first.wait(LIVENESS)
    server.proc.send_signal(signal.SIGTERM)

    refused = kept_open.post("/api/chat", json={"model": MODEL, "messages": CHAT})
    running = [s.is_alive() for s in streams]
    assert refused.status_code == 503
    assert refused.headers["retry-after"] == "5"
    assert refused.json() == {"error": "the server is shutting down; try again shortly"}
    assert any(running)  # refused while streams were still in flight
    try:  # a new connection: refused, or answered 503 in the moment before the listener closes
        late = httpx.get(server.url + "/api/version", timeout=10).status_code
    except httpx.ConnectError:
        late = None
    assert late in (None, 503)
    for s in streams:
        s.join(LIVENESS)
    assert [ending(s) for s in streams] == ["done"] * 8
    assert stop_code(server) in (0, -signal.SIGTERM)
    log = server.log_path.read_text()
    assert "stopped: unloaded tiny:latest" in log
    assert "Traceback" not in log


def test_past_the_grace_each_stream_ends_with_its_protocols_error_chunk(tmp_path: Path) -> None:
    server = start_server(tmp_path, LOCALRT_SHUTDOWN_GRACE="1s")
    streams = [Stream(server, kind, -1) for kind in STREAMS]  # open-ended: they outlive the grace
    waiting: list[httpx.Response] = []

    def not_streamed() -> None:
        waiting.append(
            httpx.post(
                server.url + "/api/chat",
                json={"model": MODEL, "messages": CHAT, "stream": False, "options": {"temperature": 0}},
                timeout=LIVENESS,
            )
        )

    unstreamed = threading.Thread(target=not_streamed, daemon=True)
    for s in streams:
        s.start()
    for s in streams:
        assert s.first.wait(LIVENESS)
    unstreamed.start()
    wait_in_flight(server, len(streams) + 1)  # the unstreamed request runs too
    server.proc.send_signal(signal.SIGTERM)
    for s in streams:
        s.join(LIVENESS)
    unstreamed.join(LIVENESS)
    message = "the server is shutting down (LOCALRT_SHUTDOWN_GRACE 1s is over)"
    assert {s.kind: ended_with_error(s, message) for s in streams} == dict.fromkeys(STREAMS, True)
    assert [r.status_code for r in waiting] == [503]
    assert waiting[0].json() == {"error": message}
    assert stop_code(server) in (0, -signal.SIGTERM)
    log = server.log_path.read_text()
    assert "the grace period is over; ending 5 request(s)" in log
    assert "stopped: unloaded tiny:latest" in log
    assert "Traceback" not in log


def test_a_second_signal_stops_at_once(tmp_path: Path) -> None:
    server = start_server(tmp_path, LOCALRT_SHUTDOWN_GRACE="1h")
    stream = Stream(server, "ollama", -1)
    stream.start()
    assert stream.first.wait(LIVENESS)
    server.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + LIVENESS
    while "may finish within 3600s" not in server.log_path.read_text():
        assert time.monotonic() < deadline, "the drain never began"
        time.sleep(0.05)
    assert server.proc.poll() is None  # draining: the stream runs on
    server.proc.send_signal(signal.SIGINT)
    assert stop_code(server) in (-signal.SIGTERM, -signal.SIGINT, 130)  # within the liveness bound, not 1h
    stream.join(LIVENESS)
    assert "stopping now (SIGINT again)" in server.log_path.read_text()


def test_a_pull_in_flight_stops_where_it_resumes(tmp_path: Path) -> None:
    with Registry() as registry:
        _, layer = registry.add_model("library/slow", "1", os.urandom(4_000_000))
        registry.delay = 0.05  # 64 KiB per 50 ms: the pull outlives the grace
        name = f"{registry.address}/library/slow:1"
        server = start_server(tmp_path, LOCALRT_SHUTDOWN_GRACE="1s")
        store = Store(tmp_path / "models")
        partial = store.partial_path(layer["digest"])
        lines: list[dict[str, Any]] = []
        signalled = False
        with httpx.stream(
            "POST", server.url + "/api/pull", json={"model": name, "insecure": True}, timeout=LIVENESS
        ) as r:
            for line in r.iter_lines():
                lines.append(json.loads(line))
                if lines[-1].get("completed", 0) > 200_000 and not signalled:
                    server.proc.send_signal(signal.SIGTERM)
                    signalled = True
        assert lines[-1] == {"error": "the server is shutting down (LOCALRT_SHUTDOWN_GRACE 1s is over)"}
        assert stop_code(server) in (0, -signal.SIGTERM)
        kept = partial.stat().st_size
        assert 0 < kept < 4_000_000
        assert not store.exists(parse_name(name))
        pull(name, store=store, insecure=True)
        gets = [r.header("Range") for r in registry.seen("GET") if r.path.endswith(layer["digest"])]
        assert gets[-1] == f"bytes={kept}-"
