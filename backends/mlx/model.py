"""A Llama-family transformer in MLX, read straight from GGUF (Llama 2/3, SmolLM2, Mistral, Qwen2, Qwen3).

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
from typing import Any

import mlx.core as mx

from localrt.backends.llama_config import LlamaConfig

from .cache import Cache
from .gguf_load import GGUFTensors, QuantizedWeight


class Linear:
    """y = x W^T (+ b) for a GGUF matrix W [out, in], quantized or dense."""

    def __init__(self, weight: QuantizedWeight | mx.array, bias: mx.array | None = None) -> None:
        self.weight = weight
        self.bias = bias

    def __call__(self, x: mx.array) -> mx.array:
        w = self.weight
        if isinstance(w, QuantizedWeight):
            y = mx.quantized_matmul(
                x, w.weight, w.scales, w.biases, transpose=True, group_size=w.group_size, bits=w.bits
            )
        else:
            y = x @ w.T
        return y if self.bias is None else y + self.bias

    def rows(self, ids: mx.array) -> mx.array:
        """W[ids] (embedding lookup): gather packed rows, then dequantize only those."""
        w = self.weight
        if isinstance(w, QuantizedWeight):
            return mx.dequantize(
                w.weight[ids], w.scales[ids], w.biases[ids], group_size=w.group_size, bits=w.bits
            )
        return w[ids]


def rms_norm(x: mx.array, weight: mx.array, eps: float) -> mx.array:
    return mx.fast.rms_norm(x, weight, eps)  # over the last axis, in fp32 internally


class Block:
    """Pre-norm attention + SwiGLU MLP."""

    def __init__(self, cfg: LlamaConfig, t: GGUFTensors, i: int, dtype: mx.Dtype) -> None:
        p = f"blk.{i}."

        def linear(name: str) -> Linear:
            bias = (
                t.dense(p + name + ".bias", dtype) if p + name + ".bias" in t else None
            )  # Qwen2 q/k/v biases
            return Linear(t.matrix(p + name + ".weight", dtype), bias)

        self.n_head, self.n_kv, self.head_dim = (
            cfg.attention_head_count,
            cfg.attention_head_count_kv,
            cfg.attention_key_length,
        )
        self.eps = cfg.attention_layer_norm_rms_epsilon
        self.attn_norm = t.dense(p + "attn_norm.weight", dtype)
        self.attn_q, self.attn_k, self.attn_v = linear("attn_q"), linear("attn_k"), linear("attn_v")
        self.attn_output = linear("attn_output")
        # Qwen3 normalises each head's q and k before RoPE
        self.attn_q_norm = t.dense(p + "attn_q_norm.weight", dtype) if p + "attn_q_norm.weight" in t else None
        self.attn_k_norm = t.dense(p + "attn_k_norm.weight", dtype) if p + "attn_k_norm.weight" in t else None
        self.ffn_norm = t.dense(p + "ffn_norm.weight", dtype)
        self.ffn_gate, self.ffn_up, self.ffn_down = linear("ffn_gate"), linear("ffn_up"), linear("ffn_down")

    def attention(self, x: mx.array, rope: Rope, caches: list[Cache], lengths: list[int]) -> mx.array:
        """x [1, L_total, dim] holding segments of `lengths` tokens, segment i appended to caches[i]."""
        _, n, _ = x.shape
        q = self.attn_q(x).reshape(1, n, self.n_head, self.head_dim)  # [1, L, H, D]
        k = self.attn_k(x).reshape(1, n, self.n_kv, self.head_dim)  # [1, L, Hkv, D]
        v = self.attn_v(x).reshape(1, n, self.n_kv, self.head_dim)
        if self.attn_q_norm is not None and self.attn_k_norm is not None:
            q, k = rms_norm(q, self.attn_q_norm, self.eps), rms_norm(k, self.attn_k_norm, self.eps)
        scale = 1.0 / math.sqrt(self.head_dim)
        q, k, v = (a.transpose(0, 2, 1, 3) for a in (q, k, v))  # [1, heads, L, D], once for the batch
        outs = []
        start = 0
        for cache, length in zip(caches, lengths):
            qs, ks, vs = (a[:, :, start : start + length] for a in (q, k, v))  # [1, heads, l, D]
            qs, ks = rope(qs, cache.offset), rope(ks, cache.offset)
            outs.append(cache.attend(qs, ks, vs, scale=scale))  # [1, H, l, D]
            start += length
        out = outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=2)
        return self.attn_output(out.transpose(0, 2, 1, 3).reshape(1, n, self.n_head * self.head_dim))

    def __call__(self, x: mx.array, rope: Rope, caches: list[Cache], lengths: list[int]) -> mx.array:
        x = x + self.attention(rms_norm(x, self.attn_norm, self.eps), rope, caches, lengths)
        h = rms_norm(x, self.ffn_norm, self.eps)
        return x + self.ffn_down(_silu(self.ffn_gate(h)) * self.ffn_up(h))  # SwiGLU


def _silu(x: mx.array) -> mx.array:
    return x * mx.sigmoid(x)


class Rope:
    """RoPE over the first `n_rot` dims of each head, positions starting at the cache offset."""

    def __init__(self, cfg: LlamaConfig, freq_factors: mx.array | None) -> None:
        self.n_rot = cfg.rope_dimension_count or cfg.attention_key_length
        self.traditional = not cfg.rope_neox  # GGUF's Llama layout: adjacent pairs
        self.scale = 1.0 / cfg.rope_scaling_factor
        self.base: float | None = cfg.rope_freq_base
        self.freqs: mx.array | None = None
        if freq_factors is not None:  # Llama 3.1's rope_freqs.weight stretches the wavelengths
            exps = mx.arange(0, self.n_rot, 2, dtype=mx.float32) / self.n_rot
            self.freqs = (cfg.rope_freq_base**exps) * freq_factors.astype(mx.float32)
            self.base = None

    def __call__(self, x: mx.array, offset: int) -> mx.array:
        return mx.fast.rope(
            x,
            self.n_rot,
            traditional=self.traditional,
            base=self.base,
            scale=self.scale,
            offset=offset,
            freqs=self.freqs,
        )


class Transformer:
    def __init__(self, t: GGUFTensors, dtype: mx.Dtype) -> None:
        md = t.metadata
        vocab = md.get("tokenizer.ggml.tokens")
        embd = t.by_name["token_embd.weight"]
        self.cfg = LlamaConfig.from_gguf(md, len(vocab) if vocab is not None else embd.shape[1])
        self.dtype = dtype
        self.token_embd = Linear(t.matrix("token_embd.weight", dtype))
        self.blk = [Block(self.cfg, t, i, dtype) for i in range(self.cfg.block_count)]
        self.output_norm = t.dense("output_norm.weight", dtype)
        # tied embeddings (SmolLM2): the head reuses token_embd
        self.output = Linear(t.matrix("output.weight", dtype)) if "output.weight" in t else self.token_embd
        factors = t.dense("rope_freqs.weight", mx.float32) if "rope_freqs.weight" in t else None
        self.rope = Rope(self.cfg, factors)
        mx.eval(self.arrays())

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
        x = self.token_embd.rows(tokens)[None].astype(self.dtype)  # [1, L, dim]
        for i, block in enumerate(self.blk[: num_layers or len(self.blk)]):
            x = block(x, self.rope, [c[i] for c in caches], lengths)
        return rms_norm(x[0], self.output_norm, self.cfg.attention_layer_norm_rms_epsilon)

    def logits(self, hidden: mx.array) -> mx.array:
        """hidden [R, dim] -> logits [R, vocab] in float32."""
        return self.output(hidden).astype(mx.float32)

    def __call__(self, tokens: mx.array, caches: list[Any], num_layers: int | None = None) -> mx.array:
        return self.logits(self.hidden(tokens, caches, num_layers))

    def arrays(self) -> list[mx.array]:
        """Every weight array (quantized triplets expanded), each once."""
        out: dict[int, mx.array] = {}
        for obj in [
            self.token_embd,
            self.output,
            self.output_norm,
            *(v for b in self.blk for v in vars(b).values()),
        ]:
            parts = [obj.weight, obj.bias] if isinstance(obj, Linear) else [obj]
            for w in parts:
                arrays = [w.weight, w.scales, w.biases] if isinstance(w, QuantizedWeight) else [w]
                out.update((id(a), a) for a in arrays if isinstance(a, mx.array))
        return list(out.values())

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays())
