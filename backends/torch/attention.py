"""Paged attention: each step's tokens write K/V into their sequence's blocks, queries read through block tables.

A step's batch is flat: sequence chunks (a prefill piece, one decode token, a token plus its drafts)
lie one after the other in N rows. Sequences with the same number of query rows are attended
together: their blocks are gathered into a padded [B, L] view and masked per row (gather on CPU;
on CUDA, decode rows go through the fused Triton kernel in `triton_attention.py` instead).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .kv_cache import KVCache


@dataclass(frozen=True)
class AttnLayer:
    """What an attention context needs of the layer that calls it, fixed when the block is built."""

    index: int  # the layer's place in the KV cache
    window: int = 0  # > 0: a query at position p sees only keys p - window + 1 .. p (Gemma's sliding layers)
    softcap: float = 0.0  # > 0: scores capped as c * tanh(s / c) before the softmax (Gemma 2)


@dataclass
class SeqChunk:
    """One sequence's rows in a step."""

    length: int  # query tokens fed this step
    context_len: int  # tokens in the cache once this chunk is written (its positions end here)
    block_table: Sequence[int]
    window_table: Sequence[int] | None = None  # the sliding layers' blocks (-1: fell out of the window)


@dataclass
class _Group:
    rows: torch.Tensor  # [B * q_len] flat row indices
    tables: torch.Tensor  # [B, n_blocks] block ids (padded with block 0, masked out)
    mask: torch.Tensor  # [B, 1, q_len, n_blocks * block_size] True where a query may look
    q_len: int
    lens: torch.Tensor  # [B] context length of each sequence


@dataclass
class _View:
    """Where one kind of layer writes (slots) and what its queries read (groups)."""

    slots: torch.Tensor  # [N] flat KV slot of each row's token
    groups: list[_Group]


