"""GGUF tensors -> MLX arrays, keeping weights quantized wherever MLX has an exact form.

MLX's affine quantization stores w = scale * q + bias per group of `group_size` consecutive inputs,
with q packed LSB-first into uint32 words. GGUF blocks map onto it without loss:

  Q4_0  w = d (q - 8)          -> 4-bit, group 32, scale d, bias -8d
  Q4_1  w = d q + m            -> 4-bit, group 32, scale d, bias m
  Q5_0  w = d (q - 16)         -> 5-bit, group 32, scale d, bias -16d
  Q5_1  w = d q + m            -> 5-bit, group 32
  Q8_0  w = d q  (q signed)    -> 8-bit, group 32, q + 128, bias -128d
  Q4_K  w = d sc_j q - dmin m_j per sub-block of 32 -> 4-bit, group 32, scale d sc_j, bias -dmin m_j
  Q5_K  the same with a fifth bit -> 5-bit, group 32

Scales and biases are float32, where every product above is exact (an fp16 d times a 6-bit scale
needs 17 bits), so `mx.dequantize` reproduces ggml's dequantization bit for bit. Types with
sub-blocks of 16 (Q2_K, Q3_K, Q6_K) have no exact MLX form and are dequantized (gguf-py's reference
dequantizers) to the compute dtype, as are F16/BF16/F32.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from localrt.backends.gguf_tensors import GGUFTensorSource
from localrt.errors import LocalrtError
from localrt.store.gguf import GGML_TYPES

GROUP = 32  # every exact form above has groups of 32 inputs
ROWS_PER_CHUNK = 4096  # rows converted at once: bounds the numpy temporaries


@dataclass
class QuantizedWeight:
    """An [out, in] matrix in MLX's quantized layout."""

    weight: mx.array  # [out, in * bits / 32] uint32
    scales: mx.array  # [out, in / group_size]
    biases: mx.array  # [out, in / group_size]
    bits: int
    group_size: int = GROUP

    @property
    def shape(self) -> tuple[int, int]:
        return self.weight.shape[0], self.weight.shape[1] * 32 // self.bits

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes + self.scales.nbytes + self.biases.nbytes

    @property
    def packed(self) -> tuple[mx.array, mx.array, mx.array]:
        """The three arrays every MLX quantized operation takes first."""
        return self.weight, self.scales, self.biases

    @property
    def layout(self) -> dict[str, int]:
        """The quantization's parameters, as every MLX quantized operation takes them."""
        return {"group_size": self.group_size, "bits": self.bits}

    def dequantize(self) -> mx.array:
        return mx.dequantize(*self.packed, **self.layout)

    def rows(self, ids: mx.array) -> mx.array:
        """W[ids]: the packed rows gathered, then only those dequantized."""
        return mx.dequantize(*(a[ids] for a in self.packed), **self.layout)

    def matmul_t(self, x: mx.array) -> mx.array:
        """x W^T."""
        return mx.quantized_matmul(x, *self.packed, transpose=True, **self.layout)


# ---- GGUF blocks -> (q [nb, groups, 32] uint8, scale [nb, groups], bias [nb, groups]) ----------------
def _f16(raw: np.ndarray) -> np.ndarray:
    """[nb, 2] bytes -> [nb, 1] float32."""
    return np.ascontiguousarray(raw).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[nb, 16] bytes -> [nb, 32]: low nibbles are elements 0..15, high nibbles 16..31."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _high_bits(raw: np.ndarray) -> np.ndarray:
    """[nb, 4] bytes -> [nb, 32] bits (bit j of the little-endian u32 is element j)."""
    return np.unpackbits(raw, axis=-1, bitorder="little")


