"""Per-request LoRA scales: llama-server's `lora` field, checked against the model before any load.

`lora: [{"id": N, "scale": S}, ...]`: ids index the model's adapters (`ADAPTER`) in load order; an adapter
the list leaves out is off (scale 0) for the request, as llama-server's /completion has it. An absent or
empty list keeps the model's default, every adapter at 1.0. The result is one scale per adapter, which the
llama.cpp engine applies (backends/llamacpp/step.py batches only requests of equal scales).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any

from localrt.errors import LocalrtError
from localrt.store.store import ResolvedModel

ENGINE = "llama.cpp"  # the one backend that applies adapters
_ANY_ENGINE = "auto"  # decided at load: checked again against the loaded backend (`check_backend`)


def scales(lora: Any, resolved: ResolvedModel, backend: str) -> tuple[float, ...] | None:
    """One scale per adapter of `resolved`, or None for the default; a `LocalrtError` (400) naming what
    is wrong: not a list of {id, scale}, a model without adapters, an unknown or repeated id, a backend
    that does not apply adapters."""
    if lora is None:
        return None
    if isinstance(lora, (str, bytes, Mapping)) or not isinstance(lora, Sequence):
        raise LocalrtError('lora must be a list of {"id": N, "scale": S} objects')
    if not lora:
        return None
    name = resolved.name.display
    n = len(resolved.adapter_paths)
    if n == 0:
        raise LocalrtError(f"lora: the model '{name}' has no LoRA adapters (ADAPTER) to scale")
    if backend not in (ENGINE, _ANY_ENGINE):
        raise _not_applied(backend)
    out = [0.0] * n
    seen: set[int] = set()
    for entry in lora:
        index, scale = _entry(entry)
        if not 0 <= index < n:
            ids = "id 0" if n == 1 else f"ids 0 to {n - 1}"
            raise LocalrtError(
                f"lora: unknown adapter id {index} (the model '{name}' has {n} LoRA adapter"
                f"{'s' if n != 1 else ''}: {ids})"
            )
        if index in seen:
            raise LocalrtError(f"lora: adapter id {index} is listed twice")
        seen.add(index)
        out[index] = scale
    return tuple(out)


def check_backend(lora: tuple[float, ...] | None, backend: str) -> None:
    """Scales on a loaded model whose backend (`auto` chose it) does not apply adapters: a 400."""
    if lora is not None and backend != ENGINE:
        raise _not_applied(backend)


def _not_applied(backend: str) -> LocalrtError:
    return LocalrtError(
        f"lora: the {backend} backend does not apply LoRA adapters; use the llama.cpp backend "
        "(option backend llama.cpp)"
    )


def _entry(entry: Any) -> tuple[int, float]:
    if not isinstance(entry, Mapping) or set(entry) != {"id", "scale"}:
        raise LocalrtError('lora: each entry must be an object {"id": N, "scale": S}')
    index, scale = entry["id"], entry["scale"]
    if isinstance(index, float) and index.is_integer():
        index = int(index)
    if isinstance(index, bool) or not isinstance(index, int):
        raise LocalrtError(f"lora: an adapter id must be an integer, got {index!r}")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise LocalrtError(f"lora: a scale must be a finite number, got {scale!r}")
    return index, float(scale)
