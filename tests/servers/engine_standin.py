"""A stand-in for vLLM/SGLang in `serve-engine` tests: run as `standin -m <module> ARGS...` (as an
--engine-python), it records its arguments, answers /health with 503 a few times before 200 (so the
wait is exercised), serves a one-model /v1/models and a tiny /v1/chat/completions stream, and on
SIGTERM records that it was stopped and exits.

Where it writes: the file named by STANDIN_RECORD (JSON lines: {"argv": [...]}, {"stopped": true}).
"""

from __future__ import annotations

import json
import os
import signal
import sys
from http.server import BaseHTTPRequestHandler
from http.server import ThreadingHTTPServer
from typing import Any

RECORD = os.environ.get("STANDIN_RECORD", "standin.jsonl")
NOT_READY = 3  # /health answers 503 this many times first


def record(item: dict[str, Any]) -> None:
    with open(RECORD, "a", encoding="utf-8") as f:
        f.write(json.dumps(item) + "\n")


def flag(name: str) -> str | None:
    args = sys.argv[1:]
    return args[args.index(name) + 1] if name in args and args.index(name) + 1 < len(args) else None


class Handler(BaseHTTPRequestHandler):
    health_calls = 0

    def log_message(self, *args: Any) -> None:
        pass

    def _json(self, status: int, obj: Any) -> None:
        body = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        if self.path == "/health":
            Handler.health_calls += 1
            self._json(200 if Handler.health_calls > NOT_READY else 503, {})
        elif self.path == "/v1/models":
            self._json(
                200, {"object": "list", "data": [{"id": flag("--served-model-name"), "max_model_len": 2048}]}
            )
        else:
            self._json(404, {"error": "not found"})

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length") or 0))
        events = [
            {"choices": [{"index": 0, "delta": {"role": "assistant", "content": "stand"}}]},
            {"choices": [{"index": 0, "delta": {"content": "-in"}, "finish_reason": "stop"}]},
            {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 2}},
        ]
        body = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body.encode())


def main() -> None:
    record({"argv": sys.argv[1:]})
    if os.environ.get("STANDIN_EXIT"):  # an engine that fails before it is ready
        sys.exit(int(os.environ["STANDIN_EXIT"]))
    server = ThreadingHTTPServer((flag("--host") or "127.0.0.1", int(flag("--port") or 8000)), Handler)

    def on_term(signum: int, frame: object) -> None:
        record({"stopped": True})
        os._exit(0)

    signal.signal(signal.SIGTERM, on_term)
    server.serve_forever()


if __name__ == "__main__":
    main()
