"""Importance matrices: llama.cpp's imatrix files (GGUF and legacy .dat) and what quantization takes
from them.

An importance matrix holds, for each weight matrix of a model, the sum over calibration tokens of the
squared activation entering each input column (`in_sum2`, one row per expert for MoE tensors) and the
number of tokens summed (`counts`, one per expert). Quantizers weight each column's rounding error by
the mean, sum / count.

Formats (as llama-imatrix writes and llama-quantize reads them):
- GGUF (default): keys `general.type = "imatrix"`, `imatrix.datasets` (string array),
  `imatrix.chunk_count`, `imatrix.chunk_size` (u32); tensors sorted by name, `<weight>.in_sum2` F32
  `[ne0, n_mat]` and `<weight>.counts` F32 `[1, n_mat]`; no general.architecture.
- legacy `.dat`: int32 n_entries; per entry int32 name length, name, int32 ncall, int32 nval, nval
  float32 `(sum / count) * ncall`; an optional trailer int32 chunk count, int32 length, dataset name.

This module only reads, writes and converts; computing an imatrix needs a model run (localrt/runtime/calibration.py).
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from dataclasses import field
from pathlib import Path
from typing import Any

import numpy as np

from localrt.errors import LocalrtError

F32 = np.float32
SUM_SUFFIX = ".in_sum2"
COUNT_SUFFIX = ".counts"
KEY_DATASETS = "imatrix.datasets"
KEY_CHUNK_COUNT = "imatrix.chunk_count"
KEY_CHUNK_SIZE = "imatrix.chunk_size"
# keys llama-quantize adds to a file quantized with an imatrix (tools/quantize/quantize.cpp)
KV_FILE = "quantize.imatrix.file"
KV_DATASET = "quantize.imatrix.dataset"
KV_N_ENTRIES = "quantize.imatrix.entries_count"
KV_N_CHUNKS = "quantize.imatrix.chunks_count"
KV_STR_MAX = 127  # llama_model_kv_override.val_str is 128 bytes with the NUL


class ImatrixError(LocalrtError, ValueError):
    """A file that is not a usable importance matrix, or one that does not fit the model."""


@dataclass
class Entry:
    """One weight matrix's statistics: sums (n_mat, ne0) of squared activations, counts (n_mat,)."""

    sums: np.ndarray
    counts: np.ndarray

    @property
    def n_mat(self) -> int:
        return int(self.sums.shape[0])


@dataclass
class Imatrix:
    entries: dict[str, Entry] = field(default_factory=dict)
    datasets: list[str] = field(default_factory=list)
    chunk_count: int = 0
    chunk_size: int = 0
    is_legacy: bool = False

    def weights(self) -> dict[str, np.ndarray]:
        """What llama-quantize hands the quantizers: per entry, float32 (n_mat * ne0) mean squares.

        GGUF: sum / count per expert slice (a slice never reached gets 1.0); legacy: value / ncall.
        """
        out = {}
        for name, e in self.entries.items():
            if self.is_legacy:
                ncall = F32(e.counts[0]) if len(e.counts) else F32(0)
                w = e.sums / ncall if ncall > 0 else e.sums.copy()
            else:
                c = e.counts.astype(F32)[:, None]
                with np.errstate(divide="ignore", invalid="ignore"):
                    w = np.where(c > 0, e.sums / np.where(c > 0, c, F32(1)), F32(1))
            out[name] = np.ascontiguousarray(w, dtype=F32).reshape(-1)
        return out


# ---- reading ---------------------------------------------------------------------------------------
def read(path: str | Path) -> Imatrix:
    """An imatrix file in either format; ImatrixError with one clear reason otherwise."""
    path = Path(path)
    try:
        head = path.read_bytes()[:4]
    except OSError as e:
        raise ImatrixError(f"cannot read imatrix {path}: {e.strerror}") from None
    if head == b"GGUF":
        return _read_gguf(path)
    return _read_legacy(path)


