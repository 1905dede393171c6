"""Per-layer KV caches for one sequence: grown in steps, trimmed for speculation, optionally 8-bit,
rotating for sliding-window layers.

Every cache has the same small protocol (as mlx-lm's): `offset` (tokens seen), `attend(q, k, v)`
(append this step's keys/values, attend over what the queries see), `trim(n)` (forget the last n
tokens, e.g. rejected draft tokens: lowering the offset is enough, later writes overwrite them) and
`nbytes`. `prefix(n)` gives a new cache holding the first n tokens (the prompt cache hands these
out): MLX arrays are values, so later writes to either cache never reach the other.

A sliding layer's cache (`window` > 0, Gemma's local layers) keeps only a bounded tail of positions
(`_Positions`): its memory does not grow with the sequence, and `min_prefix` says how far back it
can still be trimmed or cut; the prompt cache and the runners respect it.
"""

from __future__ import annotations

from typing import Any
from typing import Protocol
from typing import TypeVar

import mlx.core as mx
import numpy as np

from . import rows

STEP = 256  # tokens added per growth: few reallocations, little waste
KV_GROUP = 32  # quantization group along head_dim for the 8-bit cache
KV_BITS = 8


SLACK = 256  # positions a sliding cache keeps behind its window (see `_Positions`); >= num_draft's 64


class Cache(Protocol):
    offset: int
    min_prefix: int

    def attend(
        self, q: mx.array, k: mx.array, v: mx.array, scale: float, softcap: float = 0.0
    ) -> mx.array: ...

    def trim(self, n: int) -> int: ...

    def can_trim(self, n: int) -> bool: ...

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


def _mask(first_query: int, n_queries: int, first_key: int, n_keys: int, window: int) -> mx.array:
    """Boolean [L, T]: the query at absolute position q sees the key at k iff k <= q (and, with a
    sliding window, q - k < window)."""
    q_pos = mx.arange(first_query, first_query + n_queries)[:, None]
    k_pos = mx.arange(first_key, first_key + n_keys)[None, :]
    seen = q_pos >= k_pos
    return seen & (q_pos - k_pos < window) if window else seen


def _soft_cap(scores: mx.array, cap: float) -> mx.array:
    return cap * mx.tanh(scores / cap) if cap > 0 else scores


class _Positions:
    """Where a cache's buffer stands: `offset` tokens seen in all, buffer index 0 holding position
    `start`. Without a window `start` stays 0. With one (a sliding layer), the buffer keeps the last
    `window - 1 + slack` to `window - 1 + 2 * slack` positions, however long the sequence grows (the
    rotation: old positions are dropped a SLACK at a time, so the copy is rare); the SLACK behind the
    window is what speculation's rejected draft tokens and a shorter prefix can trim back into."""

    offset: int
    start: int
    window: int
    slack: int

    @property
    def held(self) -> int:
        return self.offset - self.start

    @property
    def min_prefix(self) -> int:
        """The shortest prefix this cache can still give (`prefix(n)`) or be trimmed to."""
        return 0 if self.start == 0 else self.start + self.window - 1

    def can_trim(self, n: int) -> bool:
        return self.offset - n >= self.min_prefix

    def trim(self, n: int) -> int:
        """Forget the last n tokens (rejected drafts): a lower offset is enough, later writes overwrite them."""
        n = min(n, self.offset)
        if not self.can_trim(n):
            raise ValueError(f"a sliding-window cache cannot go back {n} tokens (it holds {self.held})")
        self.offset -= n
        return n

    def _span(self, n: int) -> tuple[int, mx.array | str | None]:
        """For n new tokens just stored: the first buffer index their queries see, and the mask."""
        first_query = self.offset - n
        lo = max(0, first_query - self.window + 1 - self.start) if self.window else 0
        if n == 1:
            return lo, None  # one query sees every key from lo on
        if not self.window:
            return lo, "causal"
        return lo, _mask(first_query, n, self.start + lo, self.held - lo, self.window)

    def _rotate(self) -> None:
        """Drop the positions no query can see any more, a SLACK at a time."""
        if self.window and self.held > self.window - 1 + 2 * self.slack:
            drop = self.held - (self.window - 1 + self.slack)
            self._drop(drop)
            self.start += drop

    # ---- the buffers: one array each (`KVCache`), or a tuple of packed arrays (`QuantizedKVCache`) ----
    keys: Any
    values: Any

    def _cut(self, buf: Any, lo: int, hi: int) -> Any:
        """Buffer indices lo..hi-1 of one of the cache's buffers (keys or values)."""
        raise NotImplementedError

    def _empty(self: P) -> P:
        """A new empty cache of the same kind, window and slack."""
        raise NotImplementedError

    def _drop(self, n: int) -> None:
        assert self.keys is not None and self.values is not None
        held = self.held
        self.keys, self.values = self._cut(self.keys, n, held), self._cut(self.values, n, held)

    def prefix(self: P, n: int) -> P:
        out = self._empty()
        n = min(n, self.offset)
        if n > 0 and self.keys is not None and self.values is not None:
            assert n >= self.min_prefix, "the prompt cache asks only for prefixes a cache can give"
            end = n - self.start
            out.keys, out.values = self._cut(self.keys, 0, end), self._cut(self.values, 0, end)
            out.offset, out.start = n, self.start
        return out

    @property
    def nbytes(self) -> int:
        bufs = [b for b in (self.keys, self.values) if b is not None]
        return sum(a.nbytes for b in bufs for a in (b if isinstance(b, tuple) else (b,)))


