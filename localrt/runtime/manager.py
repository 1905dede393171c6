"""The runtime every interface shares, under the name it has always been imported by.

The runtime is three modules: `models` (load, keep_alive, LRU unload, queue), `prompt` (templates,
thinking, tools, truncation) and `generate` (the request paths and their answers). This module keeps
`localrt.runtime.manager.Runtime` and friends importable for code written against the old single file.
"""

from __future__ import annotations

from localrt.runtime.generate import Chunk
from localrt.runtime.generate import ContextLengthError
from localrt.runtime.generate import EmbedResult
from localrt.runtime.generate import Metrics
from localrt.runtime.generate import RerankResult
from localrt.runtime.generate import Runtime
from localrt.runtime.models import BUSY_MESSAGE
from localrt.runtime.models import LoadedInfo

__all__ = [
    "BUSY_MESSAGE",
    "Chunk",
    "ContextLengthError",
    "EmbedResult",
    "LoadedInfo",
    "Metrics",
    "RerankResult",
    "Runtime",
]
