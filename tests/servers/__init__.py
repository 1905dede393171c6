"""Real HTTP servers on 127.0.0.x for the pull tests: a registry, a blob CDN and a Hugging Face Hub.

Each runs a stdlib ThreadingHTTPServer in a daemon thread on an ephemeral port and records every
request it sees, so tests assert on what went over the wire (Range, Authorization, paths).
"""

from __future__ import annotations

import re
import socket
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any

CHUNK = 64 * 1024
_RANGE = re.compile(r"^bytes=(\d+)-(\d*)$")


@dataclass
class Seen:
    """One request as the server saw it."""

    method: str
    path: str
    headers: dict[str, str]

    def header(self, name: str) -> str | None:
        for key, value in self.headers.items():
            if key.lower() == name.lower():
                return value
        return None


class _HTTPServer(ThreadingHTTPServer):
    def handle_error(self, request: Any, client_address: Any) -> None:
        import sys

        if isinstance(sys.exc_info()[1], ConnectionError):
            return  # a client that hangs up mid-response: the pull tests drop connections on purpose
        super().handle_error(request, client_address)


class Server:
    """Owns a ThreadingHTTPServer; subclasses give the handler class and their fault switches."""

    handler: type[BaseHTTPRequestHandler]

    def __init__(self, host: str = "127.0.0.1") -> None:
        self.requests: list[Seen] = []
        self._lock = threading.Lock()
        self.httpd = _HTTPServer((host, 0), self.handler)
        self.httpd.daemon_threads = True
        self.httpd.app = self  # type: ignore[attr-defined]
        self.thread = threading.Thread(
            target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self.thread.start()

    @property
    def address(self) -> str:
        """`host:port`, the form that goes into a model name."""
        host, port = self.httpd.server_address[:2]
        return f"{host}:{port}"

    @property
    def url(self) -> str:
        return f"http://{self.address}"

    def record(self, handler: BaseHTTPRequestHandler) -> None:
        with self._lock:
            self.requests.append(Seen(handler.command, handler.path, dict(handler.headers.items())))

    def seen(self, method: str | None = None, contains: str = "") -> list[Seen]:
        with self._lock:
            return [r for r in self.requests if (method is None or r.method == method) and contains in r.path]

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Handler(BaseHTTPRequestHandler):
    """Shared plumbing: HTTP/1.1 keep-alive, quiet logs, JSON and ranged-body helpers."""

    protocol_version = "HTTP/1.1"

    @property
    def app(self) -> Any:
        return self.server.app  # type: ignore[attr-defined]

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def send_json(self, status: int, body: Any, headers: dict[str, str] | None = None) -> None:
        import json

        data = json.dumps(body).encode()
        self.send_bytes(status, data, {"Content-Type": "application/json", **(headers or {})})

    def send_bytes(self, status: int, data: bytes, headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def send_ranged(
        self,
        source: bytes | Path,
        headers: dict[str, str] | None = None,
        *,
        drop_after: int | None = None,
        delay: float = 0.0,
        honour_range: bool = True,
    ) -> None:
        """Serve `source` honouring `Range: bytes=N-[M]`; optionally cut the socket after `drop_after` bytes."""
        total = len(source) if isinstance(source, bytes) else source.stat().st_size
        start, end, status = 0, total - 1, 200
        m = _RANGE.match(self.headers.get("Range", "")) if honour_range else None
        if m:
            start = int(m.group(1))
            end = min(int(m.group(2)), total - 1) if m.group(2) else total - 1
            if start >= total:
                self.send_bytes(416, b"", {"Content-Range": f"bytes */{total}"})
                return
            status = 206
        self.send_response(status)
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("Content-Length", str(end - start + 1))
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{end}/{total}")
        self.end_headers()
        if self.command == "HEAD":
            return
        sent, pos = 0, start
        f = open(source, "rb") if isinstance(source, Path) else None
        try:
            while pos <= end:
                n = min(CHUNK, end + 1 - pos)
                if f is not None:
                    f.seek(pos)
                    block = f.read(n)
                else:
                    block = source[pos : pos + n]  # type: ignore[index]
                if drop_after is not None and sent + len(block) >= drop_after:
                    self.wfile.write(block[: drop_after - sent])
                    self.wfile.flush()
                    # an abrupt close mid-body: the client sees a short read, as on a dropped network
                    self.connection.shutdown(socket.SHUT_RDWR)
                    self.close_connection = True
                    return
                self.wfile.write(block)
                sent += len(block)
                pos += len(block)
                if delay:
                    self.wfile.flush()
                    time.sleep(delay)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True  # the client went away (a killed pull)
        finally:
            if f is not None:
                f.close()
