"""What a model will hold in memory before it is loaded: weights as the backend keeps them, the KV cache
at the context and parallel sequences it would be given, and the buffers around them.

Each backend estimates from the GGUF header alone (`EngineBackend.estimate`), with its own rules for how
it stores each tensor type, so the runtime can make room or refuse before a load that would not fit
(a process killed for memory loses every request in flight).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from collections.abc import Mapping
from dataclasses import dataclass
from dataclasses import replace
from pathlib import Path
from typing import Any

from localrt.store.gguf import GGUFInfo
from localrt.store.gguf import read_blob

from .base import LoadOptions
from .base import loaded_context

GiB = 1 << 30
MiB = 1 << 20


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes a load would hold, by part, and the settings the estimate is for."""

    backend: str
    weights: int
    kv: int
    buffers: int
    context_length: int
    parallel: int
    projector: int = 0
    draft: int = 0
    device: str = "CPU"
    gpu: int = 0  # of the total, the bytes that go to GPU memory (layers offloaded, their KV, buffers)
    gpu_free: int | None = None  # the GPUs' room when estimated (None: no GPU)
    gpu_weights: int = 0  # of the GPU's part, the weights' bytes
    pool: int = 0  # cells of the KV pool the sequences share (0: each sequence has its own context's)

    @property
    def weights_ram(self) -> int:
        """The weights' bytes that stay in system memory."""
        return self.weights - self.gpu_weights

    def without_weights(self) -> MemoryEstimate:
        """What the load adds where another loaded model already holds the same weights."""
        return replace(self, weights=0, gpu=self.gpu - self.gpu_weights, gpu_weights=0)

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.buffers + self.projector + self.draft

    @property
    def ram(self) -> int:
        """What stays in system memory: the total less the GPU's part."""
        return self.total - self.gpu

    def fits(self, available_ram: int) -> bool:
        """The RAM part fits what is left, and the GPU part fits the GPUs' room."""
        return self.ram <= available_ram and (self.gpu_free is None or self.gpu <= self.gpu_free)

    def as_dict(self) -> dict[str, Any]:
        return {
            "backend": self.backend,
            "device": self.device,
            "total": self.total,
            "weights": self.weights,
            "kv": self.kv,
            "buffers": self.buffers,
            "projector": self.projector,
            "draft": self.draft,
            "gpu": self.gpu,
            "context_length": self.context_length,
            "parallel": self.parallel,
            "pool": self.pool,
        }

    @property
    def pool_text(self) -> str:
        """What `ps` and `--estimate` add where the sequences share one pool: ", KV pool N cells"."""
        return f", KV pool {self.pool} cells" if self.pool else ""

    def lines(self) -> list[str]:
        """The estimate as `run --estimate` and `show` print it."""
        rows = [
            ("backend", f"{self.backend} ({self.device})"),
            ("context", f"{self.context_length} x {self.parallel} parallel" + self.pool_text),
            ("weights", human_bytes(self.weights)),
            ("kv cache", human_bytes(self.kv)),
            ("buffers", human_bytes(self.buffers)),
        ]
        if self.projector:
            rows.append(("projector", human_bytes(self.projector)))
        if self.draft:
            rows.append(("draft model", human_bytes(self.draft)))
        rows.append(("total", human_bytes(self.total)))
        if self.gpu:
            rows.append(("on GPU", human_bytes(self.gpu)))
            rows.append(("in RAM", human_bytes(self.ram)))
        return [f"{name:<12}{value}" for name, value in rows]


@dataclass(frozen=True)
class Sizing:
    """The settings an estimate is for, as a backend's rules give them: the context each sequence is
    loaded with and the sequences decoded together."""

    backend: str
    context: int
    parallel: int
    pool: int = 0  # cells of the KV pool the sequences share (0: a context each)

    def estimate(self, **parts: Any) -> MemoryEstimate:
        """The estimate at these settings; `parts`: the bytes by part and where they go (the other fields
        of `MemoryEstimate`)."""
        return MemoryEstimate(
            backend=self.backend, context_length=self.context, parallel=self.parallel, pool=self.pool, **parts
        )


def draft_bytes(opts: LoadOptions, size: Callable[[ModelShape], int]) -> int:
    """The draft model's bytes by the backend's rule for a model (`size` of its header); 0 without one."""
    return 0 if opts.draft_model is None else size(model_shape(opts.draft_model))


def human_bytes(n: float) -> str:
    """Sizes as Ollama prints them in its memory errors: "2.3 GiB", "241.5 MiB"."""
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", 1024)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


@dataclass(frozen=True)
class ModelShape:
    """The header facts every backend's estimate needs."""

    info: GGUFInfo
    arch: str
    n_layer: int
    n_head_kv: int
    head_dim: int
    n_vocab: int
    trained_context: int
    sliding_window: int  # 0 when no layer slides
    sliding_layers: int

    @functools.cached_property
    def text_metadata(self) -> dict[str, str]:
        """The header's single values as text, made once per file (the shape is cached per file)."""
        return self.info.text_metadata()


