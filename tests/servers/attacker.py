"""An attacker's endpoint on 127.0.0.1: it answers as an OpenAI-compatible upstream (health, model
list, chat and text completions, embeddings) and records every request whole (request line, headers,
body), so a test can assert that a secret never reached it. It also answers as an HTTP proxy (a
request line with an absolute URL): set as the server's HTTP_PROXY, it sees what a plain-http request
to any other host would show the network in between."""

from __future__ import annotations

import json
import threading
from typing import Any

from . import Handler
from . import Server

MODEL = "bait"


class AttackerHandler(Handler):
    def _body(self) -> bytes:
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length > 0 else b""

    def _remember(self, body: bytes) -> None:
        app: Attacker = self.app
        head = f"{self.command} {self.path}\n" + "".join(f"{k}: {v}\n" for k, v in self.headers.items())
        with app.lock:
            app.raw.append(head.encode("latin-1", "replace") + b"\n" + body)

    def do_GET(self) -> None:
        self._remember(b"")
        path = self.path.split("?", 1)[0]
        if path.endswith("/health"):
            self.send_json(200, {"status": "ok"})
        elif path.endswith("/models"):
            self.send_json(200, {"object": "list", "data": [{"id": MODEL, "object": "model"}]})
        else:
            self.send_json(404, {"error": "not found"})

    def do_POST(self) -> None:
        body = self._body()
        self._remember(body)
        path = self.path.split("?", 1)[0]
        if path.endswith("/chat/completions"):
            self._stream({"delta": {"role": "assistant", "content": "hi"}}, chat=True)
        elif path.endswith("/completions"):
            self._stream({"text": "hi"}, chat=False)
        elif path.endswith("/embeddings"):
            try:
                count = len(json.loads(body).get("input") or [])
            except (ValueError, AttributeError, TypeError):
                count = 1
            data = [{"index": i, "embedding": [0.5, 0.5], "object": "embedding"} for i in range(count)]
            self.send_json(200, {"data": data, "usage": {"prompt_tokens": 1}})
        elif path.endswith("tokenize"):
            self.send_json(200, {"tokens": [1, 2], "content": "hi", "prompt": "hi", "text": "hi"})
        else:
            self.send_json(404, {"error": "not found"})

    def _stream(self, piece: dict[str, Any], *, chat: bool) -> None:
        kind = "chat.completion.chunk" if chat else "text_completion"
        first = {"id": "x", "object": kind, "model": MODEL, "choices": [{"index": 0, **piece}]}
        end_piece = {"delta": {}} if chat else {"text": ""}
        last = {
            "id": "x",
            "object": kind,
            "model": MODEL,
            "choices": [{"index": 0, **end_piece, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
        }
        events = b"".join(f"data: {json.dumps(e)}\n\n".encode() for e in (first, last)) + b"data: [DONE]\n\n"
        self.send_bytes(200, events, {"Content-Type": "text/event-stream"})


class Attacker(Server):
    handler = AttackerHandler

    def __init__(self, host: str = "127.0.0.1") -> None:
        self.lock = threading.Lock()
        self.raw: list[bytes] = []
        super().__init__(host)

    def received(self) -> list[bytes]:
        """Every request so far, each as its request line, headers and body."""
        with self.lock:
            return list(self.raw)

    def saw(self, secret: str) -> bool:
        return any(secret.encode() in r for r in self.received())

    def paths(self) -> list[str]:
        return [r.split(b"\n", 1)[0].decode("latin-1") for r in self.received()]
