"""The few backend facts and helpers the interfaces need, handed over by the runtime.

The API, the client and the chat app reach backends only through the runtime (an import-linter
contract in pyproject.toml): what they used to import from `localrt.backends` they import from here.
"""

from __future__ import annotations

from localrt.backends import devices
from localrt.backends import registry
from localrt.backends.base import KV_CACHE_TYPES
from localrt.backends.base import NUMERICS
from localrt.backends.base import SPECULATIVE_MODES
from localrt.backends.base import run_in_thread_stream

__all__ = [
    "KV_CACHE_TYPES",
    "NUMERICS",
    "SPECULATIVE_MODES",
    "compute_device_report",
    "resolve_backend",
    "run_in_thread_stream",
]


def resolve_backend(name: str | None) -> str:
    """The backend a request naming `name` (`auto`, None, or a backend) would load on here."""
    return registry.resolve(name)


def compute_device_report() -> list[str]:
    """What `localrt serve` logs at start-up: llama.cpp's compute devices, and how to reinstall it when
    the machine has a GPU the build cannot use."""
    return devices.startup_report()
