"""Iteration-level continuous batching: who runs in the next step, and with how many tokens.

There are no prefill and decode phases: every sequence has `tokens` and `num_computed` (tokens whose
KV is in the cache), and each step hands out a token budget so sequences catch up. Running sequences
go first (a decode costs one token, plus its draft tokens when speculating), then waiting ones are
admitted with what is left, so a long prompt is prefilled in chunks over several steps while the
others keep decoding. When blocks run out, the most recently admitted sequence is preempted: its
blocks are freed (full ones stay findable in the prefix cache) and it is recomputed later from its
tokens, which gives the same output because sampling state lives with the request.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from dataclasses import field
from typing import Protocol

from localrt.backends.engine import EngineRequest
from localrt.backends.engine import OfRequest
from localrt.backends.engine import Pooled
from localrt.backends.engine_thread import RequestQueues

from .kv_cache import BlockPool
from .kv_cache import KVCache
from .kv_cache import blocks_needed
from .prefix_cache import ROOT_KEY
from .prefix_cache import PrefixCache
from .prefix_cache import PrefixMatch
from .sampling import RequestSampler
from .sliding import WindowBlocks


@dataclass(eq=False)
class Sequence(OfRequest):
    """A request in the engine: its tokens and where its KV stands in the block pool."""

    request: EngineRequest
    tokens: list[int]  # prompt + generated
    prompt_len: int
    max_len: int  # stop ("length") when tokens reach this
    sampler: RequestSampler | None = None  # None: a prompt-only request
    block_table: list[int] = field(default_factory=list)
    block_keys: list[bytes] = field(default_factory=list)  # SHA-256 chain keys of the leading full blocks
    window_table: list[int] = field(default_factory=list)  # sliding layers' blocks, -1 when out of window
    num_computed: int = 0
    num_preemptions: int = 0
    finished: bool = False
    pooled: Pooled | None = None  # an embed request's pooled vector so far

    @property
    def seq_id(self) -> int:
        return self.request.id

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - self.prompt_len

    @property
    def pending(self) -> int:
        return len(self.tokens) - self.num_computed


@dataclass
class Scheduled:
    seq: Sequence
    num_tokens: int  # tokens of seq.tokens fed this step
    num_draft: int = 0  # draft tokens it may add (blocks are reserved for them)
    drafts: list[int] = field(default_factory=list)


class StepLimits(Protocol):
    """What the scheduler reads of the engine's config."""

    max_batch_tokens: int  # tokens per step
    max_seqs: int  # sequences decoding together