class HeaderNumbers:
    """The architecture's numbers in a GGUF header: `num("block_count")` reads `<arch>.block_count`, the
    default where the key is missing or not a number."""

    def __init__(self, metadata: Mapping[str, Any]) -> None:
        self.metadata = metadata
        self.arch = str(metadata.get("general.architecture", "llama"))

    def __call__(self, key: str, default: int = 0) -> int:
        try:
            return int(float(self.metadata.get(f"{self.arch}.{key}", default)))
        except (TypeError, ValueError):
            return default

    def n_head(self) -> int:
        return max(1, self("attention.head_count", 1))

    def n_head_kv(self) -> int:
        return self("attention.head_count_kv", self.n_head())

    def head_dim(self) -> int:
        return self("attention.key_length", self("embedding_length") // self.n_head())


def model_shape(path: Path | str) -> ModelShape:
    p = Path(path)
    st = p.stat()
    return _model_shape(p, st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=32)
def _model_shape(path: Path, size: int, mtime_ns: int) -> ModelShape:
    """Cached by the file's identity: a fit tries several settings on one header."""
    info = read_blob(path)  # a malformed file gets the same refusal as at load, and the verdict is kept
    num = HeaderNumbers(info.metadata)
    tokens = info.metadata.get("tokenizer.ggml.tokens")
    window = num("attention.sliding_window")
    return ModelShape(
        info=info,
        arch=num.arch,
        n_layer=num("block_count"),
        n_head_kv=num.n_head_kv(),
        head_dim=num.head_dim(),
        n_vocab=num("vocab_size") or (len(tokens) if isinstance(tokens, (list, tuple)) else 0),
        trained_context=num("context_length"),
        sliding_window=window,
        sliding_layers=_sliding_layers(num) if window else 0,
    )


def _sliding_layers(num: HeaderNumbers) -> int:
    """How many layers attend through a window: a pattern in the header, else Gemma 3's five in six."""
    arch, n_layer = num.arch, num("block_count")
    pattern = num.metadata.get(f"{arch}.attention.sliding_window_pattern")
    if isinstance(pattern, (list, tuple)):
        return sum(bool(p) for p in pattern[:n_layer])
    if isinstance(pattern, int) and pattern > 1:
        return n_layer - n_layer // pattern
    if arch == "gemma3":
        return n_layer - n_layer // 6
    return n_layer if arch in ("gemma2",) else 0


def padded(cells: int) -> int:
    """Cells as llama.cpp allocates them: a multiple of 256."""
    return -(-cells // 256) * 256


def context_for(shape: ModelShape, num_ctx: int) -> int:
    return loaded_context(num_ctx, shape.trained_context)


def file_size(path: Path | str | None) -> int:
    return os.path.getsize(path) if path is not None else 0


def available_memory() -> int:
    """Free RAM now (the kernel's MemAvailable, which counts reclaimable cache), and no more than the
    memory cgroup this process runs in leaves (a container's limit, which the kernel enforces by killing)."""
    try:
        import psutil

        free = int(psutil.virtual_memory().available)
    except ImportError:
        try:
            free = int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
        except (ValueError, OSError, AttributeError):
            return 0
    left = cgroup_room()
    return free if left is None else min(free, left)


CGROUP_ROOT = Path("/sys/fs/cgroup")
UNLIMITED = 1 << 60  # cgroup v1 writes "no limit" as a page-rounded 2^63


def cgroup_room() -> int | None:
    """The limit of this process's memory cgroup less what it holds (page cache that can be dropped
    not counted), or None without a limit (or off Linux)."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2: one hierarchy
            found = _cgroup_dir(CGROUP_ROOT, path, "memory.max") or _cgroup_dir(
                CGROUP_ROOT / "unified", path, "memory.max"
            )
            if found is not None:
                return _room(found, "memory.max", "memory.current", "inactive_file")
        elif "memory" in controllers.split(","):
            found = _cgroup_dir(CGROUP_ROOT / "memory", path, "memory.limit_in_bytes")
            if found is not None:
                return _room(found, "memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
    return None


def _cgroup_dir(mount: Path, path: str, probe: str) -> Path | None:
    """The cgroup's folder: its path under the mount, or a tail of it (inside a container the mount
    shows the container's own cgroup as the root)."""
    parts = [p for p in path.split("/") if p]
    for start in range(len(parts) + 1):
        folder = mount.joinpath(*parts[start:])
        if (folder / probe).is_file():
            return folder
    return None


def _room(folder: Path, limit_file: str, usage_file: str, reclaimable: str) -> int | None:
    try:
        raw = (folder / limit_file).read_text().strip()
        if raw == "max" or int(raw) >= UNLIMITED:
            return None
        usage = int((folder / usage_file).read_text().strip())
        stat = dict(line.split() for line in (folder / "memory.stat").read_text().splitlines() if " " in line)
        return int(raw) - usage + int(stat.get(reclaimable, 0))
    except (OSError, ValueError):
        return None
