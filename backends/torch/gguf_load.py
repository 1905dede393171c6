"""GGUF tensors -> torch: memory-map the file and dequantize every ggml type the engine reads.

The dequantizers are vectorized over blocks and follow ggml-quants.c's `dequantize_row_*` byte
layouts exactly (tests/test_torch_gguf_load.py compares them with gguf-py's reference).
Work happens in float32 on the CPU; the caller casts to the compute dtype and moves to the device.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch

from localrt.backends.gguf_tensors import GGUFTensorSource
from localrt.errors import LocalrtError
from localrt.store.gguf import GGML_TYPES

QK_K = 256


def _floats(raw: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Stored floats: the bytes [nb, n * size] read as `dtype` (little-endian), as float32 [nb, n]."""
    return raw.contiguous().view(dtype).float()


def _f16(raw: torch.Tensor) -> torch.Tensor:
    """[nb, 2] uint8 -> [nb, 1] float32 (a block's fp16 scale)."""
    return _floats(raw, torch.float16)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[nb, 16] bytes -> [nb, 32] values: low nibbles are elements 0..15, high nibbles 16..31."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)


def _bits(raw: torch.Tensor, n: int) -> torch.Tensor:
    """[nb, n/8] bytes -> [nb, n] bits, little-endian within each byte (bit j of the packed u32)."""
    shifts = torch.arange(8, dtype=torch.uint8)
    return ((raw.unsqueeze(-1) >> shifts) & 1).reshape(raw.shape[0], n)


def dequant_q4_0(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b[:, :2])
    q = _nibbles(b[:, 2:]).to(torch.int16) - 8
    return d * q


def dequant_q4_1(b: torch.Tensor) -> torch.Tensor:
    d, m = _f16(b[:, :2]), _f16(b[:, 2:4])
    return d * _nibbles(b[:, 4:]).float() + m


def dequant_q5_0(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b[:, :2])
    q = _nibbles(b[:, 6:]) | (_bits(b[:, 2:6], 32) << 4)
    return d * (q.to(torch.int16) - 16)


def dequant_q5_1(b: torch.Tensor) -> torch.Tensor:
    d, m = _f16(b[:, :2]), _f16(b[:, 2:4])
    q = _nibbles(b[:, 8:]) | (_bits(b[:, 4:8], 32) << 4)
    return d * q.float() + m


def dequant_q8_0(b: torch.Tensor) -> torch.Tensor:
    return _f16(b[:, :2]) * b[:, 2:].contiguous().view(torch.int8).float()


def dequant_q2_k(b: torch.Tensor) -> torch.Tensor:
    nb = b.shape[0]
    scales, qs = b[:, :16], b[:, 16:80]
    d, dmin = _f16(b[:, 80:82]), _f16(b[:, 82:84])
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(1, 1, 4, 1)
    q = (qs.view(nb, 2, 1, 32) >> shifts) & 3  # [nb, half, shift, 32] = output order
    q = q.reshape(nb, 16, 16).float()  # 16 sub-blocks of 16, each with its own scale and min
    dl = d * (scales & 0x0F).float()
    ml = dmin * (scales >> 4).float()
    return (dl.unsqueeze(-1) * q - ml.unsqueeze(-1)).reshape(nb, QK_K)


