"""The GGUF reader: the real SmolLM2 file against gguf-py's reader, tiny factory models, and the
catalogue of malformed files (reference/security.md 4.1), each rejected with a useful message."""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import pytest

from localrt.store import gguf as gguf_module
from localrt.store.gguf import GGML_TYPES
from localrt.store.gguf import GGUFError
from localrt.store.gguf import GGUFInfo
from localrt.store.gguf import format_parameter_count
from localrt.store.gguf import read_gguf
from localrt.store.gguf import read_gguf_bytes
from tests.gguf_factory import ARRAY
from tests.gguf_factory import BOOL
from tests.gguf_factory import FILE_TYPES
from tests.gguf_factory import FLOAT32
from tests.gguf_factory import FLOAT64
from tests.gguf_factory import INT8
from tests.gguf_factory import INT16
from tests.gguf_factory import INT32
from tests.gguf_factory import INT64
from tests.gguf_factory import STRING
from tests.gguf_factory import UINT8
from tests.gguf_factory import UINT16
from tests.gguf_factory import UINT32
from tests.gguf_factory import UINT64
from tests.gguf_factory import RawTensor
from tests.gguf_factory import build_gguf
from tests.gguf_factory import encode_string
from tests.gguf_factory import small_valid_gguf
from tests.gguf_factory import write_tiny_llama

U64_MAX = (1 << 64) - 1
INT64_MAX = (1 << 63) - 1
Q4_0, Q8_0 = 2, 8


# ------------------------------------------------------------------------------------------------
# The real model


@pytest.fixture(scope="module")
def smollm2_info(smollm2_gguf: Path) -> GGUFInfo:
    return read_gguf(smollm2_gguf)


@pytest.fixture(scope="module")
def smollm2_oracle(smollm2_gguf: Path) -> gguf.GGUFReader:
    return gguf.GGUFReader(smollm2_gguf)


def test_real_model_properties(smollm2_info: GGUFInfo, smollm2_oracle: gguf.GGUFReader) -> None:
    info = smollm2_info
    assert info.version == 3
    assert info.architecture == "llama"
    assert 134_400_000 < info.parameter_count < 134_600_000
    assert format_parameter_count(info.parameter_count) == "135M"
    assert info.file_type == "Q4_1"
    assert info.quantization_label == "Q4_1"
    assert info.context_length == 8192
    assert info.embedding_length == 576
    assert info.block_count == 30
    assert info.head_count == 9
    assert info.head_count_kv == 3
    assert info.feed_forward_length == 1536
    assert info.vocab_size == 49152
    assert info.bos_token_id == 1
    assert info.eos_token_id == 2
    assert info.license == "apache-2.0"
    assert info.name
    assert "135M" in info.name
    assert info.chat_template
    assert "<|im_start|>" in info.chat_template
    assert len(info.tensors) == len(smollm2_oracle.tensors) == 272
    assert info.data_offset == smollm2_oracle.data_offset
    assert info.alignment == 32
    assert info.tensor("token_embd.weight").ggml_type == "Q8_0"


def _oracle_value(field: Any) -> Any:
    if field.types[0] == gguf.GGUFValueType.ARRAY:
        return list(field.contents())
    return field.contents()


def test_real_model_matches_gguf_reader(smollm2_info: GGUFInfo, smollm2_oracle: gguf.GGUFReader) -> None:
    oracle_fields = {k: f for k, f in smollm2_oracle.fields.items() if not k.startswith("GGUF.")}
    assert list(smollm2_info.metadata) == list(oracle_fields)
    for key, field in oracle_fields.items():
        ours = smollm2_info.metadata[key]
        ours = list(ours) if not isinstance(ours, (str, int, float)) else ours
        assert ours == _oracle_value(field), key
        type_names = [t.name for t in field.types]
        expected_label = type_names[0] if len(type_names) == 1 else f"ARRAY[{type_names[-1]}]"
        assert smollm2_info.metadata_types[key] == expected_label, key
    for ours, theirs in zip(smollm2_info.tensors, smollm2_oracle.tensors, strict=True):
        assert ours.name == theirs.name
        assert ours.shape == tuple(int(d) for d in theirs.shape)
        assert ours.ggml_type == theirs.tensor_type.name
        assert ours.file_offset == theirs.data_offset
        assert ours.n_bytes == theirs.n_bytes
        assert ours.n_elements == theirs.n_elements


