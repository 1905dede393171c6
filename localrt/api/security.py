"""Secure-by-default request gate (docs/security.md), as one pure ASGI middleware so streams pass untouched.

In order: Host check against DNS rebinding (however the server is bound: a page on a name the attacker
controls can point that name at any address of this machine), Origin allow-list on every method (a
foreign page's "simple" POST carries an Origin and is refused), the optional API key compared in
constant time, and the body size cap. docs/security.md gives the threat model.
"""

from __future__ import annotations

import fnmatch
import hmac
import ipaddress
import json
import socket
from collections.abc import Awaitable
from collections.abc import Callable
from collections.abc import MutableMapping
from typing import Any

from starlette.exceptions import HTTPException

from localrt import config
from localrt.api.web import UI_PREFIX

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
    "x-stainless-timeout, x-stainless-helper-method, x-stainless-raw-response, "
    "x-api-key, anthropic-version, anthropic-beta, anthropic-dangerous-direct-browser-access"
)
OPEN_PATHS = ("/", "/health")  # liveness answers without the API key, as `curl localhost:11434` expects
# the chat page's own files (localrt/web/, public): a browser loads them before it can ask for the key
OPEN_PREFIXES = (UI_PREFIX,)
DEFAULT_MAX_BODY = int(config.default_of("LOCALRT_MAX_BODY"))
UNCAPPED_PREFIXES = ("/api/blobs/",)  # blob uploads stream to disk and are verified by digest


def allowed_origins() -> list[str]:
    return [*DEFAULT_ORIGINS, *config.extra_origins()]


def origin_allowed(origin: str, patterns: list[str]) -> bool:
    """An Origin matches the allow-list, nothing else: "same origin" would let a rebound name through,
    since the attacker's page and its Host header then carry the same name."""
    return any(fnmatch.fnmatchcase(origin.lower(), p.lower()) for p in patterns)


def host_name(host_header: str) -> str:
    """The name or address of a Host header: lowercased, without its port, brackets or trailing dot."""
    host = host_header.strip().lower()
    if host.startswith("["):
        host = host[1:].split("]", 1)[0]
    elif host.count(":") == 1:
        host = host.rsplit(":", 1)[0]
    return _canonical(host.rstrip("."))


def _canonical(name: str) -> str:
    """An address in one spelling (`::ffff:7f00:1` and `::FFFF:127.0.0.1` alike), a name as it is."""
    try:
        return str(ipaddress.ip_address(name.split("%", 1)[0]))
    except ValueError:
        return name


def known_hosts(bind_host: str) -> frozenset[str]:
    """Every Host this server answers to beside loopback: the machine's names and the addresses they
    resolve to, the address it is bound to, and LOCALRT_ALLOWED_HOSTS (names; any port)."""
    names = {socket.gethostname(), socket.getfqdn()}
    addresses = set()
    for name in names:
        try:
            addresses |= {str(info[4][0]) for info in socket.getaddrinfo(name, None)}
        except OSError:
            continue  # a hostname DNS does not know: the name itself still counts
    mdns = {f"{n}.local" for n in names if n and "." not in n and n != "localhost"}  # Bonjour, Avahi
    found = {*names, *mdns, *addresses, bind_host, *config.allowed_hosts()}
    return frozenset(host_name(n) for n in found if n)


def host_allowed(host_header: str, known: frozenset[str]) -> bool:
    """Loopback names and addresses always; otherwise only `known` (see known_hosts)."""
    host = host_name(host_header)
    if host in ("", "localhost") or host.endswith(".localhost"):
        return True  # no Host at all is a client speaking HTTP/1.0, never a browser
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return host in known
    # 0.0.0.0 and :: reach this machine itself; a mapped ::ffff:127.0.0.1 is loopback too
    mapped = ip.ipv4_mapped if isinstance(ip, ipaddress.IPv6Address) else None
    return ip.is_loopback or ip.is_unspecified or bool(mapped and mapped.is_loopback) or host in known


