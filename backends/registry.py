"""Which backends exist, which are installed here (and why not), and what `auto` picks.

Checks use import specs, not imports, so listing backends stays cheap; the backend module is
imported only when it is chosen.
"""

from __future__ import annotations

import importlib
import importlib.util
import platform
import shutil
import sys
from dataclasses import dataclass
from typing import Any

from localrt.errors import BackendUnavailable
from localrt.errors import OptionError

ALIASES = {"llamacpp": "llama.cpp", "llama_cpp": "llama.cpp", "llama-cpp": "llama.cpp", "llama": "llama.cpp"}


@dataclass(frozen=True)
class BackendSpec:
    name: str
    module: str  # localrt.backends.<module>
    cls: str
    requires: tuple[str, ...]  # import names that must be installed
    pip_hint: str


SPECS: dict[str, BackendSpec] = {
    "llama.cpp": BackendSpec(
        "llama.cpp",
        "localrt.backends.llamacpp",
        "LlamaCppBackend",
        ("llama_cpp",),
        "pip install 'localrt[llama]'",
    ),
    "mlx": BackendSpec(
        "mlx",
        "localrt.backends.mlx",
        "MLXBackend",
        ("mlx", "numpy", "llama_cpp"),
        "pip install 'localrt[mlx]'",
    ),
    "torch": BackendSpec(
        "torch",
        "localrt.backends.torch",
        "TorchBackend",
        ("torch", "numpy", "llama_cpp"),
        "pip install 'localrt[torch]'",
    ),
}


# Not a local engine: chosen by the store for remote models (never by `auto`), so it stays out of SPECS,
# which lists the backends that load GGUF files (`installed()`, conformance tests, `auto`).
REMOTE = BackendSpec("remote", "localrt.backends.remote", "RemoteBackend", ("httpx",), "pip install httpx")


@dataclass(frozen=True)
class BackendStatus:
    name: str
    installed: bool
    reason: str  # empty when installed


def normalize(name: str) -> str:
    key = name.strip().lower()
    return ALIASES.get(key, key)


def _module_present(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def status(name: str) -> BackendStatus:
    name = normalize(name)
    spec = SPECS.get(name) or (REMOTE if name == REMOTE.name else None)
    if spec is None:
        raise OptionError(f"unknown backend {name!r} (use {', '.join(['auto', *SPECS])})")
    if not _module_present(spec.module):
        return BackendStatus(name, False, f"the {name} backend is not part of this localrt version yet")
    missing = [m for m in spec.requires if not _module_present(m)]
    if missing:
        return BackendStatus(name, False, f"{', '.join(missing)} is not installed; {spec.pip_hint}")
    try:
        backend = _backend_class(spec)
    except ImportError as e:
        return BackendStatus(name, False, f"{spec.module} failed to import ({e}); {spec.pip_hint}")
    if backend is None:  # the package exists but does not offer the backend (yet)
        return BackendStatus(name, False, f"{spec.module} does not define {spec.cls} yet")
    ok, reason = backend.availability()
    return BackendStatus(name, ok, "" if ok else reason)


def _backend_class(spec: BackendSpec) -> Any:
    """The backend (an EngineBackend value, or a class): its module imported; backends import their heavy
    libraries lazily."""
    module = importlib.import_module(spec.module)
    return getattr(module, spec.cls, None) or getattr(module, "BACKEND", None)


def statuses() -> list[BackendStatus]:
    return [status(name) for name in SPECS]


def installed() -> list[str]:
    """Names of the backends that can load models here (conformance tests run for each)."""
    return [s.name for s in statuses() if s.installed]


def _require(name: str) -> BackendStatus:
    """The status of an installed backend, or BackendUnavailable saying why and what to install."""
    st = status(name)
    if not st.installed:
        raise BackendUnavailable(f"backend {st.name} is not available: {st.reason}")
    return st


def get(name: str) -> Any:
    """The backend class for `name`, or BackendUnavailable saying why and what to install."""
    return _backend_class(SPECS.get(_require(name).name) or REMOTE)


def has_cuda() -> bool:
    return shutil.which("nvidia-smi") is not None


def is_apple_silicon() -> bool:
    return sys.platform == "darwin" and platform.machine() == "arm64"


def auto_order() -> list[str]:
    """Apple Silicon: MLX, then llama.cpp (Metal). CUDA and CPU: llama.cpp first, torch as a fallback."""
    if is_apple_silicon():
        return ["mlx", "llama.cpp", "torch"]
    return ["llama.cpp", "torch", "mlx"]


def resolve(name: str | None) -> str:
    """`auto`/None -> the first installed backend in auto order; anything else must be installed."""
    if name is None or normalize(name) == "auto":
        for candidate in auto_order():
            if status(candidate).installed:
                return candidate
        reasons = "; ".join(f"{s.name}: {s.reason}" for s in statuses())
        raise BackendUnavailable(f"no backend is installed ({reasons})")
    return _require(name).name
