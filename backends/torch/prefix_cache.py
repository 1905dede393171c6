"""Prefix caching: blocks of computed KV found again by the tokens they hold.

A full block's key is a chain hash SHA-256(parent key, its tokens), so one lookup per block walks a
prompt from the start and a key names the whole prefix up to that block. The hash is cryptographic
and a hit still compares the block's stored tokens and parent: a 64-bit `hash()` can be collided
offline (CPython's tuple hash is not salted), and a collision would hand one request another
request's KV (vLLM's CVE-2025-25183). Full blocks are shared read-only
through the pool's reference counts. The partly filled last block of a finished sequence is kept
too, under (parent key, its tokens): a later prompt that continues the same conversation copies it
(copy-on-write) and recomputes nothing it already had, token for token. Unreferenced cached blocks
sit in the pool's LRU list and are forgotten here when the pool evicts them.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from dataclasses import field

from localrt.backends.base import longest_prefix

from .kv_cache import BlockPool

ROOT_KEY = bytes(32)  # the parent of a prompt's first block


def chain_key(parent: bytes, tokens: Sequence[int]) -> bytes:
    """SHA-256 over the 32-byte parent key and the token ids as little-endian int64 (unambiguous)."""
    return hashlib.sha256(parent + struct.pack(f"<{len(tokens)}q", *tokens)).digest()


@dataclass
class PrefixMatch:
    blocks: list[int] = field(default_factory=list)  # full blocks to share, in order
    keys: list[bytes] = field(default_factory=list)  # their chain keys
    partial_block: int | None = None  # a cached block whose first `partial_tokens` tokens match
    partial_tokens: int = 0


@dataclass
class _Entry:
    parent: bytes
    tokens: tuple[int, ...]
    key: bytes | None  # chain key for full blocks, None for partial ones


@dataclass(eq=False)
class PrefixCache:
    pool: BlockPool
    enabled: bool = True
    _full: dict[bytes, int] = field(default_factory=dict, init=False)  # chain key -> block
    # parent key -> tokens -> block
    _children: dict[bytes, dict[tuple[int, ...], int]] = field(default_factory=dict, init=False)
    _entries: dict[int, _Entry] = field(default_factory=dict, init=False)  # block -> what it is cached as
    queried_tokens: int = field(default=0, init=False)
    hit_tokens: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        self.block_size = self.pool.block_size
        self.pool.on_evict = self._forget

    def match(self, tokens: Sequence[int], max_tokens: int) -> tuple[PrefixMatch, int]:
        """The longest cached prefix of tokens[:max_tokens]; returns (match, tokens covered)."""
        found = PrefixMatch()
        if not self.enabled:
            return found, 0
        bs, parent, pos = self.block_size, ROOT_KEY, 0
        while pos + bs <= max_tokens:
            block_tokens = tuple(tokens[pos : pos + bs])
            key = chain_key(parent, block_tokens)
            block = self._full.get(key)
            if block is None or not self._holds(block, parent, block_tokens):
                break
            found.blocks.append(block)
            found.keys.append(key)
            parent, pos = key, pos + bs
        # a cached block (full or partial) under the same parent that starts like the rest
        best, best_len = self.find_partial(parent, tokens[pos : min(pos + bs, max_tokens)])
        if best is not None:
            found.partial_block, found.partial_tokens = best, best_len
        covered = pos + best_len
        self.queried_tokens += len(tokens)
        self.hit_tokens += covered
        return found, covered

    def find_full(self, parent: bytes, tokens: Sequence[int]) -> int | None:
        """The cached full block holding exactly `tokens` after the prefix `parent` names, if any."""
        block_tokens = tuple(tokens)
        block = self._full.get(chain_key(parent, block_tokens)) if self.enabled else None
        return block if block is not None and self._holds(block, parent, block_tokens) else None

    def find_partial(self, parent: bytes, rest: Sequence[int]) -> tuple[int | None, int]:
        """The cached block (full or partial) under `parent` sharing the longest start with `rest`:
        (block, tokens shared), or (None, 0)."""
        children = self._children.get(parent, {})
        return longest_prefix(((block, tokens) for tokens, block in children.items()), rest, None)

    def _holds(self, block: int, parent: bytes, tokens: tuple[int, ...]) -> bool:
        """The block was cached for exactly these tokens after exactly this parent."""
        entry = self._entries.get(block)
        return entry is not None and entry.parent == parent and entry.tokens == tokens

    def insert_full(self, block: int, parent: bytes, tokens: Sequence[int]) -> bytes:
        """Register a block filled with computed KV; returns its chain key."""
        key = chain_key(parent, tokens)
        if not self.enabled or key in self._full or block in self._entries:
            return key  # the same prefix is cached in another block already: keep that one
        entry = _Entry(parent, tuple(tokens), key)
        self._full[key] = block
        self._children.setdefault(parent, {})[entry.tokens] = block
        self._entries[block] = entry
        self.pool.cached[block] = True
        return key

    def insert_partial(self, block: int, parent: bytes, tokens: Sequence[int]) -> None:
        """Keep the partly filled last block of a sequence that is leaving."""
        entry = _Entry(parent, tuple(tokens), None)
        siblings = self._children.setdefault(parent, {})
        if not self.enabled or not tokens or entry.tokens in siblings or block in self._entries:
            return
        siblings[entry.tokens] = block
        self._entries[block] = entry
        self.pool.cached[block] = True

    def _forget(self, block: int) -> None:
        entry = self._entries.pop(block, None)
        if entry is None:
            return
        if entry.key is not None:
            self._full.pop(entry.key, None)
        siblings = self._children.get(entry.parent)
        if siblings is not None:
            siblings.pop(entry.tokens, None)
            if not siblings:
                del self._children[entry.parent]

    def __len__(self) -> int:
        return len(self._entries)
