"""The GGUF tensor source the torch and MLX engines load from, written once.

A memory-mapped GGUF file: its metadata, its tensor records and each tensor's stored bytes, read on
demand. Each engine's `GGUFTensors` (torch/gguf_load.py, mlx/gguf_load.py) adds only its conversion of
those bytes (dequantized torch tensors; MLX arrays, quantized where exact).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from localrt.errors import LocalrtError
from localrt.store.gguf import GGUFInfo
from localrt.store.gguf import TensorInfo
from localrt.store.gguf import read_gguf


class GGUFTensorSource:
    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        self.info: GGUFInfo = read_gguf(self.path)
        self._map: Any = np.memmap(self.path, dtype=np.uint8, mode="r")
        self.by_name: dict[str, TensorInfo] = {t.name: t for t in self.info.tensors}

    @property
    def metadata(self) -> dict[str, Any]:
        return self.info.metadata

    def text_metadata(self) -> dict[str, str]:
        """The metadata's single values as text (the loaded model's `metadata`)."""
        return self.info.text_metadata()

    def vocabulary(self) -> list[Any]:
        """The tokenizer's entries (`tokenizer.ggml.tokens`), empty when the file has none."""
        return list(self.metadata.get("tokenizer.ggml.tokens") or [])

    def __contains__(self, name: str) -> bool:
        return name in self.by_name

    def stored(self, name: str) -> tuple[np.ndarray, TensorInfo]:
        """A tensor's stored bytes (uint8 [n_bytes], a read-only view of the map) and its record."""
        t = self.by_name.get(name)
        if t is None:
            raise LocalrtError(f"GGUF tensor {name!r} is missing")
        start = self.info.data_offset + t.offset
        return np.asarray(self._map[start : start + t.n_bytes]), t

    def close(self) -> None:
        self._map = None