def _read_gguf(path: Path) -> Imatrix:
    from gguf import GGMLQuantizationType
    from gguf import GGUFReader

    try:
        reader = GGUFReader(path)
    except Exception as e:  # gguf-py raises ValueError/struct.error/IndexError on damaged files
        raise ImatrixError(f"{path} is not a readable GGUF file ({type(e).__name__}: truncated?)") from None
    fields = reader.fields
    missing = [k for k in (KEY_DATASETS, KEY_CHUNK_COUNT, KEY_CHUNK_SIZE) if k not in fields]
    if missing:
        kind = fields["general.type"].contents() if "general.type" in fields else None
        what = f"a GGUF of type {kind!r}" if kind else "a GGUF file"
        raise ImatrixError(f"{path} is {what}, not an importance matrix (no {', '.join(missing)})")
    im = Imatrix(
        datasets=[str(s) for s in fields[KEY_DATASETS].contents()],
        chunk_count=int(fields[KEY_CHUNK_COUNT].contents()),
        chunk_size=int(fields[KEY_CHUNK_SIZE].contents()),
    )
    pairs: dict[str, dict[str, np.ndarray]] = {}
    for t in reader.tensors:
        for suffix in (SUM_SUFFIX, COUNT_SUFFIX):
            if t.name.endswith(suffix):
                if t.tensor_type != GGMLQuantizationType.F32:
                    raise ImatrixError(f"{path}: {t.name} is {t.tensor_type.name}, an imatrix stores F32")
                pairs.setdefault(t.name[: -len(suffix)], {})[suffix] = np.array(t.data, dtype=F32)
    if not pairs:
        raise ImatrixError(f"{path}: the importance matrix has no entries")
    for name in sorted(pairs):
        p = pairs[name]
        if SUM_SUFFIX not in p or COUNT_SUFFIX not in p:
            raise ImatrixError(f"{path}: {name} has sums without counts or counts without sums")
        counts = np.rint(p[COUNT_SUFFIX].reshape(-1)).astype(np.int64)  # std::lround
        sums = p[SUM_SUFFIX].reshape(-1)
        if len(counts) == 0 or len(sums) % len(counts):
            raise ImatrixError(f"{path}: {name} has {len(sums)} sums for {len(counts)} counts")
        im.entries[name] = Entry(sums.reshape(len(counts), -1), counts)
    return im


def _read_legacy(path: Path) -> Imatrix:
    data = path.read_bytes()
    bad = ImatrixError(
        f"{path} is not an importance matrix (neither imatrix GGUF nor legacy .dat) or is truncated"
    )
    pos = 0

    def take(n: int) -> bytes:
        nonlocal pos
        if pos + n > len(data):
            raise bad
        pos += n
        return data[pos - n : pos]

    def i32() -> int:
        return struct.unpack("<i", take(4))[0]

    n_entries = i32() if len(data) >= 4 else 0
    if n_entries < 1 or n_entries > len(data) // 16:
        raise bad
    im = Imatrix(is_legacy=True)
    for _ in range(n_entries):
        n = i32()
        if not 0 < n <= 4096:
            raise bad
        try:
            name = take(n).decode()
        except UnicodeDecodeError:
            raise bad from None
        ncall, nval = i32(), i32()
        if nval < 1 or ncall < 0:
            raise bad
        sums = np.frombuffer(take(4 * nval), dtype="<f4").astype(F32)
        im.entries[name] = Entry(sums.reshape(1, -1), np.array([ncall], np.int64))
    if pos < len(data):  # the optional trailer: chunk count, then the dataset name
        im.chunk_count = i32()
        if pos < len(data):
            n = i32()
            if n < 0:
                raise bad
            if n:
                im.datasets.append(take(n).decode(errors="replace"))
        if pos != len(data):
            raise bad
    return im


# ---- writing ---------------------------------------------------------------------------------------
def write_gguf(im: Imatrix, path: str | Path) -> Path:
    """The GGUF llama-imatrix writes (keys, sorted entries, F32 sums and counts); atomically."""
    from gguf import GGUFWriter

    path = Path(path)
    w = GGUFWriter(path=None, arch="")
    w.kv_data[0].clear()  # llama-imatrix's files have no general.architecture
    w.add_string("general.type", "imatrix")
    w.add_array(KEY_DATASETS, list(im.datasets))
    w.add_uint32(KEY_CHUNK_COUNT, im.chunk_count)
    w.add_uint32(KEY_CHUNK_SIZE, im.chunk_size)
    for name in sorted(im.entries):
        e = im.entries[name]
        sums = np.ascontiguousarray(e.sums, dtype=F32)
        counts = e.counts.astype(F32).reshape(-1, 1)
        if e.n_mat == 1:  # ggml_n_dims drops trailing dimensions of 1
            sums, counts = sums.reshape(-1), counts.reshape(-1)
        w.add_tensor(name + SUM_SUFFIX, sums)
        w.add_tensor(name + COUNT_SUFFIX, counts)
    tmp = path.with_name(path.name + ".part")
    try:
        w.write_header_to_file(path=tmp)
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        os.replace(tmp, path)
    except BaseException:
        w.close()
        tmp.unlink(missing_ok=True)
        raise
    return path


