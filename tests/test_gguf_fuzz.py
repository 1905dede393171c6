"""Fuzz the GGUF reader: 10,000+ mutated and truncated files, each must parse or raise GGUFError,
quickly and within a memory bound.

Bases: a small handcrafted file, a tiny Llama from the factory, the real SmolLM2 header cut at
64 KiB (its token count patched so that the reader walks ~5,000 real tokens into the cut), and
the real header rebuilt as a small valid file (real keys, arrays cut to 64 entries, the first
layers' tensor infos with one-row shapes).
Mutations land at random positions or at the start of a real field (from gguf-py's reader, an
independent parser): bit flips, boundary values (0xFF.., 0x7F.., 0x80.., 2^32, 2^63 ...),
insertions, deletions, truncations. A failing input is saved under $LOCALRT_FUZZ_ARTIFACTS
(default: the temp dir) so it can be added to REGRESSIONS below.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
import tracemalloc
from functools import cache
from pathlib import Path
from typing import Any

import gguf
import pytest
from hypothesis import HealthCheck
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st

from localrt.store.gguf import GGUFError
from localrt.store.gguf import GGUFInfo
from localrt.store.gguf import read_gguf
from localrt.store.gguf import read_gguf_bytes
from tests.gguf_factory import ARRAY
from tests.gguf_factory import BOOL
from tests.gguf_factory import STRING
from tests.gguf_factory import UINT8
from tests.gguf_factory import UINT32
from tests.gguf_factory import RawTensor
from tests.gguf_factory import build_gguf
from tests.gguf_factory import small_valid_gguf
from tests.gguf_factory import write_tiny_llama

REAL_HEAD_BYTES = 64 << 10
MEMORY_SLACK = 1 << 20  # tracemalloc also sees the interpreter's own small allocations

# Always-run inputs: Ollama's FuzzGGUFDecode seeds (security.md 3.1). Add any input the fuzzer
# saves here, next to the reader fix. (None has broken the reader so far.)
REGRESSIONS: list[bytes] = [
    b"",
    b"GGUF",
    bytes(24),
    b"GGUF\x03\x00\x00\x00" + bytes(16),
    b"GGUF\x02\x00\x00\x00" + bytes(16),
    b"GGUF\x01\x00\x00\x00" + bytes(8),
    b"GGUF\x03\x00\x00\x00" + bytes(8) + b"\xff" * 8,  # n_kv = 2^64 - 1
    b"GGUF\x03\x00\x00\x00" + b"\xff" * 8 + bytes(8),  # n_tensors = 2^64 - 1
    build_gguf([("general.name", STRING, "x")]),
    build_gguf([], [RawTensor("w", [4, 4])]),
]

BOUNDARY_VALUES = (
    0, 1, 2, 3, 4, 5, 7, 8, 9, 12, 13, 16, 31, 32, 63, 64, 0x7F, 0x80, 0xFF, 0x100,
    0x7FFF, 0x8000, 0xFFFF, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF, 1 << 32, 1 << 40,
    (1 << 62), (1 << 63) - 1, 1 << 63, (1 << 64) - 1,
)  # fmt: skip


# ------------------------------------------------------------------------------------------------
# Bases and the offsets of their fields


def _field_offsets(reader: gguf.GGUFReader, below: int) -> list[int]:
    """Where each part of each field starts (length prefixes, type ids, counts, values)."""
    offsets: set[int] = set()
    fields = list(reader.fields.values()) + [t.field for t in reader.tensors]
    for field in fields:
        position = field.offset
        for part in field.parts:
            if position >= below:
                break
            offsets.add(position)
            position += part.nbytes
    return sorted(offsets)


@cache
def small_base() -> tuple[bytes, list[int]]:
    data = small_valid_gguf()
    return data, _offsets_of(data)


@cache
def tiny_llama_base() -> tuple[bytes, list[int]]:
    with tempfile.TemporaryDirectory() as tmp:
        path = write_tiny_llama(
            Path(tmp) / "tiny.gguf", n_embd=32, n_head=2, n_head_kv=1, n_ff=64, n_layer=1, file_type="Q4_0"
        )
        data = path.read_bytes()
    return data, _offsets_of(data)


def _offsets_of(data: bytes) -> list[int]:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "base.gguf"
        path.write_bytes(data)
        reader = gguf.GGUFReader(path)
        offsets = _field_offsets(reader, len(data))
        del reader  # releases its memmap before the directory goes
    return offsets


@cache
def real_bases(real_path: Path) -> tuple[tuple[bytes, list[int]], tuple[bytes, list[int]]]:
    """(the first 64 KiB of the real file, a small valid file patched together from its header)."""
    with open(real_path, "rb") as f:
        head = bytearray(f.read(REAL_HEAD_BYTES))
    reader = gguf.GGUFReader(real_path)
    head_offsets = _field_offsets(reader, REAL_HEAD_BYTES)
    # Patch the token count down to what the 64 KiB hold, plus one: the reader then walks ~5,000
    # real tokens before it meets the cut, instead of refusing the 49,152-entry claim up front.
    tokens = reader.fields["tokenizer.ggml.tokens"]
    # parts: key length, key, value type, element type, count, then (length, bytes) per token
    count_at = tokens.offset + sum(part.nbytes for part in tokens.parts[:4])
    end, fitting = count_at + 8, 0
    for string_part in tokens.parts[6::2]:
        end += 8 + string_part.nbytes
        if end > REAL_HEAD_BYTES:
            break
        fitting += 1
    head[count_at : count_at + 8] = (fitting + 1).to_bytes(8, "little")
    del reader
    patched = _patched_real_header(read_gguf(real_path))
    return (bytes(head), head_offsets), (patched, _offsets_of(patched))


_TYPE_IDS = {name: type_id for type_id, name in enumerate(
    "UINT8 INT8 UINT16 INT16 UINT32 INT32 FLOAT32 BOOL STRING ARRAY UINT64 INT64 FLOAT64".split()
)}  # fmt: skip


def _patched_real_header(info: GGUFInfo) -> bytes:
    kv: list[tuple[str, int, Any]] = []
    for key, value in info.metadata.items():
        label = info.metadata_types[key]
        if label.startswith("ARRAY["):
            element_type = _TYPE_IDS[label[6:-1]]
            kv.append((key, ARRAY, (element_type, list(value)[:64])))
        else:
            kv.append((key, _TYPE_IDS[label], value))
    keep = [t for t in info.tensors if not t.name.startswith("blk.") or t.name.split(".")[1] in ("0", "1")]
    # One row per tensor keeps the real names, types and first dims, in a few KiB of data.
    tensors = [RawTensor(t.name, [t.shape[0], 1][: len(t.shape)], t.type_id) for t in keep]
    return build_gguf(kv, tensors)


# ------------------------------------------------------------------------------------------------
# Mutations

# Each mutation is decoded from 6 bytes that hypothesis draws (as libFuzzer's FuzzedDataProvider does):
# a `binary` strategy costs a fraction of a composite one per example, and still shrinks well.
#   byte 0: operation (and whether the position is a field start), bytes 1-3: position, bytes 4-5: argument
FILLS = (b"\xff", b"\x7f", b"\x80", b"\x00")
WIDTHS = (1, 2, 4, 8)
OP_BYTES = 6
mutations = st.binary(min_size=OP_BYTES, max_size=4 * OP_BYTES)


def _boundary_bytes(arg: int) -> bytes:
    value = BOUNDARY_VALUES[arg % len(BOUNDARY_VALUES)]
    width = WIDTHS[(arg >> 8) % len(WIDTHS)]
    return (value % (1 << (8 * width))).to_bytes(width, "little")


def _fill_bytes(arg: int) -> bytes:
    return FILLS[arg % len(FILLS)] * (1 + (arg >> 8) % 16)


def mutate(data: bytes, field_offsets: list[int], ops: bytes) -> bytes:
    buf = bytearray(data)
    for start in range(0, len(ops) - OP_BYTES + 1, OP_BYTES):
        op, n, arg = (
            ops[start],
            int.from_bytes(ops[start + 1 : start + 4], "little"),
            ops[start + 4] | ops[start + 5] << 8,
        )
        if op & 1 and field_offsets:
            pos = min(field_offsets[n % len(field_offsets)], len(buf))
        else:
            pos = n % (len(buf) + 1)
        kind = (op >> 1) % 8
        if kind == 0 and pos < len(buf):
            buf[pos] ^= 1 << (arg % 8)  # bit flip
        elif kind in (1, 2):
            value = _boundary_bytes(arg)  # overwrite a length, count, type or offset with an edge case
            buf[pos : pos + len(value)] = value
        elif kind == 3:
            fill = _fill_bytes(arg)
            buf[pos : pos + len(fill)] = fill
        elif kind == 4:
            buf[pos:pos] = _boundary_bytes(arg)
        elif kind == 5:
            buf[pos:pos] = arg.to_bytes(2, "little")[: 1 + arg % 2]
        elif kind == 6:
            del buf[pos : pos + 1 + arg % 16]
        else:
            del buf[pos:]  # truncate
    return bytes(buf)


# ------------------------------------------------------------------------------------------------
# The oracle: GGUFError or a self-consistent result, bounded time and memory


def _save_artifact(data: bytes, reason: str) -> Path:
    folder = Path(os.environ.get("LOCALRT_FUZZ_ARTIFACTS", tempfile.gettempdir())) / "localrt-gguf-fuzz"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{reason}-{hashlib.sha256(data).hexdigest()[:16]}.gguf"
    path.write_bytes(data)
    return path


def _check_consistent(info: GGUFInfo, size: int) -> None:
    end = 0
    for t in sorted(info.tensors, key=lambda t: t.offset):
        assert t.offset >= end
        assert t.offset % info.alignment == 0
        assert t.file_offset == info.data_offset + t.offset
        assert 0 < t.n_bytes
        assert t.file_offset + t.n_bytes <= size
        end = t.offset + t.n_bytes
    json.dumps(info.summary(), allow_nan=False)
    _ = (info.file_type, info.parameter_count, info.context_length, info.head_count, info.eos_token_id)


def check_input(data: bytes, *, trace_memory: bool = True) -> None:
    """Parse `data`: GGUFError or a consistent result, and (when traced) a bounded peak allocation."""
    if trace_memory:
        tracemalloc.start(1)  # only around the call: hypothesis' own allocations stay untraced
    try:
        info = read_gguf_bytes(data)
    except GGUFError:
        info = None
    except Exception as exc:
        tracemalloc.stop()
        path = _save_artifact(data, "crash")
        raise AssertionError(
            f"{type(exc).__name__} escaped the reader: {exc!r}; input saved to {path}"
        ) from exc
    if trace_memory:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        if peak > 4 * len(data) + MEMORY_SLACK:
            path = _save_artifact(data, "memory")
            raise AssertionError(f"parsing {len(data)} bytes allocated {peak} at peak; input saved to {path}")
    if info is not None:
        _check_consistent(info, len(data))


FUZZ_SETTINGS: dict[str, Any] = dict(
    # no per-example deadline: a loaded CI box must not fail a correct parser; a hang still ends at
    # pytest-timeout, and the parser's work is bounded by the memory check below
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def run_fuzz(base: tuple[bytes, list[int]], max_examples: int, trace_every: int) -> None:
    """Run `max_examples` mutations of `base`, tracing memory on every `trace_every`-th one.

    tracemalloc makes this pure-Python parser 10-20x slower on string-heavy headers (each int
    and slice is a traced allocation), so large bases are traced on a deterministic sample;
    test_worst_case_allocations traces the inputs that allocate the most on purpose.
    """
    data, field_offsets = base
    tried = 0

    @settings(max_examples=max_examples, **FUZZ_SETTINGS)
    @given(mutations)
    def fuzz(ops: bytes) -> None:
        nonlocal tried
        tried += 1
        check_input(mutate(data, field_offsets, ops), trace_memory=tried % trace_every == 0)

    start = time.perf_counter()
    fuzz()
    print(f"{max_examples} examples on a {len(data)}-byte base in {time.perf_counter() - start:.1f} s")
    assert tried >= max_examples


# 2,500 + 2,000 + 1,500 + 3,000 + 1,000 = 10,000 examples.


def test_fuzz_small_handcrafted_file() -> None:
    run_fuzz(small_base(), 2_500, trace_every=1)


def test_fuzz_tiny_llama() -> None:
    run_fuzz(tiny_llama_base(), 2_000, trace_every=8)


def test_fuzz_real_header_truncated(smollm2_gguf: Path) -> None:
    run_fuzz(real_bases(smollm2_gguf)[0], 1_500, trace_every=20)


def test_fuzz_real_header_patched(smollm2_gguf: Path) -> None:
    run_fuzz(real_bases(smollm2_gguf)[1], 3_000, trace_every=4)


@settings(max_examples=1_000, **FUZZ_SETTINGS)
@given(st.sampled_from((2, 3)), st.binary(max_size=512))
def test_fuzz_random_bytes_after_the_header(version: int, tail: bytes) -> None:
    check_input(b"GGUF" + version.to_bytes(4, "little") + tail)


@pytest.mark.parametrize("data", REGRESSIONS, ids=lambda data: hashlib.sha256(data).hexdigest()[:12])
def test_regressions(data: bytes) -> None:
    check_input(data)


def test_bases_are_valid(smollm2_gguf: Path) -> None:
    # Mutations of a valid file reach deeper than mutations of garbage.
    for data, offsets in (small_base(), tiny_llama_base(), real_bases(smollm2_gguf)[1]):
        assert read_gguf_bytes(data).tensors
        assert len(offsets) > 10
    head, head_offsets = real_bases(smollm2_gguf)[0]
    with pytest.raises(GGUFError, match=r"string \d+ of key 'tokenizer.ggml.tokens'.* bytes left"):
        read_gguf_bytes(head)
    assert len(head_offsets) > 1000


# ------------------------------------------------------------------------------------------------
# Inputs built to allocate as much as possible per byte


def _unique_names(count: int) -> list[str]:
    alphabet = "abcdefghijklmnopqrstuvwxyz0123456789"
    return [alphabet[i // 1296 % 36] + alphabet[i // 36 % 36] + alphabet[i % 36] for i in range(count)]


def _kv_array(element_type: int, items: list[Any]) -> bytes:
    return build_gguf([("k", ARRAY, (element_type, items))])


@cache
def worst_case_inputs(size: int) -> dict[str, bytes]:
    """Files of about `size` bytes whose every few bytes become a fresh Python object."""
    n_tensors = min(size // 40, 36**3)
    tensors = [RawTensor(name, [1], 24) for name in _unique_names(n_tensors)]  # one I8 each
    return {
        # 9 bytes each; b"\xff" decodes to a new U+FFFD string every time
        "invalid one-byte strings": _kv_array(STRING, [b"\xff"] * (size // 9)),
        # 11 bytes each, all distinct three-byte characters
        "distinct CJK strings": _kv_array(STRING, [chr(0x4E00 + i % 20000) for i in range(size // 11)]),
        "empty nested arrays": _kv_array(ARRAY, [(UINT8, [])] * (size // 12)),
        "bool array": _kv_array(BOOL, [1] * size),
        "many keys": build_gguf([(name, UINT8, 1) for name in _unique_names(min(size // 16, 36**3))]),
        "many tensors": build_gguf([("general.alignment", UINT32, 1)], tensors, alignment=1),
        "many tensors, last one bad": build_gguf(
            [("general.alignment", UINT32, 1)], [*tensors[:-1], RawTensor("bad", [3], 2)], alignment=1
        ),
    }


@pytest.mark.parametrize("case", list(worst_case_inputs(1024)))
def test_worst_case_allocations(case: str) -> None:
    # Fuzz-sized inputs stay within the fuzz bound (4x + 1 MiB)...
    check_input(worst_case_inputs(64 << 10)[case])
    # ...and a 256 KiB one within a small multiple of its size: Python objects cost ~50-80 bytes
    # each, so ~10x is the floor for a file made of nothing but 9-byte strings.
    data = worst_case_inputs(256 << 10)[case]
    tracemalloc.start(1)
    try:
        read_gguf_bytes(data)
    except GGUFError:
        pass
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    print(f"{case}: {len(data)} bytes -> peak {peak} ({peak / len(data):.1f}x)")
    assert peak <= 12 * len(data)
