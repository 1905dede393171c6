"""Importance matrices and weighted quantization, against llama.cpp itself.

Oracles, all from llama.cpp:
- `ggml_quantize_chunk` (libggml-base in the installed llama-cpp-python) with an imatrix pointer: the
  weighted encoders and IQ4_NL/IQ4_XS, array for array;
- `llama_model_quantize` with `params.imatrix` and the KV overrides llama-quantize adds: whole files;
- the llama-imatrix and llama-quantize binaries (built by `tests/fixtures_hf.py::llama_cpp_tools`):
  `@pytest.mark.oracle` (tests/test_imatrix_oracle.py), on a tiny random Llama converted by llama.cpp's own converter.
"""

from __future__ import annotations

import ctypes
import struct
from pathlib import Path

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType
from gguf import GGUFReader

from localrt.converters import imatrix as imx
from localrt.converters import mixes
from localrt.converters import quants
from localrt.converters.requantize import requantize
from tests.test_quants import MODELS
from tests.test_quants import _ggml
from tests.test_quants import distributions
from tests.test_quants import write_tiny_gguf

llama_cpp = pytest.importorskip("llama_cpp")
QT = GGMLQuantizationType
WEIGHTED = [
    QT.Q4_0,
    QT.Q4_1,
    QT.Q5_0,
    QT.Q5_1,
    QT.Q2_K,
    QT.Q3_K,
    QT.Q4_K,
    QT.Q5_K,
    QT.Q6_K,
    QT.IQ4_NL,
    QT.IQ4_XS,
]


def c_quantize(x: np.ndarray, qtype: QT, qw: np.ndarray | None) -> np.ndarray:
    """ggml_quantize_chunk(type, x, ..., imatrix): what llama-quantize runs per chunk of rows."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    rows, n = x.shape
    block, size = GGML_QUANT_SIZES[qtype]
    out = np.zeros((rows, n // block * size), np.uint8)
    w = None if qw is None else np.ascontiguousarray(qw, dtype=np.float32)
    _ggml().ggml_quantize_chunk(
        int(qtype), x.ctypes.data, out.ctypes.data, 0, rows, n, None if w is None else w.ctypes.data
    )
    return out


def importance(n: int, seed: int) -> dict[str, np.ndarray]:
    """Imatrix-like column weights: skewed positive, flat, and with exact zeros (never-active columns)."""
    rng = np.random.default_rng(seed)
    skewed = (rng.lognormal(0, 2, n) * 1e-3).astype(np.float32)
    zeros = skewed.copy()
    zeros[rng.random(n) < 0.2] = 0
    return {"skewed": skewed, "ones": np.ones(n, np.float32), "zeros": zeros}


@pytest.mark.parametrize("qtype", WEIGHTED, ids=lambda t: t.name)
def test_weighted_encoder_matches_ggml(qtype: QT) -> None:
    for name, x in distributions().items():
        for wname, qw in importance(x.shape[1], 7).items():
            ours = quants.quantize(x, qtype, threads=1, imatrix=qw)
            bad = np.flatnonzero((ours != c_quantize(x, qtype, qw)).any(axis=1))
            assert not len(bad), (
                f"{qtype.name} on {name} with {wname} weights: rows {bad[:8].tolist()} differ"
            )


@pytest.mark.parametrize("qtype", [QT.IQ4_NL, QT.IQ4_XS], ids=lambda t: t.name)
def test_iq4_without_imatrix_matches_ggml(qtype: QT) -> None:
    for name, x in distributions().items():
        bad = np.flatnonzero((quants.quantize(x, qtype, threads=1) != c_quantize(x, qtype, None)).any(axis=1))
        assert not len(bad), f"{qtype.name} on {name}: rows {bad[:8].tolist()} differ"


@pytest.mark.parametrize("qtype", [QT.IQ4_NL, QT.IQ4_XS], ids=lambda t: t.name)
def test_iq4_dequantizes_close(qtype: QT) -> None:
    import gguf

    x = distributions(rows=8, n=1024, seed=9)["normal"]
    back = gguf.quants.dequantize(quants.quantize(x, qtype), qtype)
    rel = np.sqrt(np.mean((back - x) ** 2) / np.mean(x * x))
    assert rel < 0.12, rel


def test_expert_slices_weight_their_own_rows() -> None:
    # a 3-D tensor (2 experts x 4 rows): rows of expert e use slice e, as llama-quantize passes them
    x = distributions(rows=8, n=256, seed=2)["normal"].reshape(2, 4, 256)
    qw = np.stack([importance(256, 1)["skewed"], importance(256, 2)["skewed"]])
    ours = quants.quantize(x, QT.Q4_K, threads=1, imatrix=qw)
    for e in range(2):
        assert np.array_equal(ours[e], c_quantize(x[e], QT.Q4_K, qw[e]))


def test_weighting_lowers_the_weighted_error() -> None:
    # the point of the method: error in the columns that matter shrinks
    import gguf

    x = distributions(rows=32, n=512, seed=4)["normal"]
    qw = importance(512, 3)["skewed"]
    for qtype in (QT.Q4_0, QT.Q4_K, QT.IQ4_XS):
        plain = gguf.quants.dequantize(quants.quantize(x, qtype), qtype)
        weighted = gguf.quants.dequantize(quants.quantize(x, qtype, imatrix=qw), qtype)
        assert ((weighted - x) ** 2 * qw).sum() < ((plain - x) ** 2 * qw).sum(), qtype.name


# ---- file formats --------------------------------------------------------------------------------
def sample_imatrix(shapes: dict[str, tuple[int, ...]], seed: int = 0, chunk: int = 512) -> imx.Imatrix:
    """Sums and counts shaped like llama-imatrix's for the blk.* matrices of a model."""
    rng = np.random.default_rng(seed)
    im = imx.Imatrix(datasets=["calibration.txt"], chunk_count=3, chunk_size=chunk)
    for name, ne in shapes.items():
        if name.startswith("blk.") and len(ne) >= 2 and not name.endswith("_norm.weight"):
            n_mat = ne[2] if len(ne) > 2 else 1
            counts = np.full(n_mat, 3 * chunk, np.int64)
            sums = (rng.lognormal(0, 1.5, (n_mat, ne[0])) * counts[:, None]).astype(np.float32)
            im.entries[name] = imx.Entry(sums, counts)
    return im


