"""Gemma 2 in MLX (GGUF architecture `gemma2`): Gemma 3's layer (`gemma3.py`) with what llama.cpp's
gemma2 graph does differently (the defaults live in `backends/family_config.py::GEMMA2`):
- sliding and global layers alternate, the even ones sliding (window 4096 unless the file says);
- attention scores are soft-capped, s -> c * tanh(s / c) with c = 50 unless the file says, before
  the mask and the softmax (`cache.py`'s capped attention); the logits too, with c = 30;
- no q/k norms; one RoPE base for both kinds of layer;
- the head is always the embedding (llama.cpp never loads an `output.weight` for Gemma 2).
"""

from __future__ import annotations

from localrt.backends.family_config import GEMMA2

from .gemma3 import Gemma3
from .gguf_load import GGUFTensors


class Gemma2(Gemma3):
    family = GEMMA2

    def has_head(self, t: GGUFTensors) -> bool:
        return False
