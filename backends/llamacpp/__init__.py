"""llama.cpp backend: one batched context serving every request (continuous batching, prefix reuse,
speculation inside the batch) on llama-cpp-python's low-level API.

`lib.py` loads the library and wraps its ctypes calls, `sequences.py` holds the sequences and their KV
state, `admission.py` admission, prefix reuse and the RAM cache, `step.py` the batched context's step loop,
`backend.py` the adapter implementing backends/base.py.
"""

from localrt.backends.lookup import NgramProposer

from .backend import NAME
from .backend import LlamaCppBackend
from .backend import LlamaCppModel
from .lib import KV_TYPES
from .lib import _lib
from .lib import default_threads
from .lib import gpu_offload_supported
from .sequences import ExternalChunk
from .step import BatchedContext

__all__ = [
    "KV_TYPES",
    "NAME",
    "BatchedContext",
    "ExternalChunk",
    "LlamaCppBackend",
    "LlamaCppModel",
    "NgramProposer",
    "_lib",
    "default_threads",
    "gpu_offload_supported",
]
