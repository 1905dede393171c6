"""Phi-3 / Phi-3.5 / Phi-4 (GGUF architecture `phi3`): the Llama block (`llama.py`) as the file stores it;
what Phi-3's graph is in llama.cpp is listed in `backends/family_config.py` (one list with MLX's `phi3.py`).

Its fused projections are the Llama file's own fused layout, so the weights load as they are. The
LongRoPE factors are chosen once per context, for every position, as llama.cpp chooses them
(`fit_context`), not per sequence length as transformers does.
"""

from __future__ import annotations

from typing import Any

import torch

from localrt.backends.family_config import llama_like_config
from localrt.backends.family_config import longrope_scaling

from .llama import Rotary
from .llama import Transformer
from .llama import vocab_size_of

ARCH = "phi3"


class Phi3(Transformer):
    arch = ARCH
    factors: dict[str, torch.Tensor]  # "short" / "long": LongRoPE's frequency divisors (empty: none)
    original_context: int  # the context the short factors serve
    attn_factor: float
    rope_factors: str  # the factors in use: "short", "long" or "none" (a file without LongRoPE)

    def fit_context(self, context_length: int) -> None:
        """Pick the RoPE factors for a context of `context_length` tokens (llama.cpp: the long ones iff
        the context is longer than the original one); the short ones until this is called."""
        if not self.factors:
            return
        kind = "long" if context_length > self.original_context else "short"
        device = self.rotary.cos.device
        # a file without long factors keeps none past the original context (llama.cpp's null tensor)
        self.rotary = Rotary(self.cfg, self.factors.get(kind), self.attn_factor).to(device)
        self.rope_factors = kind

    @classmethod
    def of_file(cls, tensors: Any) -> Phi3:
        return cls(llama_like_config(tensors.metadata, vocab_size_of(tensors), ARCH))

    def finish(self, tensors: Any, device: torch.device | str) -> None:
        """LongRoPE's factors and scales from the file, the short factors' tables until `fit_context`."""
        self.factors = {
            kind: tensors.get(f"rope_factors_{kind}.weight")
            for kind in ("short", "long")
            if f"rope_factors_{kind}.weight" in tensors
        }
        self.original_context, self.attn_factor = longrope_scaling(
            tensors.metadata, ARCH, self.cfg.context_length
        )
        self.rope_factors = "short" if self.factors else "none"
        # real buffers, off the meta device
        self.rotary = Rotary(self.cfg, self.factors.get("short"), self.attn_factor).to(device)
