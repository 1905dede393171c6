"""llama.cpp parameter values that the text contexts (`llamacpp/lib.py`) and the image projector
(`mtmd.py`, outside the llamacpp package, which imports it) set alike. It imports llama-cpp-python lazily."""

from __future__ import annotations


def flash_attn_type(flash_attn: bool | None) -> int:
    """LoadOptions.flash_attn as llama.cpp's `flash_attn_type` (text contexts and libmtmd's alike)."""
    import llama_cpp

    return {
        None: llama_cpp.LLAMA_FLASH_ATTN_TYPE_AUTO,
        True: llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED,
        False: llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED,
    }[flash_attn]
