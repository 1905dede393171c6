"""The remote backend: models served by OpenAI-compatible upstreams (vLLM, SGLang, llama-server, another
localrt). `RemoteBackend` is what `localrt.backends.registry` loads for a remote model of the store."""

from .backend import Opened
from .backend import RemoteBackend
from .backend import RemoteError
from .backend import RemoteModel

__all__ = ["Opened", "RemoteBackend", "RemoteError", "RemoteModel"]
