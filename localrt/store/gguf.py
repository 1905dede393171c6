"""A bounded, defensive GGUF reader: header, metadata and tensor infos, never tensor data.

Every count, length, dimension and offset read from the file is checked against the bytes that
remain *before* anything is allocated, so a hostile file can neither hang the reader nor make it
allocate much more than the file's own header. Any malformed input raises `GGUFError` (a
`LocalrtError`) with a message that names the offending key or tensor; nothing else escapes.

Layout (little-endian, versions 2 and 3):
    magic "GGUF" | u32 version | u64 n_tensors | u64 n_kv
    n_kv x (string key, u32 value type, value)
    n_tensors x (string name, u32 n_dims, i64 dims[n_dims], u32 ggml type, u64 offset)
    padding to `general.alignment` | tensor data (offsets are relative to its start)
"""

from __future__ import annotations

import array
import collections
import math
import os
import stat
import struct
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from dataclasses import field
from pathlib import Path
from typing import Any

from localrt.errors import LocalrtError

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
GGML_MAX_DIMS = 4
GGML_MAX_NAME = 64  # ggml keeps names in a char[64], NUL included, so 63 bytes at most
DEFAULT_ALIGNMENT = 32
MAX_KEY_BYTES = 65535  # the GGUF spec's limit on key length
MAX_STRING_BYTES = 16 << 20  # no real metadata string comes near this (Ollama caps at 16 MiB too)
MAX_ARRAY_DEPTH = 4  # arrays of arrays are legal but never deep in practice
DEFAULT_MAX_METADATA_BYTES = 64 << 20  # real headers (vocab + merges) stay near 10 MiB
FIRST_WINDOW_BYTES = 4 << 20  # read_gguf's first read; most headers fit, bigger ones get one re-read
INT64_MAX = (1 << 63) - 1

# The smallest encodings, used to bound counts before looping over them.
_MIN_KV_BYTES = 8 + 1 + 4 + 1  # key length, one key byte, value type, one-byte value
_MIN_TENSOR_INFO_BYTES = 8 + 1 + 4 + 4 + 8  # name length, one name byte, n_dims (0), type, offset


class GGUFError(LocalrtError):
    """The bytes are not a GGUF file this runtime can trust."""


# ggml type id -> (name, elements per block, bytes per block). From ggml.h / gguf-py's
# GGML_QUANT_SIZES; ids that ggml removed (4, 5, 31-33, 36-38) are deliberately absent.
GGML_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4),
    1: ("F16", 1, 2),
    2: ("Q4_0", 32, 18),
    3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24),
    8: ("Q8_0", 32, 34),
    9: ("Q8_1", 32, 40),
    10: ("Q2_K", 256, 84),
    11: ("Q3_K", 256, 110),
    12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176),
    14: ("Q6_K", 256, 210),
    15: ("Q8_K", 256, 292),
    16: ("IQ2_XXS", 256, 66),
    17: ("IQ2_XS", 256, 74),
    18: ("IQ3_XXS", 256, 98),
    19: ("IQ1_S", 256, 50),
    20: ("IQ4_NL", 32, 18),
    21: ("IQ3_S", 256, 110),
    22: ("IQ2_S", 256, 82),
    23: ("IQ4_XS", 256, 136),
    24: ("I8", 1, 1),
    25: ("I16", 1, 2),
    26: ("I32", 1, 4),
    27: ("I64", 1, 8),
    28: ("F64", 1, 8),
    29: ("IQ1_M", 256, 56),
    30: ("BF16", 1, 2),
    34: ("TQ1_0", 256, 54),
    35: ("TQ2_0", 256, 66),
    39: ("MXFP4", 32, 17),
    40: ("NVFP4", 64, 36),
    41: ("Q1_0", 128, 18),
}
GGML_TYPE_IDS: dict[str, int] = {name: type_id for type_id, (name, _, _) in GGML_TYPES.items()}

