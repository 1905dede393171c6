"""The torch engine: paged KV cache, continuous batching, prefix caching, KV quantization, speculative decoding.

`TorchBackend` is what `localrt.backends.registry` loads; torch itself is imported only when a
model is loaded, so listing backends stays cheap.
"""

from .backend import TorchBackend
from .backend import TorchModel

__all__ = ["TorchBackend", "TorchModel"]
