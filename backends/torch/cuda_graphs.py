"""CUDA graphs for decode steps: a step made only of single-token decodes replays one captured graph.

A small decode batch is bound by kernel launches, not by the math; a graph records a whole forward
once and replays it with one launch. Graphs need fixed shapes and addresses, so the batch is padded
to a bucket (1, 2, 4, ... 64, capped at max_seqs) and the step's inputs are copied into static
buffers the graph reads: token ids, positions, KV slots, block tables (as wide as the context length
allows) and context lengths. Padded rows decode token 0 at position 0 against a scratch block that
the pool never hands out, and write their K/V there, so no real sequence ever reads them.
Attention is the Triton `paged_decode` kernel (fixed grid, tensors only); K/V go in through
`KVCache.write` (`index_copy_` on the static slots; quantized caches too, the scales are plain ops).

Without capture (`capture=False`, the default off CUDA) the same static-buffer forward runs eagerly:
that is the path the CPU tests compare with `PagedAttention`, under Triton's interpreter.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import InitVar
from dataclasses import dataclass
from typing import Any

import torch

from .attention import AttnLayer
from .attention import SeqChunk
from .attention import fused_decode
from .kv_cache import KVCache
from .llama import Transformer

BUCKETS = (1, 2, 4, 8, 16, 32, 64)


@dataclass(eq=False)
class StaticDecodeAttention:
    """An `AttentionContext` for one query row per sequence over static tensors (graph-capturable).

    Full-attention layers only: the engine replays graphs only for models without sliding layers."""

    cache: KVCache
    positions: torch.Tensor  # [B] int64, position of each row's token
    slots: torch.Tensor  # [B] flat KV slot (block * block_size + offset) of each row's token
    tables: torch.Tensor  # [B, max_blocks] block ids; only the first ceil(len / block_size) are read
    lens: torch.Tensor  # [B] context length, the new token included

    def attend(self, layer: AttnLayer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [B, H, D], k/v [B, Hkv, D] -> [B, H, D]."""
        self.cache.write(layer.index, k, v, self.slots)
        return fused_decode(self.cache, layer.index, q, self.tables, self.lens)


@dataclass(eq=False)
class DecodeGraphs:
    """Static input buffers, one graph per bucket captured on first use, in one shared memory pool."""

    model: Transformer
    cache: KVCache
    scratch_block: int  # the block padded rows write to, never handed out by the pool
    max_seqs: InitVar[int]
    context_length: InitVar[int]
    device: torch.device
    capture: bool | None = None  # None: on CUDA

    def __post_init__(self, max_seqs: int, context_length: int) -> None:
        if self.capture is None:
            self.capture = self.device.type == "cuda"
        self.buckets = sorted({min(b, max_seqs) for b in BUCKETS})
        size, width = self.buckets[-1], -(-context_length // self.cache.block_size)
        pin = self.device.type == "cuda"  # pinned host mirrors: the uploads are truly asynchronous
        # rows of `vec`: token ids, positions, slots, context lengths; one upload for all four
        self.host_vec = torch.zeros(4, size, dtype=torch.long, pin_memory=pin)
        self.host_tables = torch.zeros(size, width, dtype=torch.long, pin_memory=pin)
        self.vec = torch.zeros(4, size, dtype=torch.long, device=self.device)
        self.tables = torch.zeros(size, width, dtype=torch.long, device=self.device)
        self._graphs: dict[int, tuple[Any, torch.Tensor]] = {}  # bucket -> (torch.cuda.CUDAGraph, logits)
        self._pool: Any = None
        self.runs = 0  # steps through the static buffers
        self.replays = 0  # of which graph replays

    def fits(self, n: int) -> bool:
        return n <= self.buckets[-1]

    def run(self, tokens: Sequence[int], chunks: Sequence[SeqChunk]) -> torch.Tensor:
        """One decode token per sequence (chunks of length 1) -> logits [n, vocab].

        The logits are the graph's output buffer: valid until the next `run`.
        """
        n = len(chunks)
        bucket = next(b for b in self.buckets if b >= n)
        self._upload(tokens, chunks, bucket)
        self.runs += 1
        if not self.capture:
            return self._forward(bucket)[:n]
        if bucket not in self._graphs:
            try:
                self._graphs[bucket] = self._record(bucket)
            except Exception as e:  # an op that cannot be captured: stay correct, run the same path eagerly
                warnings.warn(f"CUDA graph capture failed, decoding without graphs: {e}", stacklevel=2)
                self.capture = False
                return self._forward(bucket)[:n]
        graph, logits = self._graphs[bucket]
        graph.replay()
        self.replays += 1
        return logits[:n]

    def _upload(self, tokens: Sequence[int], chunks: Sequence[SeqChunk], bucket: int) -> None:
        bs = self.cache.block_size
        vec, tables = self.host_vec.numpy(), self.host_tables.numpy()  # views: cheap element writes
        # padding: token 0 at position 0 in the scratch block; stale table entries past a row's
        # length are never read. The host mirrors are free to reuse: each step ends with a sync.
        vec[:, :bucket] = [[0], [0], [self.scratch_block * bs], [1]]
        tables[:bucket, 0] = self.scratch_block
        for i, (token, c) in enumerate(zip(tokens, chunks)):
            pos = c.context_len - 1
            used = -(-c.context_len // bs)
            vec[:, i] = (token, pos, c.block_table[pos // bs] * bs + pos % bs, c.context_len)
            tables[i, :used] = c.block_table[:used]
        self.vec.copy_(self.host_vec, non_blocking=True)
        self.tables[:bucket].copy_(self.host_tables[:bucket], non_blocking=True)

    def _forward(self, bucket: int) -> torch.Tensor:
        """The padded decode step from the static buffers -> logits [bucket, vocab]."""
        tokens, positions, slots, lens = (row[:bucket] for row in self.vec)
        # fresh views on every call: Rotary caches its cos/sin lookup by the positions tensor's identity
        ctx = StaticDecodeAttention(self.cache, positions, slots, self.tables[:bucket], lens)
        return self.model(tokens, ctx)

    def _record(self, bucket: int) -> tuple[Any, torch.Tensor]:
        """Capture one bucket, as torch documents: warm up on a side stream, then `torch.cuda.graph`."""
        # the warm-up runs are real forwards of this step (they write the same K/V the replay will);
        # they compile the Triton kernel and set up cuBLAS before capture, where neither may happen
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                self._forward(bucket)
        torch.cuda.current_stream(self.device).wait_stream(side)
        if self._pool is None:  # one pool for every bucket: graphs never run at the same time
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            logits = self._forward(bucket)
        return graph, logits
