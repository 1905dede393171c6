"""Who sent a request, for what the prefix cache may tell them.

Requests share a model's KV cache, so one request may start from a prefix another evaluated; that
speed stays. What a reply *reports* as cached (`cached_tokens`, `cache_read_input_tokens`, a short
`prompt_eval_count`) would tell a client, token block by token block, what others have sent. So the
report is limited to the longest prefix the same tenant sent before: a tenant is a hash of the
request's API key (`Authorization` or `x-api-key`), or no key at all.

The runtime keeps a bounded record of each tenant's prompt prefixes as chained hashes of token
blocks and of its prompts' and replies' exact ends, per model; the oldest entries go first.
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
from dataclasses import dataclass
from typing import Any

from localrt.backends.base import IMAGE_TOKEN

BLOCK_TOKENS = 16  # prefixes are remembered in whole blocks of this many tokens, and at exact ends
MAX_RECORDED_PREFIXES = 200_000  # all tenants together: about 20 MB of hashes
MAX_ENDS = 32  # a tenant's most recent prompt and reply lengths, whose exact ends are looked up
MAX_TENANTS = 4096
KEY_HEADERS = (b"authorization", b"x-api-key")

# The request's tenant, set where the request enters the server and read by the runtime
current_tenant: contextvars.ContextVar[str | None] = contextvars.ContextVar("localrt_tenant", default=None)


def tenant_of(headers: Sequence[tuple[bytes, bytes]]) -> str | None:
    """A hash of the request's API key (never the key itself), or None for a request without one."""
    for name, value in headers:
        key = value.strip()
        if name.lower() == b"authorization" and key[:7].lower() == b"bearer ":
            key = key[7:].strip()  # one key is one tenant, whether sent as OpenAI's or Anthropic's header
        if name.lower() in KEY_HEADERS and key:
            return hashlib.sha256(key).hexdigest()[:32]
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


@dataclass
class Prompt:
    """One request's prompt as the engine caches it."""

    model: str
    tokens: Sequence[int]  # IMAGE_TOKEN where each image goes
    images: Sequence[str]  # each image's digest, in order: an image is part of what the prefix is
    cells: int  # its length in the engine's cache (an image takes many cells for its one token)


class _Chain:
    """Chained hashes of a token sequence's prefixes: whole blocks, and any length on request."""

    def __init__(self, prompt: Prompt, tokens: Sequence[int]) -> None:
        self.tokens = list(tokens)
        self.images = list(prompt.images)
        self.first_image = self.tokens.index(IMAGE_TOKEN) if self.images else len(self.tokens)
        self.blocks: list[bytes] = []
        self._seed = hashlib.blake2b(prompt.model.encode(), digest_size=16).digest()
        self._image_index = [0] * (len(tokens) + 1)  # images before each position
        if self.images:
            for i, t in enumerate(tokens):
                self._image_index[i + 1] = self._image_index[i] + (t == IMAGE_TOKEN)
        previous = self._seed
        for start in range(0, len(tokens) - BLOCK_TOKENS + 1, BLOCK_TOKENS):
            previous = self._step(previous, start, start + BLOCK_TOKENS)
            self.blocks.append(previous)

    def _step(self, previous: bytes, start: int, end: int) -> bytes:
        data = array.array("q", self.tokens[start:end]).tobytes()
        pictures = self.images[self._image_index[start] : self._image_index[end]]
        return hashlib.blake2b(previous + data + "".join(pictures).encode(), digest_size=16).digest()

    def prefix(self, end: int) -> bytes:
        """The hash of the first `end` tokens (a whole-block prefix hashes as its block does)."""
        full = end // BLOCK_TOKENS
        head = self.blocks[full - 1] if full else self._seed
        return head if end == full * BLOCK_TOKENS else self._step(head, full * BLOCK_TOKENS, end)


class PrefixRecord:
    """The prompt prefixes each tenant has sent, per model, with their length in cache cells; bounded
    (the least recently used go first). Before a prompt's first image a token is a cell, so every
    whole block is kept; past it only the exact ends of the tenant's own prompts and replies, whose
    length in cells the engine reported."""

    def __init__(self, max_entries: int = MAX_RECORDED_PREFIXES) -> None:
        self.max_entries = max_entries
        self._seen: collections.OrderedDict[tuple[str | None, bytes], int] = collections.OrderedDict()
        self._ends: collections.OrderedDict[str | None, collections.deque[int]] = collections.OrderedDict()
        self._lock = threading.Lock()

    def visible_cached(self, tenant: str | None, prompt: Prompt, cached: int, reply: Sequence[int]) -> int:
        """How much of the engine's `cached` count (cells) this tenant may be told: no more than the
        longest prefix of the prompt it sent itself before. Records this prompt and its reply."""
        chain = _Chain(prompt, [*prompt.tokens, *reply])
        with self._lock:
            own = self._own(tenant, chain, len(prompt.tokens))
            self._record(
                tenant,
                chain,
                {len(prompt.tokens): prompt.cells, len(chain.tokens): prompt.cells + len(reply)},
            )
        return min(cached, own)

    def _own(self, tenant: str | None, chain: _Chain, length: int) -> int:
        own = 0
        for k, h in enumerate(chain.blocks):
            cells = self._seen.get((tenant, h))
            if (k + 1) * BLOCK_TOKENS > length or cells is None:
                break
            own = cells
        for end in self._ends.get(tenant, ()):
            if end <= length:
                own = max(own, self._seen.get((tenant, chain.prefix(end)), 0))
        return own

    def _record(self, tenant: str | None, chain: _Chain, ends: dict[int, int]) -> None:
        entries = [
            (h, (k + 1) * BLOCK_TOKENS)
            for k, h in enumerate(chain.blocks)
            if (k + 1) * BLOCK_TOKENS <= chain.first_image
        ]
        entries += [(chain.prefix(end), cells) for end, cells in ends.items() if end]
        for h, cells in entries:
            key = (tenant, h)
            self._seen[key] = cells
            self._seen.move_to_end(key)
        while len(self._seen) > self.max_entries:
            self._seen.popitem(last=False)
        recent = self._ends.setdefault(tenant, collections.deque(maxlen=MAX_ENDS))
        self._ends.move_to_end(tenant)
        for end in ends:
            if end and end not in recent:
                recent.append(end)
        while len(self._ends) > MAX_TENANTS:
            self._ends.popitem(last=False)