def test_gguf_roundtrip(tmp_path: Path) -> None:
    im = sample_imatrix({"blk.0.attn_q.weight": (256, 256), "blk.0.ffn_down_exps.weight": (512, 256, 4)})
    im.entries["blk.0.ffn_down_exps.weight"].counts[2] = 0  # an expert never routed to
    back = imx.read(imx.write(im, tmp_path / "m.gguf"))
    assert back.datasets == im.datasets
    assert (back.chunk_count, back.chunk_size, back.is_legacy) == (3, 512, False)
    for name, e in im.entries.items():
        assert np.array_equal(back.entries[name].sums, e.sums)
        assert np.array_equal(back.entries[name].counts, e.counts)


def test_gguf_layout_is_llama_imatrix(tmp_path: Path) -> None:
    im = sample_imatrix({"blk.1.attn_k.weight": (256, 64), "blk.0.ffn_up_exps.weight": (256, 512, 2)})
    r = GGUFReader(imx.write(im, tmp_path / "m.gguf"))
    keys = [k for k in r.fields if not k.startswith("GGUF.")]
    assert keys == ["general.type", imx.KEY_DATASETS, imx.KEY_CHUNK_COUNT, imx.KEY_CHUNK_SIZE]
    assert [t.name for t in r.tensors] == [
        "blk.0.ffn_up_exps.weight.in_sum2",
        "blk.0.ffn_up_exps.weight.counts",
        "blk.1.attn_k.weight.in_sum2",
        "blk.1.attn_k.weight.counts",
    ]
    shapes = {t.name: [int(d) for d in t.shape] for t in r.tensors}
    assert shapes["blk.0.ffn_up_exps.weight.counts"] == [1, 2]
    assert shapes["blk.1.attn_k.weight.in_sum2"] == [256]  # ggml_n_dims drops the trailing 1


def test_legacy_roundtrip_keeps_what_quantize_uses(tmp_path: Path) -> None:
    im = sample_imatrix({"blk.0.attn_q.weight": (256, 256)}, chunk=128)
    back = imx.read(imx.write(im, tmp_path / "m.dat"))
    assert back.is_legacy
    assert back.datasets == ["calibration.txt"]
    a, b = im.weights()["blk.0.attn_q.weight"], back.weights()["blk.0.attn_q.weight"]
    np.testing.assert_allclose(b, a, rtol=1e-6)


