"""Gemma 2, read straight from GGUF (GGUF architecture `gemma2`): Gemma 3's layer (`gemma3.py`) with
what llama.cpp's gemma2 graph does differently:
- sliding and global layers alternate, the even ones sliding (window 4096 unless the file says);
- attention scores are soft-capped, s -> c * tanh(s / c) with c = 50 unless the file says, before
  the mask and the softmax; the logits too, with c = 30, always;
- no q/k norms; one RoPE base for both kinds of layer (10000: the converter writes none);
- the head is always the embedding (llama.cpp never loads an `output.weight` for Gemma 2).
"""

from __future__ import annotations

from localrt.backends.family_config import GEMMA2

from .gemma3 import Gemma3


class Gemma2(Gemma3):
    family = GEMMA2
