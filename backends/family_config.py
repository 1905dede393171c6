"""Hyper-parameters of the families past Llama (Gemma 3, Gemma 2, Phi-3, Qwen3-MoE) from GGUF metadata,
for both engines (the torch engine's and MLX's family files read them here).

Gemma's sliding layers follow llama.cpp: layer i slides iff i % period < period - 1 (Gemma 3: period 6,
five sliding layers for each global one; Gemma 2: period 2, the even layers sliding), unless the file
carries a per-layer `attention.sliding_window_pattern`. A sliding layer's query at p sees keys
p - window + 1 .. p.

What Gemma 3's graph does differently from the Llama one, as llama.cpp computes it (both engines'
`gemma3.py` build it; Gemma 2's differences from it are in their `gemma2.py`):
- Five sliding-window layers for each global one (above).
- Two RoPE bases: `rope.freq_base` for global layers (with the file's linear scaling, if any),
  `rope.freq_base_swa` for sliding ones (never scaled). Rotation pairs are halves (neox).
- q and k are RMS-normed per head before RoPE; attention scale 1/sqrt(head_dim) (27B: 1/sqrt(dim/heads)).
- Sandwich norms: RMSNorm before and after attention and before and after the MLP.
- The embedding is scaled by sqrt(dim); the MLP is GELU(tanh) gated; the head is tied unless the
  file carries `output.weight`; an optional final soft-cap c * tanh(logits / c).
- Norm weights are used as stored: llama.cpp's converter already added Gemma's "1 +" to them.

What Gemma 2's graph does differently from Gemma 3's (both engines' `gemma2.py`: Gemma 3's layer with
`GEMMA2` below):
- sliding and global layers alternate, the even ones sliding (window 4096 unless the file says);
- attention scores are soft-capped, s -> c * tanh(s / c) with c = 50 unless the file says, before
  the mask and the softmax; the logits too, with c = 30;
- no q/k norms; one RoPE base for both kinds of layer (10000: the converter writes none);
- the head is always the embedding (llama.cpp never loads an `output.weight` for Gemma 2).

Phi-3 / Phi-3.5 / Phi-4 (both engines' `phi3.py`: the Llama block as the file stores it):
- Q, K and V come fused in `attn_qkv` (rows: Q, then K, then V), gate and up fused in `ffn_up`
  (rows: gate, then up).
- RoPE pairs halves (neox) over the first `rope.dimension_count` dims of each head (partial rotary).
- LongRoPE (`longrope_scaling`): llama.cpp divides the frequencies by `rope_factors_short`, or by
  `rope_factors_long` when the context is longer than `rope.scaling.original_context_length`; cos
  and sin are scaled by `rope.scaling.attn_factor` either way.
- llama.cpp runs every layer with full attention (it ignores the file's sliding window), and so do we.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from localrt.errors import LocalrtError

from .llama_config import LlamaConfig
from .llama_config import llama_fields
from .llama_config import metadata_getter

DEFAULT_SWA_PERIOD = 6  # llama.cpp's Gemma 3 default; the converter never writes the pattern


@dataclass
class GemmaConfig(LlamaConfig):
    sliding_window: int = 0  # tokens a sliding layer's query sees (itself included); 0: no sliding layers
    sliding_layers: tuple[bool, ...] = ()  # per layer: True = sliding window
    rope_freq_base_swa: float = 10000.0
    attention_scale: float = 0.0  # multiplies q.k
    final_logit_softcapping: float = 0.0  # 0: off
    attn_logit_softcapping: float = 0.0  # 0: off (Gemma 2 caps attention scores)
    qk_norm: bool = True  # per-head RMSNorm of q and k (Gemma 2 has none)

    @property
    def windows(self) -> list[int]:
        """Each layer's sliding window in tokens, 0 for the global layers."""
        return [self.sliding_window if s else 0 for s in self.sliding_layers]


