"""Gemma 2, read straight from GGUF (GGUF architecture `gemma2`): Gemma 3's layer (`gemma3.py`) with
the defaults of `backends/family_config.py::GEMMA2`; what llama.cpp's gemma2 graph does differently
is listed there.
"""

from __future__ import annotations

from localrt.backends.family_config import GEMMA2

from .gemma3 import Gemma3


class Gemma2(Gemma3):
    family = GEMMA2
    arch = GEMMA2.arch
