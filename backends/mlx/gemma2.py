"""Gemma 2 in MLX (GGUF architecture `gemma2`): Gemma 3's layer (`gemma3.py`) with the defaults of
`backends/family_config.py::GEMMA2` (what llama.cpp's gemma2 graph does differently is listed there;
the attention scores' soft-cap is `cache.py`'s capped attention) and the embedding as the head.
"""

from __future__ import annotations

from localrt.backends.family_config import GEMMA2

from .gemma3 import Gemma3
from .gguf_load import GGUFTensors


class Gemma2(Gemma3):
    family = GEMMA2

    def has_head(self, t: GGUFTensors) -> bool:
        return False
