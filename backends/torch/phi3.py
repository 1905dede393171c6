"""Phi-3 / Phi-3.5 / Phi-4 (GGUF architecture `phi3`): the Llama block (`model.py`) as the file stores it.

- Q, K and V come fused in `attn_qkv` (rows: Q, then K, then V), gate and up fused in `ffn_up`
  (rows: gate, then up), which is the Llama file's own fused layout, so the weights load as they are.
- RoPE pairs halves (neox) over the first `rope.dimension_count` dims of each head (partial rotary).
- LongRoPE: the frequencies are divided by `rope_factors_short` (`rope_factors_long` once the
  context passes `rope.scaling.original_context_length`, as llama.cpp decides per context) and cos/sin
  are scaled by `rope.scaling.attn_factor`. This engine keeps the context within the original length
  when the file has long factors, so the short ones are always the right ones.
- llama.cpp runs every layer with full attention (it ignores the file's sliding window), and so do we.
"""

from __future__ import annotations

from typing import Any

import torch

from .model import ModuleFactory, Rotary, Transformer, llama_like_config, load_weights, vocab_size_of

ARCH = "phi3"


class Phi3(Transformer):
    @classmethod
    def from_gguf(
        cls,
        tensors: Any,
        dtype: torch.dtype,
        device: torch.device | str,
        modules: ModuleFactory | None = None,
    ) -> Phi3:
        md = tensors.metadata
        cfg = llama_like_config(md, vocab_size_of(tensors), ARCH)
        factors = None
        if "rope_factors_short.weight" in tensors:
            factors = tensors.get("rope_factors_short.weight")
            original = int(md.get(f"{ARCH}.rope.scaling.original_context_length", cfg.context_length))
            cfg.context_length = min(cfg.context_length, original)  # past it, llama.cpp uses the long factors
        attn_factor = float(md.get(f"{ARCH}.rope.scaling.attn_factor", 1.0))
        with torch.device("meta"):
            model = cls(cfg)
        load_weights(model, tensors, dtype, device, modules)
        model.rotary = Rotary(cfg, factors, attn_factor).to(device)  # real buffers, off the meta device
        return model