def _q4_0(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    d = _f16(b[:, :2])
    return _nibbles(b[:, 2:])[:, None], d, -8 * d


def _q4_1(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return _nibbles(b[:, 4:])[:, None], _f16(b[:, :2]), _f16(b[:, 2:4])


def _q5_0(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    d = _f16(b[:, :2])
    q = _nibbles(b[:, 6:]) | (_high_bits(b[:, 2:6]) << 4)
    return q[:, None], d, -16 * d


def _q5_1(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    q = _nibbles(b[:, 8:]) | (_high_bits(b[:, 4:8]) << 4)
    return q[:, None], _f16(b[:, :2]), _f16(b[:, 2:4])


def _q8_0(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    d = _f16(b[:, :2])
    q = (np.ascontiguousarray(b[:, 2:]).view(np.int8).astype(np.int16) + 128).astype(np.uint8)
    return q[:, None], d, -128 * d


def _k_scales(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K header -> per-sub-block scale d*sc_j and bias -dmin*m_j, [nb, 8] each."""
    from gguf.quants import Q4_K

    d, dmin = _f16(b[:, :2]), _f16(b[:, 2:4])
    sc, m = Q4_K.get_scale_min(np.ascontiguousarray(b[:, 4:16]))
    sc, m = sc.reshape(len(b), 8), m.reshape(len(b), 8)
    return d * sc.astype(np.float32), -(dmin * m.astype(np.float32))


def _q4_k(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    qs = b[:, 16:144].reshape(-1, 4, 1, 32)
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=2).reshape(-1, 8, 32)  # sub-block 2c: low, 2c+1: high
    return (q, *_k_scales(b))


def _q5_k(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    qh, qs = b[:, 16:48], b[:, 48:176].reshape(-1, 4, 1, 32)
    low = np.concatenate([qs & 0x0F, qs >> 4], axis=2).reshape(-1, 8, 32)
    high = (qh[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1  # sub-block s: bit s
    return (low | (high << 4), *_k_scales(b))


# ggml type -> its block unpacker; the type's MLX bits are the digit its name carries (`exact_bits`)
EXACT = dict(Q4_0=_q4_0, Q4_1=_q4_1, Q5_0=_q5_0, Q5_1=_q5_1, Q8_0=_q8_0, Q4_K=_q4_k, Q5_K=_q5_k)


def exact_bits(ggml_type: str) -> int:
    """The MLX bits of an exact type: Q4_0, Q4_1 and Q4_K are 4-bit, Q5_* 5-bit, Q8_0 8-bit."""
    return int(ggml_type[1])


def pack(q: np.ndarray, bits: int) -> np.ndarray:
    """[rows, n] integers < 2**bits -> [rows, n * bits / 32] uint32, value i at bits [i*bits, (i+1)*bits)."""
    rows, n = q.shape
    if bits == 8 and np.little_endian:  # four bytes are already one LSB-first word
        return np.ascontiguousarray(q, dtype=np.uint8).view(np.uint32)
    if 32 % bits == 0:
        per = 32 // bits
        shifts = (np.arange(per, dtype=np.uint32) * bits)[None, None, :]
        return (q.reshape(rows, n // per, per).astype(np.uint32) << shifts).sum(-1, dtype=np.uint32)
    # 5 bits: spell out the bit stream, then gather it 32 bits at a time
    stream = np.unpackbits(q.astype(np.uint8)[..., None], axis=-1, bitorder="little")[..., :bits]
    words = stream.reshape(rows, n * bits // 32, 32).astype(np.uint32) << np.arange(32, dtype=np.uint32)
    return words.sum(-1, dtype=np.uint32)


def repack(raw: np.ndarray, ggml_type: str, shape: tuple[int, ...]) -> QuantizedWeight:
    """The bytes of one GGUF matrix (GGUF shape (in, out)) -> MLX quantized [out, in]."""
    bits, unpack = exact_bits(ggml_type), EXACT[ggml_type]
    _, block_elems, block_bytes = _type_info(ggml_type)
    n_in, n_out = shape[0], int(np.prod(shape[1:]))
    blocks = raw.reshape(n_out, -1, block_bytes)  # [out, in / block, bytes]
    words, scales, biases = [], [], []
    for r in range(0, n_out, ROWS_PER_CHUNK):
        chunk = blocks[r : r + ROWS_PER_CHUNK]
        rows = chunk.shape[0]
        q, s, b = unpack(chunk.reshape(-1, block_bytes))  # q [nb, groups, 32]
        words.append(pack(q.reshape(rows, n_in), bits))
        scales.append(s.reshape(rows, n_in // GROUP))
        biases.append(b.reshape(rows, n_in // GROUP))
    return QuantizedWeight(
        mx.array(np.concatenate(words)),
        mx.array(np.concatenate(scales)),
        mx.array(np.concatenate(biases)),
        bits,
    )


def dequantize(raw: np.ndarray, ggml_type: str, shape: tuple[int, ...]) -> np.ndarray:
    """The bytes of any GGUF tensor -> float32 numpy in row-major order (GGUF's shape reversed)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    try:
        qtype = GGMLQuantizationType[ggml_type]
    except KeyError:
        raise LocalrtError(f"the MLX backend cannot read {ggml_type} tensors") from None
    try:
        out = gguf_dequantize(raw, qtype)
    except NotImplementedError:
        raise LocalrtError(f"the MLX backend cannot read {ggml_type} tensors yet") from None
    return np.asarray(out, dtype=np.float32).reshape(tuple(reversed(shape)))


def _type_info(ggml_type: str) -> tuple[str, int, int]:
    return next(v for v in GGML_TYPES.values() if v[0] == ggml_type)


class GGUFTensors(GGUFTensorSource):
    """A memory-mapped GGUF file: tensor name -> MLX arrays, quantized where exact, on demand."""

    def dense(self, name: str, dtype: mx.Dtype) -> mx.array:
        raw, t = self.stored(name)
        return mx.array(dequantize(raw, t.ggml_type, t.shape)).astype(dtype)

    def optional(self, name: str, dtype: mx.Dtype) -> mx.array | None:
        """`dense(name)` where the file has that tensor, else None (a bias, a norm or RoPE factors)."""
        return self.dense(name, dtype) if name in self else None

    def matrix(self, name: str, dtype: mx.Dtype) -> QuantizedWeight | mx.array:
        """A weight matrix [out, in]: MLX-quantized when its type has an exact form and its rows split into
        groups, else dense."""
        return self._weight(name, dtype, 2)

    def experts(self, name: str, dtype: mx.Dtype) -> QuantizedWeight | mx.array:
        """A 3-D expert tensor (GGUF shape (in, out, experts)) as [experts, out, in], the same way
        (quantized: arrays [E, out, *])."""
        return self._weight(name, dtype, 3)

    def _weight(self, name: str, dtype: mx.Dtype, ndim: int) -> QuantizedWeight | mx.array:
        raw, t = self.stored(name)
        if t.ggml_type not in EXACT or len(t.shape) != ndim or t.shape[0] % GROUP:
            return mx.array(dequantize(raw, t.ggml_type, t.shape)).astype(dtype)
        qw = repack(raw, t.ggml_type, t.shape)  # [out, *]; experts [E * out, *], each expert's rows in turn
        qw.weight, qw.scales, qw.biases = (a.reshape(*reversed(t.shape[1:]), -1) for a in qw.packed)
        if dtype != mx.float32:  # half compute: scales in the activations' dtype (no longer bit-exact)
            qw.scales, qw.biases = qw.scales.astype(dtype), qw.biases.astype(dtype)
        return qw