def _bytes_read_by_this_process() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise AssertionError("no rchar in /proc/self/io")


@pytest.mark.skipif(not Path("/proc/self/io").exists(), reason="counts bytes read through Linux's /proc")
def test_real_model_reads_only_its_header(smollm2_gguf: Path) -> None:
    """The reader's work is the header (49k tokens + 49k merges), never the ~90 MB of tensor data: counted
    in bytes the process read, which a loaded machine does not change."""
    before = _bytes_read_by_this_process()
    info = read_gguf(smollm2_gguf)
    read = _bytes_read_by_this_process() - before
    assert len(info.tensors) > 0
    assert read <= gguf_module.FIRST_WINDOW_BYTES + 4096  # one window (+ reading /proc/self/io itself)
    assert read < smollm2_gguf.stat().st_size // 10


def test_real_model_summary_is_small_and_json(smollm2_info: GGUFInfo) -> None:
    summary = smollm2_info.summary()
    assert summary["general.architecture"] == "llama"
    assert summary["llama.context_length"] == 8192
    assert summary["general.parameter_count"] == smollm2_info.parameter_count
    assert summary["general.languages"] == ["en"]
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges"):
        assert summary[key] is None
    assert len(json.dumps(summary)) < 10_000


def test_small_read_window_rereads(smollm2_gguf: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A header larger than the first window makes the file reader re-read a bigger one.
    monkeypatch.setattr(gguf_module, "FIRST_WINDOW_BYTES", 4096)
    small_window = read_gguf(smollm2_gguf)
    monkeypatch.undo()
    full = read_gguf(smollm2_gguf)
    assert small_window.tensors == full.tensors
    assert small_window.metadata.keys() == full.metadata.keys()


def test_metadata_limit(smollm2_gguf: Path) -> None:
    with pytest.raises(GGUFError, match="metadata limit"):
        read_gguf(smollm2_gguf, max_metadata_bytes=1 << 20)


# ------------------------------------------------------------------------------------------------
# Tiny factory models


@pytest.mark.parametrize("file_type", list(FILE_TYPES))
def test_tiny_llama_roundtrip(tmp_path: Path, file_type: str) -> None:
    path = write_tiny_llama(tmp_path / "tiny.gguf", file_type=file_type, n_layer=2)
    info = read_gguf(path)
    assert info.architecture == "llama"
    assert info.file_type == file_type
    assert info.context_length == 256
    assert info.embedding_length == 64
    assert info.block_count == 2
    assert info.head_count == 4
    assert info.head_count_kv == 2
    assert info.bos_token_id == 1
    assert info.eos_token_id == 2
    assert info.chat_template
    assert "im_start" in info.chat_template
    assert len(info.tensors) == 3 + 2 * 9
    assert info == read_gguf_bytes(path.read_bytes())
    oracle = gguf.GGUFReader(path)
    for ours, theirs in zip(info.tensors, oracle.tensors, strict=True):
        assert (ours.name, ours.shape, ours.ggml_type, ours.file_offset, ours.n_bytes) == (
            theirs.name,
            tuple(int(d) for d in theirs.shape),
            theirs.tensor_type.name,
            theirs.data_offset,
            theirs.n_bytes,
        )


def test_tiny_llama_loads_in_llama_cpp(tmp_path: Path) -> None:
    llama_cpp = pytest.importorskip("llama_cpp")
    path = write_tiny_llama(tmp_path / "tiny.gguf", file_type="Q8_0")
    info = read_gguf(path)
    model = llama_cpp.Llama(model_path=str(path), n_ctx=64, verbose=False)
    try:
        assert model.n_vocab() == info.vocab_size
        assert model.metadata["llama.context_length"] == str(info.context_length)
        assert model.n_embd() == info.embedding_length
        assert model.tokenize(b"the sky", add_bos=False) == [
            info.metadata["tokenizer.ggml.tokens"].index("\u2581the"),
            info.metadata["tokenizer.ggml.tokens"].index("\u2581sky"),
        ]
        out = model.create_completion("hello world", max_tokens=4, temperature=0.0)
        assert out["usage"]["completion_tokens"] >= 1
    finally:
        model.close()


def test_file_type_falls_back_to_most_common_tensor_type() -> None:
    tensors = [
        RawTensor("a", [32, 8], Q4_0),  # 256 elements
        RawTensor("b", [32, 4], Q8_0),  # 128
        RawTensor("c", [64], 0),  # 64
        RawTensor("d", [64], 0),
    ]
    info = read_gguf_bytes(build_gguf([], tensors))
    assert info.file_type == "Q4_0"
    unknown_ftype = read_gguf_bytes(build_gguf([("general.file_type", UINT32, 999)], tensors))
    assert unknown_ftype.file_type == "Q4_0"
    assert read_gguf_bytes(build_gguf()).file_type is None
    assert read_gguf_bytes(build_gguf()).quantization_label == "unknown"
    for ftype, name in ((15, "Q4_K_M"), (32, "BF16"), (0, "F32"), (18, "Q6_K"), (1024 | 7, "Q8_0")):
        assert read_gguf_bytes(build_gguf([("general.file_type", UINT32, ftype)])).file_type == name


@pytest.mark.parametrize(
    ("count", "label"),
    [
        (0, "0"),
        (999, "999"),
        (1_500, "1.5K"),
        (134_515_008, "135M"),
        (33_400_000, "33.4M"),
        (1_235_814_400, "1.2B"),
        (7_241_732_096, "7.2B"),
        (8_030_261_248, "8.0B"),
        (70_553_706_496, "70.6B"),
        (405_000_000_000, "405B"),
        (1_000_000_000_000, "1.0T"),
    ],
)
def test_format_parameter_count(count: int, label: str) -> None:
    assert format_parameter_count(count) == label


def test_every_value_type_round_trips() -> None:
    kv = [
        ("u8", UINT8, 255),
        ("i8", INT8, -128),
        ("u16", UINT16, 65535),
        ("i16", INT16, -32768),
        ("u32", UINT32, 2**32 - 1),
        ("i32", INT32, -(2**31)),
        ("f32", FLOAT32, 1.5),
        ("bool", BOOL, 1),
        ("str", STRING, "héllo ✓"),
        ("u64", UINT64, U64_MAX),
        ("i64", INT64, -(2**63)),
        ("f64", FLOAT64, -2.25),
        ("arr.i32", ARRAY, (INT32, [1, -2, 3])),
        ("arr.f32", ARRAY, (FLOAT32, [0.5, -1.0])),
        ("arr.bool", ARRAY, (BOOL, [1, 0, 1])),
        ("arr.str", ARRAY, (STRING, ["a", "", "bc"])),
        ("arr.empty", ARRAY, (UINT64, [])),
        ("arr.nested", ARRAY, (ARRAY, [(INT8, [1, 2]), (STRING, ["x"]), (ARRAY, [(UINT8, [7])])])),
    ]
    info = read_gguf_bytes(build_gguf(kv, version=2))
    assert info.version == 2
    meta = info.metadata
    assert [meta[k] for k in ("u8", "i8", "u16", "i16", "u32", "i32", "f32", "bool", "str")] == [
        255,
        -128,
        65535,
        -32768,
        2**32 - 1,
        -(2**31),
        1.5,
        True,
        "héllo ✓",
    ]
    assert (meta["u64"], meta["i64"], meta["f64"]) == (U64_MAX, -(2**63), -2.25)
    assert list(meta["arr.i32"]) == [1, -2, 3]
    assert list(meta["arr.f32"]) == [0.5, -1.0]
    assert meta["arr.bool"] == [True, False, True]
    assert meta["arr.str"] == ["a", "", "bc"]
    assert list(meta["arr.empty"]) == []
    nested = meta["arr.nested"]
    assert list(nested[0]) == [1, 2]
    assert nested[1] == ["x"]
    assert list(nested[2][0]) == [7]
    assert info.metadata_types["arr.nested"] == "ARRAY[ARRAY]"
    assert info.metadata_types["u64"] == "UINT64"
    json.dumps(info.summary())  # arrays come out as lists


def test_summary_is_strict_json() -> None:
    kv = [("nan", FLOAT32, math.nan), ("inf", FLOAT64, math.inf), ("arr", ARRAY, (FLOAT32, [math.nan, 1.0]))]
    summary = read_gguf_bytes(build_gguf(kv)).summary()
    assert summary["nan"] is None
    assert summary["inf"] is None
    assert summary["arr"] == [None, 1.0]
    json.dumps(summary, allow_nan=False)


def test_invalid_utf8_in_values_is_replaced_not_fatal() -> None:
    info = read_gguf_bytes(build_gguf([("general.name", STRING, b"bad \xff byte")]))
    assert info.name == "bad \ufffd byte"


def test_zero_tensor_file_needs_no_padding() -> None:
    data = build_gguf([("general.architecture", STRING, "llama")])
    assert len(data) % 32 != 0
    info = read_gguf_bytes(data)
    assert info.tensors == []
    assert info.parameter_count == 0


def test_custom_alignment_and_gaps_between_tensors() -> None:
    tensors = [RawTensor("a", [16], 0, offset=0), RawTensor("b", [16], 0, offset=256)]
    info = read_gguf_bytes(build_gguf([("general.alignment", UINT32, 128)], tensors, alignment=128))
    assert info.alignment == 128
    assert info.data_offset % 128 == 0
    assert [t.file_offset - info.data_offset for t in info.tensors] == [0, 256]


def test_special_token_ids_outside_the_vocab_read_as_none() -> None:
    kv = [
        ("tokenizer.ggml.tokens", ARRAY, (STRING, ["a", "b"])),
        ("tokenizer.ggml.bos_token_id", UINT32, 1),
        ("tokenizer.ggml.eos_token_id", UINT32, 2),
    ]
    info = read_gguf_bytes(build_gguf(kv))
    assert info.bos_token_id == 1
    assert info.eos_token_id is None


def test_per_layer_head_counts() -> None:
    kv = [
        ("general.architecture", STRING, "openelm"),
        ("openelm.attention.head_count", ARRAY, (INT32, [4, 8, 12])),
    ]
    assert read_gguf_bytes(build_gguf(kv)).head_count == 12


def test_unreadable_paths(tmp_path: Path) -> None:
    with pytest.raises(GGUFError, match="cannot read GGUF file 'missing.gguf'") as missing:
        read_gguf(tmp_path / "missing.gguf")
    assert str(tmp_path) not in str(missing.value)  # no absolute paths in user-facing errors
    with pytest.raises(GGUFError, match="not a regular file"):
        read_gguf(tmp_path)
    os.mkfifo(tmp_path / "pipe.gguf")  # opening a FIFO for reading would block without a writer
    with pytest.raises(GGUFError, match="not a regular file"):
        read_gguf(tmp_path / "pipe.gguf")
    (tmp_path / "empty.gguf").write_bytes(b"")
    with pytest.raises(GGUFError, match="only 0 bytes"):
        read_gguf(tmp_path / "empty.gguf")


def test_type_table_matches_gguf_py() -> None:
    for type_id, (name, block_size, type_size) in GGML_TYPES.items():
        qtype = gguf.GGMLQuantizationType(type_id)
        assert qtype.name == name
        assert gguf.GGML_QUANT_SIZES[qtype] == (block_size, type_size)


# ------------------------------------------------------------------------------------------------
# Malformed files: security.md 4.1


def _kv_file(*kv: tuple[str | bytes, int, Any], **kwargs: Any) -> bytes:
    return build_gguf(list(kv), **kwargs)


def _tensor_file(*tensors: RawTensor, kv: tuple[tuple[str, int, Any], ...] = (), **kwargs: Any) -> bytes:
    return build_gguf(list(kv), list(tensors), **kwargs)


def _patch(data: bytes, offset: int, new: bytes) -> bytes:
    return data[:offset] + new + data[offset + len(new) :]


def _header(version: int = 3, n_tensors: int = 0, n_kv: int = 0) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", version, n_tensors, n_kv)


def _raw_key(key_bytes: bytes, length: int) -> bytes:
    return _header(n_kv=1) + encode_string(key_bytes, length=length) + struct.pack("<IQ", UINT64, 1)


def _string_value(length: int, payload: bytes = b"abc") -> bytes:
    return (
        _header(n_kv=1)
        + encode_string("k")
        + struct.pack("<I", STRING)
        + encode_string(payload, length=length)
    )


def _array_value(element_type: int, count: int, payload: bytes = b"") -> bytes:
    return _header(n_kv=1) + encode_string("k") + struct.pack("<IIQ", ARRAY, element_type, count) + payload


def _nested_arrays(depth: int) -> bytes:
    value: Any = (UINT8, [1])
    for _ in range(depth - 1):
        value = (ARRAY, [value])
    return _kv_file(("k", ARRAY, value))


BAD_FILES: dict[str, tuple[Callable[[], bytes], str]] = {
    # header
    "empty": (lambda: b"", "only 0 bytes"),
    "three bytes": (lambda: b"GGU", "only 3 bytes"),
    "magic only": (lambda: b"GGUF", "truncated: version"),
    "magic FUGG": (lambda: b"FUGG" + bytes(20), "magic is b'FUGG'"),
    "magic zeros": (lambda: bytes(24), "magic is"),
    "magic lowercase": (lambda: b"gguf" + _header()[4:], "magic is b'gguf'"),
    "version 0": (lambda: _header(version=0), "version 0 is not supported"),
    "version 1": (lambda: _header(version=1), "version 1 is not supported"),
    "version 4": (lambda: _header(version=4), "version 4 is not supported"),
    "version 2^31": (lambda: _header(version=1 << 31), "version 2147483648 is not supported"),
    "version byte-swapped": (lambda: _header(version=0x03000000), "byte-swapped"),
    "header truncated in counts": (
        lambda: _header()[:20],
        "truncated: metadata key count needs 8 bytes at offset 16",
    ),
    "n_tensors -1": (lambda: _header(n_tensors=U64_MAX), r"tensor count claims 18446744073709551615 entries"),
    "n_tensors 2^63": (lambda: _header(n_tensors=1 << 63), r"claims 2\^63 entries"),
    "n_kv -1": (lambda: _header(n_kv=U64_MAX), "metadata count claims"),
    "n_kv larger than the file": (
        lambda: _kv_file(("a", UINT8, 1), n_kv=3),
        "metadata count claims 3 entries",
    ),
    "n_kv + n_tensors larger than the file": (
        lambda: _header(n_kv=1, n_tensors=1) + bytes(30),
        "1 metadata keys and 1 tensors",
    ),
    # KV section
    "key length -1": (lambda: _raw_key(b"k", U64_MAX), "metadata key 0 length"),
    "key longer than the cap": (lambda: _raw_key(b"k" * 70000, 70000), "exceeds the 65535-byte limit"),
    "key past EOF": (lambda: _raw_key(b"key", 100), "exceeds the .* bytes left"),
    "empty key": (lambda: _raw_key(b"", 0), "metadata key 0 at offset .* is empty"),
    "key not utf-8": (lambda: _raw_key(b"\xff\xfe", 2), "not valid UTF-8"),
    "duplicate key": (lambda: _kv_file(("a", UINT8, 1), ("a", UINT8, 2)), "key 'a' appears twice"),
    "unknown value type 13": (
        lambda: _kv_file(raw_kv=encode_string("k") + struct.pack("<I", 13), n_kv=1) + bytes(8),
        "key 'k' has unknown value type 13",
    ),
    "unknown value type -1": (
        lambda: _kv_file(raw_kv=encode_string("k") + struct.pack("<I", 0xFFFFFFFF), n_kv=1) + bytes(8),
        "unknown value type 4294967295",
    ),
    "string length 2^40": (
        lambda: _string_value(1 << 40),
        r"string key 'k' length 2\^40 exceeds the 3 bytes left",
    ),
    "string length -1": (lambda: _string_value(U64_MAX), "string key 'k' length 18446744073709551615"),
    "string longer than the cap": (
        lambda: _string_value((16 << 20) + 1, bytes((16 << 20) + 1)),
        "length 16777217 exceeds the 16777216-byte limit",
    ),
    "string past EOF": (lambda: _string_value(1000), "string key 'k' length 1000 exceeds the 3 bytes left"),
    "truncated mid-string": (lambda: _string_value(6)[:-1], "exceeds the 2 bytes left"),
    "array count 2^62": (
        lambda: _array_value(UINT32, 1 << 62),
        r"array key 'k' of UINT32 claims 2\^62 entries",
    ),
    "array count 2^63": (lambda: _array_value(UINT8, 1 << 63), r"claims 2\^63 entries"),
    "array count -1 of strings": (lambda: _array_value(STRING, U64_MAX), "of STRING claims"),
    "array count above the bytes left": (
        lambda: _array_value(UINT64, 3, bytes(16)),
        "claims 3 entries, but the 16 bytes left",
    ),
    "array of unknown type": (lambda: _array_value(13, 1, bytes(8)), "array of unknown value type 13"),
    "array truncated mid-strings": (
        lambda: _array_value(STRING, 2, encode_string("abc") + encode_string("defgh", length=9)),
        "string 1 of key 'k'",
    ),
    "nested arrays too deep": (lambda: _nested_arrays(5), "deeper than 4 levels"),
    "alignment 0": (
        lambda: _kv_file(("general.alignment", UINT32, 0)),
        "general.alignment' must be a UINT32 power of two",
    ),
    "alignment 13": (lambda: _kv_file(("general.alignment", UINT32, 13)), "power of two, but is UINT32 13"),
    "alignment as INT32": (
        lambda: _kv_file(("general.alignment", INT32, 32)),
        "power of two, but is INT32 32",
    ),
    "alignment as string": (lambda: _kv_file(("general.alignment", STRING, "32")), "but is STRING '32'"),
    "architecture not a string": (
        lambda: _kv_file(("general.architecture", UINT32, 7)),
        "architecture' must be a string",
    ),
    "empty architecture": (lambda: _kv_file(("general.architecture", STRING, "")), "architecture' is empty"),
    "chat template not a string": (
        lambda: _kv_file(("tokenizer.chat_template", ARRAY, (STRING, ["a"]))),
        "chat_template' must be a string, but is ARRAY",
    ),
    "negative context length": (
        lambda: _kv_file(("general.architecture", STRING, "llama"), ("llama.context_length", INT32, -1)),
        "llama.context_length' must be a non-negative integer",
    ),
    "context length as string": (
        lambda: _kv_file(("general.architecture", STRING, "llama"), ("llama.context_length", STRING, "8k")),
        "llama.context_length' must be a non-negative integer, but is STRING",
    ),
    "block count as float": (
        lambda: _kv_file(("general.architecture", STRING, "llama"), ("llama.block_count", FLOAT32, 2.0)),
        "llama.block_count' must be a non-negative integer",
    ),
    "negative per-layer head count": (
        lambda: _kv_file(
            ("general.architecture", STRING, "x"), ("x.attention.head_count", ARRAY, (INT32, [4, -1]))
        ),
        "head_count' must be a non-negative integer or an array",
    ),
    "bos token id negative": (lambda: _kv_file(("tokenizer.ggml.bos_token_id", INT32, -5)), "bos_token_id"),
    "file type as bool": (
        lambda: _kv_file(("general.file_type", BOOL, 1)),
        "file_type' must be a non-negative",
    ),
    # tensor infos
    "tensor name empty": (lambda: _tensor_file(RawTensor("", [4])), "tensor name 0 at offset .* is empty"),
    "tensor name 64 bytes": (
        lambda: _tensor_file(RawTensor("t" * 64, [4])),
        "length 64 exceeds the 63-byte limit",
    ),
    "tensor name length -1": (
        lambda: _patch(_tensor_file(RawTensor("t", [4])), 24, struct.pack("<Q", U64_MAX)),
        "tensor name 0 length 18446744073709551615",
    ),
    "duplicate tensor name": (
        lambda: _tensor_file(RawTensor("w", [4]), RawTensor("w", [4])),
        "tensor 'w' appears twice",
    ),
    "n_dims 5": (lambda: _tensor_file(RawTensor("w", [1, 1, 1, 1, 1])), "'w' has 5 dimensions, at most 4"),
    "n_dims -1": (
        lambda: _patch(_tensor_file(RawTensor("w", [4])), 24 + 9, struct.pack("<I", 0xFFFFFFFF)),
        "'w' has 4294967295 dimensions",
    ),
    "zero dim": (
        lambda: _tensor_file(RawTensor("w", [4, 0]), data=bytes(64)),
        r"shape \[4, 0\]: every dimension must be positive",
    ),
    "negative dim": (
        lambda: _tensor_file(RawTensor("w", [-1]), data=bytes(64)),
        "every dimension must be positive",
    ),
    "dims product overflows int64": (
        lambda: _tensor_file(RawTensor("w", [INT64_MAX, 2]), data=bytes(64)),
        r"more than 2\^63 elements",
    ),
    "dims product 2^64": (
        lambda: _tensor_file(RawTensor("w", [1 << 32, 1 << 32]), data=bytes(64)),
        "elements",
    ),
    "byte size overflows int64": (
        lambda: _tensor_file(RawTensor("w", [1 << 61, 2]), data=bytes(64)),
        r"more than 2\^63 bytes",
    ),
    "unknown type 4 (removed Q4_2)": (
        lambda: _tensor_file(RawTensor("w", [32], 4), data=bytes(64)),
        "unknown ggml type 4",
    ),
    "unknown type 1000": (
        lambda: _tensor_file(RawTensor("w", [32], 1000), data=bytes(64)),
        "unknown ggml type 1000",
    ),
    "unknown type -1": (
        lambda: _tensor_file(RawTensor("w", [32], 0xFFFFFFFF), data=bytes(64)),
        "unknown ggml type 4294967295",
    ),
    "row not a multiple of the block": (
        lambda: _tensor_file(RawTensor("w", [31, 2], Q4_0), data=bytes(64)),
        "Q4_0 has a first dimension of 31, not a multiple of its block size 32",
    ),
    "misaligned offset": (
        lambda: _tensor_file(RawTensor("w", [4], offset=4), data=bytes(64)),
        "offset 4 is not a multiple of the alignment 32",
    ),
    "offset -1": (
        lambda: _tensor_file(RawTensor("w", [4], offset=U64_MAX & ~31), data=bytes(64)),
        "'w' data runs past the end of the file",
    ),
    "offset past EOF": (
        lambda: _tensor_file(RawTensor("w", [4], offset=64), data=bytes(64)),
        "'w' data runs past the end of the file",
    ),
    "tensor data truncated (Bleeding Llama)": (
        lambda: _tensor_file(RawTensor("blk.0.attn_q.weight", [512, 2]), data=bytes(32)),
        "'blk.0.attn_q.weight' data runs past the end of the file",
    ),
    "overlapping tensors": (
        lambda: _tensor_file(RawTensor("a", [16], offset=0), RawTensor("b", [16], offset=32)),
        "tensors 'a' and 'b' overlap",
    ),
    "same offset": (
        lambda: _tensor_file(RawTensor("a", [8], offset=0), RawTensor("b", [8], offset=0)),
        "overlap",
    ),
    "n_tensors larger than the infos": (lambda: _tensor_file(RawTensor("w", [8]), n_tensors=2), "tensor"),
    "truncated in tensor infos": (
        lambda: _tensor_file(RawTensor("w", [8]))[:50],
        "truncated: data offset of tensor 'w'",
    ),
}


@pytest.mark.parametrize("case", list(BAD_FILES))
def test_bad_file_is_rejected_with_a_clear_message(case: str) -> None:
    make, message = BAD_FILES[case]
    data = make()
    with pytest.raises(GGUFError, match=message) as excinfo:
        read_gguf_bytes(data)
    assert "GGUF" in str(excinfo.value)


def test_bad_file_from_disk(tmp_path: Path) -> None:
    path = tmp_path / "bleeding.gguf"
    path.write_bytes(BAD_FILES["tensor data truncated (Bleeding Llama)"][0]())
    with pytest.raises(GGUFError, match="runs past the end of the file"):
        read_gguf(path)


def test_nested_arrays_at_the_depth_limit_parse() -> None:
    value = read_gguf_bytes(_nested_arrays(4)).metadata["k"]
    assert list(value[0][0][0]) == [1]


def test_truncated_at_every_byte_of_a_small_valid_file() -> None:
    data = small_valid_gguf()
    full = read_gguf_bytes(data)
    assert [t.name for t in full.tensors] == ["token_embd.weight", "output_norm.weight"]
    for length in range(len(data)):
        with pytest.raises(GGUFError):
            read_gguf_bytes(data[:length])


def test_truncated_at_every_byte_of_a_tiny_llama_header(tmp_path: Path) -> None:
    data = write_tiny_llama(tmp_path / "tiny.gguf", file_type="Q4_0").read_bytes()
    header_end = read_gguf_bytes(data).data_offset
    # Every 3rd byte of the header (the small file above covers every byte), then samples of the data.
    for length in [*range(0, header_end + 64, 3), *range(header_end + 64, len(data), 997)]:
        with pytest.raises(GGUFError):
            read_gguf_bytes(data[:length])
