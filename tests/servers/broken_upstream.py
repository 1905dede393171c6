"""Real misbehaving upstreams on 127.0.0.1 for the remote backend's error paths: a server whose
/health and /v1/models are fine but whose completions answer 500s, garbage, or a redirect, and a
server that records the headers it was sent (to prove a key never follows a redirect)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler
from http.server import ThreadingHTTPServer
from typing import Any


class _Handler(BaseHTTPRequestHandler):
    server: BrokenUpstream  # type: ignore[assignment]

    def log_message(self, *args: Any) -> None:  # quiet test output
        pass

    def _send(self, status: int, body: bytes, ctype: str, extra: dict[str, str] | None = None) -> None:
        self.send_response(status)
        self.send_header("content-type", ctype)
        self.send_header("content-length", str(len(body)))
        for k, v in (extra or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        self.server.seen.append((self.command, self.path, dict(self.headers)))
        if self.path == "/health":
            self._send(200, b'{"status":"ok"}', "application/json")
        elif self.path == "/v1/models":
            models = {"object": "list", "data": [{"id": "broken", "object": "model"}]}
            self._send(200, json.dumps(models).encode(), "application/json")
        else:
            self._send(404, b'{"error":"not found"}', "application/json")

    def do_POST(self) -> None:
        length = int(self.headers.get("content-length") or 0)
        self.rfile.read(length)
        self.server.seen.append((self.command, self.path, dict(self.headers)))
        mode = self.server.mode
        if mode == "500":
            key = self.headers.get("authorization", "")
            # an upstream that echoes the request's credentials in its error: they must not reach our client
            self._send(
                500, json.dumps({"error": f"engine crashed (request had {key})"}).encode(), "application/json"
            )
        elif mode == "garbage":
            self._send(200, b"<html>this is not an event stream</html>", "text/html")
        elif mode == "redirect":
            self._send(307, b"", "text/plain", {"location": self.server.redirect_to + self.path})
        else:
            self._send(404, b"{}", "application/json")


class BrokenUpstream(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, mode: str, redirect_to: str = "") -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.mode = mode
        self.redirect_to = redirect_to
        self.seen: list[tuple[str, str, dict[str, str]]] = []
        self.url = f"http://127.0.0.1:{self.server_address[1]}"
        self._thread = threading.Thread(target=self.serve_forever, daemon=True)

    def __enter__(self) -> BrokenUpstream:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
        self.server_close()