# llama.cpp's LLAMA_FTYPE values (include/llama.h) without the MOSTLY_/ALL_ prefix, as Ollama shows them.
LLAMA_FILE_TYPES: dict[int, str] = {
    0: "F32",
    1: "F16",
    2: "Q4_0",
    3: "Q4_1",
    7: "Q8_0",
    8: "Q5_0",
    9: "Q5_1",
    10: "Q2_K",
    11: "Q3_K_S",
    12: "Q3_K_M",
    13: "Q3_K_L",
    14: "Q4_K_S",
    15: "Q4_K_M",
    16: "Q5_K_S",
    17: "Q5_K_M",
    18: "Q6_K",
    19: "IQ2_XXS",
    20: "IQ2_XS",
    21: "Q2_K_S",
    22: "IQ3_XS",
    23: "IQ3_XXS",
    24: "IQ1_S",
    25: "IQ4_NL",
    26: "IQ3_S",
    27: "IQ3_M",
    28: "IQ2_S",
    29: "IQ2_M",
    30: "IQ4_XS",
    31: "IQ1_M",
    32: "BF16",
    36: "TQ1_0",
    37: "TQ2_0",
    38: "MXFP4_MOE",
    39: "NVFP4",
    40: "Q1_0",
}
_LLAMA_FTYPE_GUESSED = 1024  # llama.cpp ORs this into ftypes it inferred; the base type still applies


def _array_code(size: int, signed: bool) -> str:
    # array's C-type codes have platform-dependent sizes; pick the one that matches the GGUF width.
    for code in "bhilq" if signed else "BHILQ":
        if array.array(code).itemsize == size:
            return code
    raise RuntimeError(f"no array typecode for a {size}-byte integer")  # pragma: no cover


# GGUF value type id -> (name, struct format, size in bytes, array.array typecode)
_VALUE_TYPES: dict[int, tuple[str, str, int, str]] = {
    0: ("UINT8", "<B", 1, _array_code(1, False)),
    1: ("INT8", "<b", 1, _array_code(1, True)),
    2: ("UINT16", "<H", 2, _array_code(2, False)),
    3: ("INT16", "<h", 2, _array_code(2, True)),
    4: ("UINT32", "<I", 4, _array_code(4, False)),
    5: ("INT32", "<i", 4, _array_code(4, True)),
    6: ("FLOAT32", "<f", 4, "f"),
    7: ("BOOL", "<B", 1, ""),
    8: ("STRING", "", 8, ""),  # size here is the minimum: the u64 length of an empty string
    9: ("ARRAY", "", 12, ""),  # minimum: u32 element type + u64 count of an empty array
    10: ("UINT64", "<Q", 8, _array_code(8, False)),
    11: ("INT64", "<q", 8, _array_code(8, True)),
    12: ("FLOAT64", "<d", 8, "d"),
}
_TYPE_STRING = 8
_TYPE_ARRAY = 9
_TYPE_UINT32 = 4
_INTEGER_TYPES = frozenset({0, 1, 2, 3, 4, 5, 10, 11})
_SCALAR_STRUCTS = {type_id: struct.Struct(fmt) for type_id, (_, fmt, _, _) in _VALUE_TYPES.items() if fmt}
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_I64 = struct.Struct("<q")
_NEEDS_BYTESWAP = sys.byteorder == "big"

# Keys whose value later code indexes or allocates with: their types are checked at parse time
# so that properties (and backends) can trust them.
_ARCH_UINT_KEYS = ("context_length", "embedding_length", "block_count", "vocab_size")
_ARCH_UINT_OR_ARRAY_KEYS = ("feed_forward_length", "attention.head_count", "attention.head_count_kv")
_TOKEN_ID_KEYS = tuple(
    f"tokenizer.ggml.{name}_token_id" for name in ("bos", "eos", "unknown", "padding", "separator")
)


def _fmt_count(n: int) -> str:
    """Huge file-supplied numbers read better as powers of two ("2^40") when they are one."""
    if n >= 1 << 20 and n & (n - 1) == 0:
        return f"2^{n.bit_length() - 1}"
    return str(n)


@dataclass(slots=True)
class TensorInfo:
    """One tensor's header entry. `shape` is in GGUF order (ne[0], the contiguous dim, first)."""

    name: str
    shape: tuple[int, ...]
    ggml_type: str
    type_id: int
    offset: int  # relative to the start of the data section, as stored in the file
    n_bytes: int
    file_offset: int = 0  # absolute position of the first byte in the file

    @property
    def n_elements(self) -> int:
        count = 1
        for dim in self.shape:
            count *= dim
        return count


