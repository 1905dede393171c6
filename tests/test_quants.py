"""The numpy encoders and the per-tensor type rules, byte for byte against llama.cpp itself.

Two oracles, both inside the installed llama-cpp-python:
- `ggml_quantize_chunk` from libggml-base (the C reference quantizer, no importance matrix), per array;
- `llama_model_quantize` on a tiny F32/F16 GGUF, per file type: types, order and bytes of every tensor.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType
from gguf import GGUFReader

from localrt.converters import mixes
from localrt.converters import quants

llama_cpp = pytest.importorskip("llama_cpp")
QT = GGMLQuantizationType


def _ggml() -> ctypes.CDLL:
    lib = ctypes.CDLL(os.path.join(os.path.dirname(llama_cpp.__file__), "lib", "libggml-base.so"))
    lib.ggml_quantize_chunk.restype = ctypes.c_size_t
    lib.ggml_quantize_chunk.argtypes = [
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_int64,
        ctypes.c_int64,
        ctypes.c_int64,
        ctypes.c_void_p,
    ]
    return lib


def c_quantize(x: np.ndarray, qtype: QT) -> np.ndarray:
    """llama.cpp's reference quantizer (what llama-quantize runs without an imatrix)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    rows, n = x.shape
    block, size = GGML_QUANT_SIZES[qtype]
    out = np.zeros((rows, n // block * size), np.uint8)
    _ggml().ggml_quantize_chunk(int(qtype), x.ctypes.data, out.ctypes.data, 0, rows, n, None)
    return out


def distributions(rows: int = 16, n: int = 512, seed: int = 0) -> dict[str, np.ndarray]:
    """Weight-like data plus the cases where exact rounding and tie rules show."""
    rng = np.random.default_rng(seed)
    edge = rng.standard_normal((rows, n)).astype(np.float32)
    edge[0] = 0.0  # all-zero blocks
    edge[1] = -0.0
    edge[2, ::2] = -0.0
    edge[2, 1::2] = 0.0
    edge[3] = 1.5  # constant blocks
    edge[4] = -2.0
    edge[5] = 1e-20  # below GROUP_MAX_EPS
    edge[6, 40:] = 0.0
    edge[7, 7] = 1e4  # one outlier
    signed = (np.round(rng.standard_normal((rows, n)) * 4) / 8).astype(np.float32)  # many exact ties
    sparse = rng.standard_normal((rows, n)) * (rng.random((rows, n)) < 0.05)
    return {
        "normal": (rng.standard_normal((rows, n)) * 0.02).astype(np.float32),
        "heavy": rng.standard_t(2, (rows, n)).astype(np.float32),
        "positive": np.abs(rng.standard_normal((rows, n))).astype(np.float32),
        "negative": -np.abs(rng.standard_normal((rows, n))).astype(np.float32),
        "tiny": (rng.standard_normal((rows, n)) * 1e-9).astype(np.float32),
        "f16_values": (rng.standard_normal((rows, n)) * 0.05).astype(np.float16).astype(np.float32),
        "bf16_values": quants.bf16_to_f32(quants.to_bf16(rng.standard_normal((rows, n)).astype(np.float32))),
        "ties": signed,
        "sparse": sparse.astype(np.float32),
        "edge": edge,
    }


@pytest.mark.parametrize("qtype", list(quants.ENCODERS), ids=lambda t: t.name)
def test_encoder_matches_ggml_reference(qtype: QT) -> None:
    for name, x in distributions().items():
        ours = quants.quantize(x, qtype, threads=1)
        ref = c_quantize(x, qtype)
        bad = np.flatnonzero((ours != ref).any(axis=1))
        assert not len(bad), f"{qtype.name} on {name}: rows {bad[:8].tolist()} differ"


@pytest.mark.parametrize("qtype", [QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1], ids=lambda t: t.name)
def test_legacy_encoders_match_gguf_py(qtype: QT) -> None:
    x = distributions(rows=8, n=256, seed=3)["normal"]
    assert np.array_equal(quants.quantize(x, qtype), gguf.quants.quantize(x, qtype))


@pytest.mark.parametrize("qtype", [QT.Q4_K, QT.Q6_K, QT.Q3_K], ids=lambda t: t.name)
def test_chunks_and_threads_do_not_change_bytes(qtype: QT, monkeypatch: pytest.MonkeyPatch) -> None:
    x = distributions(rows=64, n=768, seed=5)["normal"]
    whole = quants.quantize(x, qtype, threads=1)
    monkeypatch.setattr(quants, "CHUNK_ELEMS", 256 * 3)
    monkeypatch.setattr(quants, "CHUNK_ELEMS_BY_TYPE", {})
    assert np.array_equal(quants.quantize(x, qtype, threads=3), whole)


def test_dequantized_values_are_close() -> None:
    x = distributions(rows=8, n=1024, seed=9)["normal"]
    for qtype, tol in ((QT.Q8_0, 0.01), (QT.Q6_K, 0.03), (QT.Q4_K, 0.12), (QT.Q2_K, 0.5)):
        back = gguf.quants.dequantize(quants.quantize(x, qtype), qtype)
        rel = np.sqrt(np.mean((back - x) ** 2) / np.mean(x * x))
        assert rel < tol, (qtype.name, rel)


def test_row_length_must_fit_the_block() -> None:
    with pytest.raises(quants.QuantError, match="multiple of 256"):
        quants.quantize(np.zeros((2, 320), np.float32), QT.Q4_K)


def test_float_types() -> None:
    x = np.array([[1.0, -2.5, 1e-8, 65519.0, 3.14159265, float("nan")]], np.float32)
    assert quants.quantize(x, QT.F16).dtype == np.float16
    bits = quants.to_bf16(x)
    assert np.array_equal(bits[0, :5], gguf.quants.quantize(x[:, :5], QT.BF16).view(np.uint16)[0])
    assert bits[0, 5] & 0x7FC0 == 0x7FC0  # NaN stays a (quiet) NaN


# ---- file types: our plan + encoders vs llama_model_quantize ----------------------------------------
def write_tiny_gguf(
    path: Path,
    n_embd: int,
    n_ff: int,
    n_layer: int,
    n_head: int,
    n_kv: int,
    n_vocab: int,
    tied: bool,
    dtype: type,
    seed: int = 0,
) -> dict[str, np.ndarray]:
    """A random-weight llama GGUF (F32 or F16 matrices, F32 norms), the input llama-quantize expects."""
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(n_layer)
    w.add_context_length(128)
    w.add_embedding_length(n_embd)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(n_embd // n_head)
    w.add_file_type(0 if dtype == np.float32 else 1)
    w.add_tokenizer_model("llama")
    w.add_token_list([f"t{i}" for i in range(n_vocab)])
    w.add_token_scores([0.0] * n_vocab)
    w.add_token_types([1] * n_vocab)
    hd = n_embd // n_head
    shapes: dict[str, tuple[int, ...]] = {
        "token_embd.weight": (n_vocab, n_embd),
        "output_norm.weight": (n_embd,),
    }
    if not tied:
        shapes["output.weight"] = (n_vocab, n_embd)
    for i in range(n_layer):
        p = f"blk.{i}."
        shapes |= {
            p + "attn_norm.weight": (n_embd,),
            p + "attn_q.weight": (n_embd, n_embd),
            p + "attn_k.weight": (n_kv * hd, n_embd),
            p + "attn_v.weight": (n_kv * hd, n_embd),
            p + "attn_output.weight": (n_embd, n_embd),
            p + "ffn_norm.weight": (n_embd,),
            p + "ffn_gate.weight": (n_ff, n_embd),
            p + "ffn_up.weight": (n_ff, n_embd),
            p + "ffn_down.weight": (n_embd, n_ff),
        }
    data = {}
    for name, shape in shapes.items():
        a = (rng.standard_normal(shape) * 0.02).astype(np.float32)
        a = 1 + a if len(shape) == 1 else a.astype(dtype)
        data[name] = a
        w.add_tensor(name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return data


def llama_quantize(src: Path, dst: Path, file_type: str) -> None:
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = int(mixes.FILE_TYPES[file_type][0])
    params.nthread = 2
    assert llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params)) == 0


MODELS = {
    # rows that are multiples of 256: every k-quant path; GQA 4 (the Q2_K attn_v rule)
    "k256": dict(
        n_embd=256, n_ff=256, n_layer=8, n_head=4, n_kv=1, n_vocab=256, tied=False, dtype=np.float32
    ),
    # 96-wide rows: the 32-block fallbacks; 16 layers (Q3_K_M's n/16 rule); tied embeddings; F16 input
    "fallback96": dict(
        n_embd=96, n_ff=160, n_layer=16, n_head=3, n_kv=3, n_vocab=256, tied=True, dtype=np.float16
    ),
}


@pytest.fixture(scope="module", params=list(MODELS))
def tiny_model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    cfg = MODELS[request.param]
    path = tmp_path_factory.mktemp(request.param) / "in.gguf"
    data = write_tiny_gguf(path, **cfg)
    shape = mixes.ModelShape("llama", cfg["n_layer"], cfg["n_head"], cfg["n_kv"])
    return path, data, shape


@pytest.mark.parametrize("file_type", list(mixes.FILE_TYPES))
def test_file_type_matches_llama_quantize(tiny_model, file_type: str, tmp_path: Path) -> None:
    src, data, shape = tiny_model
    dst = tmp_path / "out.gguf"
    llama_quantize(src, dst, file_type)
    reader = GGUFReader(dst)
    specs = [mixes.TensorSpec(name, tuple(reversed(a.shape))) for name, a in data.items()]
    plan = mixes.plan(specs, file_type, shape)
    assert [t.name for t in reader.tensors] == mixes.tensor_order(plan)
    for t in reader.tensors:
        want = plan[t.name]
        assert t.tensor_type == want, f"{t.name}: llama.cpp chose {t.tensor_type.name}, we chose {want.name}"
        ours = quants.quantize(data[t.name].astype(np.float32), want)
        assert np.asarray(ours).tobytes() == np.asarray(t.data).tobytes(), (
            f"{t.name} ({want.name}) bytes differ"
        )


def test_use_more_bits_layers() -> None:
    # llama.cpp's sets for common depths (reference notes, section 3.2)
    assert [i for i in range(16) if mixes._use_more_bits(i, 16)] == [0, 1, 4, 7, 10, 13, 14, 15]
    assert [i for i in range(22) if mixes._use_more_bits(i, 22)] == [0, 1, 4, 7, 10, 13, 16, 19, 20, 21]
    assert [i for i in range(32) if mixes._use_more_bits(i, 32)] == [
        0,
        1,
        2,
        3,
        6,
        9,
        12,
        15,
        18,
        21,
        24,
        27,
        28,
        29,
        30,
        31,
    ]


def test_parse_file_type() -> None:
    assert mixes.parse_file_type("q4_k_m") == "Q4_K_M"
    assert mixes.parse_file_type("Q4_K") == "Q4_K_M"
    with pytest.raises(mixes.MixError, match="choose one of"):
        mixes.parse_file_type("Q7_X")


@pytest.mark.parametrize("file_type", ["F16", "Q8_0", "Q4_0", "Q2_K", "Q3_K_M", "Q4_K_M", "Q5_K_S", "Q6_K"])
def test_requantize_writes_llama_quantize_file(tiny_model, file_type: str, tmp_path: Path) -> None:
    from localrt.converters.requantize import requantize

    src, _, _ = tiny_model
    theirs = tmp_path / "llama.gguf"
    llama_quantize(src, theirs, file_type)
    ours = requantize(src, tmp_path / "ours.gguf", file_type)
    assert ours.read_bytes() == theirs.read_bytes()


def test_requantize_refuses_quantized_input(tmp_path: Path) -> None:
    from localrt.converters.hf import ConvertError
    from localrt.converters.requantize import requantize

    src = tmp_path / "in.gguf"
    write_tiny_gguf(src, **MODELS["k256"])
    q = tmp_path / "q.gguf"
    llama_quantize(src, q, "Q4_0")
    with pytest.raises(ConvertError, match="already Q4_0"):
        requantize(q, tmp_path / "out.gguf", "Q4_K_M")
    assert not (tmp_path / "out.gguf").exists()
