"""Speculative decoding: three proposers, one exact verifier.

A proposer guesses k tokens after a sequence's last token (with the distribution q it drew them
from, or none for deterministic guesses). The target then scores [last, d1..dk] in one pass, batched
with every other running sequence, and `verify` (shared: backends/speculation.py) keeps a prefix of
the guesses:

  accept d_j with probability min(1, p_j(d_j) / q_j(d_j)); at the first rejection draw from
  norm(max(p_j - q_j, 0)); if every guess survives, draw a bonus token from p_k.

This keeps the target's distribution exactly (Leviathan et al. 2023); a deterministic guess is
q = one-hot, and greedy decoding reduces to "keep guesses while they equal the target's argmax".

Proposers: `LookupProposer` (prompt-lookup n-grams), `SelfProposer` (the target's first layers +
its final norm and head, sharing the target's KV cache for those layers) and `DraftModelProposer`
(a small model with the same vocabulary and its own paged cache).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

from localrt.backends.lookup import LookupIndex
from localrt.backends.speculation import (  # noqa: F401  (re-exported for the engine and tests)
    DEFAULT_NUM_DRAFT,
    WARMUP_DRAFTS,
    break_even_acceptance,
    expected_tokens,
    verify,
)

from .attention import PagedAttention, SeqChunk
from .kv_cache import BlockPool, KVCache, OutOfBlocks, blocks_needed

if TYPE_CHECKING:
    from .model import Transformer
    from .sampling import RequestSampler


@dataclass
class Proposal:
    tokens: list[int]
    q: torch.Tensor | None = None  # [k, V] draft distributions; None = deterministic guesses


@dataclass
class SpecState:
    """Per-request speculation settings and statistics."""

    mode: str  # "lookup" | "self" | "draft"
    k: int
    cost_per_draft: float  # draft + verify cost of one guess, in units of one target decode step
    enabled: bool = True
    drafted: int = 0
    accepted: int = 0
    lookup: LookupIndex | None = None
    draft_fed: list[int] = field(default_factory=list)  # tokens whose KV the draft model's cache holds
    draft_blocks: list[int] = field(default_factory=list)

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 1.0

    def record(self, drafted: int, accepted: int) -> None:
        self.drafted += drafted
        self.accepted += accepted
        if self.drafted >= WARMUP_DRAFTS and self.acceptance < break_even_acceptance(
            self.k, self.cost_per_draft
        ):
            self.enabled = False  # speculation costs this request more than it saves


class Seq(Protocol):
    """What the proposers and the verifier read of a scheduled sequence (the scheduler's `Sequence`);
    a protocol, so this module never imports the scheduler that imports it."""

    tokens: list[int]
    spec: SpecState | None
    sampler: RequestSampler


# ---- proposers -----------------------------------------------------------------------------------
class LookupProposer:
    cost_per_draft = 0.0  # no model runs to guess

    def propose(self, seqs: Sequence[Seq], ks: Sequence[int]) -> list[Proposal]:
        out = []
        for seq, k in zip(seqs, ks):
            assert seq.spec is not None
            if seq.spec.lookup is None:
                seq.spec.lookup = LookupIndex()
            out.append(Proposal(seq.spec.lookup.propose(seq.tokens, k)))
        return out

    def release(self, seq: Seq) -> None:
        pass


def _draft_step(
    model: Transformer,
    cache: KVCache,
    chunks: list[SeqChunk],
    feed: list[int],
    rows: list[int],
    device: torch.device,
    num_layers: int | None,
) -> torch.Tensor:
    ctx = PagedAttention(cache, chunks, device)
    tokens = torch.tensor(feed, dtype=torch.long, device=device)
    return model(tokens, ctx, num_layers=num_layers, rows=torch.tensor(rows, device=device))


def _guess(
    seqs: Sequence[Seq], logits: torch.Tensor, histories: list[list[int]]
) -> tuple[list[int], list[torch.Tensor]]:
    """One guess per sequence from its draft logits [B, V]: greedy -> argmax, else a draw from q."""
    tokens, qs = [], []
    for i, seq in enumerate(seqs):
        q = seq.sampler.probs(logits[i], histories[i])
        tokens.append(seq.sampler.draw(q))
        qs.append(q)
    return tokens, qs


class _ModelProposer:
    """Shared loop of the model-based proposers: k batched single-token steps of a (smaller) model."""

    def __init__(self, model: Transformer, device: torch.device, num_layers: int | None) -> None:
        self.model = model
        self.device = device
        self.num_layers = num_layers

    def _run(
        self,
        seqs: Sequence[Seq],
        ks: Sequence[int],
        cache: KVCache,
        start: Callable[[Seq], tuple[list[int], int, Sequence[int]]],
    ) -> list[Proposal]:
        """`start(seq)` -> (tokens to feed first, their first position, block table)."""
        drafts: list[list[int]] = [[] for _ in seqs]
        qs: list[list[torch.Tensor]] = [[] for _ in seqs]
        live = list(range(len(seqs)))
        first = {i: start(seqs[i]) for i in live}
        for step in range(max(ks, default=0)):
            live = [i for i in live if len(drafts[i]) < ks[i]]
            if not live:
                break
            chunks, feed, rows = [], [], []
            for i in live:
                if step == 0:
                    tokens, pos, table = first[i]
                else:
                    tokens, pos, table = (
                        [drafts[i][-1]],
                        first[i][1] + len(first[i][0]) + step - 1,
                        first[i][2],
                    )
                chunks.append(SeqChunk(len(tokens), pos + len(tokens), table))
                feed.extend(tokens)
                rows.append(len(feed) - 1)
            logits = _draft_step(self.model, cache, chunks, feed, rows, self.device, self.num_layers)
            live_seqs = [seqs[i] for i in live]
            histories = [seqs[i].tokens + drafts[i] for i in live]
            guesses, guess_q = _guess(live_seqs, logits, histories)
            for j, i in enumerate(live):
                drafts[i].append(guesses[j])
                qs[i].append(guess_q[j])
        return [
            Proposal(d, torch.stack(q) if q and not s.sampler.greedy else None)
            for d, q, s in zip(drafts, qs, seqs)
        ]


class SelfProposer(_ModelProposer):
    """The target's first `num_layers` blocks, final norm and head; their KV lives in the target's cache.

    The verify pass recomputes those layers for the same tokens and overwrites the same slots, so
    guessing costs only the shallow forward passes and no extra memory.
    """

    def __init__(self, model: Transformer, cache: KVCache, device: torch.device, num_layers: int) -> None:
        super().__init__(model, device, num_layers)
        self.cache = cache
        self.cost_per_draft = num_layers / model.cfg.block_count

    def propose(self, seqs: Sequence[Seq], ks: Sequence[int]) -> list[Proposal]:
        return self._run(seqs, ks, self.cache, lambda s: ([s.tokens[-1]], len(s.tokens) - 1, s.block_table))

    def release(self, seq: Seq) -> None:
        pass


class DraftModelProposer(_ModelProposer):
    """A small model with the target's vocabulary, with its own block pool (no prefix sharing)."""

    def __init__(
        self, model: Transformer, cache: KVCache, pool: BlockPool, device: torch.device, cost_per_draft: float
    ) -> None:
        super().__init__(model, device, None)
        self.cache = cache
        self.pool = pool
        self.cost_per_draft = cost_per_draft

    def propose(self, seqs: Sequence[Seq], ks: Sequence[int]) -> list[Proposal]:
        ready, ready_ks = [], []
        for seq, k in zip(seqs, ks):
            if self._reserve(seq, len(seq.tokens) + k):
                ready.append(seq)
                ready_ks.append(k)
        proposals = {id(s): p for s, p in zip(ready, self._run(ready, ready_ks, self.cache, self._catch_up))}
        for seq in ready:
            assert seq.spec is not None
            # the cache now holds every fed token except the last guess
            seq.spec.draft_fed = seq.tokens + proposals[id(seq)].tokens[:-1]
        return [proposals.get(id(s), Proposal([])) for s in seqs]

    def _catch_up(self, seq: Seq) -> tuple[list[int], int, Sequence[int]]:
        assert seq.spec is not None
        done = 0  # tokens of the draft cache that still match the sequence
        for a, b in zip(seq.spec.draft_fed, seq.tokens):
            if a != b:
                break
            done += 1
        done = min(done, len(seq.tokens) - 1)  # refeed at least the last token, for its logits
        return seq.tokens[done:], done, seq.spec.draft_blocks

    def _reserve(self, seq: Seq, n_tokens: int) -> bool:
        assert seq.spec is not None
        need = blocks_needed(n_tokens, self.pool.block_size) - len(seq.spec.draft_blocks)
        if need <= 0:
            return True
        try:
            seq.spec.draft_blocks.extend(self.pool.allocate_many(need))
            return True
        except OutOfBlocks:
            return False  # no room in the draft cache: this sequence decodes plainly this step

    def release(self, seq: Seq) -> None:
        if seq.spec is not None:
            self.pool.release_all(seq.spec.draft_blocks)
            seq.spec.draft_blocks = []
            seq.spec.draft_fed = []
