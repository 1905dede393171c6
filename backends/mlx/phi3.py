"""Phi-3 / Phi-3.5 / Phi-4 in MLX (GGUF architecture `phi3`): the Llama block (`llama.py`) as the file
stores it; what Phi-3's graph is in llama.cpp is listed in `backends/family_config.py` (one list with
torch's `phi3.py`).

The fused projections are one matrix product each, split after. LongRoPE: this engine keeps the
context within `rope.scaling.original_context_length` when the file has LongRoPE factors, so the
short ones are always the right ones (torch's switches to the long ones instead, `fit_context`).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from localrt.backends.family_config import llama_like_config
from localrt.backends.family_config import longrope_scaling
from localrt.backends.llama_config import LlamaConfig

from .gguf_load import GGUFTensors
from .llama import Block
from .llama import Rope
from .llama import Transformer
from .llama import linear
from .llama import linears
from .llama import silu

ARCH = "phi3"


class Phi3Block(Block):
    def load_attention(self, t: GGUFTensors, p: str, dtype: mx.Dtype) -> None:
        self.attn_qkv = linear(t, p + "attn_qkv", dtype)
        self.q_size, self.kv_size = self.n_head * self.head_dim, self.n_kv * self.head_dim

    def load_feed_forward(self, t: GGUFTensors, p: str, dtype: mx.Dtype) -> None:
        self.ffn_up, self.ffn_down = linears(t, p, dtype, "ffn_up", "ffn_down")

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
        self._factors = t.optional("rope_factors_short.weight", mx.float32)
        super().__init__(t, dtype)

    def read_config(self, metadata: dict[str, Any], vocab_size: int) -> LlamaConfig:  # type: ignore[override]
        cfg = llama_like_config(metadata, vocab_size, ARCH)
        original, self._attn_factor = longrope_scaling(metadata, ARCH, cfg.context_length)
        if self._factors is not None:  # past the original length llama.cpp uses the long factors
            cfg.context_length = min(cfg.context_length, original)
        return cfg

    def make_rope(self, t: GGUFTensors) -> Rope:
        return Rope(self.cfg, self._factors, self._attn_factor)