def test_legacy_layout(tmp_path: Path) -> None:
    im = imx.Imatrix(datasets=["d.txt"], chunk_count=2, chunk_size=4)
    im.entries["blk.0.x"] = imx.Entry(np.array([[8.0, 16.0]], np.float32), np.array([8]))
    raw = imx.write(im, tmp_path / "m.dat").read_bytes()
    # 1 entry; name; ncall = ceil(8/4) = 2; 2 values (sum/count)*ncall; trailer: 2 chunks, "d.txt"
    want = struct.pack("<ii", 1, 7) + b"blk.0.x" + struct.pack("<ii2f", 2, 2, 2.0, 4.0)
    assert raw == want + struct.pack("<ii", 2, 5) + b"d.txt"


def test_weights_are_means_and_unreached_experts_one() -> None:
    im = imx.Imatrix(chunk_size=1)
    im.entries["e"] = imx.Entry(np.array([[4.0, 8.0], [3.0, 3.0]], np.float32), np.array([4, 0]))
    assert im.weights()["e"].tolist() == [1.0, 2.0, 1.0, 1.0]


@pytest.mark.parametrize(
    "content, reason",
    [
        (b"", "not an importance matrix"),
        (b"hello, this is a text file\n", "not an importance matrix"),
        (struct.pack("<ii", 1, 5) + b"blk.0" + struct.pack("<ii", 1, 64) + b"\0" * 20, "truncated"),
    ],
    ids=["empty", "text", "truncated-dat"],
)
def test_bad_files_are_refused(tmp_path: Path, content: bytes, reason: str) -> None:
    p = tmp_path / "bad.imatrix"
    p.write_bytes(content)
    with pytest.raises(imx.ImatrixError, match=reason):
        imx.read(p)


def test_truncated_gguf_is_refused(tmp_path: Path) -> None:
    good = imx.write(sample_imatrix({"blk.0.attn_q.weight": (256, 256)}), tmp_path / "m.gguf").read_bytes()
    p = tmp_path / "cut.gguf"
    p.write_bytes(good[: len(good) // 2])
    with pytest.raises(imx.ImatrixError, match="truncated"):
        imx.read(p)


def test_model_gguf_is_not_an_imatrix(tmp_path: Path) -> None:
    src = tmp_path / "model.gguf"
    write_tiny_gguf(src, **MODELS["k256"])
    with pytest.raises(imx.ImatrixError, match="not an importance matrix"):
        imx.read(src)


# ---- whole files: requantize --imatrix vs llama_model_quantize -------------------------------------
def llama_quantize_imatrix(src: Path, dst: Path, file_type: str, im: imx.Imatrix, label: str) -> None:
    """llama_model_quantize as tools/quantize/quantize.cpp drives it with `--imatrix label`."""
    weights = {
        n: (e.sums / np.where(e.counts > 0, e.counts, 1)[:, None].astype(np.float32))
        for n, e in im.entries.items()
    }
    for n, e in im.entries.items():
        weights[n][e.counts == 0] = 1.0
    keep = [np.ascontiguousarray(w, dtype=np.float32).reshape(-1) for w in weights.values()]
    arr = (llama_cpp.llama_model_imatrix_data * (len(keep) + 1))()
    for i, (name, w) in enumerate(zip(weights, keep)):
        arr[i].name = name.encode()
        arr[i].data = w.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
        arr[i].size = w.size
    kvs = [(imx.KV_FILE, label)]
    if im.datasets:
        kvs.append((imx.KV_DATASET, im.datasets[0]))
    kvs += [(imx.KV_N_ENTRIES, len(im.entries)), (imx.KV_N_CHUNKS, im.chunk_count)]
    over = (llama_cpp.llama_model_kv_override * (len(kvs) + 1))()
    for i, (key, value) in enumerate(kvs):
        over[i].key = key.encode()
        if isinstance(value, str):
            over[i].tag = llama_cpp.LLAMA_KV_OVERRIDE_TYPE_STR
            over[i].value.val_str = value.encode()[:127]
        else:
            over[i].tag = llama_cpp.LLAMA_KV_OVERRIDE_TYPE_INT
            over[i].value.val_i64 = value
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = int(mixes.FILE_TYPES[file_type][0])
    params.nthread = 2
    params.imatrix = arr
    params.kv_overrides = over
    assert llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params)) == 0


