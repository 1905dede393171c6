"""Gemma 3 (text), read straight from GGUF (GGUF architecture `gemma3`).

What differs from the Llama file (`llama.py`), as llama.cpp's gemma3 graph computes it, is listed in
`backends/family_config.py` (one list for this file and MLX's `gemma3.py`).

The model and its block are the Llama file's (`model.Transformer`, `model.Block`: the fused `attn_qkv`
and `ffn_gate_up` projections, one matmul each) with those differences as overrides, so the same
loader and the same quantized modules serve both.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from localrt.backends.family_config import GEMMA3
from localrt.backends.family_config import GemmaConfig
from localrt.backends.family_config import GemmaFamily
from localrt.backends.family_config import gemma_config

from .attention import AttnLayer
from .llama import AttentionContext
from .llama import Block as LlamaBlock
from .llama import RMSNorm
from .llama import Rotary
from .llama import Transformer
from .llama import random_model
from .llama import vocab_size_of


class Block(LlamaBlock):
    """The Llama block's attention and gated MLP (`model.Block`), sandwich-normed, with a GELU gate,
    the q scale, and the sliding window and score soft-cap handed to the attention context."""

    def __init__(self, cfg: GemmaConfig, layer: int) -> None:
        super().__init__(cfg, layer, qkv_bias=False, qk_norm=cfg.qk_norm)
        window = cfg.sliding_window if cfg.sliding_layers[layer] else 0
        self.attn_layer = AttnLayer(layer, window, max(cfg.attn_logit_softcapping, 0.0))  # 0: no cap
        # the attention context applies SDPA's 1/sqrt(head_dim): q carries the rest of the scale
        self.q_scale = cfg.attention_scale * math.sqrt(self.head_dim)
        dim, eps = cfg.embedding_length, cfg.attention_layer_norm_rms_epsilon
        self.post_attention_norm = RMSNorm(dim, eps)
        self.post_ffw_norm = RMSNorm(dim, eps)

    def activation(self, gate: torch.Tensor) -> torch.Tensor:
        return F.gelu(gate, approximate="tanh")

    def forward(self, x: torch.Tensor, rotary: Rotary, ctx: AttentionContext) -> torch.Tensor:
        x = x + self.post_attention_norm(self.attention(self.attn_norm(x), rotary, ctx))
        return x + self.post_ffw_norm(self.feed_forward(self.ffn_norm(x)))


class Gemma3(Transformer):
    """The Llama model (`model.Transformer`: hidden, forward) with Gemma's blocks, a scaled
    embedding, two RoPE tables and the optional final soft-cap."""

    family: GemmaFamily = GEMMA3  # the hyper-parameters' defaults and layer pattern (`family_config.py`)
    arch = GEMMA3.arch

    def __init__(self, cfg: GemmaConfig) -> None:
        super().__init__(cfg, qk_norm=cfg.qk_norm)
        self.blk = nn.ModuleList(Block(cfg, i) for i in range(cfg.block_count))
        self.embed_scale = math.sqrt(cfg.embedding_length)  # exact in fp32, as llama.cpp's sqrtf
        self.rotary, self.rotary_swa = _rotaries(cfg)
        _cap_logits(self)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.token_embd(tokens) * self.embed_scale

    def rotary_of(self, block: nn.Module) -> Rotary:
        return self.rotary_swa if block.attn_layer.window else self.rotary  # type: ignore[union-attr]

    @classmethod
    def of_file(cls, tensors: Any) -> Gemma3:
        return cls(gemma_config(tensors.metadata, vocab_size_of(tensors), cls.family))

    def finish(self, tensors: Any, device: torch.device | str) -> None:
        self.rotary, self.rotary_swa = (r.to(device) for r in _rotaries(self.cfg))  # real buffers, off meta
        _cap_logits(self)  # again: `modules` may have swapped the head


def _cap_logits(model: Gemma3) -> None:
    """The final soft-cap c * tanh(logits / c) as a hook on the head, so every caller of
    `model.output` (the engine, scoring) gets capped logits."""
    cap = model.cfg.final_logit_softcapping
    head = model.output
    if cap > 0 and not getattr(head, "soft_capped", False):
        head.register_forward_hook(lambda _m, _i, out: cap * torch.tanh(out.float() / cap))
        head.soft_capped = True  # type: ignore[assignment]


def _rotaries(cfg: GemmaConfig) -> tuple[Rotary, Rotary]:
    """RoPE tables of the global layers and of the sliding ones (their own base, never scaled)."""
    local = replace(cfg, rope_freq_base=cfg.rope_freq_base_swa, rope_scaling_factor=1.0)
    return Rotary(cfg), Rotary(local)


def random_gemma3(cfg: GemmaConfig, seed: int = 0, dtype: torch.dtype = torch.float32) -> Gemma3:
    """A randomly initialised model (engine tests): nn defaults, with a seeded generator."""
    return random_model(Gemma3, cfg, seed, dtype)
