"""The GGUF architectures the MLX engine runs: `general.architecture` -> the model file that builds it.

One model file per family (`llama.py`: the Llama family, `gemma3.py`: Gemma 3, `gemma2.py`: Gemma 2 on
Gemma 3's layer, `phi3.py`: Phi-3 on the Llama block, `qwen3moe.py`: Qwen3's attention with routed
experts); each class is built as `cls(tensors, dtype)` and has the same forward contract
(`hidden_batch`, `logits`, `make_caches`), so the engine never asks which one it runs.
"""

from __future__ import annotations

import mlx.core as mx

from localrt.backends.checks import model_for_architecture
from localrt.backends.llama_config import SUPPORTED_ARCHS

from .gemma2 import Gemma2
from .gemma3 import Gemma3
from .gguf_load import GGUFTensors
from .llama import Transformer
from .phi3 import Phi3
from .qwen3moe import Qwen3MoE

MODELS: dict[str, type[Transformer]] = {
    **dict.fromkeys(sorted(SUPPORTED_ARCHS), Transformer),  # the Llama family (`llama_config.py`)
    "gemma2": Gemma2,
    "gemma3": Gemma3,
    "phi3": Phi3,
    "qwen3moe": Qwen3MoE,
}


def load_model(tensors: GGUFTensors, dtype: mx.Dtype) -> Transformer:
    """The model a GGUF describes, its weights in MLX (quantized where exact) in `dtype`."""
    return model_for_architecture(tensors.metadata, MODELS, "MLX")(tensors, dtype)
