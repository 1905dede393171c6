"""Importance-weighted encoders and the IQ4 types, byte-identical to llama.cpp's `quantize_row_*_impl`.

With an importance matrix `qw` (one value per input column, the mean square of the activations that
column multiplies), ggml-quants.c replaces the reference encoders by searches that minimize the
weighted squared error, with per-element weights `qw_j * sqrt(sigma2 + x_j^2)`:

- sigma2 is the mean square of the whole row for Q4_0/Q4_1/Q5_0/Q5_1, of the 256-element super-block for
  Q2_K (factor 1) and Q3_K/Q4_K/Q5_K (factor 2), of the 32- or 256-element block for IQ4 (factor 2);
  Q6_K uses qw itself as the weight.
- The 32-block types and the k-quants' sub-blocks run `make_qx_quants` (symmetric) or `make_qkx3_quants`
  (affine); the k-quants' per-sub-block scales are then quantized with `make_qp_quants` (Q2/Q4/Q5_K)
  or another `make_qx_quants` (Q3_K), weighted by each sub-block's total weight.
- IQ4_NL / IQ4_XS map onto a fixed 16-value non-linear grid (with or without qw; without it the
  weights are x^2).

The float rules of quants.py hold here too: float32 throughout, C's evaluation order, sums that run
element after element (over axis 0 of element-major arrays), ggml's nearest_int, fp16 scales read
back before the final pass. Encoders take `(nb, block)` float32 values, the same-shape weights and the
per-block row sigma2 (only the 32-block types use it) and return `(nb, block_bytes)` uint8.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from gguf import GGMLQuantizationType

from localrt.converters.quants import (
    F32,
    GROUP_MAX_EPS,
    _abs_max_signed,
    _clamp_f,
    _f16_round,
    _first_abs_max,
    _from_subblocks,
    _levels,
    _make_qkx2,
    _pack_2bit,
    _pack_legacy,
    _seq_sum,
    _to_subblocks,
    nearest_int,
)

QT = GGMLQuantizationType
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
