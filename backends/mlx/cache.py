"""Per-layer KV caches for one sequence: grown in steps, trimmed for speculation, optionally 8-bit.

Every cache has the same small protocol (as mlx-lm's): `offset` (tokens held), `attend(q, k, v)`
(append this step's keys/values, attend over everything so far), `trim(n)` (forget the last n
tokens, e.g. rejected draft tokens: lowering the offset is enough, later writes overwrite them) and
`nbytes`. `prefix(n)` gives a new cache holding the first n tokens (the prompt cache hands these
out): MLX arrays are values, so later writes to either cache never reach the other.
"""

from __future__ import annotations

from typing import Protocol

import mlx.core as mx

STEP = 256  # tokens added per growth: few reallocations, little waste
KV_GROUP = 32  # quantization group along head_dim for the 8-bit cache
KV_BITS = 8


class Cache(Protocol):
    offset: int

    def attend(self, q: mx.array, k: mx.array, v: mx.array, scale: float) -> mx.array: ...

    def trim(self, n: int) -> int: ...

    def prefix(self, n: int) -> Cache: ...

    @property
    def nbytes(self) -> int: ...


def _grow(
    buf: mx.array | None, offset: int, needed: int, shape_tail: tuple[int, ...], n_heads: int, dtype: mx.Dtype
) -> mx.array:
    """A buffer [1, heads, capacity, *tail] with room for `needed` tokens, keeping the first `offset`."""
    if buf is not None and needed <= buf.shape[2]:
        return buf
    capacity = (needed + STEP - 1) // STEP * STEP
    fresh = mx.zeros((1, n_heads, capacity, *shape_tail), dtype=dtype)
    if buf is not None and offset > 0:
        fresh[:, :, :offset] = buf[:, :, :offset]
    return fresh


def _causal_mask(n_queries: int, n_keys: int) -> mx.array | None:
    """Additive-free boolean mask: query i (at absolute position n_keys - n_queries + i) sees keys <= it."""
    if n_queries == 1:
        return None
    q_pos = mx.arange(n_keys - n_queries, n_keys)[:, None]
    return q_pos >= mx.arange(n_keys)[None, :]  # [L, T]


class _Trimmable:
    offset: int

    def trim(self, n: int) -> int:
        """Forget the last n tokens (rejected drafts): a lower offset is enough, later writes overwrite them."""
        n = min(n, self.offset)
        self.offset -= n
        return n


class KVCache(_Trimmable):
    """Keys and values [1, Hkv, capacity, D] in `dtype` (f16 by default, as llama.cpp's cache)."""

    def __init__(self, dtype: mx.Dtype = mx.float16) -> None:
        self.dtype = dtype
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self.offset = 0

    def attend(self, q: mx.array, k: mx.array, v: mx.array, scale: float) -> mx.array:
        _, n_kv, n, d = k.shape
        end = self.offset + n
        self.keys = _grow(self.keys, self.offset, end, (d,), n_kv, self.dtype)
        self.values = _grow(self.values, self.offset, end, (v.shape[-1],), n_kv, self.dtype)
        self.keys[:, :, self.offset : end] = k
        self.values[:, :, self.offset : end] = v
        self.offset = end
        keys, values = self.keys[:, :, :end], self.values[:, :, :end]
        if keys.dtype != q.dtype:  # a half cache under fp32 compute (only when asked for explicitly)
            keys, values = keys.astype(q.dtype), values.astype(q.dtype)
        return mx.fast.scaled_dot_product_attention(
            q, keys, values, scale=scale, mask="causal" if n > 1 else None
        )

    def prefix(self, n: int) -> KVCache:
        out = KVCache(self.dtype)
        n = min(n, self.offset)
        if n > 0 and self.keys is not None and self.values is not None:
            out.keys, out.values, out.offset = self.keys[:, :, :n], self.values[:, :, :n], n
        return out

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.keys, self.values) if a is not None)


