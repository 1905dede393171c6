"""The GGUF architectures the torch engine runs: `general.architecture` -> the model file that builds it.

One model file per architecture family (`model.py`: the Llama family, `gemma3.py`: Gemma 3); each
class has `from_gguf(tensors, dtype, device, modules)` and the same forward contract (tokens and an
attention context in, float32 logits out), so the engine never asks which one it runs.
"""

from __future__ import annotations

from typing import Any

import torch

from localrt.errors import LocalrtError

from .gemma3 import Gemma3
from .model import ModuleFactory, Transformer

MODELS: dict[str, Any] = {
    "llama": Transformer,
    "mistral": Transformer,
    "granite": Transformer,
    "qwen2": Transformer,
    "qwen3": Transformer,
    "gemma3": Gemma3,
}


def model_class(metadata: dict[str, Any]) -> Any:
    arch = str(metadata.get("general.architecture", "llama"))
    cls = MODELS.get(arch)
    if cls is None:
        raise LocalrtError(
            f"the torch backend does not support the {arch!r} architecture yet "
            f"(supported: {', '.join(sorted(MODELS))}); the llama.cpp backend runs it"
        )
    return cls


def load_model(
    tensors: Any, dtype: torch.dtype, device: torch.device | str, modules: ModuleFactory | None = None
) -> Any:
    """The model a GGUF describes, its weights dequantized into `dtype` on `device` (or supplied by
    `modules`, e.g. kept quantized)."""
    return model_class(tensors.metadata).from_gguf(tensors, dtype, device, modules=modules)
