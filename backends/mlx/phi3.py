"""Phi-3 / Phi-3.5 / Phi-4 in MLX (GGUF architecture `phi3`): the Llama block (`model.py`) as the file
stores it.

- Q, K and V come fused in `attn_qkv` (rows: Q, then K, then V), gate and up fused in `ffn_up`
  (rows: gate, then up): one matrix product each, split after.
- RoPE pairs halves (neox) over the first `rope.dimension_count` dims of each head (partial rotary).
- LongRoPE: the wavelengths are stretched by `rope_factors_short` and the rotated dims scaled by
  `rope.scaling.attn_factor`. llama.cpp switches to `rope_factors_long` once the context passes
  `rope.scaling.original_context_length`; this engine (as the torch one) keeps the context within
  that length when the file has long factors, so the short ones are always the right ones.
- llama.cpp runs every layer with full attention (it ignores the file's sliding window), and so do we.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from localrt.backends.family_config import llama_like_config
from localrt.backends.llama_config import LlamaConfig

from .gguf_load import GGUFTensors
from .model import Block, Rope, Transformer, linear, silu

ARCH = "phi3"


class Phi3Block(Block):
    def load_attention(self, t: GGUFTensors, p: str, dtype: mx.Dtype) -> None:
        self.attn_qkv = linear(t, p + "attn_qkv", dtype)
        self.q_size, self.kv_size = self.n_head * self.head_dim, self.n_kv * self.head_dim

    def load_feed_forward(self, t: GGUFTensors, p: str, dtype: mx.Dtype) -> None:
        self.ffn_up, self.ffn_down = linear(t, p + "ffn_up", dtype), linear(t, p + "ffn_down", dtype)

    def qkv(self, x: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        qkv = self.attn_qkv(x)
        q_end, k_end = self.q_size, self.q_size + self.kv_size
        return qkv[..., :q_end], qkv[..., q_end:k_end], qkv[..., k_end:]

    def feed_forward(self, h: mx.array) -> mx.array:
        gate, up = mx.split(self.ffn_up(h), 2, axis=-1)
        return self.ffn_down(silu(gate) * up)


class Phi3(Transformer):
    block_class = Phi3Block

    def __init__(self, t: GGUFTensors, dtype: mx.Dtype) -> None:
        self._factors = (
            t.dense("rope_factors_short.weight", mx.float32) if "rope_factors_short.weight" in t else None
        )
        super().__init__(t, dtype)

    def read_config(self, metadata: dict[str, Any], vocab_size: int) -> LlamaConfig:  # type: ignore[override]
        cfg = llama_like_config(metadata, vocab_size, ARCH)
        if self._factors is not None:  # past the original length llama.cpp uses the long factors
            original = int(metadata.get(f"{ARCH}.rope.scaling.original_context_length", cfg.context_length))
            cfg.context_length = min(cfg.context_length, original)
        self._attn_factor = float(metadata.get(f"{ARCH}.rope.scaling.attn_factor", 1.0))
        return cfg

    def make_block(self, t: GGUFTensors, i: int) -> Block:
        if i == 0:
            self.rope = Rope(self.cfg, self._factors, self._attn_factor)
        return self.block_class(self.cfg, t, i, self.dtype, self.rope)