class SecurityMiddleware:
    def __init__(
        self, app: ASGIApp, *, bind_host: str, api_key: str | None = None, max_body: int = DEFAULT_MAX_BODY
    ) -> None:
        self.app = app
        self.hosts = known_hosts(bind_host)
        self.api_key = api_key
        self.max_body = max_body
        self.origins = allowed_origins()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        path: str = scope.get("path", "")
        style = error_style(path)
        host = headers.get("host", "")
        if not host_allowed(host, self.hosts):
            await reply(
                send,
                403,
                "forbidden: Host header is not allowed (list the name in LOCALRT_ALLOWED_HOSTS)",
                style,
            )
            return
        origin = headers.get("origin")
        if origin is not None and not origin_allowed(origin, self.origins):
            await reply(send, 403, f"forbidden: origin {origin!r} is not allowed", style)
            return
        cors_headers = cors_for(origin)
        if scope["method"] == "OPTIONS":
            await preflight(send, cors_headers)
            return
        if self.api_key and not is_open(path) and not key_matches(headers, self.api_key):
            await reply(
                send,
                401,
                "unauthorized: a valid API key is required",
                style,
                extra=[(b"www-authenticate", b"Bearer")],
            )
            return
        capped = not path.startswith(UNCAPPED_PREFIXES)
        declared = headers.get("content-length")
        if capped and declared and declared.isdigit() and int(declared) > self.max_body:
            await reply(send, 413, f"request body too large (limit {self.max_body} bytes)", style)
            return
        await self.app(
            scope,
            self._capped(receive) if capped else receive,
            _with_headers(send, cors_headers),
        )

    def _capped(self, receive: Receive) -> Receive:
        """`receive` that counts body bytes and stops a chunked body past the cap."""
        received = 0

        async def capped_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body:
                    raise BodyTooLarge()
            return message

        return capped_receive


def is_open(path: str) -> bool:
    return path in OPEN_PATHS or path.startswith(OPEN_PREFIXES)


def key_matches(headers: dict[str, str], api_key: str) -> bool:
    """`Authorization: Bearer <key>` (OpenAI, Ollama) or `x-api-key: <key>` (Anthropic), in constant time."""
    bearer = hmac.compare_digest(headers.get("authorization", "").encode(), f"Bearer {api_key}".encode())
    x_api_key = hmac.compare_digest(headers.get("x-api-key", "").encode(), api_key.encode())
    return bearer or x_api_key


def cors_for(origin: str | None) -> list[tuple[bytes, bytes]]:
    if origin is None:
        return []
    return [
        (b"access-control-allow-origin", origin.encode("latin-1")),
        (b"vary", b"Origin"),
        (b"access-control-allow-credentials", b"true"),
    ]


async def preflight(send: Send, cors_headers: list[tuple[bytes, bytes]]) -> None:
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


def _with_headers(send: Send, extra: list[tuple[bytes, bytes]]) -> Send:
    if not extra:
        return send

    async def send_with_headers(message: Message) -> None:
        if message["type"] == "http.response.start":
            message["headers"] = [*message.get("headers", []), *extra]
        await send(message)

    return send_with_headers


class BodyTooLarge(HTTPException):
    """Raised from `receive` while a handler reads a chunked body past the cap; the app answers 413."""

    def __init__(self) -> None:
        super().__init__(413, "request body too large")


async def reply(
    send: Send, status: int, message: str, style: str, extra: list[tuple[bytes, bytes]] | None = None
) -> None:
    body = json.dumps(error_body(message, status, style)).encode()
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


def error_style(path: str) -> str:
    """Which API's error shape a path answers with: "anthropic", "openai" or "ollama"."""
    if path == "/v1/messages" or path.startswith("/v1/messages/"):
        return "anthropic"
    return "openai" if path.startswith("/v1/") else "ollama"


OPENAI_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "invalid_request_error",
    503: "server_busy",
}
# Anthropic's error.type per status (its SDK picks the exception class from the status).
ANTHROPIC_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def error_body(message: str, status: int, style: str | bool) -> dict[str, Any]:
    """Ollama: {"error": "..."}; OpenAI: {"error": {"message", "type", "param", "code"}};
    Anthropic: {"type": "error", "error": {"type", "message"}}. A bool style means OpenAI (True) or Ollama."""
    if isinstance(style, bool):
        style = "openai" if style else "ollama"
    if style == "anthropic":
        kind = ANTHROPIC_ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
        return {"type": "error", "error": {"type": kind, "message": message}}
    if style == "ollama":
        return {"error": message}
    kind = OPENAI_ERROR_TYPES.get(status, "api_error")
    return {"error": {"message": message, "type": kind, "param": None, "code": None}}