def write_legacy(im: Imatrix, path: str | Path) -> Path:
    """The legacy .dat layout (entries without any data are skipped, as llama-imatrix does)."""
    path = Path(path)
    chunk = max(1, im.chunk_size)
    parts: list[bytes] = []
    names = [n for n in sorted(im.entries) if (im.entries[n].counts != 0).any()]
    parts.append(struct.pack("<i", len(names)))
    for name in names:
        e = im.entries[name]
        raw = name.encode()
        ncall = int((int(e.counts.max()) + chunk - 1) // chunk)
        c = e.counts.astype(F32)[:, None]
        with np.errstate(divide="ignore", invalid="ignore"):
            vals = np.where(c == 0, F32(1), e.sums / np.where(c == 0, F32(1), c)) * F32(ncall)
        parts += [struct.pack("<i", len(raw)), raw, struct.pack("<ii", ncall, e.sums.size)]
        parts.append(np.ascontiguousarray(vals, dtype="<f4").tobytes())
    dataset = (im.datasets[-1] if im.datasets else "").encode()
    parts += [struct.pack("<ii", im.chunk_count, len(dataset)), dataset]
    tmp = path.with_name(path.name + ".part")
    tmp.write_bytes(b"".join(parts))
    os.replace(tmp, path)
    return path


def write(im: Imatrix, path: str | Path) -> Path:
    """`.dat` selects the legacy layout; anything else is GGUF (llama-imatrix's default)."""
    return write_legacy(im, path) if str(path).endswith(".dat") else write_gguf(im, path)


# ---- matching a model ------------------------------------------------------------------------------
def weights_for_model(
    im: Imatrix, tensors: dict[str, tuple[int, ...]], source: str = "the imatrix"
) -> dict[str, np.ndarray]:
    """Per quantizable tensor name (ggml shape, ne0 first), its importance weights `(n_mat, ne0)`.

    llama.cpp's rules: a tensor without an entry is quantized without weights; an entry whose size is
    not ne0 * ne2 is an error, except for token_embd (whose entry is then ignored). Non-finite values
    are an error. An imatrix none of whose entries names a tensor of the model is refused too: it was
    computed for another model.
    """
    weights = im.weights()
    for name, w in weights.items():
        if not np.isfinite(w).all():
            raise ImatrixError(f"{source} has non-finite values for {name}")
    out: dict[str, np.ndarray] = {}
    matched = 0
    for name, ne in tensors.items():
        w = weights.get(name)
        if w is None:
            continue
        matched += 1
        n_mat = ne[2] if len(ne) > 2 else 1
        if w.size != ne[0] * n_mat:
            if name == "token_embd.weight":
                continue
            raise ImatrixError(
                f"{source} has {w.size} values for {name}, the model's tensor needs {ne[0] * n_mat} "
                "(an imatrix computed for another model?)"
            )
        out[name] = w.reshape(n_mat, ne[0])
    if weights and not matched:
        raise ImatrixError(
            f"none of the {len(weights)} entries of {source} names a tensor of this model "
            "(an imatrix computed for another model?)"
        )
    return out


def check_quantized(file_type: str, im: Imatrix | None) -> None:
    """An importance matrix only means something for a quantized output type."""
    if im is not None and file_type in ("F32", "F16", "BF16"):
        raise ImatrixError(f"--imatrix needs a quantized type; {file_type} is a float type")


def add_quantize_kv(writer: Any, im: Imatrix, file_label: str) -> None:
    """Append llama-quantize's quantize.imatrix.* keys to a GGUFWriter (strings, then u32 counts)."""
    for key, value in quantize_kv(im, file_label):
        if isinstance(value, str):
            writer.add_string(key, value)
        else:
            writer.add_uint32(key, value)


def quantize_kv(im: Imatrix, file_label: str) -> list[tuple[str, str | int]]:
    """The keys llama-quantize appends to the output, in its order (after general.file_type)."""
    kv: list[tuple[str, str | int]] = [(KV_FILE, _clip(file_label))]
    if im.datasets:
        kv.append((KV_DATASET, _clip(im.datasets[0])))
    kv.append((KV_N_ENTRIES, len(im.entries)))
    if im.chunk_count > 0:
        kv.append((KV_N_CHUNKS, im.chunk_count))
    return kv


def _clip(s: str) -> str:
    """strncpy into a 128-byte field: at most 127 bytes."""
    raw = s.encode()[:KV_STR_MAX]
    return raw.decode(errors="ignore")
