"""Secure-by-default request gate (SPEC 7), as one pure ASGI middleware so streams pass untouched.

In order: body size cap, Host check against DNS rebinding (only when bound to loopback), Origin
allow-list on every method (a foreign page's "simple" POST carries an Origin and is refused), and
the optional API key compared in constant time.
"""

from __future__ import annotations

import fnmatch
import hmac
import ipaddress
import json
import socket
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from starlette.exceptions import HTTPException

from localrt import config

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

DEFAULT_ORIGINS = (
    "http://localhost",
    "https://localhost",
    "http://localhost:*",
    "https://localhost:*",
    "http://127.0.0.1",
    "https://127.0.0.1",
    "http://127.0.0.1:*",
    "https://127.0.0.1:*",
    "http://[::1]",
    "https://[::1]",
    "http://[::1]:*",
    "https://[::1]:*",
    "http://0.0.0.0",
    "https://0.0.0.0",
    "http://0.0.0.0:*",
    "https://0.0.0.0:*",
    "app://*",
    "file://*",
    "tauri://*",
    "vscode-webview://*",
    "vscode-file://*",
)
ALLOW_HEADERS = (
    "authorization, content-type, user-agent, accept, x-requested-with, openai-beta, "
    "x-stainless-arch, x-stainless-lang, x-stainless-os, x-stainless-package-version, "
    "x-stainless-runtime, x-stainless-runtime-version, x-stainless-async, x-stainless-retry-count, "
    "x-stainless-timeout, x-stainless-helper-method, x-stainless-raw-response"
)
OPEN_PATHS = ("/", "/health")  # liveness answers without the API key, as `curl localhost:11434` expects
DEFAULT_MAX_BODY = 64 << 20
UNCAPPED_PREFIXES = ("/api/blobs/",)  # blob uploads stream to disk and are verified by digest


def allowed_origins() -> list[str]:
    return [*DEFAULT_ORIGINS, *config.extra_origins()]


def origin_allowed(origin: str, host_header: str, patterns: list[str]) -> bool:
    if origin in (f"http://{host_header}", f"https://{host_header}"):
        return True  # same origin
    return any(fnmatch.fnmatchcase(origin.lower(), p.lower()) for p in patterns)


def is_loopback_bind(bind_host: str) -> bool:
    if bind_host in ("localhost", ""):
        return True
    try:
        return ipaddress.ip_address(bind_host.strip("[]")).is_loopback
    except ValueError:
        return False


def host_allowed(host_header: str) -> bool:
    """Ollama's rule: loopback/private/unspecified IPs, localhost, this machine, *.localhost|.local|.internal."""
    host = host_header.strip().lower()
    if host.startswith("["):
        host = host[1:].split("]", 1)[0]
    elif host.count(":") == 1:
        host = host.rsplit(":", 1)[0]
    if host in ("", "localhost") or host.endswith((".localhost", ".local", ".internal")):
        return True
    try:
        ip = ipaddress.ip_address(host)
        return ip.is_loopback or ip.is_private or ip.is_unspecified or ip.is_link_local
    except ValueError:
        return host == socket.gethostname().lower()


class SecurityMiddleware:
    def __init__(
        self, app: ASGIApp, *, bind_host: str, api_key: str | None = None, max_body: int = DEFAULT_MAX_BODY
    ) -> None:
        self.app = app
        self.check_host = is_loopback_bind(bind_host)
        self.api_key = api_key
        self.max_body = max_body
        self.origins = allowed_origins()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        path: str = scope.get("path", "")
        openai_style = path.startswith("/v1/")
        host = headers.get("host", "")

        if self.check_host and not host_allowed(host):
            await reply(send, 403, "forbidden: Host header is not allowed", openai_style)
            return
        origin = headers.get("origin")
        cors_headers: list[tuple[bytes, bytes]] = []
        if origin is not None:
            if not origin_allowed(origin, host, self.origins):
                await reply(send, 403, f"forbidden: origin {origin!r} is not allowed", openai_style)
                return
            cors_headers = [
                (b"access-control-allow-origin", origin.encode("latin-1")),
                (b"vary", b"Origin"),
                (b"access-control-allow-credentials", b"true"),
            ]
        if scope["method"] == "OPTIONS":
            await send(
                {
                    "type": "http.response.start",
                    "status": 204,
                    "headers": [
                        *cors_headers,
                        (b"access-control-allow-methods", b"GET, POST, PUT, PATCH, DELETE, HEAD, OPTIONS"),
                        (b"access-control-allow-headers", ALLOW_HEADERS.encode()),
                        (b"access-control-max-age", b"600"),
                    ],
                }
            )
            await send({"type": "http.response.body", "body": b""})
            return
        if self.api_key and path not in OPEN_PATHS:
            given = headers.get("authorization", "")
            expected = f"Bearer {self.api_key}"
            if not hmac.compare_digest(given.encode(), expected.encode()):
                await reply(
                    send,
                    401,
                    "unauthorized: a valid API key is required",
                    openai_style,
                    extra=[(b"www-authenticate", b"Bearer")],
                )
                return

        capped = not path.startswith(UNCAPPED_PREFIXES)
        declared = headers.get("content-length")
        if capped and declared and declared.isdigit() and int(declared) > self.max_body:
            await reply(send, 413, f"request body too large (limit {self.max_body} bytes)", openai_style)
            return

        received = 0

        async def capped_receive() -> Message:
            nonlocal received
            message = await receive()
            if capped and message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body:
                    raise BodyTooLarge()
            return message

        async def send_with_cors(message: Message) -> None:
            if message["type"] == "http.response.start" and cors_headers:
                message["headers"] = [*message.get("headers", []), *cors_headers]
            await send(message)

        await self.app(scope, capped_receive if capped else receive, send_with_cors)


class BodyTooLarge(HTTPException):
    """Raised from `receive` while a handler reads a chunked body past the cap; the app answers 413."""

    def __init__(self) -> None:
        super().__init__(413, "request body too large")


async def reply(
    send: Send, status: int, message: str, openai_style: bool, extra: list[tuple[bytes, bytes]] | None = None
) -> None:
    body = json.dumps(error_body(message, status, openai_style)).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                *(extra or []),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


def error_body(message: str, status: int, openai_style: bool) -> dict[str, Any]:
    """Ollama: {"error": "..."}; OpenAI: {"error": {"message", "type", "param", "code"}}."""
    if not openai_style:
        return {"error": message}
    kind = {
        400: "invalid_request_error",
        401: "authentication_error",
        403: "permission_error",
        404: "not_found_error",
        413: "invalid_request_error",
        503: "server_busy",
    }.get(status, "api_error")
    return {"error": {"message": message, "type": kind, "param": None, "code": None}}
