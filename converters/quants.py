"""Vectorized numpy encoders for ggml block formats, byte-identical to llama.cpp's reference quantizers.

Every encoder reproduces the `quantize_row_*_ref` path of ggml-quants.c (what `llama-quantize` runs when
no importance matrix is given), or with one the `quantize_row_*_impl` path (section "importance-weighted
encoders" below), operation for operation in float32:

- C evaluates left to right in float32 without FMA (ggml-base is built without -march flags), so every
  product and sum here is a float32 numpy op in the same order: `a*b*c` is `(a*b)*c`.
- C sums loop left to right. numpy's `np.sum` over a contiguous axis is pairwise, so sums here run over
  axis 0 of an element-major array `(n, blocks)`, which numpy adds row after row (sequentially).
- `nearest_int` is ggml's magic-number rounding, reproduced bit for bit (including its wrap-around for
  huge inputs, which later clamps make visible).
- fp16 scales are rounded (round-to-nearest-even, as numpy's astype does) and read back before the
  final re-quantization pass, as C does.

Layouts: a sub-block array is `(n, S)`: element i of every sub-block in row i (S = blocks * sub-blocks
per block, block-major). Encoders take `(nb, block_elems)` float32 and return `(nb, block_bytes)` uint8.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType

QT = GGMLQuantizationType
F32 = np.float32
GROUP_MAX_EPS = F32(1e-15)
_MAGIC = F32(12582912.0)  # 1.5 * 2**23: adding it leaves round-to-nearest-even(f) in the low mantissa bits

# elements per chunk: big enough that numpy's per-call overhead vanishes, small enough for the L2 cache
# (measured on a 2-core x86 box; Q3_K's per-element sweeps want larger chunks)
CHUNK_ELEMS = 1 << 17
CHUNK_ELEMS_BY_TYPE = {GGMLQuantizationType.Q3_K: 1 << 18, GGMLQuantizationType.Q6_K: 1 << 15}


class QuantError(ValueError):
    """A tensor whose rows cannot be cut into blocks of the type (row length not a multiple)."""


# ---- shared helpers ------------------------------------------------------------------------------
def nearest_int(f: np.ndarray) -> np.ndarray:
    """ggml's nearest_int: float32 -> int32, round half to even (bit trick kept for out-of-range inputs)."""
    return ((f + _MAGIC).view(np.int32) & 0x7FFFFF) - 0x400000