@pytest.fixture(scope="module", params=list(MODELS))
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp(request.param) / "in.gguf"
    data = write_tiny_gguf(path, **MODELS[request.param])
    return path, sample_imatrix({n: tuple(reversed(a.shape)) for n, a in data.items()})


WEIGHTED_FILE_TYPES = [
    "Q4_0",
    "Q4_1",
    "Q5_0",
    "Q5_1",
    "Q2_K",
    "Q3_K_M",
    "Q4_K_M",
    "Q5_K_S",
    "Q6_K",
    "IQ4_NL",
    "IQ4_XS",
]


@pytest.mark.parametrize("file_type", WEIGHTED_FILE_TYPES)
def test_requantize_with_imatrix_matches_llama(tiny, file_type: str, tmp_path: Path) -> None:
    src, im = tiny
    theirs = tmp_path / "llama.gguf"
    llama_quantize_imatrix(src, theirs, file_type, im, "calib/imatrix.gguf")
    ours = requantize(src, tmp_path / "ours.gguf", file_type, imatrix=im, imatrix_label="calib/imatrix.gguf")
    assert ours.read_bytes() == theirs.read_bytes()


def test_imatrix_changes_the_mix_and_the_bytes(tiny, tmp_path: Path) -> None:
    src, im = tiny
    plain = GGUFReader(requantize(src, tmp_path / "plain.gguf", "Q4_0"))
    weighted = GGUFReader(requantize(src, tmp_path / "w.gguf", "Q4_0", imatrix=im, imatrix_label="x"))
    types = {t.name: t.tensor_type for t in weighted.tensors}
    assert types["blk.0.ffn_down.weight"] == QT.Q4_1  # llama.cpp's guard for the first n_layer/8 layers
    a = {t.name: bytes(t.data) for t in plain.tensors}
    assert (
        bytes(next(t for t in weighted.tensors if t.name == "blk.0.attn_q.weight").data)
        != a["blk.0.attn_q.weight"]
    )


def test_imatrix_from_another_model_is_refused(tmp_path: Path) -> None:
    src = tmp_path / "in.gguf"
    write_tiny_gguf(src, **MODELS["k256"])
    wrong_size = sample_imatrix({"blk.0.attn_q.weight": (512, 256)})
    with pytest.raises(imx.ImatrixError, match="needs 256"):
        requantize(src, tmp_path / "o.gguf", "Q4_K_M", imatrix=wrong_size)
    other_names = sample_imatrix({"blk.0.mixer.in_proj.weight": (256, 256)})
    with pytest.raises(imx.ImatrixError, match="none of the 1 entries"):
        requantize(src, tmp_path / "o.gguf", "Q4_K_M", imatrix=other_names)
    assert not list(tmp_path.glob("o.gguf*"))


def test_imatrix_with_float_type_is_refused(tmp_path: Path) -> None:
    src = tmp_path / "in.gguf"
    write_tiny_gguf(src, **MODELS["k256"])
    with pytest.raises(imx.ImatrixError, match="F16 is a float type"):
        requantize(
            src, tmp_path / "o.gguf", "F16", imatrix=sample_imatrix({"blk.0.attn_q.weight": (256, 256)})
        )
    assert not (tmp_path / "o.gguf").exists()


# ---- computing an imatrix (llama-imatrix itself is the oracle in tests/test_imatrix_oracle.py) ---------
GOLDEN = Path(__file__).parent / "golden"


def test_imatrix_shared_inputs_have_equal_sums(smollm2_gguf: Path) -> None:
    """attn_q/k/v read the same normed hidden state, as do ffn_gate/up: their sums must be equal."""
    from localrt.runtime.calibration import compute

    text = (GOLDEN / "imatrix_calibration.txt").read_text(encoding="utf-8")
    im = compute(smollm2_gguf, text, "calib", ctx=64, chunks=2, threads=2).imatrix
    for layer in (0, 29):
        q = im.entries[f"blk.{layer}.attn_q.weight"].sums
        assert np.array_equal(im.entries[f"blk.{layer}.attn_k.weight"].sums, q)
        assert np.array_equal(im.entries[f"blk.{layer}.attn_v.weight"].sums, q)
        up = im.entries[f"blk.{layer}.ffn_up.weight"].sums
        assert np.array_equal(im.entries[f"blk.{layer}.ffn_gate.weight"].sums, up)
    assert im.entries["blk.0.attn_q.weight"].counts.tolist() == [128]  # 2 chunks of 64 tokens
    assert im.chunk_count == 2