P = TypeVar("P", bound=_Positions)


class KVCache(_Positions):
    """Keys and values [1, Hkv, capacity, D] in `dtype` (f16 by default, as llama.cpp's cache);
    `window` > 0: a sliding layer's rotating cache."""

    def __init__(self, dtype: mx.Dtype = mx.float16, window: int = 0, slack: int = SLACK) -> None:
        self.dtype = dtype
        self.window, self.slack = window, slack
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self.offset = 0
        self.start = 0

    def attend(self, q: mx.array, k: mx.array, v: mx.array, scale: float, softcap: float = 0.0) -> mx.array:
        _, n_kv, n, d = k.shape
        held, end = self.held, self.held + n
        self.keys = _grow(self.keys, held, end, (d,), n_kv, self.dtype)
        self.values = _grow(self.values, held, end, (v.shape[-1],), n_kv, self.dtype)
        self.keys[:, :, held:end] = k
        self.values[:, :, held:end] = v
        self.offset += n
        lo, mask = self._span(n)
        keys, values = self.keys[:, :, lo:end], self.values[:, :, lo:end]
        if keys.dtype != q.dtype:  # a half cache under fp32 compute (only when asked for explicitly)
            keys, values = keys.astype(q.dtype), values.astype(q.dtype)
        # (a half cache cast for fp32 compute keeps the plain path: the layout reads the whole buffer)
        if rows.LAYOUT is not None and not self.window and not softcap and self.keys.dtype == q.dtype:
            out = _laid_out_attention(q, self.keys, self.values, self.offset - n, scale, rows.LAYOUT)
        elif softcap > 0:
            out = _capped_attention(q, keys, values, scale, mask, softcap)
        else:
            out = mx.fast.scaled_dot_product_attention(q, keys, values, scale=scale, mask=mask)
        self._rotate()
        return out

    def _cut(self, buf: mx.array, lo: int, hi: int) -> mx.array:
        return buf[:, :, lo:hi]

    def _empty(self) -> KVCache:
        return KVCache(self.dtype, self.window, self.slack)


def _laid_out_attention(
    q: mx.array, keys: mx.array, values: mx.array, first: int, scale: float, layout: rows.RowLayout
) -> mx.array:
    """Attention on an optimized BLAS, each query's products the same whatever the step around it: the
    queries laid out as alone (`rows.RowLayout`), each over `rows.key_span` keys of the buffer (the
    keys after it masked; the buffer always holds them: it grows 256 at a time). q [1, H, L, D] for
    positions first.., keys/values the whole buffers [1, Hkv, capacity, D]."""
    n = q.shape[2]
    outs = []
    i = 0
    while i < n:
        span = rows.key_span(first + i)
        j = min(n, span - first)  # the queries sharing this span
        mask = layout.pack_mask(np.arange(first + i, first + j)[:, None] >= np.arange(span)[None])
        out = mx.fast.scaled_dot_product_attention(
            layout.pack(q[:, :, i:j]), keys[:, :, :span], values[:, :, :span], scale=scale, mask=mask
        )
        outs.append(layout.unpack(out, j - i))
        i = j
    return outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=2)


