"""The GGUF architectures the torch engine runs: `general.architecture` -> the model file that builds it.

One model file per architecture family (`llama.py`: the Llama family, `gemma3.py`: Gemma 3, `gemma2.py`: Gemma 2 on the same layer,
`phi3.py`: Phi-3 on the Llama block,
`qwen3moe.py`: Qwen3-MoE, Qwen3's attention with routed experts, and OLMoE on the same code); each
class has `from_gguf(tensors, dtype, device, modules)` and the same forward contract (tokens and an
attention context in, float32 logits out), so the engine never asks which one it runs.
"""

from __future__ import annotations

from typing import Any

import torch

from localrt.backends.checks import model_for_architecture
from localrt.backends.llama_config import SUPPORTED_ARCHS

from .gemma2 import Gemma2
from .gemma3 import Gemma3
from .llama import ModuleFactory
from .llama import Transformer
from .phi3 import Phi3
from .qwen3moe import OLMoE
from .qwen3moe import Qwen3MoE

# the Llama family's architectures (`llama_config.py`), then each other family's own (its `arch`)
MODELS: dict[str, Any] = dict.fromkeys(sorted(SUPPORTED_ARCHS), Transformer)
MODELS.update({family.arch: family for family in (Gemma2, Gemma3, Phi3, Qwen3MoE, OLMoE)})


def settle(model: torch.nn.Module) -> None:
    """Every module's parameters, buffers and submodules placed in its instance dict as well, where
    attribute lookup finds them first. Without this each `self.weight` of a forward falls through to
    `nn.Module.__getattr__` (three dictionary lookups), about 800 times a token for a 30-layer model:
    about 4% of a batch-1 decode step on the CPU. For a model whose module tree no longer changes: the
    last step of a load. A module or parameter assigned later replaces its entry (nn.Module removes it
    from the instance dict); a buffer replaced later (an assignment, `.to()`) would not be seen."""
    for module in model.modules():
        for table in (module._parameters, module._buffers, module._modules):
            module.__dict__.update(table)


def load_model(
    tensors: Any, dtype: torch.dtype, device: torch.device | str, modules: ModuleFactory | None = None
) -> Any:
    """The model a GGUF describes, its weights dequantized into `dtype` on `device` (or supplied by
    `modules`, e.g. kept quantized)."""
    return model_for_architecture(tensors.metadata, MODELS, "torch").from_gguf(
        tensors, dtype, device, modules=modules
    )
