"""Which compute devices the installed llama.cpp build can use, and whether the machine has a GPU that
build leaves idle.

`pip install llama-cpp-python` compiles a CPU-only library unless CMAKE_ARGS asks for a GPU backend, so a
GPU machine can run at CPU speed without a word; `localrt serve` logs these lines at start-up to say so.
llama_cpp is imported lazily: the server starts (and says what it can) without it.
"""

from __future__ import annotations

import ctypes
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# ggml's enum ggml_backend_dev_type, in its order (ggml-backend.h)
DEVICE_KINDS = ("cpu", "gpu", "igpu", "accel", "meta")

# the CMAKE_ARGS that build llama-cpp-python for each vendor's GPUs
CMAKE_ARGS = {"NVIDIA": "-DGGML_CUDA=on", "AMD": "-DGGML_HIP=on"}


@dataclass(frozen=True)
class ComputeDevice:
    name: str  # ggml's device name: CPU, CUDA0, Metal, Vulkan0, ROCm0, ...
    description: str
    kind: str  # one of DEVICE_KINDS
    free: int = 0  # bytes of its memory free now, as the device reports them (0 where it does not)
    total: int = 0

    def __str__(self) -> str:
        return f"{self.name} ({self.kind}: {self.description})"


def declare(fn: Any, restype: Any, *argtypes: Any) -> None:
    """Give a C function of a ctypes library its result and argument types (undeclared, ctypes takes and
    returns C ints, which truncates pointers and sizes)."""
    fn.restype = restype
    fn.argtypes = list(argtypes)


def _ggml_library() -> Any:
    """The ggml library llama_cpp loaded (its device registry), with the backend initialised."""
    import llama_cpp
    from llama_cpp._ggml import libggml

    llama_cpp.llama_backend_init()
    lib = libggml
    size_p = ctypes.POINTER(ctypes.c_size_t)
    declare(lib.ggml_backend_dev_count, ctypes.c_size_t)
    declare(lib.ggml_backend_dev_get, ctypes.c_void_p, ctypes.c_size_t)
    declare(lib.ggml_backend_dev_name, ctypes.c_char_p, ctypes.c_void_p)
    declare(lib.ggml_backend_dev_description, ctypes.c_char_p, ctypes.c_void_p)
    declare(lib.ggml_backend_dev_type, ctypes.c_int, ctypes.c_void_p)
    declare(lib.ggml_backend_dev_memory, None, ctypes.c_void_p, size_p, size_p)
    return lib


def compute_devices() -> list[ComputeDevice] | None:
    """ggml's device list as the installed build registered it; None where the binding does not expose
    the registry (older llama-cpp-python) or llama_cpp is not installed."""
    try:
        lib = _ggml_library()
    except (ImportError, AttributeError, OSError):
        return None
    devices = []
    for i in range(int(lib.ggml_backend_dev_count())):
        dev = lib.ggml_backend_dev_get(i)
        kind = int(lib.ggml_backend_dev_type(dev))
        free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
        lib.ggml_backend_dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
        devices.append(
            ComputeDevice(
                (lib.ggml_backend_dev_name(dev) or b"?").decode(errors="replace"),
                (lib.ggml_backend_dev_description(dev) or b"").decode(errors="replace"),
                DEVICE_KINDS[kind] if 0 <= kind < len(DEVICE_KINDS) else f"type {kind}",
                int(free.value),
                int(total.value),
            )
        )
    return devices


def gpu_room(devices: Sequence[ComputeDevice] | None, overhead: int) -> int | None:
    """Bytes the GPUs of the build can take now: each one's free memory less `overhead`
    (LOCALRT_GPU_OVERHEAD), summed, as llama.cpp spreads layers over every GPU it has. None without a
    GPU device, or where the devices do not report their memory."""
    gpus = [d for d in devices or () if d.kind in ("gpu", "igpu")]
    if not gpus or not any(d.total for d in gpus):
        return None
    return sum(max(0, d.free - overhead) for d in gpus)


def build_offloads(devices: Sequence[ComputeDevice] | None) -> bool:
    """Whether the build can put layers on a GPU: a GPU device in the registry, or, where the registry is
    not exposed, llama.cpp's own llama_supports_gpu_offload()."""
    if devices is not None:
        return any(d.kind in ("gpu", "igpu") for d in devices)
    try:
        import llama_cpp

        return bool(llama_cpp.llama_supports_gpu_offload())
    except ImportError:
        return False


def gpu_vendors_present(dev: Path = Path("/dev")) -> list[str]:
    """GPU vendors whose driver tools or device nodes this machine has: NVIDIA (`nvidia-smi` on PATH),
    AMD (`/dev/kfd`, ROCm's compute node, or `rocm-smi` on PATH)."""
    vendors = []
    if shutil.which("nvidia-smi"):
        vendors.append("NVIDIA")
    if (dev / "kfd").exists() or shutil.which("rocm-smi"):
        vendors.append("AMD")
    return vendors


def reinstall_hint(vendors: Sequence[str], offloads: bool) -> str | None:
    """The one line to log when the machine has a GPU but the llama.cpp build cannot use one (else None)."""
    if offloads or not vendors:
        return None
    args = " ".join(CMAKE_ARGS[v] for v in vendors if v in CMAKE_ARGS)
    return (
        f"this machine has an {' and an '.join(vendors)} GPU but llama.cpp was built for the CPU only; "
        f'reinstall it with: CMAKE_ARGS="{args}" pip install --force-reinstall --no-cache-dir '
        "llama-cpp-python"
    )


def startup_report() -> list[str]:
    """The lines `localrt serve` logs at start-up: the devices, and the reinstall hint when it applies."""
    devices = compute_devices()
    offloads = build_offloads(devices)
    if devices is not None:
        lines = ["llama.cpp compute devices: " + (", ".join(str(d) for d in devices) or "none")]
    else:
        lines = [f"llama.cpp GPU offload: {'yes' if offloads else 'no (CPU only)'}"]
    hint = reinstall_hint(gpu_vendors_present(), offloads)
    if hint is not None:
        lines.append(hint)
    return lines
