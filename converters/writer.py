"""Stream a GGUF file one tensor at a time with gguf-py's GGUFWriter.

The header, key/values and tensor infos go out first; then each tensor is produced, written and
dropped, so memory holds one tensor at a time. The file is written as NAME.part and renamed when
complete: a failed conversion leaves no half-written output behind.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from collections.abc import Callable
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType
from gguf import GGUFWriter

QT = GGMLQuantizationType


class DiskFull(OSError):
    """ENOSPC while a GGUF was written; `needed` is the size of its tensor data (the file's floor)."""

    def __init__(self, path: Path, needed: int) -> None:
        super().__init__(errno.ENOSPC, f"no space left on device writing {path}", str(path))
        self.needed = needed


def new_writer(arch: str) -> GGUFWriter:
    """A writer with general.architecture set; keys are then added in the order they should appear."""
    return GGUFWriter(path=None, arch=arch)


def add_kv(writer: GGUFWriter, key: str, value: Any, kind: str) -> None:
    """Set one key the way llama.cpp's converter does (re-setting a key keeps its position)."""
    if kind == "u32":
        writer.add_uint32(key, int(value))
    elif kind == "f32":
        writer.add_float32(key, float(value))
    elif kind == "bool":
        writer.add_bool(key, bool(value))
    elif kind == "str":
        writer.add_string(key, value)
    elif kind.startswith("arr_"):
        writer.add_array(key, value)
    elif kind == "chat_template":
        writer.add_chat_template(value)
    else:
        raise ValueError(f"unknown key type {kind}")


def move_to_end(writer: GGUFWriter, key: str) -> None:
    """llama-quantize re-sets general.quantization_version / general.file_type, which appends them."""
    kv = writer.kv_data[0]
    if key in kv:
        kv[key] = kv.pop(key)


def set_at_end(writer: GGUFWriter, key: str, value: Any, kind: str) -> None:
    """Remove `key` and set it again, so it comes last (gguf_set_val_* in llama-quantize)."""
    writer.kv_data[0].pop(key, None)
    add_kv(writer, key, value, kind)


def nbytes(qtype: QT, shape: tuple[int, ...]) -> int:
    block, size = GGML_QUANT_SIZES[qtype]
    n = int(np.prod(shape, dtype=np.int64))
    return n // block * size


def write_streaming(
    writer: GGUFWriter,
    path: Path,
    tensors: Iterable[tuple[str, tuple[int, ...], QT, Callable[[], np.ndarray]]],
    on_tensor: Callable[[str, int], None] | None = None,
) -> None:
    """Write `writer`'s keys plus `tensors` = (name, numpy-order shape, type, produce()) to `path`.

    produce() returns the encoded data: float32/float16/uint16 arrays or uint8 blocks.
    """
    items = list(tensors)
    for name, shape, qtype, _ in items:
        writer.add_tensor_info(name, shape, np.dtype(np.float32), nbytes(qtype, shape), raw_dtype=qtype)
    tmp = path.with_name(path.name + ".part")
    try:
        _write_all(writer, tmp, items, on_tensor)
        os.replace(tmp, path)
    except BaseException as e:
        needed = sum(nbytes(qtype, shape) for _, shape, qtype, _ in items)
        full = isinstance(e, OSError) and _disk_full(e, tmp, needed)
        writer.close()
        with contextlib.suppress(OSError):
            tmp.unlink()
        if full:
            raise DiskFull(path, needed) from None
        raise


def _disk_full(e: OSError, tmp: Path, needed: int) -> bool:
    """ENOSPC, or numpy's short write ("N requested and M written", no errno) with less room left on the
    disk than the file still needed."""
    if e.errno == errno.ENOSPC:
        return True
    if e.errno is not None:
        return False
    try:
        left = needed - tmp.stat().st_size
        return shutil.disk_usage(tmp.parent).free < left
    except OSError:
        return False


def _write_all(
    writer: GGUFWriter,
    tmp: Path,
    items: list[tuple[str, tuple[int, ...], QT, Callable[[], np.ndarray]]],
    on_tensor: Callable[[str, int], None] | None,
) -> None:
    writer.write_header_to_file(path=tmp)
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for name, shape, qtype, produce in items:
        data = np.ascontiguousarray(produce())
        expected = nbytes(qtype, shape)
        if data.nbytes != expected:
            raise ValueError(f"{name}: encoded {data.nbytes} bytes, expected {expected} for {qtype.name}")
        writer.write_tensor_data(data.view(np.uint8).reshape(-1))
        if on_tensor:
            on_tensor(name, expected)
    writer.close()
