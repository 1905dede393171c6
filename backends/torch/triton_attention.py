"""Fused paged attention for decode rows (one query per sequence), in Triton.

One program per (sequence, query head) walks the sequence's block table and keeps an online
softmax, so keys and values are read once, straight from the paged cache, with no gathered copy.
Quantized caches (int8 / fp8 with per-(token, head) scales) are dequantized in registers.
`attention.PagedAttention` uses it on CUDA; on a CPU the same kernel runs under TRITON_INTERPRET=1
(tests/test_torch_triton.py compares it with the gather path).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl


@triton.jit
def _paged_decode_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    ks_ptr,
    vs_ptr,
    tables_ptr,
    lens_ptr,
    out_ptr,
    sm_scale,
    stride_qb,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_sb,
    stride_st,
    stride_tb,
    stride_ob,
    stride_oh,
    GROUP: tl.constexpr,
    BLOCK: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    QUANTIZED: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // GROUP  # grouped-query attention: GROUP query heads share one KV head
    dims = tl.arange(0, HEAD_DIM)
    slots = tl.arange(0, BLOCK)
    q = tl.load(q_ptr + seq * stride_qb + head * stride_qh + dims).to(tl.float32)
    context = tl.load(lens_ptr + seq)
    m_i = tl.max(tl.full([BLOCK], float("-inf"), tl.float32), 0)  # running max (a scalar)
    l_i = tl.sum(tl.zeros([BLOCK], tl.float32), 0)  # running normaliser
    acc = tl.zeros([HEAD_DIM], tl.float32)
    for i in range(0, tl.cdiv(context, BLOCK)):
        block = tl.load(tables_ptr + seq * stride_tb + i)
        valid = i * BLOCK + slots < context
        offsets = block * stride_kb + slots[:, None] * stride_kt + kv_head * stride_kh + dims[None, :]
        k = tl.load(k_ptr + offsets, mask=valid[:, None], other=0.0).to(tl.float32)  # [BLOCK, HEAD_DIM]
        v = tl.load(v_ptr + offsets, mask=valid[:, None], other=0.0).to(tl.float32)
        if QUANTIZED:
            scale_offsets = block * stride_sb + slots * stride_st + kv_head
            k = k * tl.load(ks_ptr + scale_offsets, mask=valid, other=0.0)[:, None]
            v = v * tl.load(vs_ptr + scale_offsets, mask=valid, other=0.0)[:, None]
        scores = tl.sum(k * q[None, :], 1) * sm_scale  # [BLOCK]
        scores = tl.where(valid, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 0))
        p = tl.exp(scores - m_new)
        correction = tl.exp(m_i - m_new)
        acc = acc * correction + tl.sum(p[:, None] * v, 0)
        l_i = l_i * correction + tl.sum(p, 0)
        m_i = m_new
    tl.store(out_ptr + seq * stride_ob + head * stride_oh + dims, acc / l_i)


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    context_lens: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [B, H, D]; caches [num_blocks, block_size, Hkv, D]; tables [B, max_blocks]; lens [B] -> [B, H, D]."""
    b, n_head, head_dim = q.shape
    _, block_size, n_kv, _ = k_cache.shape
    q = q.contiguous()
    out = torch.empty(b, n_head, head_dim, dtype=torch.float32, device=q.device)
    quantized = k_scale is not None and v_scale is not None
    ks = k_scale if quantized else context_lens  # any tensor: unused when not quantized
    vs = v_scale if quantized else context_lens
    _paged_decode_kernel[(b, n_head)](
        q,
        k_cache,
        v_cache,
        ks,
        vs,
        tables,
        context_lens,
        out,
        1.0 / math.sqrt(head_dim),
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        k_scale.stride(0) if quantized else 0,
        k_scale.stride(1) if quantized else 0,
        tables.stride(0),
        out.stride(0),
        out.stride(1),
        GROUP=n_head // n_kv,
        BLOCK=block_size,
        HEAD_DIM=head_dim,
        QUANTIZED=quantized,
    )
    return out.to(q.dtype)
