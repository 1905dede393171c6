"""A Llama-family transformer in MLX, read straight from GGUF (Llama 2/3, SmolLM2, Mistral, Qwen2, Qwen3),
and the layer the other families' files build on (`architectures.py` picks the file).

Attributes carry GGUF's tensor names (`blk[3].attn_q`), so loading needs no renaming. Matrices stay
in MLX's quantized layout where GGUF's blocks have an exact form (gguf_load.py) and run through
`mx.quantized_matmul`; the rest are dense in the compute dtype.

RoPE follows GGUF's layout: llama.cpp's converter permutes Llama's Q/K rows so rotation pairs are
adjacent (MLX's `traditional=True`); Qwen models keep HF's half-split pairs (`traditional=False`).
Several sequences run in one forward: their tokens are laid end to end ([1, L_total, dim]), so every
matrix product covers the whole batch, and attention splits the rows back into segments, each with
its own cache, RoPE offset and causal mask (as llama.cpp's flat batches). A row's result does not
depend on what else is in the batch: MLX's CPU matmuls compute each output row on its own, and each
segment's attention is exactly the call it would make alone.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from functools import partial
from typing import Any

import mlx.core as mx

from localrt.backends.llama_config import LlamaConfig

from . import rows
from .cache import SLACK
from .cache import Cache
from .cache import make_caches
from .gguf_load import GGUFTensors
from .gguf_load import QuantizedWeight


class Linear:
    """y = x W^T (+ b) for a GGUF matrix W [out, in], quantized or dense."""

    def __init__(self, weight: QuantizedWeight | mx.array, bias: mx.array | None = None) -> None:
        self.weight = weight
        self.bias = bias
        # lays its rows out itself on an optimized BLAS (the head); the blocks' products get the forward's
        # rows already laid out (`Transformer.hidden_batch`)
        self.lays_out = False

    def __call__(self, x: mx.array) -> mx.array:
        w = self.weight
        if isinstance(w, QuantizedWeight):
            y = w.matmul_t(x)
        elif self.lays_out and rows.LAYOUT is not None:  # an optimized BLAS: rows laid out (rows.py)
            y = rows.LAYOUT.matmul_t(x, w)
        else:
            y = x @ w.T
        return y if self.bias is None else y + self.bias

    def rows(self, ids: mx.array) -> mx.array:
        """W[ids] (embedding lookup)."""
        w = self.weight
        return w.rows(ids) if isinstance(w, QuantizedWeight) else w[ids]


def rms_norm(x: mx.array, weight: mx.array, eps: float) -> mx.array:
    return mx.fast.rms_norm(x, weight, eps)  # over the last axis, in fp32 internally


class Block:
    """Pre-norm attention + SwiGLU MLP. Subclasses (other families) change how the weights load
    (`load_norms`, `load_attention`, `load_feed_forward`), the projections (`qkv`, `feed_forward`) or
    the norms around them (`__call__`); the per-sequence attention itself is shared."""

    def __init__(self, cfg: LlamaConfig, t: GGUFTensors, i: int, dtype: mx.Dtype, rope: Rope) -> None:
        self.n_head, self.n_kv, self.head_dim = (
            cfg.attention_head_count,
            cfg.attention_head_count_kv,
            cfg.attention_key_length,
        )
        self.eps = cfg.attention_layer_norm_rms_epsilon
        self.rope = rope
        self.scale = 1.0 / math.sqrt(self.head_dim)  # multiplies q.k
        self.softcap = 0.0  # attention-score soft-cap (Gemma 2); 0: off
        p = f"blk.{i}."
        self.load_norms(t, p, dtype)
        self.attn_output = linear(t, p + "attn_output", dtype)
        self.load_attention(t, p, dtype)
        self.load_feed_forward(t, p, dtype)

    def load_norms(self, t: GGUFTensors, p: str, dtype: mx.Dtype) -> None:
        self.attn_norm, self.ffn_norm = (
            t.dense(p + n, dtype) for n in ("attn_norm.weight", "ffn_norm.weight")
        )
        # Qwen3 and Gemma 3 normalise each head's q and k before RoPE
        self.attn_q_norm = t.optional(p + "attn_q_norm.weight", dtype)
        self.attn_k_norm = t.optional(p + "attn_k_norm.weight", dtype)

    def load_attention(self, t: GGUFTensors, p: str, dtype: mx.Dtype) -> None:
        self.attn_q, self.attn_k, self.attn_v = linears(t, p, dtype, "attn_q", "attn_k", "attn_v")

    def load_feed_forward(self, t: GGUFTensors, p: str, dtype: mx.Dtype) -> None:
        self.ffn_gate, self.ffn_up, self.ffn_down = linears(t, p, dtype, "ffn_gate", "ffn_up", "ffn_down")

    def qkv(self, x: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        """x [1, L, dim] -> q [1, L, H * D], k and v [1, L, Hkv * D]."""
        return self.attn_q(x), self.attn_k(x), self.attn_v(x)

    def attention(self, x: mx.array, caches: list[Cache], lengths: list[int]) -> mx.array:
        """x [1, L_total, dim] holding segments of `lengths` tokens, segment i appended to caches[i]."""
        _, n, _ = x.shape
        q, k, v = self.qkv(x)
        layout = rows.LAYOUT
        if layout is not None:  # x's rows are laid out (hidden_batch): the segments are the real rows
            n = sum(lengths)
            q, k, v = (layout.unpack(a, n) for a in (q, k, v))
        q = q.reshape(1, n, self.n_head, self.head_dim)  # [1, L, H, D]
        k = k.reshape(1, n, self.n_kv, self.head_dim)  # [1, L, Hkv, D]
        v = v.reshape(1, n, self.n_kv, self.head_dim)
        if self.attn_q_norm is not None and self.attn_k_norm is not None:
            q, k = rms_norm(q, self.attn_q_norm, self.eps), rms_norm(k, self.attn_k_norm, self.eps)
        q, k, v = (a.transpose(0, 2, 1, 3) for a in (q, k, v))  # [1, heads, L, D], once for the batch
        outs = []
        start = 0
        for cache, length in zip(caches, lengths):
            qs, ks, vs = (a[:, :, start : start + length] for a in (q, k, v))  # [1, heads, l, D]
            qs, ks = self.rope(qs, cache.offset), self.rope(ks, cache.offset)
            outs.append(cache.attend(qs, ks, vs, scale=self.scale, softcap=self.softcap))  # [1, H, l, D]
            start += length
        out = outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=2)
        out = out.transpose(0, 2, 1, 3).reshape(1, n, self.n_head * self.head_dim)
        return self.attn_output(out if layout is None else layout.pack(out))

    def feed_forward(self, h: mx.array) -> mx.array:
        return self.ffn_down(silu(self.ffn_gate(h)) * self.ffn_up(h))  # SwiGLU

    def __call__(self, x: mx.array, caches: list[Cache], lengths: list[int]) -> mx.array:
        x = x + self.attention(rms_norm(x, self.attn_norm, self.eps), caches, lengths)
        return x + self.feed_forward(rms_norm(x, self.ffn_norm, self.eps))


def linear(t: GGUFTensors, name: str, dtype: mx.Dtype) -> Linear:
    """The GGUF matrix `name`.weight, with its bias when the file has one (Qwen2's q/k/v)."""
    return Linear(t.matrix(name + ".weight", dtype), t.optional(name + ".bias", dtype))


def linears(t: GGUFTensors, p: str, dtype: mx.Dtype, *names: str) -> list[Linear]:
    """The matrices `p + name` of one block, in the order named."""
    return [linear(t, p + n, dtype) for n in names]


def silu(x: mx.array) -> mx.array:
    return x * mx.sigmoid(x)


class Rope:
    """RoPE over the first `n_rot` dims of each head, positions starting at the cache offset."""

    def __init__(
        self, cfg: LlamaConfig, freq_factors: mx.array | None = None, attn_factor: float = 1.0
    ) -> None:
        """`freq_factors` stretch the wavelengths (Llama 3.1's `rope_freqs`, Phi-3's LongRoPE factors);
        `attn_factor` scales cos and sin, i.e. the rotated dims (Phi-3's LongRoPE)."""
        self.n_rot = cfg.rope_dimension_count or cfg.attention_key_length
        self.attn_factor = attn_factor
        freqs = None
        if freq_factors is not None:  # the wavelengths themselves, in place of the base
            exps = mx.arange(0, self.n_rot, 2, dtype=mx.float32) / self.n_rot
            freqs = (cfg.rope_freq_base**exps) * freq_factors.astype(mx.float32)
        # `mx.fast.rope` with everything but the input and its offset bound once, at load
        self._rope = partial(
            mx.fast.rope,
            dims=self.n_rot,
            traditional=not cfg.rope_neox,  # GGUF's Llama layout: adjacent pairs
            base=cfg.rope_freq_base if freqs is None else None,
            scale=1.0 / cfg.rope_scaling_factor,
            freqs=freqs,
        )

    def __call__(self, x: mx.array, offset: int) -> mx.array:
        out = self._rope(x, offset=offset)
        if self.attn_factor == 1.0:
            return out
        rotated = out[..., : self.n_rot] * self.attn_factor
        return (
            mx.concatenate([rotated, out[..., self.n_rot :]], axis=-1)
            if out.shape[-1] > self.n_rot
            else rotated
        )


class Transformer:
    """The Llama family (llama, mistral, qwen2, qwen3); other families subclass it (`architectures.py`).

    `windows` gives each layer's sliding window (0: global attention), which `make_caches` turns into
    rotating caches for the sliding layers."""

    block_class: type[Block] = Block
    cache_slack = SLACK  # positions a sliding layer's cache keeps behind the window (tests make it small)

    def __init__(self, t: GGUFTensors, dtype: mx.Dtype) -> None:
        md = t.metadata
        vocab = md.get("tokenizer.ggml.tokens")
        embd = t.by_name["token_embd.weight"]
        self.cfg = self.read_config(md, len(vocab) if vocab is not None else embd.shape[1])
        self.dtype = dtype
        self.token_embd = Linear(t.matrix("token_embd.weight", dtype))
        self.blk = [self.make_block(t, i) for i in range(self.cfg.block_count)]
        self.output_norm = t.dense("output_norm.weight", dtype)
        # tied embeddings (SmolLM2): the head reuses token_embd
        self.output = Linear(t.matrix("output.weight", dtype)) if self.has_head(t) else self.token_embd
        self.output.lays_out = True
        mx.eval(self.arrays())

    def read_config(self, metadata: dict[str, Any], vocab_size: int) -> LlamaConfig:
        return LlamaConfig.from_gguf(metadata, vocab_size)

    def make_block(self, t: GGUFTensors, i: int) -> Block:
        if i == 0:  # one RoPE for every layer
            self.rope = self.make_rope(t)
        return self.block_class(self.cfg, t, i, self.dtype, self.rope)

    def make_rope(self, t: GGUFTensors) -> Rope:
        return Rope(self.cfg, t.optional("rope_freqs.weight", mx.float32))

    def has_head(self, t: GGUFTensors) -> bool:
        """Whether the file has its own output matrix (else the head is the embedding)."""
        return "output.weight" in t

    @property
    def windows(self) -> list[int]:
        return self.cfg.windows  # the config's, as it is now (a test turns the windows off after loading)

    def make_caches(self, kv_cache_type: str) -> list[Any]:
        """Fresh per-layer caches for one sequence."""
        return make_caches(self.cfg.block_count, kv_cache_type, self.dtype, self.windows, self.cache_slack)

    def embed(self, tokens: mx.array) -> mx.array:
        """tokens [L] -> [1, L, dim] in the compute dtype."""
        return self.token_embd.rows(tokens)[None].astype(self.dtype)

    def hidden(self, tokens: mx.array, caches: list[Any], num_layers: int | None = None) -> mx.array:
        """tokens [L] -> final-normed hidden states [L, dim], appending to the first layers' caches.

        `num_layers` runs only the first blocks (self-speculative drafting); the final norm and head
        still apply, so the shallow model speaks the same vocabulary.
        """
        return self.hidden_batch(tokens, [caches], [tokens.shape[0]], num_layers)

    def hidden_batch(
        self, tokens: mx.array, caches: list[list[Any]], lengths: list[int], num_layers: int | None = None
    ) -> mx.array:
        """Several sequences in one forward: tokens [L_total] = segments of `lengths` tokens laid end to
        end, segment i appended to the per-layer caches `caches[i]`; hidden states [L_total, dim]."""
        x = self.embed(tokens)  # [1, L, dim]
        layout = rows.LAYOUT
        if layout is not None:  # an optimized BLAS: the rows laid out once for every product (rows.py)
            x = layout.pack(x)
        for i, block in enumerate(self.blk[: num_layers or len(self.blk)]):
            x = block(x, [c[i] for c in caches], lengths)
        if layout is not None:
            x = layout.unpack(x, tokens.shape[0])
        return rms_norm(x[0], self.output_norm, self.cfg.attention_layer_norm_rms_epsilon)

    def logits(self, hidden: mx.array) -> mx.array:
        """hidden [R, dim] -> logits [R, vocab] in float32."""
        return self.output(hidden).astype(mx.float32)

    def __call__(self, tokens: mx.array, caches: list[Any], num_layers: int | None = None) -> mx.array:
        return self.logits(self.hidden(tokens, caches, num_layers))

    def dense_weights(self) -> None:
        """Dequantize every matrix `Linear` multiplies by, once, into the compute dtype (a tied head stays
        shared): with an optimized BLAS under MLX (blas.py) a dense product over a batch costs about
        one row, the quantized one a row per row."""
        for obj in self._weights():  # a tied head is the embedding's own Linear: dense by its second visit
            if isinstance(obj, Linear) and isinstance(obj.weight, QuantizedWeight):
                obj.weight = obj.weight.dequantize().astype(self.dtype)
        mx.eval(self.arrays())

    def _weights(self) -> list[Any]:
        """What may hold weights: the embedding, the head, the final norm and every block attribute."""
        return [
            self.token_embd,
            self.output,
            self.output_norm,
            *(v for b in self.blk for v in vars(b).values()),
        ]

    def arrays(self) -> list[mx.array]:
        """Every weight array (quantized triplets expanded), each once (a tied head is the embedding)."""
        arrays = (a for obj in self._weights() for a in _arrays_of(obj))
        return list({id(a): a for a in arrays}.values())

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays())


def _arrays_of(obj: Any) -> Iterator[mx.array]:
    """The MLX arrays one attribute holds: a `Linear`'s weight and bias, a quantized triplet, an array."""
    if isinstance(obj, Linear):
        yield from (a for part in (obj.weight, obj.bias) for a in _arrays_of(part))
    elif isinstance(obj, QuantizedWeight):
        yield from obj.packed
    elif isinstance(obj, mx.array):
        yield obj
