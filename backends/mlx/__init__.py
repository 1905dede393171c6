"""The MLX backend: a Llama-family engine in MLX reading GGUF (quantized weights kept quantized).

`MLXBackend` is what `localrt.backends.registry` loads; MLX itself is imported only when a model
is loaded, so listing backends stays cheap (and works where `mlx` is installed without its CPU library).
"""

from .backend import MLXBackend
from .backend import MLXModel

__all__ = ["MLXBackend", "MLXModel"]
