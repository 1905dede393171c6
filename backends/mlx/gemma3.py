"""Gemma 3 (text) in MLX, read straight from GGUF (GGUF architecture `gemma3`).

What differs from the Llama file (`llama.py`), as llama.cpp's gemma3 graph computes it, is listed in
`backends/family_config.py` (which also reads the hyper-parameters and the layer pattern, for this file
and torch's `gemma3.py`). Here the sliding layers get rotating caches (`cache.py`: their memory stays
bounded however long the sequence grows).
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import mlx.core as mx

from localrt.backends.family_config import GEMMA3
from localrt.backends.family_config import GemmaConfig
from localrt.backends.family_config import GemmaFamily
from localrt.backends.family_config import gemma_config

from .cache import Cache
from .gguf_load import GGUFTensors
from .llama import Block
from .llama import Rope
from .llama import Transformer
from .llama import rms_norm

SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def gelu_tanh(x: mx.array) -> mx.array:
    """GELU's tanh approximation (llama.cpp's and Gemma's)."""
    return 0.5 * x * (1.0 + mx.tanh(SQRT_2_OVER_PI * (x + 0.044715 * x * x * x)))


class GemmaBlock(Block):
    """Sandwich-normed attention and GELU-gated MLP."""

    def __init__(self, cfg: GemmaConfig, t: GGUFTensors, i: int, dtype: mx.Dtype, rope: Rope) -> None:
        super().__init__(cfg, t, i, dtype, rope)
        self.scale = cfg.attention_scale
        self.softcap = cfg.attn_logit_softcapping

    def load_norms(self, t: GGUFTensors, p: str, dtype: mx.Dtype) -> None:
        super().load_norms(t, p, dtype)
        self.post_attention_norm, self.post_ffw_norm = (
            t.dense(p + n, dtype) for n in ("post_attention_norm.weight", "post_ffw_norm.weight")
        )

    def feed_forward(self, h: mx.array) -> mx.array:
        return self.ffn_down(gelu_tanh(self.ffn_gate(h)) * self.ffn_up(h))

    def __call__(self, x: mx.array, caches: list[Cache], lengths: list[int]) -> mx.array:
        attn = self.attention(rms_norm(x, self.attn_norm, self.eps), caches, lengths)
        x = x + rms_norm(attn, self.post_attention_norm, self.eps)
        ff = self.feed_forward(rms_norm(x, self.ffn_norm, self.eps))
        return x + rms_norm(ff, self.post_ffw_norm, self.eps)


class Gemma3(Transformer):
    block_class = GemmaBlock
    family: GemmaFamily = GEMMA3
    cfg: GemmaConfig

    def read_config(self, metadata: dict[str, Any], vocab_size: int) -> GemmaConfig:  # type: ignore[override]
        return gemma_config(metadata, vocab_size, self.family)

    def make_block(self, t: GGUFTensors, i: int) -> Block:
        if i == 0:  # global layers: the file's base and scaling; sliding ones: their own base, unscaled
            self.rope = Rope(self.cfg)
            self.rope_swa = Rope(
                replace(self.cfg, rope_freq_base=self.cfg.rope_freq_base_swa, rope_scaling_factor=1.0)
            )
        rope = self.rope_swa if self.cfg.sliding_layers[i] else self.rope
        return self.block_class(self.cfg, t, i, self.dtype, rope)

    def embed(self, tokens: mx.array) -> mx.array:
        return super().embed(tokens) * math.sqrt(self.cfg.embedding_length)  # fp32, as llama.cpp's sqrtf

    def logits(self, hidden: mx.array) -> mx.array:
        logits = super().logits(hidden)
        cap = self.cfg.final_logit_softcapping
        return cap * mx.tanh(logits / cap) if cap > 0 else logits