def test_text_too_short_is_refused(smollm2_gguf: Path) -> None:
    from localrt.errors import LocalrtError
    from localrt.runtime.calibration import compute

    with pytest.raises(LocalrtError, match="needs at least 1024"):
        compute(smollm2_gguf, "Too short.", "x", ctx=512)


# ---- the CLI: bad input is one line on stderr and nothing written ----------------------------------
def run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, list[str]]:
    from localrt.cli import main

    rc = main(argv)
    return rc, capsys.readouterr().err.strip().splitlines()


@pytest.fixture
def k256(tmp_path: Path) -> tuple[Path, Path]:
    src = tmp_path / "in.gguf"
    data = write_tiny_gguf(src, **MODELS["k256"])
    im = sample_imatrix({n: tuple(reversed(a.shape)) for n, a in data.items()})
    return src, imx.write(im, tmp_path / "imatrix.gguf")


def test_cli_create_with_imatrix(k256, models_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from localrt.store.store import Store

    src, im = k256
    rc, _ = run_cli(
        ["create", "w:q4", "--from", str(src), "--quantize", "Q4_K_M", "--imatrix", str(im)], capsys
    )
    assert rc == 0
    path = Store(models_dir).resolve("w:q4").model_path
    fields = GGUFReader(path).fields
    assert fields[imx.KV_FILE].contents() == str(im)
    assert fields[imx.KV_N_ENTRIES].contents() == 56  # 8 layers x 7 matrices


@pytest.mark.parametrize(
    "extra, reason",
    [
        (["--quantize", "F16"], "F16 is a float type"),
        ([], "--imatrix needs --quantize"),
    ],
    ids=["float-type", "no-quantize"],
)
def test_cli_create_imatrix_misuse(k256, models_dir: Path, capsys, extra: list[str], reason: str) -> None:
    src, im = k256
    rc, err = run_cli(["create", "w:bad", "--from", str(src), "--imatrix", str(im), *extra], capsys)
    assert rc == 1
    assert len(err) == 1
    assert reason in err[0]
    assert not list(models_dir.rglob("*w*bad*"))


@pytest.mark.parametrize("kind", ["text", "truncated", "model", "other-model"])
def test_cli_create_refuses_bad_imatrix(k256, tmp_path: Path, models_dir: Path, capsys, kind: str) -> None:
    src, good = k256
    bad = tmp_path / f"bad-{kind}.gguf"
    if kind == "text":
        bad.write_text("not an imatrix at all\n")
    elif kind == "truncated":
        bad.write_bytes(good.read_bytes()[:300])
    elif kind == "model":
        bad.write_bytes(src.read_bytes())
    else:
        imx.write(sample_imatrix({"blk.0.attn_q.weight": (1024, 1024)}), bad)
    rc, err = run_cli(
        ["create", "w:bad", "--from", str(src), "--quantize", "Q4_0", "--imatrix", str(bad)], capsys
    )
    assert rc == 1
    assert len(err) == 1
    assert err[0].startswith("Error: ")
    assert "Traceback" not in err[0]
    assert not list(models_dir.rglob("*w*bad*"))
    assert not list(models_dir.rglob(".quantize-*"))


def test_cli_imatrix_refuses_short_text(smollm2_gguf: Path, tmp_path: Path, capsys) -> None:
    text = tmp_path / "t.txt"
    text.write_text("A few words only.")
    rc, err = run_cli(
        ["imatrix", str(smollm2_gguf), "--text", str(text), "-o", str(tmp_path / "o.gguf")], capsys
    )
    assert rc == 1
    assert err[-1].startswith("Error: the text tokenizes to")
    assert not (tmp_path / "o.gguf").exists()


def test_cli_imatrix_writes_file_and_perplexity(smollm2_gguf: Path, tmp_path: Path, capsys) -> None:
    from localrt.cli import main

    out = tmp_path / "im.gguf"
    text = GOLDEN / "imatrix_calibration.txt"
    rc = main(
        ["imatrix", str(smollm2_gguf), "--text", str(text), "-o", str(out), "--ctx", "64", "--chunks", "2"]
    )
    captured = capsys.readouterr()
    assert rc == 0
    assert captured.out.startswith("Final estimate: PPL = ")
    assert "tokens/s" in captured.err
    assert len(imx.read(out).entries) == 210


def test_api_create_with_an_uploaded_imatrix_blob(k256, models_dir: Path) -> None:
    """/api/create's `imatrix` field: the digest of an uploaded blob weights the quantization."""
    from localrt.store.modelfile import create_from_request
    from localrt.store.names import parse_name
    from localrt.store.store import Store

    src, im_path = k256
    store = Store(models_dir)
    model_digest, _ = store.add_blob_file(src)
    im_digest, _ = store.add_blob_file(im_path)
    fields = {"files": {"in.gguf": model_digest}, "quantize": "Q4_K_M", "imatrix": im_digest}
    create_from_request(parse_name("api:w"), fields, store=store, progress=lambda _: None)
    ours = GGUFReader(store.resolve("api:w").model_path)
    theirs = GGUFReader(
        requantize(src, models_dir / "ref.gguf", "Q4_K_M", imatrix=imx.read(im_path), imatrix_label=im_digest)
    )
    assert [bytes(t.data) for t in ours.tensors] == [bytes(t.data) for t in theirs.tensors]
    assert ours.fields[imx.KV_FILE].contents() == im_digest
    from localrt.errors import LocalrtError

    with pytest.raises(LocalrtError, match="not found"):
        create_from_request(
            parse_name("api:x"), {**fields, "imatrix": "sha256:" + "0" * 64}, store=store, progress=print
        )


def test_convert_with_imatrix_equals_f16_then_weighted_requantize(tmp_path: Path) -> None:
    """convert --imatrix = convert to the 16-bit intermediate, then requantize --imatrix (each of which
    is byte-identical to llama.cpp's converter and llama-quantize)."""
    pytest.importorskip("sentencepiece")
    from localrt.converters.convert import convert
    from tests.fixtures_hf import write_tiny_model

    model = write_tiny_model(tmp_path / "m", n_layer=2, n_kv=1)
    f16 = convert(model, tmp_path / "f16.gguf", "F16").path
    shapes = {t.name: tuple(int(d) for d in t.shape) for t in GGUFReader(f16).tensors}
    im = sample_imatrix(shapes)
    for ft in ("Q4_0", "IQ4_XS"):
        direct = convert(model, tmp_path / f"d-{ft}.gguf", ft, imatrix=im, imatrix_label="im.gguf").path
        staged = requantize(f16, tmp_path / f"s-{ft}.gguf", ft, imatrix=im, imatrix_label="im.gguf")
        assert direct.read_bytes() == staged.read_bytes(), ft


def test_cli_create_with_imatrix_through_a_running_server(smollm2_gguf: Path, tmp_path: Path) -> None:
    """With `localrt serve` answering, create uploads the GGUF and the imatrix as blobs and the server
    quantizes with it (the server records the blob's digest as the imatrix file)."""
    from tests.servers.serve import LocalrtServer
    from tests.test_cli_client import localrt

    src = tmp_path / "in.gguf"
    data = write_tiny_gguf(src, **MODELS["k256"])
    im = imx.write(
        sample_imatrix({n: tuple(reversed(a.shape)) for n, a in data.items()}), tmp_path / "im.gguf"
    )
    root = tmp_path / "served"
    served = LocalrtServer(root, tmp_path / "serve.log")
    try:
        cli_store = tmp_path / "cli-models"
        made = localrt(
            served, cli_store, "create", "w:srv", "--from", str(src), "-q", "Q4_K_M", "--imatrix", str(im)
        )
        assert made.returncode == 0, made.stderr
        path = stored_model_path(root, "w:srv")
        assert GGUFReader(path).fields[imx.KV_FILE].contents().startswith("sha256:")
        local = requantize(src, tmp_path / "local.gguf", "Q4_K_M", imatrix=imx.read(im), imatrix_label="x")
        assert [bytes(t.data) for t in GGUFReader(path).tensors] == [
            bytes(t.data) for t in GGUFReader(local).tensors
        ]
        assert not cli_store.exists()
    finally:
        served.stop()


def stored_model_path(root: Path, name: str) -> Path:
    from localrt.store.store import Store

    return Store(root).resolve(name).model_path
