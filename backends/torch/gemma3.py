"""Gemma 3 (text), read straight from GGUF (GGUF architecture `gemma3`).

What differs from the Llama file (`model.py`), as llama.cpp's gemma3 graph computes it:
- Five sliding-window layers for each global one: layer i slides iff i % period < period - 1 (period
  6 unless the file says otherwise); a sliding layer's query at p sees keys p - window + 1 .. p.
- Two RoPE bases: `rope.freq_base` for global layers (with the file's linear scaling, if any),
  `rope.freq_base_swa` for sliding ones (never scaled). Rotation pairs are halves (neox).
- q and k are RMS-normed per head before RoPE; attention scale 1/sqrt(head_dim) (27B: 1/sqrt(dim/heads)).
- Sandwich norms: RMSNorm before and after attention and before and after the MLP.
- The embedding is scaled by sqrt(dim); the MLP is GELU(tanh) gated; the head is tied unless the
  file carries `output.weight`; an optional final soft-cap c * tanh(logits / c).
- Norm weights are used as stored: llama.cpp's converter already added Gemma's "1 +" to them.

The model and its block are the Llama file's (`model.Transformer`, `model.Block`: the fused `attn_qkv`
and `ffn_gate_up` projections, one matmul each) with the differences above as overrides, so the same
loader and the same quantized modules serve both.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from localrt.backends.llama_config import llama_fields, metadata_getter
from localrt.errors import LocalrtError

from .model import (
    AttentionContext,
    LlamaConfig,
    ModuleFactory,
    RMSNorm,
    Rotary,
    Transformer,
    build,
    random_model,
    vocab_size_of,
)
from .model import Block as LlamaBlock

ARCH = "gemma3"
DEFAULT_SWA_PERIOD = 6  # llama.cpp's default; the converter never writes the pattern
SIZE_27B_LAYERS = 62  # the one size whose attention scale is 1/sqrt(dim / heads)


@dataclass
class Gemma3Config(LlamaConfig):
    sliding_window: int = 0  # tokens a sliding layer's query sees (itself included); 0: no sliding layers
    sliding_layers: tuple[bool, ...] = ()  # per layer: True = sliding window
    rope_freq_base_swa: float = 10000.0
    attention_scale: float = 0.0  # multiplies q.k
    final_logit_softcapping: float = 0.0  # 0: off
    attn_logit_softcapping: float = 0.0  # 0: off (Gemma 2 caps attention scores)
    qk_norm: bool = True  # per-head RMSNorm of q and k (Gemma 2 has none)

    @classmethod
    def from_gguf(cls, metadata: dict[str, Any], vocab_size: int) -> Gemma3Config:  # type: ignore[override]
        return read_config(metadata, vocab_size, GEMMA3)


@dataclass(frozen=True)
class Family:
    """What llama.cpp assumes for a Gemma generation when the file is silent."""

    arch: str
    swa_period: int  # layer i slides iff i % period < period - 1
    window: int  # sliding window when the file has none (0: no sliding layers)
    layers_27b: int  # the 27B size scales attention by 1/sqrt(dim / heads)
    attn_softcap: float
    final_softcap: float
    qk_norm: bool
    swa_base: float | None  # sliding layers' RoPE base when the file has none (None: the global one)


GEMMA3 = Family(ARCH, DEFAULT_SWA_PERIOD, 0, SIZE_27B_LAYERS, 0.0, 0.0, True, 10000.0)


def read_config(metadata: dict[str, Any], vocab_size: int, family: Family) -> Gemma3Config:
    arch = family.arch
    get = metadata_getter(metadata, arch)
    fields = llama_fields(metadata, arch, vocab_size, context_length=131072, eps=None)
    n_layer, n_embd = fields["block_count"], fields["embedding_length"]
    n_head, head_dim = fields["attention_head_count"], fields["attention_key_length"]
    window = int(get("attention.sliding_window", family.window))
    pattern = metadata.get(f"{arch}.attention.sliding_window_pattern", family.swa_period)
    base = fields["rope_freq_base"]
    return Gemma3Config(
        **fields,
        rope_neox=True,
        sliding_window=window,
        sliding_layers=sliding_pattern(pattern, n_layer) if window > 0 else (False,) * n_layer,
        rope_freq_base_swa=float(
            get("rope.freq_base_swa", base if family.swa_base is None else family.swa_base)
        ),
        attention_scale=1 / math.sqrt(n_embd / n_head if n_layer == family.layers_27b else head_dim),
        final_logit_softcapping=float(get("final_logit_softcapping", family.final_softcap)),
        attn_logit_softcapping=float(get("attn_logit_softcapping", family.attn_softcap)),
        qk_norm=family.qk_norm,
    )


def sliding_pattern(pattern: Any, n_layer: int) -> tuple[bool, ...]:
    """Which layers slide: a per-layer bool array as given, else a period n (layer i slides iff
    i % n < n - 1; n = 0: every layer slides, n = 1: none)."""
    if isinstance(pattern, (list, tuple)) or hasattr(pattern, "tolist"):
        flags = [bool(x) for x in (pattern.tolist() if hasattr(pattern, "tolist") else pattern)]
        if len(flags) != n_layer:
            raise LocalrtError(
                f"{ARCH}.attention.sliding_window_pattern has {len(flags)} entries, not {n_layer}"
            )
        return tuple(flags)
    period = DEFAULT_SWA_PERIOD if pattern is None else int(pattern)
    if period == 0:
        return (True,) * n_layer
    return tuple(i % period < period - 1 for i in range(n_layer))


class Block(LlamaBlock):
    """The Llama block's attention and gated MLP (`model.Block`), sandwich-normed, with a GELU gate,
    the q scale, and the sliding window and score soft-cap handed to the attention context."""

    def __init__(self, cfg: Gemma3Config, layer: int) -> None:
        super().__init__(cfg, layer, qkv_bias=False, qk_norm=cfg.qk_norm)
        self.window = cfg.sliding_window if cfg.sliding_layers[layer] else 0
        # the attention context applies SDPA's 1/sqrt(head_dim): q carries the rest of the scale
        self.q_scale = cfg.attention_scale * math.sqrt(self.head_dim)
        if self.window:
            self.attend_options["window"] = self.window
        if cfg.attn_logit_softcapping > 0:
            self.attend_options["softcap"] = cfg.attn_logit_softcapping
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

    config_from_gguf = staticmethod(Gemma3Config.from_gguf)

    def __init__(self, cfg: Gemma3Config) -> None:
        super().__init__(cfg, qk_norm=cfg.qk_norm)
        self.blk = nn.ModuleList(Block(cfg, i) for i in range(cfg.block_count))
        self.embed_scale = math.sqrt(cfg.embedding_length)  # exact in fp32, as llama.cpp's sqrtf
        self.rotary, self.rotary_swa = _rotaries(cfg)
        _cap_logits(self)

    @property
    def windows(self) -> list[int]:
        """Each layer's sliding window in tokens, 0 for the global layers."""
        return [block.window for block in self.blk]  # type: ignore[union-attr]

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.token_embd(tokens) * self.embed_scale

    def rotary_of(self, block: nn.Module) -> Rotary:
        return self.rotary_swa if block.window else self.rotary  # type: ignore[union-attr]

    @classmethod
    def from_gguf(
        cls,
        tensors: Any,
        dtype: torch.dtype,
        device: torch.device | str,
        modules: ModuleFactory | None = None,
    ) -> Gemma3:
        cfg = cls.config_from_gguf(tensors.metadata, vocab_size_of(tensors))
        model = build(lambda: cls(cfg), tensors, dtype, device, modules)
        model.rotary, model.rotary_swa = (r.to(device) for r in _rotaries(cfg))  # real buffers, off meta
        _cap_logits(model)  # again: `modules` may have swapped the head
        return model


def _cap_logits(model: Gemma3) -> None:
    """The final soft-cap c * tanh(logits / c) as a hook on the head, so every caller of
    `model.output` (the engine, scoring) gets capped logits."""
    cap = model.cfg.final_logit_softcapping
    head = model.output
    if cap > 0 and not getattr(head, "soft_capped", False):
        head.register_forward_hook(lambda _m, _i, out: cap * torch.tanh(out.float() / cap))
        head.soft_capped = True  # type: ignore[assignment]


def _rotaries(cfg: Gemma3Config) -> tuple[Rotary, Rotary]:
    """RoPE tables of the global layers and of the sliding ones (their own base, never scaled)."""
    local = replace(cfg, rope_freq_base=cfg.rope_freq_base_swa, rope_scaling_factor=1.0)
    return Rotary(cfg), Rotary(local)


def random_gemma3(cfg: Gemma3Config, seed: int = 0, dtype: torch.dtype = torch.float32) -> Gemma3:
    """A randomly initialised model (engine tests): nn defaults, with a seeded generator."""
    return random_model(Gemma3, cfg, seed, dtype)
