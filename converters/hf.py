"""Read a Hugging Face checkpoint: config.json, safetensors (one file or a sharded index), lazily.

Nothing here loads a whole model: `index_tensors` parses only the safetensors headers, and each
`SafeTensor.read()` reads one tensor's bytes with a plain file read (no mmap, so pages of tensors
already written do not stay in this process's RSS).
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from fnmatch import fnmatch
from pathlib import Path
from typing import Any

import numpy as np

from localrt import config
from localrt.errors import LocalrtError


class ConvertError(LocalrtError):
    """A checkpoint the converter cannot handle; the message says which file and why."""


# safetensors dtype -> (numpy dtype of the stored bytes, bytes per element)
DTYPES: dict[str, tuple[np.dtype, int]] = {
    "F32": (np.dtype("<f4"), 4),
    "F16": (np.dtype("<f2"), 2),
    "BF16": (np.dtype("<u2"), 2),  # read as raw bits, widened exactly to float32
}
MAX_HEADER = 100 * 1024 * 1024


@dataclass(frozen=True)
class SafeTensor:
    name: str
    dtype: str  # "F32", "F16" or "BF16"
    shape: tuple[int, ...]  # torch order (rows first)
    path: Path
    offset: int  # absolute byte offset of the data in the file
    nbytes: int

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def read(self) -> np.ndarray:
        """The tensor as float32 (F32), float16 (F16) or float32 widened from bf16 bits (BF16)."""
        np_dtype, _ = DTYPES[self.dtype]
        count = self.nbytes // np_dtype.itemsize
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            data = np.fromfile(f, dtype=np_dtype, count=count)
        if data.size != count:
            raise ConvertError(f"{self.path.name}: tensor {self.name} is truncated (file too short)")
        if self.dtype == "BF16":
            data = (data.astype(np.uint32) << 16).view(np.float32)
        return data.reshape(self.shape)


def read_header(path: Path) -> tuple[dict[str, Any], int]:
    """(header JSON, offset where the data starts), with the checks that catch truncated files."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ConvertError(f"{path.name}: not a safetensors file (too short)")
        (n,) = struct.unpack("<Q", head)
        if n > min(MAX_HEADER, size - 8):
            raise ConvertError(
                f"{path.name}: safetensors header length {n} exceeds the file size {size} "
                "(truncated or not a safetensors file)"
            )
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ConvertError(f"{path.name}: safetensors header is not valid JSON: {e}") from None
    if not isinstance(header, dict):
        raise ConvertError(f"{path.name}: safetensors header is not a JSON object")
    return header, 8 + n


def read_part(path: Path) -> dict[str, SafeTensor]:
    """Tensors of one safetensors file, sorted by name (the order llama.cpp's converter uses)."""
    header, start = read_header(path)
    size = path.stat().st_size
    out: dict[str, SafeTensor] = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        dtype = meta.get("dtype")
        if dtype not in DTYPES:
            raise ConvertError(f"{path.name}: tensor {name} has dtype {dtype}; supported: F32, F16, BF16")
        shape = tuple(int(d) for d in meta.get("shape", ()))
        begin, end = (int(v) for v in meta.get("data_offsets", (0, 0)))
        if end - begin != int(np.prod(shape, dtype=np.int64)) * DTYPES[dtype][1]:
            raise ConvertError(f"{path.name}: tensor {name} has {end - begin} bytes for shape {list(shape)}")
        if start + end > size:
            raise ConvertError(
                f"{path.name}: tensor {name} ends at byte {start + end} but the file has "
                f"{size} bytes (truncated download?)"
            )
        out[name] = SafeTensor(name, dtype, shape, path, start + begin, end - begin)
    return dict(sorted(out.items()))


def index_tensors(model_dir: Path) -> dict[str, SafeTensor]:
    """All tensors of a checkpoint: parts in sorted file order, names sorted within each part."""
    index_file = model_dir / "model.safetensors.index.json"
    if index_file.is_file():
        try:
            weight_map = json.loads(index_file.read_text(encoding="utf-8"))["weight_map"]
        except (KeyError, json.JSONDecodeError, TypeError) as e:
            raise ConvertError(f"{index_file.name}: no usable weight_map ({e})") from None
        parts = sorted(set(weight_map.values()))
        missing = [p for p in parts if not (model_dir / p).is_file()]
        if missing:
            raise ConvertError(
                f"missing safetensors shards listed in {index_file.name}: {', '.join(missing)}"
            )
    else:
        weight_map = None
        parts = sorted(
            p for p in os.listdir(model_dir) if p.startswith("model") and p.endswith(".safetensors")
        )
    if not parts:
        raise ConvertError(
            f"no *.safetensors weights in {model_dir} (only safetensors checkpoints are supported)"
        )
    tensors: dict[str, SafeTensor] = {}
    for part in parts:
        tensors.update(read_part(model_dir / part))
    if weight_map is not None and set(weight_map) != set(tensors):
        missing_t = sorted(set(weight_map) - set(tensors))[:5]
        extra = sorted(set(tensors) - set(weight_map))[:5]
        raise ConvertError(
            f"safetensors shards do not match {index_file.name}: missing {missing_t}, extra {extra}"
        )
    return tensors


def read_config(model_dir: Path) -> dict[str, Any]:
    path = model_dir / "config.json"
    if not path.is_file():
        raise ConvertError(f"{model_dir} has no config.json (is it a Hugging Face model directory?)")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ConvertError(f"{path}: invalid JSON: {e}") from None
    if not isinstance(config, dict):
        raise ConvertError(f"{path}: expected a JSON object")
    return config


def read_json(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    return data if isinstance(data, dict) else None


def resolve_source(src: str) -> tuple[Path, str | None]:
    """A local model directory, or an HF repo id fetched with huggingface_hub: (directory, repo id)."""
    path = Path(src).expanduser()
    if path.is_dir():
        return path, None
    if path.exists():
        raise ConvertError(f"{src} is a file; convert takes a Hugging Face model directory or repo id")
    if src.count("/") != 1 or src.startswith((".", "/")):
        raise ConvertError(f"{src}: no such directory (and not an HF repo id like 'org/name')")
    try:
        from huggingface_hub import HfApi
        from huggingface_hub import hf_hub_download
    except ImportError:  # pragma: no cover - a dependency of localrt
        raise ConvertError("fetching from the Hugging Face Hub needs huggingface_hub") from None
    patterns = ("*.json", "*.safetensors", "tokenizer.model", "*.jinja", "README.md", "LICENSE*")
    # HF_ENDPOINT is read now, not when huggingface_hub was imported (mirrors, tests)
    endpoint = config.hf_endpoint()
    try:
        info = HfApi(endpoint=endpoint).model_info(src)
        files = [s.rfilename for s in info.siblings or [] if any(fnmatch(s.rfilename, p) for p in patterns)]
        if not files:
            raise ConvertError(f"{src} has no safetensors checkpoint files on the Hub")
        paths = [hf_hub_download(src, f, revision=info.sha, endpoint=endpoint) for f in files]
    except ConvertError:
        raise
    except Exception as e:  # network, auth, missing repo: one line for the user
        raise ConvertError(f"cannot download {src} from the Hugging Face Hub: {e}") from None
    local = Path(paths[0]).parents[len(Path(files[0]).parts) - 1]  # the snapshot directory
    return Path(local), src