class QuantizedKVCache(_Trimmable):
    """Keys and values stored as MLX 8-bit affine groups of 32 along head_dim (about half of fp16).

    Attention runs on the packed cache directly: scores = q . dequant(K) via `quantized_matmul`,
    then probs . dequant(V) the same way; GQA shares each KV head across its query heads.
    """

    def __init__(self, bits: int = KV_BITS, group_size: int = KV_GROUP) -> None:
        self.bits, self.group_size = bits, group_size
        self.keys: tuple[mx.array, mx.array, mx.array] | None = None
        self.values: tuple[mx.array, mx.array, mx.array] | None = None
        self.offset = 0

    def _store(
        self, buf: tuple[mx.array, ...] | None, x: mx.array, end: int
    ) -> tuple[mx.array, mx.array, mx.array]:
        packed = mx.quantize(x, group_size=self.group_size, bits=self.bits)  # (uint32 words, scales, biases)
        n_kv = x.shape[1]
        out = tuple(
            _grow(None if buf is None else buf[i], self.offset, end, (p.shape[-1],), n_kv, p.dtype)
            for i, p in enumerate(packed)
        )
        for o, p in zip(out, packed):
            o[:, :, self.offset : end] = p
        return out  # type: ignore[return-value]

    def attend(self, q: mx.array, k: mx.array, v: mx.array, scale: float) -> mx.array:
        _, n_kv, n, d = k.shape
        end = self.offset + n
        self.keys, self.values = self._store(self.keys, k, end), self._store(self.values, v, end)
        self.offset = end
        _, n_head, _, _ = q.shape
        rep = n_head // n_kv
        qg = (q * scale).reshape(1, n_kv, rep, n, d)  # query heads grouped under their KV head
        keys = [a[:, :, None, :end] for a in self.keys]  # [1, Hkv, 1, T, *]
        values = [a[:, :, None, :end] for a in self.values]
        scores = mx.quantized_matmul(qg, *keys, transpose=True, group_size=self.group_size, bits=self.bits)
        mask = _causal_mask(n, end)  # [L, T] or None
        if mask is not None:
            scores = mx.where(mask, scores, mx.array(-mx.inf, scores.dtype))
        probs = mx.softmax(scores.astype(mx.float32), axis=-1).astype(q.dtype)  # [1, Hkv, rep, L, T]
        out = mx.quantized_matmul(probs, *values, transpose=False, group_size=self.group_size, bits=self.bits)
        return out.reshape(1, n_head, n, d)

    def prefix(self, n: int) -> QuantizedKVCache:
        out = QuantizedKVCache(self.bits, self.group_size)
        n = min(n, self.offset)
        if n > 0 and self.keys is not None and self.values is not None:
            out.keys = tuple(a[:, :, :n] for a in self.keys)  # type: ignore[assignment]
            out.values = tuple(a[:, :, :n] for a in self.values)  # type: ignore[assignment]
            out.offset = n
        return out

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for buf in (self.keys, self.values) if buf is not None for a in buf)


KV_DTYPES = {"f16": mx.float16, "bf16": mx.bfloat16, "f32": mx.float32}
KV_CACHE_TYPES = (*KV_DTYPES, "q8_0")


def kv_dtype(kv_cache_type: str, compute: mx.Dtype | None) -> mx.Dtype:
    """The dtype a float cache stores: the compute dtype where one is given and the device computes in
    fp32 (MLX's CPU): there, casting the whole cache to fp32 in every layer for every token costs more
    than the memory a half-precision cache saves (`q8_0` is the type that saves memory)."""
    if compute is not None and compute == mx.float32:
        return mx.float32
    return KV_DTYPES[kv_cache_type]


def make_caches(
    n_layers: int, kv_cache_type: str, compute: mx.Dtype | None = None
) -> list[KVCache | QuantizedKVCache]:
    if kv_cache_type == "q8_0":
        return [QuantizedKVCache() for _ in range(n_layers)]
    dtype = kv_dtype(kv_cache_type, compute)
    return [KVCache(dtype) for _ in range(n_layers)]


def trim_caches(caches: list[KVCache | QuantizedKVCache], n: int) -> None:
    for cache in caches:
        cache.trim(n)
