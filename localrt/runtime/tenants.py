"""Who sent a request, for what the prefix cache may tell them.

Requests share a model's KV cache, so one request may start from a prefix another evaluated; that
speed stays. What a reply *reports* as cached (`cached_tokens`, `cache_read_input_tokens`, a short
`prompt_eval_count`) would tell a client, token block by token block, what others have sent. So the
report is limited to the longest prefix the same tenant sent before: a tenant is a hash of the
request's API key (`Authorization` or `x-api-key`), or no key at all.

The runtime keeps a bounded record of each tenant's prompt prefixes as chained hashes of token
blocks, per model; the oldest entries go first.
"""

from __future__ import annotations

import array
import collections
import contextvars
import hashlib
import threading
from collections.abc import Awaitable
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any

BLOCK_TOKENS = 16  # a prefix is remembered, and reported, in whole blocks of this many tokens
MAX_RECORDED_BLOCKS = 200_000  # all tenants together: about 20 MB of hashes
KEY_HEADERS = (b"authorization", b"x-api-key")

# The request's tenant, set where the request enters the server and read by the runtime
current_tenant: contextvars.ContextVar[str | None] = contextvars.ContextVar("localrt_tenant", default=None)


def tenant_of(headers: Sequence[tuple[bytes, bytes]]) -> str | None:
    """A hash of the request's API key (never the key itself), or None for a request without one."""
    for name, value in headers:
        if name.lower() in KEY_HEADERS and value:
            return hashlib.sha256(value.strip()).hexdigest()[:32]
    return None


class TenantScope:
    """ASGI middleware: every request runs with its tenant in `current_tenant`."""

    def __init__(self, app: Callable[..., Awaitable[None]]) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope.get("type") != "http":
            await self.app(scope, receive, send)
            return
        token = current_tenant.set(tenant_of(scope.get("headers") or ()))
        try:
            await self.app(scope, receive, send)
        finally:
            current_tenant.reset(token)


def _block_hashes(model: str, tokens: Sequence[int]) -> list[bytes]:
    """Chained hashes of the whole blocks of `tokens`: the i-th names the prefix of (i+1) blocks."""
    out: list[bytes] = []
    previous = hashlib.blake2b(model.encode(), digest_size=16).digest()
    for start in range(0, len(tokens) - BLOCK_TOKENS + 1, BLOCK_TOKENS):
        block = array.array("q", tokens[start : start + BLOCK_TOKENS]).tobytes()
        previous = hashlib.blake2b(previous + block, digest_size=16).digest()
        out.append(previous)
    return out


class PrefixRecord:
    """The prompt prefixes each tenant has sent, per model, bounded (least recently used goes first)."""

    def __init__(self, max_blocks: int = MAX_RECORDED_BLOCKS) -> None:
        self.max_blocks = max_blocks
        self._seen: collections.OrderedDict[tuple[str | None, bytes], None] = collections.OrderedDict()
        self._lock = threading.Lock()

    def visible_cached(self, tenant: str | None, model: str, tokens: Sequence[int], cached: int) -> int:
        """How much of the engine's `cached` count this tenant may be told: no more than the longest
        prefix of `tokens` it sent itself before. Records this prompt's prefixes for its next request."""
        hashes = _block_hashes(model, tokens)
        with self._lock:
            own = 0
            for h in hashes:
                if (tenant, h) not in self._seen:
                    break
                own += 1
            for h in hashes:
                key = (tenant, h)
                self._seen[key] = None
                self._seen.move_to_end(key)
            while len(self._seen) > self.max_blocks:
                self._seen.popitem(last=False)
        return min(cached, own * BLOCK_TOKENS)