def _clamp_f(i: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """Clamp int32 levels and return them as float32 (what `int * float` does in C)."""
    return np.clip(i, lo, hi).astype(F32)


def _seq_sum(a: np.ndarray) -> np.ndarray:
    """Left-to-right float32 sum over axis 0 (numpy adds the rows of an outer axis in order)."""
    return np.add.reduce(a, axis=0)


def _f16_round(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(fp16 bits as uint16, the fp16 value read back as float32), like GGML_FP32_TO_FP16 then back."""
    h = np.asarray(x, dtype=F32).astype(np.float16)
    return h.view(np.uint16), h.astype(F32)


def _first_abs_max(x: np.ndarray, axis: int) -> tuple[np.ndarray, np.ndarray]:
    """(max |x|, the signed x where it first occurs) — C's `if (ax > amax)` keeps the first index.

    Where every |x| is 0, C never updates and returns the initial +0.0.
    """
    ax = np.abs(x)
    idx = np.expand_dims(np.argmax(ax, axis=axis), axis)
    amax = np.take_along_axis(ax, idx, axis).squeeze(axis)
    vmax = np.take_along_axis(x, idx, axis).squeeze(axis)
    return amax, np.where(amax > 0, vmax, F32(0))


def _first_extreme_signed_zero(x: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Give zero extremes the sign of the first element equal to them (C keeps the first of equal values)."""
    zero = v == 0
    if zero.any():
        rows = x[zero]
        v = v.copy()
        v[zero] = rows[np.arange(len(rows)), np.argmax(rows == 0, axis=1)]
    return v


def _pack_2bit(L: np.ndarray) -> np.ndarray:
    """(nb, 256) levels 0..3 -> (nb, 64): byte 32h+l holds L[128h+32s+l] in bits 2s..2s+1."""
    L = L.reshape(-1, 2, 4, 32).astype(np.uint8)
    return (L[:, :, 0] | (L[:, :, 1] << 2) | (L[:, :, 2] << 4) | (L[:, :, 3] << 6)).reshape(-1, 64)


def _to_subblocks(x: np.ndarray, n: int) -> np.ndarray:
    """(nb, 256) -> element-major (n, nb*256/n)."""
    return np.ascontiguousarray(x.reshape(-1, n).T)


def _from_subblocks(a: np.ndarray, nb: int) -> np.ndarray:
    """Inverse of _to_subblocks."""
    return a.T.reshape(nb, -1)


# ---- legacy 32-element types ---------------------------------------------------------------------
def _q8_0(x: np.ndarray) -> np.ndarray:
    amax = np.abs(x).max(axis=1)
    d = amax / F32(127)
    with np.errstate(divide="ignore"):
        inv = np.where(d != 0, F32(1) / d, F32(0)).astype(F32)
    v = (x * inv[:, None]).astype(np.float64)
    qs = np.trunc(v + np.copysign(0.5, v)).astype(np.int8)  # roundf: halves away from zero
    out = np.empty((len(x), 34), np.uint8)
    out[:, :2] = _f16_round(d)[0].view(np.uint8).reshape(-1, 2)
    out[:, 2:] = qs.view(np.uint8)
    return out


def _qx_0(x: np.ndarray, nbits: int) -> np.ndarray:
    """Q4_0 / Q5_0: symmetric, d = max / -2^(b-1), levels truncated from x*id + 2^(b-1) + 0.5."""
    half = 1 << (nbits - 1)
    _, vmax = _first_abs_max(x, 1)
    d = vmax / F32(-half)
    with np.errstate(divide="ignore"):
        inv = np.where(d != 0, F32(1) / d, F32(0)).astype(F32)
    q = np.minimum((x * inv[:, None] + F32(half + 0.5)).astype(np.int32), 2 * half - 1).astype(np.uint8)
    return _pack_legacy(d, None, q, nbits)


def _qx_1(x: np.ndarray, nbits: int) -> np.ndarray:
    """Q4_1 / Q5_1: affine, d = (max-min)/(2^b-1), m = min, levels truncated from (x-min)*id + 0.5."""
    nmax = (1 << nbits) - 1
    mn = _first_extreme_signed_zero(x, x.min(axis=1))
    mx = _first_extreme_signed_zero(x, x.max(axis=1))
    d = (mx - mn) / F32(nmax)
    with np.errstate(divide="ignore"):
        inv = np.where(d != 0, F32(1) / d, F32(0)).astype(F32)
    q = ((x - mn[:, None]) * inv[:, None] + F32(0.5)).astype(np.int32)
    if nbits == 4:
        q = np.minimum(q, 15)  # Q5_1's C code has no MIN: its levels cannot exceed 31
    return _pack_legacy(d, mn, q.astype(np.uint8), nbits)


def _pack_legacy(d: np.ndarray, m: np.ndarray | None, q: np.ndarray, nbits: int) -> np.ndarray:
    """Layout: d f16, [m f16], [qh u32 for 5-bit], qs[16] (q[j] low nibble, q[j+16] high nibble)."""
    parts = [_f16_round(d)[0].view(np.uint8).reshape(-1, 2)]
    if m is not None:
        parts.append(_f16_round(m)[0].view(np.uint8).reshape(-1, 2))
    if nbits == 5:
        bits = ((q >> 4) & 1).astype(np.uint32) << np.arange(32, dtype=np.uint32)  # bit j = 5th bit of q[j]
        parts.append(np.bitwise_or.reduce(bits, axis=1).astype("<u4").view(np.uint8).reshape(-1, 4))
    parts.append((q[:, :16] & 0xF) | ((q[:, 16:] & 0xF) << 4))
    return np.concatenate(parts, axis=1)


# ---- k-quant helpers (ggml-quants.c: make_qkx2_quants, make_qx_quants, make_q3_quants) -----------
def _levels(iscale: np.ndarray, xm: np.ndarray, lo: int, hi: int, in_range: bool) -> np.ndarray:
    """clamp(nearest_int(iscale * xm), lo, hi) as float32.

    When every |iscale * xm| is known to be below 2**22, rounding by adding the magic number and
    clamping in float gives the same levels with fewer passes; otherwise take the exact integer path.
    """
    v = iscale * xm
    if not in_range:
        return _clamp_f(nearest_int(v), lo, hi)
    v += _MAGIC
    np.clip(v, _MAGIC + F32(lo), _MAGIC + F32(hi), out=v)
    v -= _MAGIC
    return v


def _make_qkx2(
    x: np.ndarray, w: np.ndarray, nmax: int, rmin: float, rdelta: float, nstep: int, use_mad: bool
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Affine scale/min search. x, w: (n, S). Returns (L (n,S) float32 levels, scale (S,), the_min (S,)).

    The candidate steps run in order because an accepted candidate moves `min`, which later steps use.
    """
    xmin = x.min(axis=0)
    zero_min = xmin == 0
    if zero_min.any():  # C keeps the first of equal values: the min's zero has the first zero's sign
        cols = np.flatnonzero(zero_min)
        xmin[cols] = x[np.argmax(x[:, cols] == 0, axis=0), cols]
    mn0 = np.where(xmin > 0, F32(0), xmin)  # C: if (min > 0) min = 0
    mx = x.max(axis=0)
    flat = mx == mn0  # C returns early: L = 0, scale 0, the_min = -min
    sum_w = _seq_sum(w)
    sum_x = _seq_sum(w * x)

    def error(scale: np.ndarray, L: np.ndarray, m: np.ndarray) -> np.ndarray:
        diff = scale * L
        diff += m
        diff -= x
        if use_mad:
            np.abs(diff, out=diff)
        else:
            diff *= diff
        diff *= w
        return F32(0) + _seq_sum(diff)  # C starts the sum at 0.0f

    def in_range(iscale: np.ndarray, mn: np.ndarray) -> bool:
        bound = np.abs(iscale) * np.maximum(np.abs(mx - mn), np.abs(xmin - mn))
        return bool(bound.max() < 4e6)  # NaN compares False: exact path

    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        mn = mn0
        rng = np.where(flat, F32(1), mx - mn)  # flat sub-blocks are overwritten at the end
        iscale = F32(nmax) / rng
        scale = F32(1) / iscale
        xm = x - mn
        L = _levels(iscale, xm, 0, nmax, in_range(iscale, mn))
        best = error(scale, L, mn)
        for step in range(nstep + 1):
            num = F32(F32(rmin) + F32(rdelta) * F32(step)) + F32(nmax)
            iscale = num / np.where(flat, F32(1), mx - mn)
            La = _levels(iscale, xm, 0, nmax, in_range(iscale, mn))
            wl = w * La
            sum_l = _seq_sum(wl)
            sum_l2 = _seq_sum(wl * La)
            wl *= x
            sum_xl = _seq_sum(wl)
            D = sum_w * sum_l2 - sum_l * sum_l
            this_scale = (sum_w * sum_xl - sum_x * sum_l) / D
            this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D
            pos = this_min > 0
            this_min = np.where(pos, F32(0), this_min)
            this_scale = np.where(pos, sum_xl / sum_l2, this_scale)
            cur = error(this_scale, La, this_min)
            take = (D > 0) & (cur < best)
            if not take.any():
                continue
            L = np.where(take, La, L)
            best = np.where(take, cur, best)
            scale = np.where(take, this_scale, scale)
            mn = np.where(take, this_min, mn)
            xm = x - mn
    L = np.where(flat, F32(0), L)
    scale = np.where(flat, F32(0), scale)
    return L, scale, -np.where(flat, mn0, mn)


def _make_qx(x: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray]:
    """make_qx_quants with rmse_type=1 and no weights (Q6_K): 19 symmetric scale candidates.

    x: (n, S). Returns (L (n,S) int levels 0..2*nmax-1, scale (S,)).
    """
    amax, vmax = _first_abs_max(x, 0)
    zero = amax < GROUP_MAX_EPS
    steps = [0, *range(-9, 0), *range(1, 10)]  # the initial guess, then C's is=-9..9 without 0
    w = x * x
    wx = w * x
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        vmax = np.where(zero, F32(1), vmax)  # zero sub-blocks are overwritten below
        pick = np.zeros(x.shape[1], F32)
        for c, step in enumerate(steps):
            iscale = -(F32(nmax) + F32(0.1) * F32(step)) / vmax
            lv = _levels(iscale, x, -nmax, nmax - 1, True)  # |iscale * x| <= nmax + 1 by construction
            sumlx = _seq_sum(wx * lv)
            suml2 = _seq_sum((w * lv) * lv)
            if c == 0:
                scale = np.where(suml2 != 0, sumlx / suml2, F32(0))
                best = scale * sumlx
                pick = iscale
                continue
            take = (suml2 > 0) & (sumlx * sumlx > best * suml2)
            pick = np.where(take, iscale, pick)
            scale = np.where(take, sumlx / suml2, scale)
            best = np.where(take, scale * sumlx, best)
    L = np.clip(nearest_int(pick * x), -nmax, nmax - 1) + nmax
    L[:, zero] = 0
    return L, np.where(zero, F32(0), scale)


def _make_q3(x: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray]:
    """make_q3_quants with do_rmse (Q3_K): initial symmetric guess, then coordinate-descent sweeps.

    x: (n, S). Returns (L (n,S) int levels 0..2*nmax-1, scale (S,)).
    """
    n = x.shape[0]
    amax, vmax = _first_abs_max(x, 0)
    zero = amax < GROUP_MAX_EPS
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        iscale = F32(-nmax) / vmax
        L = _clamp_f(nearest_int(iscale * x), -nmax, nmax - 1)
        w = x * x
        wx = w * x
        sumlx = F32(0) + _seq_sum(wx * L)
        suml2 = F32(0) + _seq_sum((w * L) * L)
        # A sweep that changes nothing in a sub-block leaves its state as it was, so the next sweep
        # would change nothing either: each sweep only revisits the sub-blocks the previous one changed.
        active = np.arange(x.shape[1])
        for _ in range(5):
            xa, wa, wxa, La = x[:, active], w[:, active], wx[:, active], L[:, active]
            slx_a, sl2_a = sumlx[active], suml2[active]
            changed = np.zeros(len(active), bool)
            for i in range(n):
                Li = La[i]
                slx0 = slx_a - wxa[i] * Li
                sl2 = sl2_a - (wa[i] * Li) * Li
                new = _clamp_f(nearest_int((xa[i] * sl2) / slx0), -nmax, nmax - 1)
                slx = slx0 + wxa[i] * new
                sl2 = sl2 + (wa[i] * new) * new
                take = (slx0 > 0) & (new != Li) & (sl2 > 0) & ((slx * slx) * sl2_a > (slx_a * slx_a) * sl2)
                La[i] = np.where(take, new, Li)
                slx_a = np.where(take, slx, slx_a)
                sl2_a = np.where(take, sl2, sl2_a)
                changed |= take
            L[:, active], sumlx[active], suml2[active] = La, slx_a, sl2_a
            active = active[changed]
            if not len(active):
                break
        scale = np.where(suml2 > 0, sumlx / suml2, F32(0))
    Li = L.astype(np.int32) + nmax
    Li[:, zero] = 0
    return Li, np.where(zero, F32(0), scale)


def _abs_max_signed(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per block (rows of s): (max |s|, the signed s where it first occurs; 0 if all are 0)."""
    return _first_abs_max(s, 1)


# ---- k-quants (256-element super-blocks) ---------------------------------------------------------
def _q2_k(x: np.ndarray) -> np.ndarray:
    nb = len(x)
    xs = _to_subblocks(x, 16)  # (16, nb*16)
    L, scales, mins = _make_qkx2(xs, np.abs(xs), 3, -0.5, 0.1, 15, True)
    scales, mins = scales.reshape(nb, 16), mins.reshape(nb, 16)
    max_scale = np.maximum(scales.max(axis=1), F32(0))
    max_min = np.maximum(mins.max(axis=1), F32(0))
    with np.errstate(divide="ignore", invalid="ignore"):
        isc = F32(15) / max_scale
        imn = F32(15) / max_min
        sc = np.where(max_scale[:, None] > 0, nearest_int(isc[:, None] * scales), 0) & 0xFF
        sc = sc | (np.where(max_min[:, None] > 0, nearest_int(imn[:, None] * mins), 0) << 4) & 0xFF
        d16, d = _f16_round(np.where(max_scale > 0, max_scale / F32(15), F32(0)))
        m16, dmin = _f16_round(np.where(max_min > 0, max_min / F32(15), F32(0)))
        dl = (d[:, None] * (sc & 0xF).astype(F32)).reshape(1, -1)  # (1, nb*16)
        ml = (dmin[:, None] * (sc >> 4).astype(F32)).reshape(1, -1)
        requant = _clamp_f(nearest_int((xs + ml) / dl), 0, 3)
        L = np.where(dl != 0, requant, L)
    out = np.empty((nb, 84), np.uint8)
    out[:, :16] = sc
    out[:, 16:80] = _pack_2bit(_from_subblocks(L, nb))
    out[:, 80:82] = d16.view(np.uint8).reshape(-1, 2)
    out[:, 82:84] = m16.view(np.uint8).reshape(-1, 2)
    return out


def _q3_k(x: np.ndarray) -> np.ndarray:
    nb = len(x)
    xs = _to_subblocks(x, 16)
    L, scales = _make_q3(xs, 4)
    scales = scales.reshape(nb, 16)
    amax, max_scale = _abs_max_signed(scales)
    has = max_scale != 0
    with np.errstate(divide="ignore", invalid="ignore"):
        iscale = F32(-32) / max_scale
        l6 = nearest_int(iscale[:, None] * scales)
        l6 = ((l6 + 128) & 0xFF) - 128  # int8_t l = nearest_int(...)
        l6 = np.where(has[:, None], np.clip(l6, -32, 31) + 32, 0)
        d16, d = _f16_round(np.where(has, F32(1) / iscale, F32(0)))
        sc = (l6 - 32).astype(F32)  # what C unpacks again (all-zero bytes unpack to -32, with d = 0)
        dl = (d[:, None] * sc).reshape(1, -1)
        requant = nearest_int(xs / dl)
        L = np.where(dl != 0, np.clip(requant, -4, 3) + 4, L)
    L = _from_subblocks(L, nb).astype(np.uint8)  # (nb, 256) levels 0..7
    hbit = L >> 2  # the level's high bit goes to hmask: bit k of hmask[m] for element 32k+m
    hmask = np.bitwise_or.reduce(
        hbit.reshape(nb, 8, 32) << np.arange(8, dtype=np.uint8)[None, :, None], axis=1
    )
    l6 = l6.astype(np.uint8)
    scb = np.zeros((nb, 12), np.uint8)
    scb[:, :8] = (l6[:, :8] & 0xF) | ((l6[:, 8:] & 0xF) << 4)
    hi = (l6 >> 4).reshape(nb, 4, 4)  # [j // 4, j % 4]
    scb[:, 8:] = hi[:, 0] | (hi[:, 1] << 2) | (hi[:, 2] << 4) | (hi[:, 3] << 6)
    out = np.empty((nb, 110), np.uint8)
    out[:, :32] = hmask
    out[:, 32:96] = _pack_2bit(L & 3)
    out[:, 96:108] = scb
    out[:, 108:110] = d16.view(np.uint8).reshape(-1, 2)
    return out


def _kx_scales(x: np.ndarray, nmax: int, rmin: float, nstep: int) -> tuple[np.ndarray, ...]:
    """Shared first half of Q4_K/Q5_K: 8 sub-blocks of 32, 6-bit scales and mins, requantized levels."""
    nb = len(x)
    xs = _to_subblocks(x, 32)  # (32, nb*8)
    av_x = np.sqrt(F32(0) + _seq_sum(xs * xs) / F32(32))
    L, scales, mins = _make_qkx2(xs, av_x + np.abs(xs), nmax, rmin, 0.1, nstep, False)
    scales, mins = scales.reshape(nb, 8), mins.reshape(nb, 8)
    max_scale = np.maximum(scales.max(axis=1), F32(0))
    max_min = np.maximum(mins.max(axis=1), F32(0))
    with np.errstate(divide="ignore", invalid="ignore"):
        inv_scale = np.where(max_scale > 0, F32(63) / max_scale, F32(0))
        inv_min = np.where(max_min > 0, F32(63) / max_min, F32(0))
    ls = np.minimum(nearest_int(inv_scale[:, None] * scales) & 0xFF, 63)  # uint8_t, then MIN(63, .)
    lm = np.minimum(nearest_int(inv_min[:, None] * mins) & 0xFF, 63)
    d16, d = _f16_round(max_scale / F32(63))
    m16, dmin = _f16_round(max_min / F32(63))
    dl = (d[:, None] * ls.astype(F32)).reshape(1, -1)
    ml = (dmin[:, None] * lm.astype(F32)).reshape(1, -1)
    with np.errstate(divide="ignore", invalid="ignore"):
        requant = _clamp_f(nearest_int((xs + ml) / dl), 0, nmax)
    L = np.where(dl != 0, requant, L)
    ls, lm = ls.astype(np.uint8), lm.astype(np.uint8)
    scb = np.empty((nb, 12), np.uint8)
    scb[:, 0:4] = ls[:, :4] | ((ls[:, 4:] >> 4) << 6)
    scb[:, 4:8] = lm[:, :4] | ((lm[:, 4:] >> 4) << 6)
    scb[:, 8:12] = (ls[:, 4:] & 0xF) | ((lm[:, 4:] & 0xF) << 4)
    head = np.concatenate([d16.view(np.uint8).reshape(-1, 2), m16.view(np.uint8).reshape(-1, 2), scb], axis=1)
    return head, _from_subblocks(L, nb).astype(np.uint8)


def _q4_k(x: np.ndarray) -> np.ndarray:
    head, L = _kx_scales(x, 15, -1.0, 20)
    L = L.reshape(-1, 4, 2, 32)  # [chunk c, half, l]: element 64c + 32*half + l
    qs = (L[:, :, 0] | (L[:, :, 1] << 4)).reshape(-1, 128)
    return np.concatenate([head, qs], axis=1)


def _q5_k(x: np.ndarray) -> np.ndarray:
    head, L = _kx_scales(x, 31, -0.5, 15)
    L = L.reshape(-1, 4, 2, 32)
    qs = ((L[:, :, 0] & 0xF) | ((L[:, :, 1] & 0xF) << 4)).reshape(-1, 128)
    hb = (L >> 4).reshape(-1, 8, 32)  # bit 2c+half of qh[l] = 5th bit of element 64c + 32*half + l
    qh = np.bitwise_or.reduce(hb << np.arange(8, dtype=np.uint8)[None, :, None], axis=1)
    return np.concatenate([head, qh, qs], axis=1)


def _q6_k(x: np.ndarray) -> np.ndarray:
    nb = len(x)
    xs = _to_subblocks(x, 16)
    L, scales = _make_qx(xs, 32)
    scales = scales.reshape(nb, 16)
    max_abs, max_scale = _abs_max_signed(scales)
    zero = max_abs < GROUP_MAX_EPS
    with np.errstate(divide="ignore", invalid="ignore"):
        iscale = F32(-128) / max_scale
        sc = np.minimum(nearest_int(iscale[:, None] * scales), 127)
        sc = ((sc + 128) & 0xFF) - 128  # stored as int8_t
        d16, d = _f16_round(F32(1) / iscale)
        dl = (d[:, None] * sc.astype(F32)).reshape(1, -1)
        requant = np.clip(nearest_int(xs / dl), -32, 31) + 32
        L = np.where(dl != 0, requant, L)
    L = _from_subblocks(L, nb).astype(np.uint8).reshape(nb, 2, 4, 32)  # [half h, quarter q, l]
    ql = np.empty((nb, 2, 2, 32), np.uint8)
    ql[:, :, 0] = (L[:, :, 0] & 0xF) | ((L[:, :, 2] & 0xF) << 4)
    ql[:, :, 1] = (L[:, :, 1] & 0xF) | ((L[:, :, 3] & 0xF) << 4)
    hb = L >> 4
    qh = hb[:, :, 0] | (hb[:, :, 1] << 2) | (hb[:, :, 2] << 4) | (hb[:, :, 3] << 6)
    out = np.concatenate(
        [
            ql.reshape(nb, 128),
            qh.reshape(nb, 64),
            sc.astype(np.int8).view(np.uint8),
            d16.view(np.uint8).reshape(-1, 2),
        ],
        axis=1,
    )
    out[zero] = 0  # C zeroes the whole block when every sub-block scale is ~0
    return out


# ---- importance-weighted encoders and IQ4 (ggml-quants.c `quantize_row_*_impl`) ------------------
# With an importance matrix qw (one value per input column: the mean square of the activations that
# column multiplies), ggml-quants.c replaces the reference encoders by searches that minimize the
# weighted squared error, with per-element weights qw_j * sqrt(sigma2 + x_j^2): sigma2 is the mean
# square of the whole row for Q4_0/Q4_1/Q5_0/Q5_1, of the 256-element super-block for Q2_K (factor 1)
# and Q3_K/Q4_K/Q5_K (factor 2), of the 32- or 256-element block for IQ4 (factor 2); Q6_K weights by qw
# itself. The 32-block types and the k-quants' sub-blocks run make_qx_quants (symmetric) or
# make_qkx3_quants (affine); the k-quants' sub-block scales are quantized with make_qp_quants (Q2/Q4/
# Q5_K) or make_qx_quants (Q3_K), weighted by each sub-block's total weight. IQ4_NL / IQ4_XS map onto a
# fixed 16-value grid, with or without qw (without it the weights are x^2). Weighted encoders take
# (nb, block) values, the same-shape weights and the per-block row sigma2 (used by the 32-block types).
# kvalues_iq4nl (ggml-common.h): the IQ4 grid, sorted and asymmetric
IQ4_GRID = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.int8)
_GRID_F = IQ4_GRID.astype(F32)
IQ4_NTRY = 7  # what quantize_iq4_nl / quantize_iq4_xs pass (llama-quantize's path)


# ---- helpers ---------------------------------------------------------------------------------------
def _weights(xs: np.ndarray, qw: np.ndarray, sigma2: np.ndarray) -> np.ndarray:
    """qw * sqrtf(sigma2 + x*x), element-major (n, S) with sigma2 broadcast over rows."""
    return qw * np.sqrt(sigma2 + xs * xs)


def _block_sigma2(x: np.ndarray, factor: float) -> np.ndarray:
    """factor * (sequential sum of x^2 over each 256-element block) / 256, per block."""
    sq = np.ascontiguousarray((x * x).T)  # (256, nb): the sum runs over the outer axis, in order
    s = F32(0) + _seq_sum(sq)
    if factor != 1:
        s = F32(factor) * s
    return s / F32(x.shape[1])


def _make_qx_w(x: np.ndarray, w: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray]:
    """make_qx_quants(n, nmax, x, L, rmse_type=1, w) over element-major (n, S): (L 0..2nmax-1, scale)."""
    amax, vmax = _first_abs_max(x, 0)
    zero = amax < GROUP_MAX_EPS
    wx = w * x
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        vmax = np.where(zero, F32(1), vmax)
        pick = np.zeros(x.shape[1], F32)
        scale = best = pick
        for c, step in enumerate([0, *range(-9, 0), *range(1, 10)]):
            iscale = -(F32(nmax) + F32(0.1) * F32(step)) / vmax
            lv = _levels(iscale, x, -nmax, nmax - 1, True)
            sumlx = F32(0) + _seq_sum(wx * lv)
            suml2 = F32(0) + _seq_sum((w * lv) * lv)
            if c == 0:
                scale = np.where(suml2 != 0, sumlx / suml2, F32(0))
                best = scale * sumlx
                pick = iscale
                continue
            take = (suml2 > 0) & (sumlx * sumlx > best * suml2)
            pick = np.where(take, iscale, pick)
            scale = np.where(take, sumlx / suml2, scale)
            best = np.where(take, scale * sumlx, best)
    L = np.clip(nearest_int(pick * x), -nmax, nmax - 1) + nmax
    L[:, zero] = 0
    return L, np.where(zero, F32(0), scale)


def _make_qp(x: np.ndarray, w: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray]:
    """make_qp_quants(n, nmax, x >= 0, L, w) over element-major (n, S): (L int32 0..nmax, scale)."""
    n = x.shape[0]
    mx = np.maximum(F32(0), x.max(axis=0))
    zero = mx < GROUP_MAX_EPS
    safe = np.where(zero, F32(1), mx)

    def mse(iscale: np.ndarray, clamp: bool) -> np.ndarray:
        lv = nearest_int(iscale * x)
        if clamp:
            lv = np.minimum(lv, nmax)
        diff = x - (F32(1) / iscale) * lv.astype(F32)
        return F32(0) + _seq_sum((w * diff) * diff)

    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        iscale = F32(nmax) / safe
        best = mse(iscale, False)
        for step in (-4, -3, -2, -1, 1, 2, 3, 4):
            cand = (F32(F32(0.1) * F32(step)) + F32(nmax)) / safe
            cur = mse(cand, True)
            take = cur < best
            best = np.where(take, cur, best)
            iscale = np.where(take, cand, iscale)
        L = np.minimum(nearest_int(iscale * x), nmax)
        wx = w * x
        Lf = L.astype(F32)
        sumlx = F32(0) + _seq_sum(wx * Lf)
        suml2 = F32(0) + _seq_sum((w * Lf) * Lf)
        for _ in range(5):  # a sweep that changes nothing leaves the state as it was: run all five
            for i in range(n):
                Li = L[i].astype(F32)
                slx = sumlx - wx[i] * Li
                sl2 = suml2 - (w[i] * Li) * Li
                new = np.minimum(nearest_int((x[i] * sl2) / slx), nmax)
                nf = new.astype(F32)
                slx2 = slx + wx[i] * nf
                sl22 = sl2 + (w[i] * nf) * nf
                take = (
                    (slx > 0) & (sl2 > 0) & (new != L[i]) & ((slx2 * slx2) * suml2 > (sumlx * sumlx) * sl22)
                )
                L[i] = np.where(take, new, L[i])
                sumlx = np.where(take, slx2, sumlx)
                suml2 = np.where(take, sl22, suml2)
        scale = np.where(suml2 > 0, sumlx / suml2, F32(0))
    L[:, zero] = 0
    return L, np.where(zero, F32(0), scale)


def _qkx3(xs: np.ndarray, w: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """make_qkx3_quants(n, nmax, x, w, L, &the_min, Laux, -0.9, 0.05, 36, false).

    Same search as make_qkx2_quants (which quants.py ports); the early exit on `max <= min` and the
    `D > 0` guard give the same results as qkx2's `max == min` exit and its `take` mask.
    """
    return _make_qkx2(xs, w, nmax, -0.9, 0.05, 36, False)


# ---- 32-element types ------------------------------------------------------------------------------
def _legacy_weights(x: np.ndarray, qw: np.ndarray, row_sigma2: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    xs = np.ascontiguousarray(x.T)  # (32, nb)
    return xs, _weights(xs, np.ascontiguousarray(qw.T), row_sigma2[None, :])


def _qx_0_w(x: np.ndarray, qw: np.ndarray, row_sigma2: np.ndarray, nbits: int) -> np.ndarray:
    xs, w = _legacy_weights(x, qw, row_sigma2)
    L, d = _make_qx_w(xs, w, 1 << (nbits - 1))
    return _pack_legacy(d, None, L.T.astype(np.uint8), nbits)


def _qx_1_w(x: np.ndarray, qw: np.ndarray, row_sigma2: np.ndarray, nbits: int) -> np.ndarray:
    xs, w = _legacy_weights(x, qw, row_sigma2)
    L, d, the_min = _qkx3(xs, w, (1 << nbits) - 1)
    return _pack_legacy(d, -the_min, L.T.astype(np.uint8), nbits)


# ---- k-quants --------------------------------------------------------------------------------------
def _q2_k_w(x: np.ndarray, qw: np.ndarray, _: np.ndarray) -> np.ndarray:
    nb = len(x)
    xs = _to_subblocks(x, 16)  # (16, nb*16)
    sigma2 = np.repeat(_block_sigma2(x, 1), 16)
    w = _weights(xs, _to_subblocks(qw, 16), sigma2[None, :])
    sw = F32(0) + _seq_sum(w)
    L, scales, mins = _qkx3(xs, w, 3)
    sw16 = np.ascontiguousarray(sw.reshape(nb, 16).T)
    Ls, dm = _make_qp(np.ascontiguousarray(scales.reshape(nb, 16).T), sw16, 15)
    Lm, mm = _make_qp(np.ascontiguousarray(mins.reshape(nb, 16).T), sw16, 15)
    sc = (Ls.T | (Lm.T << 4)) & 0xFF  # (nb, 16)
    d16, d = _f16_round(dm)
    m16, dmin = _f16_round(mm)
    dl = (d[:, None] * (sc & 0xF).astype(F32)).reshape(1, -1)
    ml = (dmin[:, None] * (sc >> 4).astype(F32)).reshape(1, -1)
    with np.errstate(divide="ignore", invalid="ignore"):
        requant = _clamp_f(nearest_int((xs + ml) / dl), 0, 3)
    L = np.where(dl != 0, requant, L)
    out = np.empty((nb, 84), np.uint8)
    out[:, :16] = sc
    out[:, 16:80] = _pack_2bit(_from_subblocks(L, nb))
    out[:, 80:82] = d16.view(np.uint8).reshape(-1, 2)
    out[:, 82:84] = m16.view(np.uint8).reshape(-1, 2)
    return out


def _q3_k_w(x: np.ndarray, qw: np.ndarray, _: np.ndarray) -> np.ndarray:
    nb = len(x)
    xs = _to_subblocks(x, 16)
    sigma2 = np.repeat(_block_sigma2(x, 2), 16)
    w = _weights(xs, _to_subblocks(qw, 16), sigma2[None, :])
    sw = F32(0) + _seq_sum(w)
    L, scales = _make_qx_w(xs, w, 4)
    Ls, d_block = _make_qx_w(
        np.ascontiguousarray(scales.reshape(nb, 16).T), np.ascontiguousarray(sw.reshape(nb, 16).T), 32
    )
    l6 = Ls.T.astype(np.int32)  # (nb, 16), stored as l + 32
    d16, d = _f16_round(d_block)
    dl = (d[:, None] * (l6 - 32).astype(F32)).reshape(1, -1)
    with np.errstate(divide="ignore", invalid="ignore"):
        requant = nearest_int(xs / dl)
        L = np.where(dl != 0, np.clip(requant, -4, 3) + 4, L)
    return _pack_q3_k(_from_subblocks(L, nb).astype(np.uint8), l6.astype(np.uint8), d16)


def _pack_q3_k(L: np.ndarray, l6: np.ndarray, d16: np.ndarray) -> np.ndarray:
    """(nb, 256) levels 0..7, (nb, 16) 6-bit scales, fp16 d bits -> Q3_K blocks."""
    nb = len(L)
    hmask = np.bitwise_or.reduce(
        (L >> 2).reshape(nb, 8, 32) << np.arange(8, dtype=np.uint8)[None, :, None], axis=1
    )
    scb = np.zeros((nb, 12), np.uint8)
    scb[:, :8] = (l6[:, :8] & 0xF) | ((l6[:, 8:] & 0xF) << 4)
    hi = (l6 >> 4).reshape(nb, 4, 4)
    scb[:, 8:] = hi[:, 0] | (hi[:, 1] << 2) | (hi[:, 2] << 4) | (hi[:, 3] << 6)
    out = np.empty((nb, 110), np.uint8)
    out[:, :32] = hmask
    out[:, 32:96] = _pack_2bit(L & 3)
    out[:, 96:108] = scb
    out[:, 108:110] = d16.view(np.uint8).reshape(-1, 2)
    return out


def _kx_w(x: np.ndarray, qw: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K with weights: (12+4 header bytes, (nb, 256) levels)."""
    nb = len(x)
    xs = _to_subblocks(x, 32)  # (32, nb*8)
    sigma2 = np.repeat(_block_sigma2(x, 2), 8)
    w = _weights(xs, _to_subblocks(qw, 32), sigma2[None, :])
    sw = np.ascontiguousarray((F32(0) + _seq_sum(w)).reshape(nb, 8).T)
    L, scales, mins = _qkx3(xs, w, nmax)
    Ls, d_block = _make_qp(np.ascontiguousarray(scales.reshape(nb, 8).T), sw, 63)
    Lm, m_block = _make_qp(np.ascontiguousarray(mins.reshape(nb, 8).T), sw, 63)
    ls, lm = np.minimum(Ls.T, 63), np.minimum(Lm.T, 63)  # (nb, 8)
    d16, d = _f16_round(d_block)
    m16, dmin = _f16_round(m_block)
    dl = (d[:, None] * ls.astype(F32)).reshape(1, -1)
    ml = (dmin[:, None] * lm.astype(F32)).reshape(1, -1)
    with np.errstate(divide="ignore", invalid="ignore"):
        requant = _clamp_f(nearest_int((xs + ml) / dl), 0, nmax)
    L = np.where(dl != 0, requant, L)
    ls, lm = ls.astype(np.uint8), lm.astype(np.uint8)
    scb = np.empty((nb, 12), np.uint8)
    scb[:, 0:4] = ls[:, :4] | ((ls[:, 4:] >> 4) << 6)
    scb[:, 4:8] = lm[:, :4] | ((lm[:, 4:] >> 4) << 6)
    scb[:, 8:12] = (ls[:, 4:] & 0xF) | ((lm[:, 4:] & 0xF) << 4)
    head = np.concatenate([d16.view(np.uint8).reshape(-1, 2), m16.view(np.uint8).reshape(-1, 2), scb], axis=1)
    return head, _from_subblocks(L, nb).astype(np.uint8)


def _q4_k_w(x: np.ndarray, qw: np.ndarray, _: np.ndarray) -> np.ndarray:
    head, L = _kx_w(x, qw, 15)
    L = L.reshape(-1, 4, 2, 32)
    return np.concatenate([head, (L[:, :, 0] | (L[:, :, 1] << 4)).reshape(-1, 128)], axis=1)


def _q5_k_w(x: np.ndarray, qw: np.ndarray, _: np.ndarray) -> np.ndarray:
    head, L = _kx_w(x, qw, 31)
    L = L.reshape(-1, 4, 2, 32)
    qs = ((L[:, :, 0] & 0xF) | ((L[:, :, 1] & 0xF) << 4)).reshape(-1, 128)
    hb = (L >> 4).reshape(-1, 8, 32)
    qh = np.bitwise_or.reduce(hb << np.arange(8, dtype=np.uint8)[None, :, None], axis=1)
    return np.concatenate([head, qh, qs], axis=1)


def _q6_k_w(x: np.ndarray, qw: np.ndarray, _: np.ndarray) -> np.ndarray:
    nb = len(x)
    xs = _to_subblocks(x, 16)
    L, scales = _make_qx_w(xs, _to_subblocks(qw, 16), 32)  # Q6_K weights by qw alone
    scales = scales.reshape(nb, 16)
    max_abs, max_scale = _abs_max_signed(scales)
    zero = max_abs < GROUP_MAX_EPS
    with np.errstate(divide="ignore", invalid="ignore"):
        iscale = F32(-128) / max_scale
        sc = np.minimum(nearest_int(iscale[:, None] * scales), 127)
        sc = ((sc + 128) & 0xFF) - 128
        d16, d = _f16_round(F32(1) / iscale)
        dl = (d[:, None] * sc.astype(F32)).reshape(1, -1)
        requant = np.clip(nearest_int(xs / dl), -32, 31) + 32
        L = np.where(dl != 0, requant, L)
    L = _from_subblocks(L, nb).astype(np.uint8).reshape(nb, 2, 4, 32)
    ql = np.empty((nb, 2, 2, 32), np.uint8)
    ql[:, :, 0] = (L[:, :, 0] & 0xF) | ((L[:, :, 2] & 0xF) << 4)
    ql[:, :, 1] = (L[:, :, 1] & 0xF) | ((L[:, :, 3] & 0xF) << 4)
    hb = L >> 4
    qh = hb[:, :, 0] | (hb[:, :, 1] << 2) | (hb[:, :, 2] << 4) | (hb[:, :, 3] << 6)
    out = np.concatenate(
        [
            ql.reshape(nb, 128),
            qh.reshape(nb, 64),
            sc.astype(np.int8).view(np.uint8),
            d16.view(np.uint8).reshape(-1, 2),
        ],
        axis=1,
    )
    out[zero] = 0
    return out


# ---- IQ4_NL / IQ4_XS -------------------------------------------------------------------------------
# hi = how many grid values are <= v, clamped to 1..15; the grid is integer, so floor(v) decides
_HI_BY_FLOOR = np.clip(np.searchsorted(IQ4_GRID.astype(np.int32), np.arange(-128, 115), side="right"), 1, 15)


def best_index(v: np.ndarray) -> np.ndarray:
    """best_index_int8 on the IQ4 grid: the nearest grid index, a tie going to the upper value.

    The final choice between the two neighbours is C's float32 test `v - K[lo] < K[hi] - v`.
    """
    f = np.floor(np.clip(v, F32(-128), F32(114))).astype(np.int16)
    hi = _HI_BY_FLOOR[np.clip(f, -128, 114) + 128]  # the clip keeps NaN inputs in range
    lo = hi - 1
    idx = np.where((v - _GRID_F[lo]) < (_GRID_F[hi] - v), lo, hi)
    idx = np.where(v <= _GRID_F[0], 0, idx)
    return np.where(v >= _GRID_F[15], 15, idx).astype(np.uint8)


def _iq4_block_scales(xs: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Steps 2-6 of quantize_row_iq4_nl_impl per 32-element block (element-major (32, S)): the scale."""
    amax, vmax = _first_abs_max(xs, 0)
    zero = amax < GROUP_MAX_EPS
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        vmax = np.where(zero, F32(1), vmax)
        d = -vmax / _GRID_F[0]
        q = _GRID_F[best_index((F32(1) / d) * xs)]
        sumqx = F32(0) + _seq_sum((w * q) * xs)
        sumq2 = F32(0) + _seq_sum((w * q) * q)
        d = np.where(sumq2 > 0, sumqx / sumq2, F32(0))
        best = d * sumqx
        for t in range(-IQ4_NTRY, IQ4_NTRY + 1):
            inv = F32(t + int(IQ4_GRID[0])) / vmax
            q = _GRID_F[best_index(inv * xs)]
            sumqx = F32(0) + _seq_sum((w * q) * xs)
            sumq2 = F32(0) + _seq_sum((w * q) * q)
            take = (sumq2 > 0) & (sumqx * sumqx > best * sumq2)
            d = np.where(take, sumqx / sumq2, d)
            best = np.where(take, d * sumqx, best)
    return np.where(zero, F32(0), d)


def _iq4_weights(x: np.ndarray, qw: np.ndarray | None, super_block: int) -> tuple[np.ndarray, np.ndarray]:
    """Element-major 32-blocks and their weights (x^2 without an imatrix)."""
    xs = _to_subblocks(x, 32)
    if qw is None:
        return xs, xs * xs
    sq = np.ascontiguousarray((x * x).T)
    sigma2 = (F32(0) + _seq_sum(sq)) * F32(2.0 / super_block)
    return xs, _weights(xs, _to_subblocks(qw, 32), np.repeat(sigma2, super_block // 32)[None, :])


def _inv(d: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore"):
        return np.where(d != 0, F32(1) / d, F32(0)).astype(F32)


def _pack_nibbles(L: np.ndarray) -> np.ndarray:
    """(nb, 32k) indices -> (nb, 16k): per 32 elements, byte j = L[j] | L[j+16] << 4."""
    L = L.reshape(len(L), -1, 2, 16)
    return (L[:, :, 0] | (L[:, :, 1] << 4)).reshape(len(L), -1)


def iq4_nl(x: np.ndarray, qw: np.ndarray | None = None) -> np.ndarray:
    """(nb, 32) -> (nb, 18) IQ4_NL blocks (quantize_iq4_nl, ntry 7)."""
    xs, w = _iq4_weights(x, qw, 32)
    scale = _iq4_block_scales(xs, w)
    d16, _ = _f16_round(scale)
    L = best_index(_inv(scale) * x.T).T  # from the f32 scale, not its fp16 rounding
    return np.concatenate([d16.view(np.uint8).reshape(-1, 2), _pack_nibbles(L)], axis=1)


def iq4_xs(x: np.ndarray, qw: np.ndarray | None = None) -> np.ndarray:
    """(nb, 256) -> (nb, 136) IQ4_XS blocks (quantize_iq4_xs, ntry 7)."""
    nb = len(x)
    xs, w = _iq4_weights(x, qw, 256)
    scales = _iq4_block_scales(xs, w).reshape(nb, 8)
    _, max_scale = _abs_max_signed(scales)
    D = -max_scale / F32(32)
    d16, _ = _f16_round(D)
    lv = np.clip(nearest_int(_inv(D)[:, None] * scales), -32, 31)  # (nb, 8)
    dl = D[:, None] * lv.astype(F32)
    L = best_index(_inv(dl).reshape(1, -1) * xs)
    L = _from_subblocks(L, nb)
    ls = (lv + 32).astype(np.uint16)
    scales_l = ((ls[:, 0::2] & 0xF) | ((ls[:, 1::2] & 0xF) << 4)).astype(np.uint8)
    scales_h = np.bitwise_or.reduce((ls >> 4) << (2 * np.arange(8, dtype=np.uint16)), axis=1).astype("<u2")
    return np.concatenate(
        [
            d16.view(np.uint8).reshape(-1, 2),
            scales_h.view(np.uint8).reshape(-1, 2),
            scales_l,
            _pack_nibbles(L),
        ],
        axis=1,
    )


WeightedEncoder = Callable[[np.ndarray, np.ndarray, np.ndarray], np.ndarray]
WEIGHTED: dict[QT, WeightedEncoder] = {
    QT.Q4_0: lambda x, w, s: _qx_0_w(x, w, s, 4),
    QT.Q5_0: lambda x, w, s: _qx_0_w(x, w, s, 5),
    QT.Q4_1: lambda x, w, s: _qx_1_w(x, w, s, 4),
    QT.Q5_1: lambda x, w, s: _qx_1_w(x, w, s, 5),
    QT.Q2_K: _q2_k_w,
    QT.Q3_K: _q3_k_w,
    QT.Q4_K: _q4_k_w,
    QT.Q5_K: _q5_k_w,
    QT.Q6_K: _q6_k_w,
    QT.IQ4_NL: lambda x, w, s: iq4_nl(x, w),
    QT.IQ4_XS: lambda x, w, s: iq4_xs(x, w),
}
# the 32-block types weight by the row's mean square: their encoders need it
ROW_SIGMA2_TYPES = (QT.Q4_0, QT.Q5_0, QT.Q4_1, QT.Q5_1)


ENCODERS: dict[QT, Callable[[np.ndarray], np.ndarray]] = {
    QT.Q8_0: _q8_0,
    QT.Q4_0: lambda x: _qx_0(x, 4),
    QT.Q5_0: lambda x: _qx_0(x, 5),
    QT.Q4_1: lambda x: _qx_1(x, 4),
    QT.Q5_1: lambda x: _qx_1(x, 5),
    QT.Q2_K: _q2_k,
    QT.Q3_K: _q3_k,
    QT.Q4_K: _q4_k,
    QT.Q5_K: _q5_k,
    QT.Q6_K: _q6_k,
    QT.IQ4_NL: iq4_nl,
    QT.IQ4_XS: iq4_xs,
}
QUANTIZED_TYPES = tuple(ENCODERS)


# ---- float types ---------------------------------------------------------------------------------
def to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bits (uint16), round to nearest even, NaN kept quiet (ggml_compute_fp32_to_bf16)."""
    u = np.ascontiguousarray(x, dtype=F32).view(np.uint32)
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    rounded = ((u.astype(np.uint64) + (0x7FFF + ((u >> 16) & 1))) >> 16).astype(np.uint16)
    return np.where(nan, ((u >> 16) | 64).astype(np.uint16), rounded)


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(F32)


# ---- entry point ---------------------------------------------------------------------------------
def type_size(qtype: QT) -> tuple[int, int]:
    """(elements per block, bytes per block)."""
    return GGML_QUANT_SIZES[qtype]


def row_bytes(qtype: QT, n: int) -> int:
    block, size = GGML_QUANT_SIZES[qtype]
    return n // block * size


def quantize(data: np.ndarray, qtype: QT, threads: int = 0, imatrix: np.ndarray | None = None) -> np.ndarray:
    """Encode float32 data with shape (..., n) as `qtype`.

    Returns float32/float16/uint16 (bf16 bits) arrays of the same shape for the float types, and
    uint8 `(..., n // block * block_bytes)` for the block types. Chunks of rows run on `threads`
    threads (0 = all cores); numpy releases the GIL inside its loops.

    `imatrix`: importance weights, `(n,)` for every row or `(n_mat, n)` for a 3-D tensor of shape
    `(n_mat, rows, n)` (expert e's rows use slice e). The types llama.cpp weights then run their
    weighted encoders (`WEIGHTED` below); the others (Q8_0, the float types) ignore it, as llama.cpp does.
    """
    data = np.asarray(data)
    if qtype == QT.F32:
        return np.ascontiguousarray(data, dtype=F32)
    if qtype == QT.F16:
        return np.ascontiguousarray(data, dtype=F32).astype(np.float16)
    if qtype == QT.BF16:
        return to_bf16(data)
    encoder = ENCODERS.get(qtype)
    if encoder is None:
        raise NotImplementedError(f"no encoder for {qtype.name}")
    block, size = GGML_QUANT_SIZES[qtype]
    n = data.shape[-1]
    if n % block:
        raise QuantError(f"row length {n} is not a multiple of {block} (block size of {qtype.name})")
    rows = np.ascontiguousarray(data, dtype=F32).reshape(-1, n)
    out = np.empty((len(rows), n // block * size), np.uint8)
    weighted = _weighted_runner(qtype, rows, n, imatrix) if imatrix is not None else None
    if weighted is None:
        blocks = rows.reshape(-1, block)
        flat = out.reshape(len(blocks), size)
        per_chunk = max(1, CHUNK_ELEMS_BY_TYPE.get(qtype, CHUNK_ELEMS) // block)

        def run(s: int) -> None:
            flat[s : s + per_chunk] = encoder(blocks[s : s + per_chunk])

        starts = range(0, len(blocks), per_chunk)
    else:
        per_chunk = max(1, CHUNK_ELEMS // n)

        def run(s: int) -> None:
            out[s : s + per_chunk] = weighted(s, min(s + per_chunk, len(rows)))

        starts = range(0, len(rows), per_chunk)
    workers = threads or os.cpu_count() or 1
    if workers == 1 or len(starts) == 1:
        for s in starts:
            run(s)
    else:
        with ThreadPoolExecutor(workers) as pool:
            list(pool.map(run, starts))
    return out.reshape(*data.shape[:-1], n // block * size)


def _weighted_runner(
    qtype: QT, rows: np.ndarray, n: int, imatrix: np.ndarray
) -> Callable[[int, int], np.ndarray] | None:
    """An encoder of rows [a, b) with the importance weights, or None for a type that ignores them."""
    enc = WEIGHTED.get(qtype)
    if enc is None:
        return None
    block, size = GGML_QUANT_SIZES[qtype]
    qw = np.asarray(imatrix, dtype=F32).reshape(-1, n)
    if len(rows) % len(qw):
        raise QuantError(f"{len(qw)} importance-matrix slices do not divide {len(rows)} rows")
    rows_per_slice = len(rows) // len(qw)
    row_sigma2 = qtype in ROW_SIGMA2_TYPES

    def run(a: int, b: int) -> np.ndarray:
        x = rows[a:b]
        w = qw[np.arange(a, b) // rows_per_slice]
        if row_sigma2:  # sum_x2 over the whole row, left to right, divided by n_per_row
            s = (F32(0) + _seq_sum(np.ascontiguousarray((x * x).T))) / F32(n)
            sig = np.repeat(s, n // block)
        else:
            sig = np.empty(0, F32)
        return enc(x.reshape(-1, block), w.reshape(-1, block), sig).reshape(b - a, n // block * size)

    return run
