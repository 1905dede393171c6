"""llama.cpp backend: one context per model serving every request (continuous batching, prefix reuse,
speculation inside the batch, embeddings and scores batched with generation) on llama-cpp-python's
low-level API.

`lib.py` loads the library and wraps its ctypes calls; the engine is built from parts: `sequences.py`
(what a request is to it), `kv.py` (the record of each seq id's cells and the RAM cache),
`scheduler.py` (admission and each step's plan), `runner.py` (the context, its batch and the decode),
`draft.py` (the draft model's context) and `engine.py` (the step loop); `backend.py` is the adapter
implementing backends/base.py.
"""

from .backend import NAME
from .backend import LlamaCppBackend
from .backend import LlamaCppModel
from .lib import KV_TYPES
from .lib import default_threads
from .lib import gpu_offload_supported

__all__ = ["KV_TYPES", "NAME", "LlamaCppBackend", "LlamaCppModel", "default_threads", "gpu_offload_supported"]