@dataclass(eq=False)
class PagedAttention:
    """An `AttentionContext` over a `KVCache`; built once per step, used by every layer.

    Sliding layers (an `AttnLayer` with a window w) see only the last w positions; in a cache whose
    sliding layers have their own pool (`KVCache.windowed`) they read and write through each chunk's
    `window_table`, of which only the window's blocks are gathered.
    """

    cache: KVCache
    chunks: Sequence[SeqChunk]
    device: torch.device | str
    # decode rows through the Triton kernel (None: on CUDA when Triton is installed)
    fused: bool | None = None
    # numerics "llama.cpp": Q and the softmax weights rounded to fp16, as llama.cpp's CPU attention
    # without flash attention rounds them (`ggml_numerics.py`)
    fp16_rounding: bool = False

    def __post_init__(self) -> None:
        if self.fused is None:
            self.fused = fused_available(torch.device(self.device))
        positions = [pos for c in self.chunks for pos in range(c.context_len - c.length, c.context_len)]
        self.positions = upload(torch.tensor(positions, dtype=torch.long), self.device)  # [N]
        self._views: dict[tuple[int, bool], _View] = {}
        full = self._view(0, own_table=False)
        self.slots, self.groups = full.slots, full.groups

    def _view(self, window: int, own_table: bool) -> _View:
        """The slots and groups of full layers (window 0) or of sliding ones, built on first use."""
        found = self._views.get((window, own_table))
        if found is not None:
            return found
        bs = self.cache.block_size
        slots: list[int] = []
        by_len: dict[int, list[tuple[int, int, SeqChunk]]] = {}
        row = 0
        for chunk in self.chunks:
            table = _table(chunk, own_table)
            first = chunk.context_len - chunk.length
            slots.extend(table[pos // bs] * bs + pos % bs for pos in range(first, chunk.context_len))
            # the first block any of this chunk's queries can see
            low = max(0, first - window + 1) // bs if window else 0
            by_len.setdefault(chunk.length, []).append((row, low, chunk))
            row += chunk.length
        view = _View(
            upload(torch.tensor(slots, dtype=torch.long), self.device),
            [self._group(q_len, members, window, own_table) for q_len, members in by_len.items()],
        )
        self._views[(window, own_table)] = view
        return view

    def _group(
        self, q_len: int, members: list[tuple[int, int, SeqChunk]], window: int, own_table: bool
    ) -> _Group:
        bs = self.cache.block_size
        n_blocks = max(-(-c.context_len // bs) - low for _, low, c in members)
        tables = torch.zeros(len(members), n_blocks, dtype=torch.long)
        rows = torch.empty(len(members), q_len, dtype=torch.long)
        ctx = torch.empty(len(members), dtype=torch.long)
        lows = torch.empty(len(members), dtype=torch.long)
        for i, (start, low, c) in enumerate(members):
            used = -(-c.context_len // bs)
            tables[i, : used - low] = torch.as_tensor(list(_table(c, own_table)[low:used]), dtype=torch.long)
            rows[i] = torch.arange(start, start + q_len)
            ctx[i] = c.context_len
            lows[i] = low * bs
        key_pos = lows[:, None] + torch.arange(n_blocks * bs)[None, :]  # [B, L]
        query_pos = ctx[:, None] - q_len + torch.arange(q_len)[None, :]  # [B, q_len]
        mask = key_pos[:, None, :] <= query_pos[:, :, None]  # [B, q_len, L] causal within context
        if window:
            mask &= key_pos[:, None, :] > query_pos[:, :, None] - window
        return _Group(
            upload(rows.flatten(), self.device),
            upload(tables, self.device),
            upload(mask.unsqueeze(1), self.device),
            q_len,
            upload(ctx, self.device),
        )

    def attend(self, layer: AttnLayer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [N, H, D], k/v [N, Hkv, D] -> [N, H, D]; k/v are stored first, then read back paged."""
        i, window = layer.index, layer.window
        view = self._view(window, self.cache.windowed[i]) if window else self._views[(0, False)]
        self.cache.write(i, k, v, view.slots)
        groups = view.groups
        if len(groups) == 1 and groups[0].rows.numel() == q.shape[0]:
            return self._attend_group(layer, q, groups[0])  # rows are already in order
        out = torch.empty_like(q)
        for group in groups:
            out[group.rows] = self._attend_group(layer, q[group.rows], group)
        return out

    def _attend_group(self, layer: AttnLayer, q: torch.Tensor, group: _Group) -> torch.Tensor:
        if self.fused and group.q_len == 1 and not layer.window and not layer.softcap:
            return fused_decode(self.cache, layer.index, q, group.tables, group.lens)
        b, n_head, head_dim = group.tables.shape[0], q.shape[1], q.shape[2]
        dtype = q.dtype
        cpu = q.device.type == "cpu"
        # on the CPU in float64, rounded back: how the CPU's SDPA blocks its sums (a context padded
        # to the batch's longest, a prompt split in other chunks) no longer shows in the fp32
        # result, which the quantized path's bf16 kernel outputs would amplify into other tokens
        keys, values = self.cache.gather(
            layer.index, group.tables, torch.float64 if cpu else None
        )  # [B, L, Hkv, D]
        if cpu:
            q = q.double()
        q = q.view(b, group.q_len, n_head, head_dim).transpose(1, 2)  # [B, H, q_len, D]
        attend = fp16_rounded_attention if self.fp16_rounding else attention
        out = attend(
            q, keys.transpose(1, 2), values.transpose(1, 2), group.mask, layer.softcap
        )  # [B, H, q_len, D]
        return out.to(dtype).transpose(1, 2).reshape(b * group.q_len, n_head, head_dim)


def fused_decode(
    cache: KVCache, layer: int, q: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor
) -> torch.Tensor:
    """One query row per sequence, q [B, H, D] -> [B, H, D], through the Triton kernel reading the
    layer's stored K/V (and their scales, in a quantized cache) by block tables [B, n] and lengths [B]."""
    from .triton_attention import paged_decode

    scales = (cache.k_scale[layer], cache.v_scale[layer]) if cache.quantized else (None, None)
    return paged_decode(q, cache.k[layer], cache.v[layer], tables, lens, *scales)


def causal_mask(positions: torch.Tensor, window: int = 0) -> torch.Tensor:
    """[N, N] for one sequence at `positions`: causal, and within the query's window when one is given."""
    mask = positions[None, :] <= positions[:, None]
    if window > 0:
        mask &= positions[None, :] > positions[:, None] - window  # the key is within the query's window
    return mask


def _table(chunk: SeqChunk, own_table: bool) -> Sequence[int]:
    if not own_table:
        return chunk.block_table
    if chunk.window_table is None:
        raise ValueError("a sliding layer with its own blocks needs the chunk's window_table")
    return chunk.window_table


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, softcap: float = 0.0
) -> torch.Tensor:
    """q [B, H, Q, D], k/v [B, Hkv, L, D], mask [B or 1, 1, Q, L] (True: may look) -> [B, H, Q, D].

    `softcap` > 0 (Gemma 2): scores become c * tanh(s / c) before the mask and softmax, which SDPA
    cannot do, so that case is written out."""
    if softcap <= 0:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)  # [B, H, L, D]
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])  # [B, H, Q, L]
    scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, -1) @ v


def fp16_rounded_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, softcap: float = 0.0
) -> torch.Tensor:
    """`attention` with Q and the softmax weights rounded to fp16 (llama.cpp's F16 K.Q matmul and its
    rounding of the weights before they multiply V); full attention only, as `ggml_numerics` emulates."""
    if softcap > 0:
        raise ValueError("llama.cpp numerics emulate attention without a soft-cap only")
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)  # [B, H, L, D]
    scores = (q.half().to(q.dtype) @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])  # [B, H, Q, L]
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), -1)
    return probs.half().to(q.dtype) @ v


def upload(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A host tensor on the device: pinned and copied `non_blocking` on CUDA (the copy queues behind
    the work in flight instead of waiting for it), the tensor itself on the CPU."""
    device = torch.device(device)
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def fused_available(device: torch.device) -> bool:
    if device.type != "cuda":
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True