@dataclass
class GGUFInfo:
    """Everything in a GGUF file except the tensor data.

    Numeric metadata arrays are `array.array` (compact: a 50k-entry token_type array is 200 KB,
    not 2 MB of Python ints); string arrays are lists of str, bool arrays lists of bool.
    """

    version: int
    metadata: dict[str, Any]
    tensors: list[TensorInfo]
    data_offset: int
    alignment: int = DEFAULT_ALIGNMENT
    file_size: int = 0
    # The GGUF value type of each metadata key ("UINT32", "ARRAY[STRING]", ...), for writers that copy them.
    metadata_types: dict[str, str] = field(default_factory=dict, repr=False)
    # Where each key/value entry starts in the file, in file order, then where the last one ends: what
    # merging the parts of a split GGUF copies as is. Eight bytes a key, so a file of many keys stays
    # within the reader's memory bound.
    metadata_offsets: array.array = field(default_factory=lambda: array.array("Q"), repr=False)

    def text_metadata(self) -> dict[str, str]:
        """The single values as text; arrays (the vocabulary, 262k entries on Gemma 3) are left out."""
        return {k: str(v) for k, v in self.metadata.items() if isinstance(v, (str, int, float, bool))}

    def metadata_spans(self) -> dict[str, tuple[int, int]]:
        """Each key's entry as [start, end) bytes of the file, key included."""
        o = self.metadata_offsets
        return {key: (o[i], o[i + 1]) for i, key in enumerate(self.metadata)}

    # ---- general ----
    @property
    def architecture(self) -> str | None:
        return self.metadata.get("general.architecture")

    @property
    def name(self) -> str | None:
        value = self.metadata.get("general.name")
        return value if isinstance(value, str) else None

    @property
    def license(self) -> str | None:
        value = self.metadata.get("general.license")
        return value if isinstance(value, str) else None

    @property
    def parameter_count(self) -> int:
        return sum(t.n_elements for t in self.tensors)

    @property
    def file_type(self) -> str | None:
        """llama.cpp's file type name ("Q4_K_M"), else the tensor type holding most weights."""
        ftype = self.metadata.get("general.file_type")
        if isinstance(ftype, int):
            name = LLAMA_FILE_TYPES.get(ftype & ~_LLAMA_FTYPE_GUESSED)
            if name is not None:
                return name
        elements_by_type: dict[str, int] = {}
        for t in self.tensors:
            elements_by_type[t.ggml_type] = elements_by_type.get(t.ggml_type, 0) + t.n_elements
        if not elements_by_type:
            return None
        return max(elements_by_type, key=lambda type_name: elements_by_type[type_name])

    @property
    def quantization_label(self) -> str:
        return self.file_type or "unknown"

    # ---- architecture ----
    def _arch_value(self, suffix: str) -> Any:
        arch = self.architecture
        return None if arch is None else self.metadata.get(f"{arch}.{suffix}")

    def _arch_int(self, suffix: str) -> int | None:
        value = self._arch_value(suffix)
        if isinstance(value, int) or value is None:
            return value
        # Per-layer arrays (OpenELM-style head counts): report the largest, as a model-wide figure.
        return max(value) if len(value) else None

    @property
    def context_length(self) -> int | None:
        return self._arch_int("context_length")

    @property
    def embedding_length(self) -> int | None:
        return self._arch_int("embedding_length")

    @property
    def block_count(self) -> int | None:
        return self._arch_int("block_count")

    @property
    def feed_forward_length(self) -> int | None:
        return self._arch_int("feed_forward_length")

    @property
    def head_count(self) -> int | None:
        return self._arch_int("attention.head_count")

    @property
    def head_count_kv(self) -> int | None:
        return self._arch_int("attention.head_count_kv")

    # ---- tokenizer ----
    @property
    def chat_template(self) -> str | None:
        return self.metadata.get("tokenizer.chat_template")

    @property
    def vocab_size(self) -> int | None:
        tokens = self.metadata.get("tokenizer.ggml.tokens")
        if isinstance(tokens, list):
            return len(tokens)
        return self._arch_int("vocab_size")

    def _token_id(self, key: str) -> int | None:
        token_id = self.metadata.get(key)
        vocab_size = self.vocab_size
        if token_id is None or (vocab_size is not None and token_id >= vocab_size):
            return None  # llama.cpp, too, ignores special ids outside the vocabulary
        return token_id

    @property
    def bos_token_id(self) -> int | None:
        return self._token_id("tokenizer.ggml.bos_token_id")

    @property
    def eos_token_id(self) -> int | None:
        return self._token_id("tokenizer.ggml.eos_token_id")

    # ---- views ----
    def tensor(self, name: str) -> TensorInfo:
        """The tensor called `name`; KeyError if the file has none."""
        for t in self.tensors:
            if t.name == name:
                return t
        raise KeyError(name)

    def summary(self, max_array_length: int = 16) -> dict[str, Any]:
        """Metadata as Ollama's `/api/show` `model_info`: JSON-ready, long arrays replaced by None."""
        info: dict[str, Any] = {}
        for key, value in self.metadata.items():
            info[key] = _summarize(value, max_array_length)
        info["general.parameter_count"] = self.parameter_count
        return info


