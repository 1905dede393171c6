"""Speculative decoding in the torch engine: three proposers over the paged cache.

A proposer proposes k draft tokens after a sequence's last token (with the distribution q it drew them
from, or none for deterministic draft tokens). The target then scores [last, d1..dk] in one pass,
batched with every other running sequence; the exact verifier, the request's speculation state and
its policy are the engines' shared ones (backends/speculation.py).

Proposers: `SelfProposer` (the target's first layers + its final norm and head, sharing the target's
KV cache for those layers) and `DraftModelProposer` (a small model with the same vocabulary and its own
paged cache). "lookup" draft tokens come from each sequence's own n-gram index, `SpecState.ngram`
(backends/lookup.py), as in the other engines.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING
from typing import Protocol

import torch

from localrt.backends.speculation import SpecState

from .attention import PagedAttention
from .attention import SeqChunk
from .kv_cache import BlockPool
from .kv_cache import KVCache
from .kv_cache import OutOfBlocks
from .kv_cache import blocks_needed

if TYPE_CHECKING:
    from .llama import Transformer
    from .sampling import RequestSampler


@dataclass
class DraftTokens:
    """What a proposer proposes for one sequence."""

    tokens: list[int]
    q: torch.Tensor | None = None  # [k, V] draft distributions; None = deterministic draft tokens


class Seq(Protocol):
    """What the proposers and the verifier read of a scheduled sequence (the scheduler's `Sequence`);
    a protocol, so this module never imports the scheduler that imports it."""

    seq_id: int
    tokens: list[int]
    spec: SpecState | None
    sampler: RequestSampler


# ---- proposers -----------------------------------------------------------------------------------
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


def _sample_draft(
    seqs: Sequence[Seq], logits: torch.Tensor, histories: list[list[int]]
) -> tuple[list[int], list[torch.Tensor]]:
    """One draft token per sequence from its draft logits [B, V]: greedy -> argmax, else a draw from q."""
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
        start: Callable[[Seq], tuple[list[int], int, Sequence[int], Sequence[int] | None]],
    ) -> list[DraftTokens]:
        """`start(seq)` -> (tokens to feed first, their first position, block table, the sliding layers'
        block table or None)."""
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
                    tokens, pos, table, window_table = first[i]
                else:
                    tokens, pos, table, window_table = (
                        [drafts[i][-1]],
                        first[i][1] + len(first[i][0]) + step - 1,
                        first[i][2],
                        first[i][3],
                    )
                chunks.append(SeqChunk(len(tokens), pos + len(tokens), table, window_table))
                feed.extend(tokens)
                rows.append(len(feed) - 1)
            logits = _draft_step(self.model, cache, chunks, feed, rows, self.device, self.num_layers)
            live_seqs = [seqs[i] for i in live]
            histories = [seqs[i].tokens + drafts[i] for i in live]
            tokens, token_q = _sample_draft(live_seqs, logits, histories)
            for j, i in enumerate(live):
                drafts[i].append(tokens[j])
                qs[i].append(token_q[j])
        return [
            DraftTokens(d, torch.stack(q) if q and not s.sampler.greedy else None)
            for d, q, s in zip(drafts, qs, seqs)
        ]


class SelfProposer(_ModelProposer):
    """The target's first `num_layers` blocks, final norm and head; their KV lives in the target's cache.

    The verify pass recomputes those layers for the same tokens and overwrites the same slots, so
    proposing costs only the shallow forward passes and no extra memory.
    """

    def __init__(self, model: Transformer, cache: KVCache, device: torch.device, num_layers: int) -> None:
        super().__init__(model, device, num_layers)
        self.cache = cache
        self.cost_per_draft = num_layers / model.cfg.block_count

    def propose(self, seqs: Sequence[Seq], ks: Sequence[int]) -> list[DraftTokens]:
        # sliding-window layers (Gemma) read and write their own blocks through the window table, which
        # the scheduler has already grown for the drafts
        return self._run(
            seqs,
            ks,
            self.cache,
            lambda s: ([s.tokens[-1]], len(s.tokens) - 1, s.block_table, s.window_table),
        )

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
        # per sequence id: the tokens whose KV the draft cache holds, and its blocks there
        self.fed: dict[int, list[int]] = {}
        self.blocks: dict[int, list[int]] = {}

    def propose(self, seqs: Sequence[Seq], ks: Sequence[int]) -> list[DraftTokens]:
        ready, ready_ks = [], []
        for seq, k in zip(seqs, ks):
            if self._reserve(seq, len(seq.tokens) + k):
                ready.append(seq)
                ready_ks.append(k)
        drafts = {id(s): p for s, p in zip(ready, self._run(ready, ready_ks, self.cache, self._catch_up))}
        for seq in ready:
            # the cache now holds every fed token except the last draft token
            self.fed[seq.seq_id] = seq.tokens + drafts[id(seq)].tokens[:-1]
        return [drafts.get(id(s), DraftTokens([])) for s in seqs]

    def _catch_up(self, seq: Seq) -> tuple[list[int], int, Sequence[int], Sequence[int] | None]:
        done = 0  # tokens of the draft cache that still match the sequence
        for a, b in zip(self.fed.get(seq.seq_id, []), seq.tokens):
            if a != b:
                break
            done += 1
        done = min(done, len(seq.tokens) - 1)  # refeed at least the last token, for its logits
        return seq.tokens[done:], done, self.blocks[seq.seq_id], None

    def _reserve(self, seq: Seq, n_tokens: int) -> bool:
        blocks = self.blocks.setdefault(seq.seq_id, [])
        need = blocks_needed(n_tokens, self.pool.block_size) - len(blocks)
        if need <= 0:
            return True
        try:
            blocks.extend(self.pool.allocate_many(need))
            return True
        except OutOfBlocks:
            return False  # no room in the draft cache: this sequence decodes plainly this step

    def release(self, seq: Seq) -> None:
        self.pool.release_all(self.blocks.pop(seq.seq_id, []))
        self.fed.pop(seq.seq_id, None)
