"""The sliding-window layers' blocks: each sequence keeps only the blocks its window can still see.

Sliding layers (Gemma 3's five of six) have their own block pool and KV tensors
(`KVCache.windowed`). A sequence's `window_table` runs parallel to its `block_table`, block i holding
positions i*bs .. i*bs + bs - 1 of the sliding layers, but an entry is -1 once every later query
is past it: a query at p sees keys p - window + 1 .. p, so when the next query is at p the blocks
before (p - window + 1) // bs go back to the pool. Between steps a sequence therefore holds at most
ceil(window / bs) + 1 sliding blocks however long it grows; during a step, also the blocks of the
positions it feeds.

Full blocks are cached in a prefix cache of their own under the same chain keys as the global
layers' blocks, so a freed block stays findable until the pool reuses it. A prefix hit of c tokens
needs the global blocks of all c tokens and the sliding blocks of the last `window` of them; when
some of those were reused, the hit shrinks to the longest prefix whose window is still whole.
"""

from __future__ import annotations

from typing import Protocol

from .kv_cache import BlockPool
from .kv_cache import KVCache
from .kv_cache import blocks_needed
from .prefix_cache import ROOT_KEY
from .prefix_cache import PrefixCache
from .prefix_cache import PrefixMatch


class Sequence(Protocol):
    """What this module reads and writes of the scheduler's `Sequence` (a protocol: the scheduler
    imports this module)."""

    block_keys: list[bytes]
    window_table: list[int]


class WindowBlocks:
    def __init__(self, pool: BlockPool, cache: KVCache, window: int, prefix_caching: bool) -> None:
        self.pool = pool
        self.cache = cache
        self.window = window
        self.prefix = PrefixCache(pool, enabled=prefix_caching)

    def first_block(self, pos: int) -> int:
        """The first block a query at `pos` (or any later one) sees."""
        return max(0, pos - self.window + 1) // self.pool.block_size

    @staticmethod
    def held(seq: Sequence) -> list[int]:
        return [b for b in seq.window_table if b >= 0]

    def trim(self, seq: Sequence, pos: int) -> None:
        """Give back the blocks no query from `pos` on can see."""
        table = seq.window_table
        for i in range(min(self.first_block(pos), len(table))):
            if table[i] >= 0:
                self.pool.release(table[i])
                table[i] = -1

    def shortfall(self, seq: Sequence, n_blocks: int, pos: int) -> int:
        """Blocks to allocate so the table reaches `n_blocks` for a step whose first query is at `pos`."""
        low = self.first_block(pos)
        return sum(1 for i in range(len(seq.window_table), n_blocks) if i >= low)

    def extend(self, seq: Sequence, n_blocks: int, pos: int) -> None:
        low = self.first_block(pos)
        for i in range(len(seq.window_table), n_blocks):
            seq.window_table.append(self.pool.allocate() if i >= low else -1)

    def truncate(self, seq: Sequence, keep: int) -> None:
        """Drop entries past `keep` (blocks reserved for guesses that were rejected)."""
        self.pool.release_all(b for b in seq.window_table[keep:] if b >= 0)
        del seq.window_table[keep:]

    def cache_full(self, seq: Sequence, i: int, parent: bytes, tokens: list[int]) -> None:
        if seq.window_table[i] >= 0:
            self.prefix.insert_full(seq.window_table[i], parent, tokens)

    def release(self, seq: Sequence, tail: list[int]) -> None:
        """Free the sequence's blocks, keeping its computed partial last block findable (as the global
        layers' one)."""
        full = len(seq.block_keys)
        if tail and full < len(seq.window_table) and seq.window_table[full] >= 0:
            parent = seq.block_keys[-1] if seq.block_keys else ROOT_KEY
            self.prefix.insert_partial(seq.window_table[full], parent, tail)
        self.pool.release_all(self.held(seq))
        seq.window_table = []

    # ---- prefix hits ----------------------------------------------------------------------------
    def match(
        self, found: PrefixMatch, covered: int, tokens: list[int]
    ) -> tuple[PrefixMatch, int, list[int], int | None]:
        """Shrink the global layers' hit `found` (covering `covered` tokens) to what the sliding layers
        also hold: (match, tokens covered, window table so far, a partial block to copy or None)."""
        bs = self.pool.block_size
        m = len(found.blocks)
        if covered > m * bs:  # a partial block: usable if the window's full blocks and a partial one exist
            parent = found.keys[-1] if m else ROOT_KEY
            block, n = self.prefix.find_partial(parent, tokens[m * bs : covered])
            table = self._full_blocks(found.keys, m, m * bs + n, tokens) if block is not None else None
            if table is not None:
                return found, m * bs + n, table, block
        found.partial_block, found.partial_tokens = None, 0
        for kept in range(m, -1, -1):
            table = self._full_blocks(found.keys, kept, kept * bs, tokens)
            if table is not None:
                found.blocks, found.keys = found.blocks[:kept], found.keys[:kept]
                return found, kept * bs, table, None
        raise AssertionError("an empty prefix needs no blocks")  # kept = 0 always matches

    def _full_blocks(self, keys: list[bytes], m: int, covered: int, tokens: list[int]) -> list[int] | None:
        """The window table of the first m full blocks for a first query at `covered`, or None when a
        block the query sees is no longer cached."""
        bs = self.pool.block_size
        low = min(self.first_block(covered), m)
        table = [-1] * low
        for i in range(low, m):
            parent = keys[i - 1] if i else ROOT_KEY
            block = self.prefix.find_full(parent, tokens[i * bs : (i + 1) * bs])
            if block is None:
                return None
            table.append(block)
        return table

    def attach(self, seq: Sequence, table: list[int], partial: int | None, n_blocks: int, pos: int) -> None:
        """Share the matched blocks, copy the partial one, allocate the rest up to `n_blocks`."""
        for block in table:
            if block >= 0:
                self.pool.retain(block)
        seq.window_table = list(table)
        if partial is not None:
            self.pool.retain(partial)  # the allocation below must not evict the block being copied
            dst = self.pool.allocate()
            self.cache.copy_block(partial, dst, windowed=True)
            self.pool.release(partial)
            seq.window_table.append(dst)
        self.extend(seq, n_blocks, pos)

    def admission_cost(self, table: list[int], partial: int | None, n_blocks: int, pos: int) -> int:
        """Blocks an admission takes from what is free: shared evictable ones, the copy, fresh ones."""
        taken = sum(1 for b in table if b >= 0 and self.pool.ref_count[b] == 0)
        if partial is not None:
            taken += 1 + (self.pool.ref_count[partial] == 0)
        start = len(table) + (partial is not None)
        low = self.first_block(pos)
        return taken + sum(1 for i in range(start, n_blocks) if i >= low)


def window_pool_blocks(window: int, max_seqs: int, max_batch_tokens: int, full_blocks: int, bs: int) -> int:
    """Sliding blocks for max_seqs sequences: each one's window plus a block, and one step's fed tokens."""
    per_seq = blocks_needed(window, bs) + 2
    return max(1, min(full_blocks, max_seqs * per_seq + blocks_needed(max_batch_tokens, bs) + 1))
