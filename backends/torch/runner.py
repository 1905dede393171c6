"""The model runner: a step's tensors, from its plan to the sampled token ids.

The engine decides (schedule, propose, verify, commit); the runner holds every tensor of a step. It
lays out all the inputs at once (token ids, logits rows, and the attention's positions, slots and
block tables; pinned and copied `non_blocking` on CUDA), runs one forward (or replays a CUDA graph),
and samples every plain decode with one batched sampler, logprobs included, with one host sync.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from dataclasses import field

import torch

from .attention import PagedAttention
from .attention import SeqChunk
from .attention import upload
from .cuda_graphs import DecodeGraphs
from .kv_cache import KVCache
from .llama import Transformer
from .sampling import Sampled
from .sampling import sample_batch
from .scheduler import Scheduled


@dataclass
class StepBatch:
    """A step's forward: logits rows and where each plan item's rows are (an embed request's rows are
    final-normed hidden states, in `hidden`)."""

    logits: torch.Tensor  # [R, vocab]
    rows: dict[int, tuple[int, int]] = field(default_factory=dict)  # plan index -> its rows [a, b)
    hidden: torch.Tensor | None = None  # [H, dim]: the embed requests' rows


@dataclass(eq=False)
class ModelRunner:
    model: Transformer
    cache: KVCache
    device: torch.device
    graphs: DecodeGraphs | None  # decode-only steps replay captured graphs (None: every step eager)
    fp16_attention: bool = False  # numerics "llama.cpp": attention rounded as llama.cpp's CPU kernels

    def forward(self, plan: Sequence[Scheduled]) -> StepBatch:
        """One batched forward over every scheduled chunk (its tokens, then its draft tokens); a
        prompt-only request's chunk gives a row for each of its tokens (logits to score, or hidden
        states to pool)."""
        feed: list[int] = []
        chunks: list[SeqChunk] = []
        rows: list[int] = []  # positions in `feed` whose logits are needed
        pooled: list[int] = []  # positions in `feed` whose hidden states are needed
        spans: dict[int, tuple[int, int]] = {}
        for i, item in enumerate(plan):
            seq = item.seq
            start = seq.num_computed
            tokens = seq.tokens[start : start + item.num_tokens] + item.drafts
            chunks.append(SeqChunk(len(tokens), start + len(tokens), seq.block_table, seq.window_table))
            if seq.pooled is not None:
                spans[i] = (len(pooled), len(pooled) + len(tokens))
                pooled.extend(range(len(feed), len(feed) + len(tokens)))
            elif seq.prompt_only:
                spans[i] = (len(rows), len(rows) + len(tokens))
                rows.extend(range(len(feed), len(feed) + len(tokens)))
            elif start + item.num_tokens == len(seq.tokens):  # caught up: logits for the last (+ drafts)
                first = len(feed) + item.num_tokens - 1
                spans[i] = (len(rows), len(rows) + 1 + len(item.drafts))
                rows.extend(range(first, len(feed) + len(tokens)))
            feed.extend(tokens)
        graphs = self.graphs
        decodes_only = len(feed) == len(rows) == len(plan) and not pooled
        if graphs is not None and decodes_only and graphs.fits(len(plan)):
            return StepBatch(graphs.run(feed, chunks), spans)  # every item one decode token, row i for item i
        ctx = PagedAttention(self.cache, chunks, self.device, fp16_rounding=self.fp16_attention)
        host = torch.tensor([*feed, *rows, *pooled], dtype=torch.long)  # one upload: ids and rows
        ids = upload(host, self.device)
        tokens, logits_rows = ids[: len(feed)], ids[len(feed) : len(feed) + len(rows)]
        if not pooled:
            return StepBatch(self.model(tokens, ctx, rows=logits_rows), spans)
        # the same arithmetic as the model's forward, with the embed requests' normed rows kept aside
        x = self.model.run_blocks(tokens, ctx)
        hidden = self.model.output_norm(x[ids[len(feed) + len(rows) :]])
        logits = self.model.output(self.model.output_norm(x[logits_rows])).float()
        return StepBatch(logits, spans, hidden)

    def sample(
        self, plan: Sequence[Scheduled], batch: StepBatch, members: Sequence[int]
    ) -> dict[int, Sampled]:
        """Plan index -> its draw, for the plain decodes `members`, in one batched pass."""
        if not members:
            return {}
        seqs = [plan[i].seq for i in members]
        index = torch.tensor([batch.rows[i][0] for i in members], device=batch.logits.device)
        drawn = sample_batch(
            [s.sampler for s in seqs],
            batch.logits.index_select(0, index),
            [s.tokens for s in seqs],
            [s.top_logprobs for s in seqs],
        )
        return {
            i: Sampled([drawn.tokens[j]], [drawn.logprob[j]], [drawn.top[j]]) for j, i in enumerate(members)
        }


def logprobs_of(logits: torch.Tensor, tokens: Sequence[int], top_n: int) -> Sampled:
    """Logprobs of tokens chosen outside the batched sampler (draft tokens kept, grammar rows): row j for token j."""
    lp = torch.log_softmax(logits[: len(tokens)].double(), -1)
    chosen = lp.gather(1, torch.tensor(tokens, device=lp.device)[:, None]).squeeze(1).tolist()
    top: list[list[tuple[int, float]]] = [[] for _ in tokens]
    if top_n > 0:
        values, ids = torch.topk(lp, top_n)
        top = [list(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
    return Sampled(list(tokens), chosen, top)