@dataclass(eq=False)
class Scheduler(RequestQueues):
    pool: BlockPool
    cache: KVCache
    prefix: PrefixCache
    limits: StepLimits
    window: WindowBlocks | None = None  # the sliding layers' blocks, when the model has such layers
    waiting: deque[Sequence] = field(default_factory=deque, init=False)
    running: list[Sequence] = field(default_factory=list, init=False)
    num_preemptions: int = field(default=0, init=False)
    # what happened besides the plan, for the engine to collect after each step (no callbacks):
    # (sequence, reason) in the order they ended, and those that gave their blocks back (proposers
    # free their state too)
    finished: list[tuple[Sequence, str]] = field(default_factory=list, init=False)
    released: list[Sequence] = field(default_factory=list, init=False)

    # ---- a step's plan ----------------------------------------------------------------------
    def schedule(self, draft_len: Callable[[Sequence], int]) -> list[Scheduled]:
        budget = self.limits.max_batch_tokens
        plan: list[Scheduled] = []
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            k = draft_len(seq) if seq.pending == 1 else 0
            n = min(seq.pending, budget)
            k = max(0, min(k, budget - n))
            before = len(self.running)
            grown = self._grow(seq, seq.num_computed + n + k)
            preempted = preempted or len(self.running) < before
            if not grown:
                continue  # seq itself left the running list (preempted or failed)
            plan.append(Scheduled(seq, n, k))
            budget -= n + k
            i += 1
        if preempted:
            return plan
        while self.waiting and len(self.running) < self.limits.max_seqs and budget > 0:
            seq = self.waiting[0]
            n = self._admit(seq, budget)
            if n == 0:
                break
            self.waiting.popleft()
            self.running.append(seq)
            plan.append(Scheduled(seq, n))
            budget -= n
        return plan

    def _grow(self, seq: Sequence, n_tokens: int) -> bool:
        """Blocks for n_tokens positions, preempting later sequences when a pool is short."""
        n_blocks = blocks_needed(n_tokens, self.pool.block_size)
        need = n_blocks - len(seq.block_table)
        window, pos = self.window, seq.num_computed
        if window is not None:
            window.trim(seq, pos)
        while need > self.pool.num_free or (
            window is not None and window.shortfall(seq, n_blocks, pos) > window.pool.num_free
        ):
            if len(self.running) == 1:  # alone and still short: it can never fit
                self.fail(seq, "the sequence does not fit the KV cache (raise the KV cache budget)")
                return False
            victim = self.running[-1]
            self.preempt(victim)
            if victim is seq:
                return False
        if need > 0:
            seq.block_table.extend(self.pool.allocate_many(need))
        if window is not None:
            window.extend(seq, n_blocks, pos)
        return True

    def _admit(self, seq: Sequence, budget: int) -> int:
        """Attach cached prefix blocks and blocks for the first chunk; returns tokens to feed (0: not now)."""
        bs = self.pool.block_size
        # the last token makes logits; a prompt-only request needs every row, so it reuses nothing
        match, covered = (
            (PrefixMatch(), 0) if seq.prompt_only else self.prefix.match(seq.tokens, len(seq.tokens) - 1)
        )
        window_table: list[int] = []
        window_partial = None
        if self.window is not None:  # the sliding layers' blocks may cover less
            match, covered, window_table, window_partial = self.window.match(match, covered, seq.tokens)
        n = min(len(seq.tokens) - covered, budget)
        shared = match.blocks
        # sharing an evictable block takes it off the free list, so it counts against what is free
        taken_from_free = sum(1 for b in shared if self.pool.ref_count[b] == 0)
        if match.partial_block is not None and self.pool.ref_count[match.partial_block] == 0:
            taken_from_free += 1  # held while it is copied
        fresh = blocks_needed(covered + n, bs) - len(shared)
        window_short = self.window is not None and (
            self.window.admission_cost(window_table, window_partial, blocks_needed(covered + n, bs), covered)
            > self.window.pool.num_free
        )
        if fresh + taken_from_free > self.pool.num_free or window_short:
            if not self.running and blocks_needed(len(seq.tokens), bs) > self.pool.num_blocks:
                self.fail(seq, "the prompt does not fit the KV cache (raise the KV cache budget)")
            return 0
        for block in shared:
            self.pool.retain(block)
        seq.block_table = list(shared)
        seq.block_keys = list(match.keys)
        if match.partial_block is not None:
            src = match.partial_block
            self.pool.retain(src)  # the allocation below must not evict the block being copied
            dst = self.pool.allocate()
            self.cache.copy_block(src, dst)
            self.pool.release(src)
            seq.block_table.append(dst)
        seq.block_table.extend(self.pool.allocate_many(blocks_needed(covered + n, bs) - len(seq.block_table)))
        if self.window is not None:
            self.window.attach(seq, window_table, window_partial, len(seq.block_table), covered)
        seq.num_computed = covered
        if not seq.request.admitted_ns:  # its first admission (not a return after a preemption)
            seq.request.admitted_ns = time.perf_counter_ns()
            seq.request.timings.cached_count = covered
        return n

    # ---- leaving ----------------------------------------------------------------------------
    def commit(self, seq: Sequence) -> None:
        """After a step: cache newly full blocks, drop blocks reserved for rejected draft tokens."""
        bs = self.pool.block_size
        keep = blocks_needed(seq.num_computed + 1, bs)  # room for the next token's KV
        window = self.window
        if len(seq.block_table) > keep:
            self.pool.release_all(seq.block_table[keep:])
            del seq.block_table[keep:]
        if window is not None:
            window.truncate(seq, keep)
        while len(seq.block_keys) < seq.num_computed // bs:
            i = len(seq.block_keys)
            parent = seq.block_keys[-1] if seq.block_keys else ROOT_KEY
            tokens = seq.tokens[i * bs : (i + 1) * bs]
            seq.block_keys.append(self.prefix.insert_full(seq.block_table[i], parent, tokens))
            if window is not None:
                window.cache_full(seq, i, parent, tokens)
        if window is not None:
            window.trim(seq, seq.num_computed)  # the next query is at num_computed

    def _release(self, seq: Sequence) -> None:
        """Free a sequence's blocks, keeping its computed tail findable (copy-on-write on reuse)."""
        bs = self.pool.block_size
        self.commit(seq)
        full = len(seq.block_keys)
        tail = seq.tokens[full * bs : seq.num_computed]
        if tail and full < len(seq.block_table):
            parent = seq.block_keys[-1] if seq.block_keys else ROOT_KEY
            self.prefix.insert_partial(seq.block_table[full], parent, tail)
        if self.window is not None:
            self.window.release(seq, tail)
        self.pool.release_all(seq.block_table)
        seq.block_table, seq.block_keys = [], []
        self.released.append(seq)

    def preempt(self, seq: Sequence) -> None:
        self._release(seq)
        seq.num_computed = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.running.remove(seq)
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        if seq.finished:
            return
        seq.finished = True
        self._release(seq)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.finished.append((seq, reason))

    def fail(self, seq: Sequence, message: str) -> None:
        from localrt.errors import LocalrtError

        seq.error = LocalrtError(message)
        self.finish(seq, "error")