@dataclass(frozen=True)
class GemmaFamily:
    """What llama.cpp assumes for a Gemma generation when the file is silent."""

    arch: str
    swa_period: int  # layer i slides iff i % period < period - 1
    window: int  # sliding window when the file has none (0: no sliding layers)
    layers_27b: int  # the 27B size scales attention by 1/sqrt(dim / heads)
    attn_softcap: float
    final_softcap: float
    qk_norm: bool
    swa_base: float | None  # sliding layers' RoPE base when the file has none (None: the global one)


GEMMA3 = GemmaFamily("gemma3", DEFAULT_SWA_PERIOD, 0, 62, 0.0, 0.0, True, 10000.0)
GEMMA2 = GemmaFamily("gemma2", 2, 4096, 46, 50.0, 30.0, False, None)


def gemma_config(metadata: dict[str, Any], vocab_size: int, family: GemmaFamily) -> GemmaConfig:
    arch = family.arch
    get = metadata_getter(metadata, arch)
    fields = llama_fields(metadata, arch, vocab_size, context_length=131072, eps=None)
    n_layer, n_embd = fields["block_count"], fields["embedding_length"]
    n_head, head_dim = fields["attention_head_count"], fields["attention_key_length"]
    window = int(get("attention.sliding_window", family.window))
    pattern = metadata.get(f"{arch}.attention.sliding_window_pattern", family.swa_period)
    base = fields["rope_freq_base"]
    return GemmaConfig(
        **fields,
        rope_neox=True,
        sliding_window=window,
        sliding_layers=sliding_pattern(pattern, n_layer, arch) if window > 0 else (False,) * n_layer,
        rope_freq_base_swa=float(
            get("rope.freq_base_swa", base if family.swa_base is None else family.swa_base)
        ),
        attention_scale=1 / math.sqrt(n_embd / n_head if n_layer == family.layers_27b else head_dim),
        final_logit_softcapping=float(get("final_logit_softcapping", family.final_softcap)),
        attn_logit_softcapping=float(get("attn_logit_softcapping", family.attn_softcap)),
        qk_norm=family.qk_norm,
    )


def sliding_pattern(pattern: Any, n_layer: int, arch: str = "gemma3") -> tuple[bool, ...]:
    """Which layers slide: a per-layer bool array as given, else a period n (layer i slides iff
    i % n < n - 1; n = 0: every layer slides, n = 1: none)."""
    if isinstance(pattern, (list, tuple)) or hasattr(pattern, "tolist"):
        flags = [bool(x) for x in (pattern.tolist() if hasattr(pattern, "tolist") else pattern)]
        if len(flags) != n_layer:
            raise LocalrtError(
                f"{arch}.attention.sliding_window_pattern has {len(flags)} entries, not {n_layer}"
            )
        return tuple(flags)
    period = DEFAULT_SWA_PERIOD if pattern is None else int(pattern)
    if period == 0:
        return (True,) * n_layer
    return tuple(i % period < period - 1 for i in range(n_layer))


def llama_like_config(metadata: dict[str, Any], vocab_size: int, arch: str) -> LlamaConfig:
    """The Llama-family hyper-parameters of another architecture's keys (`phi3.*`, `qwen3moe.*`), read
    as the shared reader reads Qwen3's (neox RoPE, head dim from key_length)."""
    keys = {f"qwen3.{k[len(arch) + 1 :]}": v for k, v in metadata.items() if k.startswith(f"{arch}.")}
    cfg = LlamaConfig.from_gguf({**keys, "general.architecture": "qwen3"}, vocab_size)
    cfg.architecture = arch
    return cfg


def longrope_scaling(metadata: dict[str, Any], arch: str, context_length: int) -> tuple[int, float]:
    """Phi-3's LongRoPE keys: (the context its short factors serve, the scale of cos and sin)."""
    get = metadata_getter(metadata, arch)
    return int(get("rope.scaling.original_context_length", context_length)), float(
        get("rope.scaling.attn_factor", 1.0)
    )
