"""Vectorized numpy encoders for ggml block formats, byte-identical to llama.cpp's reference quantizers.

Every encoder reproduces the `quantize_row_*_ref` path of ggml-quants.c (what `llama-quantize` runs when
no importance matrix is given) operation for operation in float32:

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
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

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


def _iq4_nl(x: np.ndarray) -> np.ndarray:
    from localrt.converters.quants_weighted import iq4_nl

    return iq4_nl(x)


def _iq4_xs(x: np.ndarray) -> np.ndarray:
    from localrt.converters.quants_weighted import iq4_xs

    return iq4_xs(x)


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
    QT.IQ4_NL: _iq4_nl,
    QT.IQ4_XS: _iq4_xs,
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
    weighted encoders (quants_weighted); the others (Q8_0, the float types) ignore it, as llama.cpp does.
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
    from localrt.converters import quants_weighted as qwt

    enc = qwt.WEIGHTED.get(qtype)
    if enc is None:
        return None
    block, size = GGML_QUANT_SIZES[qtype]
    qw = np.asarray(imatrix, dtype=F32).reshape(-1, n)
    if len(rows) % len(qw):
        raise QuantError(f"{len(qw)} importance-matrix slices do not divide {len(rows)} rows")
    rows_per_slice = len(rows) // len(qw)
    row_sigma2 = qtype in qwt.ROW_SIGMA2_TYPES

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