def _capped_attention(
    q: mx.array, keys: mx.array, values: mx.array, scale: float, mask: mx.array | str | None, softcap: float
) -> mx.array:
    """Attention with soft-capped scores, c * tanh(q.k * scale / c) before the mask (Gemma 2), which
    MLX's fused kernel does not offer. q [1, H, L, D]; keys/values [1, Hkv, T, D]."""
    _, n_head, n, d = q.shape
    n_kv, n_keys = keys.shape[1], keys.shape[2]
    qg = (q * scale).reshape(1, n_kv, n_head // n_kv, n, d)  # query heads grouped under their KV head
    scores = _soft_cap(qg @ keys[:, :, None].swapaxes(-1, -2), softcap)  # [1, Hkv, rep, L, T]
    if isinstance(mask, str):
        mask = _mask(n_keys - n, n, 0, n_keys, 0)
    if mask is not None:
        scores = mx.where(mask, scores, mx.array(-mx.inf, scores.dtype))
    probs = mx.softmax(scores.astype(mx.float32), axis=-1).astype(q.dtype)
    return (probs @ values[:, :, None]).reshape(1, n_head, n, values.shape[-1])


class QuantizedKVCache(_Positions):
    """Keys and values stored as MLX 8-bit affine groups of 32 along head_dim (about half of fp16).

    Attention runs on the packed cache directly: scores = q . dequant(K) via `quantized_matmul`,
    then probs . dequant(V) the same way; GQA shares each KV head across its query heads.
    """

    def __init__(
        self, bits: int = KV_BITS, group_size: int = KV_GROUP, window: int = 0, slack: int = SLACK
    ) -> None:
        self.bits, self.group_size = bits, group_size
        self.window, self.slack = window, slack
        self.keys: tuple[mx.array, mx.array, mx.array] | None = None
        self.values: tuple[mx.array, mx.array, mx.array] | None = None
        self.offset = 0
        self.start = 0

    def _store(
        self, buf: tuple[mx.array, ...] | None, x: mx.array, end: int
    ) -> tuple[mx.array, mx.array, mx.array]:
        packed = mx.quantize(x, group_size=self.group_size, bits=self.bits)  # (uint32 words, scales, biases)
        n_kv = x.shape[1]
        held = self.held
        out = tuple(
            _grow(None if buf is None else buf[i], held, end, (p.shape[-1],), n_kv, p.dtype)
            for i, p in enumerate(packed)
        )
        for o, p in zip(out, packed):
            o[:, :, held:end] = p
        return out  # type: ignore[return-value]

    def attend(self, q: mx.array, k: mx.array, v: mx.array, scale: float, softcap: float = 0.0) -> mx.array:
        _, n_kv, n, d = k.shape
        end = self.held + n
        self.keys, self.values = self._store(self.keys, k, end), self._store(self.values, v, end)
        self.offset += n
        lo, mask = self._span(n)
        _, n_head, _, _ = q.shape
        rep = n_head // n_kv
        qg = (q * scale).reshape(1, n_kv, rep, n, d)  # query heads grouped under their KV head
        keys = [a[:, :, None, lo:end] for a in self.keys]  # [1, Hkv, 1, T, *]
        values = [a[:, :, None, lo:end] for a in self.values]
        scores = mx.quantized_matmul(qg, *keys, transpose=True, group_size=self.group_size, bits=self.bits)
        scores = _soft_cap(scores, softcap)
        if isinstance(mask, str):
            mask = _mask(self.offset - n, n, self.start + lo, end - lo, 0)
        if mask is not None:
            scores = mx.where(mask, scores, mx.array(-mx.inf, scores.dtype))
        probs = mx.softmax(scores.astype(mx.float32), axis=-1).astype(q.dtype)  # [1, Hkv, rep, L, T]
        out = mx.quantized_matmul(probs, *values, transpose=False, group_size=self.group_size, bits=self.bits)
        self._rotate()
        return out.reshape(1, n_head, n, d)

    def _cut(self, buf: tuple[mx.array, ...], lo: int, hi: int) -> tuple[mx.array, ...]:
        return tuple(a[:, :, lo:hi] for a in buf)

    def _empty(self) -> QuantizedKVCache:
        return QuantizedKVCache(self.bits, self.group_size, self.window, self.slack)


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
    n_layers: int,
    kv_cache_type: str,
    compute: mx.Dtype | None = None,
    windows: list[int] | None = None,
    slack: int = SLACK,
) -> list[KVCache | QuantizedKVCache]:
    """One cache per layer; `windows` (per layer, 0 = global) makes the sliding layers' rotating,
    keeping `slack` positions behind the window (at least the most draft tokens a step verifies)."""
    windows = windows or [0] * n_layers
    if kv_cache_type == "q8_0":
        return [QuantizedKVCache(window=w, slack=slack) for w in windows[:n_layers]]
    dtype = kv_dtype(kv_cache_type, compute)
    return [KVCache(dtype, w, slack) for w in windows[:n_layers]]


def trim_caches(caches: list[KVCache | QuantizedKVCache], n: int) -> None:
    for cache in caches:
        cache.trim(n)