def _summarize(value: Any, max_array_length: int) -> Any:
    if isinstance(value, (list, array.array)):
        if len(value) > max_array_length:
            return None
        return [_summarize(item, max_array_length) for item in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None  # NaN/inf are not JSON; strict clients would reject the whole response
    return value


def format_parameter_count(n: int) -> str:
    """Parameters as Ollama shows them: 134_515_008 -> "135M", 1_235_814_400 -> "1.2B", 8.03e9 -> "8.0B"."""
    for threshold, suffix in ((10**12, "T"), (10**9, "B"), (10**6, "M"), (10**3, "K")):
        if n >= threshold:
            value = n / threshold
            return f"{value:.0f}{suffix}" if value >= 100 else f"{value:.1f}{suffix}"
    return str(n)


# ------------------------------------------------------------------------------------------------
# Parsing


class _NeedMore(Exception):
    """The in-memory window ended before the file did: the file reader re-reads a larger window."""

    def __init__(self, needed_end: int) -> None:
        super().__init__(needed_end)
        self.needed_end = needed_end


class _Reader:
    """A cursor over the first `len(buf)` bytes of a file of `file_size` bytes.

    Bounds are checked against the real file size (so a truncated file says so), then against
    the metadata budget, and only then against the window in memory.
    """

    def __init__(self, buf: bytes, file_size: int, max_metadata_bytes: int) -> None:
        self.buf = buf
        self.pos = 0
        self.file_size = file_size
        self.max_metadata_bytes = max_metadata_bytes
        self.end = min(file_size, max_metadata_bytes)  # no header byte may lie beyond this

    def left(self) -> int:
        return self.end - self.pos

    def _out_of_bytes(self, what: str, needed: int) -> GGUFError:
        if self.pos + needed > self.file_size:
            return GGUFError(
                f"GGUF file is truncated: {what} needs {_fmt_count(needed)} bytes at offset {self.pos}, "
                f"but only {self.file_size - self.pos} are left"
            )
        return GGUFError(
            f"GGUF header is larger than the {self.max_metadata_bytes}-byte metadata limit "
            f"(reading {what} at offset {self.pos})"
        )

    def ensure(self, n: int, what: str) -> None:
        needed_end = self.pos + n
        if needed_end > self.end:
            raise self._out_of_bytes(what, n)
        if needed_end > len(self.buf):
            raise _NeedMore(needed_end)

    def check_claim(self, count: int, min_item_bytes: int, what: str) -> None:
        """Reject `count` items before looping when even the smallest encoding would not fit."""
        if count * min_item_bytes > self.left():
            limit_note = "" if self.end == self.file_size else " within the metadata limit"
            raise GGUFError(
                f"GGUF {what} claims {_fmt_count(count)} entries, but the {self.left()} bytes left"
                f"{limit_note} can hold at most {self.left() // min_item_bytes}"
            )

    def take(self, n: int, what: str) -> bytes:
        self.ensure(n, what)
        start = self.pos
        self.pos = start + n
        return self.buf[start : self.pos]

    def u32(self, what: str) -> int:
        self.ensure(4, what)
        (value,) = _U32.unpack_from(self.buf, self.pos)
        self.pos += 4
        return value

    def u64(self, what: str) -> int:
        self.ensure(8, what)
        (value,) = _U64.unpack_from(self.buf, self.pos)
        self.pos += 8
        return value

    def i64(self, what: str) -> int:
        self.ensure(8, what)
        (value,) = _I64.unpack_from(self.buf, self.pos)
        self.pos += 8
        return value

    def raw_string(self, what: str, max_bytes: int) -> bytes:
        length = self.u64(f"{what} length")
        # "bytes left" first: for a huge or garbage length it is the more telling of the two.
        if length > self.left():
            raise GGUFError(f"GGUF {what} length {_fmt_count(length)} exceeds the {self.left()} bytes left")
        if length > max_bytes:
            raise GGUFError(f"GGUF {what} length {_fmt_count(length)} exceeds the {max_bytes}-byte limit")
        return self.take(length, what)

    def name_string(self, what: str, max_bytes: int) -> str:
        """A key or tensor name: non-empty, valid UTF-8 (they are identifiers, never display text)."""
        raw = self.raw_string(what, max_bytes)
        if not raw:
            raise GGUFError(f"GGUF {what} at offset {self.pos - 8} is empty")
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise GGUFError(f"GGUF {what} {raw[:80]!r} is not valid UTF-8") from None

    def value(self, type_id: int, what: str, depth: int = 0) -> Any:
        if type_id == _TYPE_STRING:
            # Values are display text or vocab pieces: undecodable bytes become U+FFFD rather than
            # failing a whole model over one odd token.
            return self.raw_string(f"string {what}", MAX_STRING_BYTES).decode("utf-8", "replace")
        if type_id == _TYPE_ARRAY:
            return self.array(what, depth + 1)
        spec = _SCALAR_STRUCTS.get(type_id)
        if spec is None:
            raise GGUFError(f"GGUF {what} has unknown value type {type_id}")
        self.ensure(spec.size, what)
        (value,) = spec.unpack_from(self.buf, self.pos)
        self.pos += spec.size
        return bool(value) if type_id == 7 else value

    def array(self, what: str, depth: int) -> Any:
        if depth > MAX_ARRAY_DEPTH:
            raise GGUFError(f"GGUF {what} nests arrays deeper than {MAX_ARRAY_DEPTH} levels")
        element_type = self.u32(f"array element type of {what}")
        count = self.u64(f"array length of {what}")
        if element_type not in _VALUE_TYPES:
            raise GGUFError(f"GGUF {what} is an array of unknown value type {element_type}")
        type_name, _, element_size, typecode = _VALUE_TYPES[element_type]
        self.check_claim(count, element_size, f"array {what} of {type_name}")
        if element_type == _TYPE_STRING:
            return self.string_array(count, what)
        if element_type == _TYPE_ARRAY:
            return [self.array(f"{what}[{i}]", depth + 1) for i in range(count)]
        n_bytes = count * element_size
        self.ensure(n_bytes, f"array {what}")
        start = self.pos
        self.pos += n_bytes
        # Converted straight from a view of the buffer: no intermediate copy of a large array.
        with memoryview(self.buf)[start : self.pos] as data:
            if element_type == 7:
                return data.cast("?").tolist()  # any nonzero byte is true, as in C
            values = array.array(typecode)
            values.frombytes(data)
        if _NEEDS_BYTESWAP:
            values.byteswap()
        return values

    def string_array(self, count: int, what: str) -> list[str]:
        # The hot loop of every real file (50k+ tokens, merges): locals only, one slice per string.
        buf, pos, end = self.buf, self.pos, self.end
        window = len(buf)
        unpack_u64 = _U64.unpack_from
        strings: list[str] = []
        append = strings.append
        for index in range(count):
            if pos + 8 > end or pos + 8 > window:
                self.pos = pos
                self.ensure(8, f"length of string {index} of {what}")
            (length,) = unpack_u64(buf, pos)
            pos += 8
            if length > MAX_STRING_BYTES or length > end - pos:
                self.pos = pos - 8
                limit = f"{end - pos} bytes left" if length > end - pos else f"{MAX_STRING_BYTES}-byte limit"
                raise GGUFError(
                    f"GGUF string {index} of {what} has length {_fmt_count(length)}, more than the {limit}"
                )
            if pos + length > window:
                raise _NeedMore(pos + length)
            append(str(buf[pos : pos + length], "utf-8", "replace"))
            pos += length
        self.pos = pos
        return strings


def _check_metadata(metadata: dict[str, Any], types: dict[str, str]) -> int:
    """Type-check the keys that later code trusts; returns the alignment."""

    def fail(key: str, expected: str) -> GGUFError:
        return GGUFError(f"GGUF key '{key}' must be {expected}, but is {types[key]} {_short(metadata[key])}")

    def is_uint(value: Any) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and value >= 0

    alignment = DEFAULT_ALIGNMENT
    if "general.alignment" in metadata:
        alignment = metadata["general.alignment"]
        if types["general.alignment"] != "UINT32" or alignment == 0 or alignment & (alignment - 1):
            raise fail("general.alignment", "a UINT32 power of two")
    for key in ("general.architecture", "tokenizer.chat_template"):
        if key in metadata and not isinstance(metadata[key], str):
            raise fail(key, "a string")
    arch = metadata.get("general.architecture")
    if arch is not None and not arch:
        raise GGUFError("GGUF key 'general.architecture' is empty")
    uint_keys = ["general.file_type", *_TOKEN_ID_KEYS]
    if arch:
        uint_keys += [f"{arch}.{suffix}" for suffix in _ARCH_UINT_KEYS]
        for suffix in _ARCH_UINT_OR_ARRAY_KEYS:
            key = f"{arch}.{suffix}"
            value = metadata.get(key)
            if isinstance(value, array.array) and value.typecode not in "fd":
                if any(item < 0 for item in value):
                    raise fail(key, "a non-negative integer or an array of them")
            elif value is not None and not is_uint(value):
                raise fail(key, "a non-negative integer or an array of them")
    for key in uint_keys:
        if key in metadata and not is_uint(metadata[key]):
            raise fail(key, "a non-negative integer")
    return alignment


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _parse(buf: bytes, file_size: int, max_metadata_bytes: int) -> GGUFInfo:
    r = _Reader(buf, file_size, max_metadata_bytes)
    version, n_tensors, n_kv = _read_header(r, file_size)
    metadata, types, offsets = _read_metadata(r, n_kv)
    alignment = _check_metadata(metadata, types)
    tensors = _read_tensor_infos(r, n_tensors, alignment, file_size)

    header_end = r.pos
    data_offset = -(-header_end // alignment) * alignment
    for tensor in tensors:
        if data_offset + tensor.offset + tensor.n_bytes > file_size:
            raise GGUFError(f"GGUF tensor '{tensor.name}' data runs past the end of the file")
        tensor.file_offset = data_offset + tensor.offset
    _check_overlaps(tensors)
    return GGUFInfo(
        version=version,
        metadata=metadata,
        tensors=tensors,
        data_offset=data_offset,
        alignment=alignment,
        file_size=file_size,
        metadata_types=types,
        metadata_offsets=offsets,
    )


def _read_header(r: _Reader, file_size: int) -> tuple[int, int, int]:
    """Magic, version and the two counts, each claim checked against the bytes left: (version,
    tensor count, metadata key count)."""
    if file_size < 4:
        raise GGUFError(f"not a GGUF file: only {file_size} bytes")
    magic = r.take(4, "magic")
    if magic != GGUF_MAGIC:
        raise GGUFError(f"not a GGUF file: magic is {magic!r}, expected b'GGUF'")
    version = r.u32("version")
    if version not in SUPPORTED_VERSIONS:
        if struct.unpack("<I", struct.pack(">I", version))[0] in (1, 2, 3):
            raise GGUFError(
                f"GGUF version {version} looks byte-swapped: big-endian GGUF files are not supported"
            )
        if version == 1:
            raise GGUFError("GGUF version 1 is not supported (re-convert the model with a current llama.cpp)")
        raise GGUFError(f"GGUF version {version} is not supported (only versions 2 and 3)")
    n_tensors = r.u64("tensor count")
    n_kv = r.u64("metadata key count")
    r.check_claim(n_kv, _MIN_KV_BYTES, "header metadata count")
    r.check_claim(n_tensors, _MIN_TENSOR_INFO_BYTES, "header tensor count")
    if n_kv * _MIN_KV_BYTES + n_tensors * _MIN_TENSOR_INFO_BYTES > r.left():
        raise GGUFError(
            f"GGUF header claims {n_kv} metadata keys and {n_tensors} tensors, "
            f"more than the {r.left()} bytes left can hold"
        )
    return version, n_tensors, n_kv


def _read_metadata(r: _Reader, n_kv: int) -> tuple[dict[str, Any], dict[str, str], array.array]:
    """The key/value section: (values, type labels such as "UINT32" or "ARRAY[STRING]", entry offsets)."""
    metadata: dict[str, Any] = {}
    types: dict[str, str] = {}
    offsets = array.array("Q")
    for index in range(n_kv):
        offsets.append(r.pos)
        key = r.name_string(f"metadata key {index}", MAX_KEY_BYTES)
        if key in metadata:
            raise GGUFError(f"GGUF metadata key '{key}' appears twice")
        type_id = r.u32(f"value type of key '{key}'")
        if type_id not in _VALUE_TYPES:
            raise GGUFError(f"GGUF key '{key}' has unknown value type {type_id}")
        value_start = r.pos
        metadata[key] = r.value(type_id, f"key '{key}'")
        type_label = _VALUE_TYPES[type_id][0]
        if type_id == _TYPE_ARRAY:
            # The value parsed, so its leading element type is in the buffer.
            (element_type,) = _U32.unpack_from(r.buf, value_start)
            type_label = f"ARRAY[{_VALUE_TYPES[element_type][0]}]"
        types[key] = type_label
    offsets.append(r.pos)
    return metadata, types, offsets


def _read_tensor_infos(r: _Reader, n_tensors: int, alignment: int, file_size: int) -> list[TensorInfo]:
    """The tensor-info section; every tensor's bytes are bounded by the file before it is listed."""
    r.check_claim(n_tensors, _MIN_TENSOR_INFO_BYTES, "header tensor count")
    tensors: list[TensorInfo] = []
    names: set[str] = set()
    for index in range(n_tensors):
        name = r.name_string(f"tensor name {index}", GGML_MAX_NAME - 1)
        if name in names:
            raise GGUFError(f"GGUF tensor '{name}' appears twice")
        names.add(name)
        n_dims = r.u32(f"dimension count of tensor '{name}'")
        if n_dims > GGML_MAX_DIMS:
            raise GGUFError(
                f"GGUF tensor '{name}' has {_fmt_count(n_dims)} dimensions, at most {GGML_MAX_DIMS} allowed"
            )
        shape = tuple(r.i64(f"dimension {d} of tensor '{name}'") for d in range(n_dims))
        type_id = r.u32(f"type of tensor '{name}'")
        offset = r.u64(f"data offset of tensor '{name}'")
        n_bytes = _tensor_bytes(name, shape, type_id)
        if offset % alignment:
            raise GGUFError(
                f"GGUF tensor '{name}' data offset {offset} is not a multiple of the alignment {alignment}"
            )
        # The data section starts at or after the current position, so this already bounds the tensor.
        if offset + n_bytes > file_size - r.pos:
            raise GGUFError(f"GGUF tensor '{name}' data runs past the end of the file")
        tensors.append(TensorInfo(name, shape, GGML_TYPES[type_id][0], type_id, offset, n_bytes))
    return tensors


def _tensor_bytes(name: str, shape: Sequence[int], type_id: int) -> int:
    for dim in shape:
        if dim <= 0:
            raise GGUFError(f"GGUF tensor '{name}' has shape {list(shape)}: every dimension must be positive")
    n_elements = 1
    for dim in shape:
        n_elements *= dim
    if n_elements > INT64_MAX:
        raise GGUFError(f"GGUF tensor '{name}' shape {list(shape)} has more than 2^63 elements")
    type_spec = GGML_TYPES.get(type_id)
    if type_spec is None:
        raise GGUFError(f"GGUF tensor '{name}' has unknown ggml type {type_id}")
    type_name, block_size, type_size = type_spec
    first_dim = shape[0] if shape else 1
    if first_dim % block_size:
        raise GGUFError(
            f"GGUF tensor '{name}' of type {type_name} has a first dimension of {first_dim}, "
            f"not a multiple of its block size {block_size}"
        )
    n_bytes = n_elements // block_size * type_size
    if n_bytes > INT64_MAX:
        raise GGUFError(f"GGUF tensor '{name}' would take more than 2^63 bytes")
    return n_bytes


def _check_overlaps(tensors: list[TensorInfo]) -> None:
    previous: TensorInfo | None = None
    for t in sorted(tensors, key=lambda t: t.offset):
        if previous is not None and t.offset < previous.offset + previous.n_bytes:
            raise GGUFError(f"GGUF tensors '{previous.name}' and '{t.name}' overlap in the data section")
        previous = t


def read_gguf_bytes(data: bytes, *, max_metadata_bytes: int = DEFAULT_MAX_METADATA_BYTES) -> GGUFInfo:
    """Parse a whole GGUF file held in memory (tests, fuzzing, uploads)."""
    return _parse(bytes(data), len(data), max_metadata_bytes)


def read_gguf(
    path: str | os.PathLike[str], *, max_metadata_bytes: int = DEFAULT_MAX_METADATA_BYTES
) -> GGUFInfo:
    """Parse the header of the GGUF file at `path`, reading only the bytes before its data section.

    The header is read into memory in one window (4 MiB first, larger if the vocabulary needs it),
    never byte by byte and never beyond `max_metadata_bytes`. Raises GGUFError for malformed files
    and for files that cannot be read.
    """
    path = Path(path)
    window = FIRST_WINDOW_BYTES
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            # A FIFO or device would block or never end; a GGUF is always a regular file.
            raise GGUFError(f"cannot read GGUF file '{path.name}': not a regular file")
        with open(path, "rb") as f:
            file_size = os.fstat(f.fileno()).st_size
            while True:
                f.seek(0)
                buf = f.read(min(window, file_size, max_metadata_bytes))
                try:
                    return _parse(buf, file_size, max_metadata_bytes)
                except _NeedMore as more:
                    if len(buf) < min(window, file_size, max_metadata_bytes):
                        # The file shrank under us: parse what is there as the whole file.
                        return _parse(buf, len(buf), max_metadata_bytes)
                    window = max(window * 2, more.needed_end + (1 << 20))
    except OSError as exc:
        # Name the file, not its absolute path: error messages can reach API clients.
        raise GGUFError(f"cannot read GGUF file '{path.name}': {exc.strerror or exc}") from None


# ---- one verdict per blob ------------------------------------------------------------------------
# In this process only, not a file beside the blob: the store stays Ollama's layout, a verdict cannot
# be planted by whoever writes the store, and a replaced blob (another size or mtime) is read again.
# Reading a header costs milliseconds once per blob per process; the key names the blob's bytes.
MAX_VERDICTS = 4096
_verdicts: collections.OrderedDict[tuple[str, int, int, int], str | None] = collections.OrderedDict()
_verdicts_lock = threading.Lock()


def _blob_key(path: Path, what: str) -> tuple[str, int, int, int]:
    try:
        st = os.stat(path)
    except OSError as exc:
        raise GGUFError(f"{what} file '{path.name}' cannot be read: {exc.strerror or exc}") from None
    return (str(path), st.st_size, st.st_mtime_ns, st.st_ino)


def _remember(key: tuple[str, int, int, int], verdict: str | None) -> None:
    with _verdicts_lock:
        _verdicts[key] = verdict
        _verdicts.move_to_end(key)
        while len(_verdicts) > MAX_VERDICTS:
            _verdicts.popitem(last=False)


def _refuse(path: Path, what: str, verdict: str) -> GGUFError:
    return GGUFError(f"{what} file '{path.name}' is not a GGUF file this runtime can trust: {verdict}")


def read_blob(path: str | os.PathLike[str], what: str = "model") -> GGUFInfo:
    """`read_gguf`, with its verdict kept for `check_blob` (for callers that need the header anyway)."""
    path = Path(path)
    key = _blob_key(path, what)
    try:
        info = read_gguf(path)
    except GGUFError as exc:
        _remember(key, str(exc))
        raise _refuse(path, what, str(exc)) from None
    _remember(key, None)
    return info


def check_blob(path: str | os.PathLike[str], what: str = "model") -> None:
    """Pass a GGUF file through the bounded reader before any backend opens it, once: the verdict is
    kept by the blob's path (its digest, in the store), size, mtime and inode. A GGUFError naming `what`
    if the file is malformed."""
    path = Path(path)
    key = _blob_key(path, what)
    with _verdicts_lock:
        known = key in _verdicts
        verdict = _verdicts.get(key)
    if not known:
        read_blob(path, what)
    elif verdict is not None:
        raise _refuse(path, what, verdict)