def _q3_k_scales(raw: torch.Tensor) -> torch.Tensor:
    """12 bytes -> 16 signed 6-bit scales: low 4 bits from bytes 0..7, high 2 bits from bytes 8..11."""
    i = torch.arange(16)
    low = torch.where(i < 8, raw[:, i % 8] & 0x0F, raw[:, i % 8] >> 4)
    high = (raw[:, 8 + i % 4] >> (2 * (i // 4)).to(torch.uint8)) & 3
    return (low | (high << 4)).to(torch.int16) - 32


def dequant_q3_k(b: torch.Tensor) -> torch.Tensor:
    nb = b.shape[0]
    hmask, qs, d = b[:, :32], b[:, 32:96], _f16(b[:, 108:110])
    scales = _q3_k_scales(b[:, 96:108]).float()
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(1, 1, 4, 1)
    low = (qs.view(nb, 2, 1, 32) >> shifts) & 3  # [nb, half, shift, 32]
    # the high bit of (half h, shift j) lives in bit h*4 + j of hmask
    hbit = (hmask.view(nb, 1, 1, 32) >> torch.arange(8, dtype=torch.uint8).view(1, 2, 4, 1)) & 1
    q = low.to(torch.int16) - 4 * (1 - hbit.to(torch.int16))
    q = q.reshape(nb, 16, 16).float()
    return (d.unsqueeze(-1) * scales.unsqueeze(-1) * q).reshape(nb, QK_K)


def _k4_scale_min(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """12 bytes -> 8 (scale, min) pairs of 6 bits (ggml's get_scale_min_k4)."""
    lo = raw[:, :4], raw[:, 4:8]
    sc_hi = (raw[:, 8:12] & 0x0F) | ((raw[:, 0:4] >> 6) << 4)
    mn_hi = (raw[:, 8:12] >> 4) | ((raw[:, 4:8] >> 6) << 4)
    scale = torch.cat([lo[0] & 63, sc_hi], dim=-1).float()
    minimum = torch.cat([lo[1] & 63, mn_hi], dim=-1).float()
    return scale, minimum


def _k4_scaled(b: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Q4_K / Q5_K: a super-block's d and dmin (f16) and its 8 sub-blocks' 6-bit (scale, min) pairs,
    bytes 0..15, applied to the sub-blocks' quants q [nb, 8, 32]: d * scale * q - dmin * min."""
    d, dmin = _f16(b[:, :2]), _f16(b[:, 2:4])
    scale, minimum = _k4_scale_min(b[:, 4:16])
    return ((d * scale).unsqueeze(-1) * q - (dmin * minimum).unsqueeze(-1)).reshape(b.shape[0], QK_K)


def _k4_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """128 bytes [nb, 128] -> [nb, 8, 32]: 32 bytes per chunk c, sub-block 2c its low nibbles, 2c+1 its high."""
    qs = qs.view(qs.shape[0], 4, 1, 32)
    return torch.cat([qs & 0x0F, qs >> 4], dim=2).reshape(qs.shape[0], 8, 32)


def dequant_q4_k(b: torch.Tensor) -> torch.Tensor:
    return _k4_scaled(b, _k4_nibbles(b[:, 16:144]).float())


def dequant_q5_k(b: torch.Tensor) -> torch.Tensor:
    nb = b.shape[0]
    qh = b[:, 16:48]
    high = (qh.view(nb, 1, 32) >> torch.arange(8, dtype=torch.uint8).view(1, 8, 1)) & 1  # sub-block s: bit s
    return _k4_scaled(b, (_k4_nibbles(b[:, 48:176]) | (high << 4)).float())


def q6_k_parts(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q6_K blocks [nb, 210] -> (d [nb, 1] fp32, scales [nb, 16] fp32 (int8 values), u [nb, 16, 16]
    uint8 in 0..63): element i of sub-block j is d * scales[j] * (u[j, i] - 32)."""
    nb = b.shape[0]
    ql, qh = b[:, :128].view(nb, 2, 2, 32), b[:, 128:192].view(nb, 2, 1, 32)
    scales = b[:, 192:208].contiguous().view(torch.int8).float()
    low = torch.cat([ql & 0x0F, ql >> 4], dim=2)  # [nb, half, quarter r, 32]: r = 0,1 low nibbles, 2,3 high
    high = (qh >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(1, 1, 4, 1)) & 3
    return _f16(b[:, 208:210]), scales, (low | (high << 4)).reshape(nb, 16, 16)


def dequant_q6_k(b: torch.Tensor) -> torch.Tensor:
    d, scales, u = q6_k_parts(b)
    q = u.float() - 32
    return (d.unsqueeze(-1) * scales.unsqueeze(-1) * q).reshape(b.shape[0], QK_K)


IQ4_GRID = torch.tensor(
    [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=torch.float32
)


def dequant_iq4_nl(b: torch.Tensor) -> torch.Tensor:
    """d f16, qs[16]: element j = d * grid[low nibble of qs[j]], element j+16 = the high nibble's."""
    return _f16(b[:, :2]) * IQ4_GRID[_nibbles(b[:, 2:]).long()]


def dequant_iq4_xs(b: torch.Tensor) -> torch.Tensor:
    """d f16, scales_h u16, scales_l[4], qs[128]: 8 sub-blocks of 32 with 6-bit scales (ls - 32)."""
    d = _f16(b[:, :2])
    sh = (b[:, 2].long() | (b[:, 3].long() << 8)).unsqueeze(1)  # [nb, 1]
    ib = torch.arange(8)
    lo = (b[:, 4 + ib // 2].long() >> (4 * (ib % 2))) & 0xF
    ls = lo | (((sh >> (2 * ib)) & 3) << 4)  # [nb, 8]
    dl = d * (ls - 32).float()
    q = IQ4_GRID[_nibbles(b[:, 8:].reshape(-1, 16)).long()].reshape(-1, 8, 32)
    return (dl.unsqueeze(-1) * q).reshape(-1, 256)


DEQUANTIZERS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "F32": lambda b: _floats(b, torch.float32),
    "F16": _f16,
    "BF16": lambda b: _floats(b, torch.bfloat16),
    "Q4_0": dequant_q4_0,
    "Q4_1": dequant_q4_1,
    "Q5_0": dequant_q5_0,
    "Q5_1": dequant_q5_1,
    "Q8_0": dequant_q8_0,
    "Q2_K": dequant_q2_k,
    "Q3_K": dequant_q3_k,
    "Q4_K": dequant_q4_k,
    "Q5_K": dequant_q5_k,
    "Q6_K": dequant_q6_k,
    "IQ4_NL": dequant_iq4_nl,
    "IQ4_XS": dequant_iq4_xs,
}
ROWS_PER_CHUNK = 1 << 14  # blocks dequantized at once: bounds the int16/float temporaries
# type name -> (elements, bytes) of one block, looked up once per dequantize (every step's embedding)
BLOCK_SHAPES = {name: (elems, nbytes) for name, elems, nbytes in GGML_TYPES.values()}


def dequantize(raw: torch.Tensor, ggml_type: str, shape: tuple[int, ...]) -> torch.Tensor:
    """Bytes of one tensor -> float32 tensor in torch order (GGUF's shape reversed)."""
    fn = DEQUANTIZERS.get(ggml_type)
    if fn is None:
        raise LocalrtError(f"the torch backend cannot read {ggml_type} tensors yet")
    block_elems, block_bytes = BLOCK_SHAPES[ggml_type]
    n_elements = math.prod(shape)
    if block_elems == 1:
        out = fn(raw)
    elif raw.numel() == 0:  # no rows asked for (a step whose chunks all stop short of their prompt's end)
        out = torch.empty(0, dtype=torch.float32)
    else:
        blocks = raw.view(-1, block_bytes)  # [n_blocks, bytes per block]
        if blocks.shape[0] <= ROWS_PER_CHUNK:  # one chunk (a step's embedding rows, a head's refined rows)
            out = fn(blocks)
        else:
            chunks = range(0, blocks.shape[0], ROWS_PER_CHUNK)
            out = torch.cat([fn(blocks[i : i + ROWS_PER_CHUNK]).reshape(-1) for i in chunks])
    if out.numel() != n_elements:
        raise LocalrtError(f"tensor of {n_elements} elements decoded to {out.numel()}")
    return out.reshape(tuple(reversed(shape)))


class GGUFTensors(GGUFTensorSource):
    """A memory-mapped GGUF file: tensor name -> dequantized float32 torch tensor, on demand."""

    def raw(self, name: str) -> torch.Tensor:
        """The tensor's stored bytes, uint8 [n_bytes]."""
        # a copy: the map is read-only and torch wants writable storage
        return torch.from_numpy(np.array(self.stored(name)[0]))

    def get(self, name: str) -> torch.Tensor:
        raw = self.raw(name)  # raises when the tensor is missing
        t = self.by_name[name]
        return dequantize(raw, t.ggml_type, t.shape)
