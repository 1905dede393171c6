"""`localrt imatrix` and `--imatrix` quantization against llama.cpp's own tools (llama-imatrix and
llama-quantize, built from the pinned sources by `tests/fixtures_hf.py::llama_cpp_tools`).

Marked `oracle`: part of the default run and CI. The tools are built once (about 20 minutes on 2 cores)
and cached outside the repository; tests/test_imatrix.py checks the same encoders against llama.cpp's
library without them.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np
import pytest

from localrt.converters import imatrix as imx
from localrt.converters import mixes
from localrt.converters.convert import convert
from localrt.converters.requantize import requantize
from tests.fixtures_hf import CORPUS
from tests.fixtures_hf import compare_gguf
from tests.fixtures_hf import llama_cpp_tools
from tests.fixtures_hf import oracle_float
from tests.fixtures_hf import write_tiny_model

pytestmark = pytest.mark.oracle
pytest.importorskip("llama_cpp")
pytest.importorskip("sentencepiece")

CTX = 128
WEIGHTED_TYPES = [t for t in mixes.FILE_TYPES if t not in ("F32", "F16", "BF16", "Q8_0")]


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama (rows of 256/512, 8 layers so n_layer/8 rules show), converted to F16 by
    llama.cpp's converter, and a calibration text; paths relative to this folder (as the tools record them)."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("imatrix-oracle")
    model = write_tiny_model(root / "model", n_layer=8, n_kv=1)
    oracle_float(model, root, "f16")
    rng = np.random.default_rng(0)
    text = " ".join(CORPUS[i] for i in rng.integers(0, len(CORPUS), 300))
    (root / "calib.txt").write_text(text + "\n")
    return root


def tool(name: str, *args: str, cwd: Path) -> None:
    proc = subprocess.run([str(llama_cpp_tools() / name), *args], cwd=cwd, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.fixture(scope="module")
def theirs(work: Path) -> Path:
    tool(
        "llama-imatrix",
        "-m",
        "oracle-f16.gguf",
        "-f",
        "calib.txt",
        "-o",
        "theirs.gguf",
        "-c",
        str(CTX),
        "-t",
        "2",
        cwd=work,
    )
    return work / "theirs.gguf"


@pytest.fixture(scope="module")
def ours(work: Path) -> imx.Imatrix:
    import os

    from localrt.runtime.calibration import compute

    cwd = os.getcwd()
    os.chdir(work)
    try:
        text = Path("calib.txt").read_text()
        return compute(Path("oracle-f16.gguf"), text, "calib.txt", ctx=CTX, threads=2).imatrix
    finally:
        os.chdir(cwd)


def test_imatrix_equals_llama_imatrix(theirs: Path, ours: imx.Imatrix) -> None:
    ref = imx.read(theirs)
    assert sorted(ours.entries) == sorted(ref.entries)
    assert (ours.chunk_count, ours.chunk_size, ours.datasets) == (
        ref.chunk_count,
        ref.chunk_size,
        ref.datasets,
    )
    worst = 0.0
    for name, e in ref.entries.items():
        o = ours.entries[name]
        assert np.array_equal(o.counts, e.counts), name
        rel = np.abs(o.sums - e.sums) / np.maximum(np.abs(e.sums), 1e-30)
        worst = max(worst, float(rel.max()))
    assert worst <= 1e-4, f"largest relative difference {worst:.3g}"


CALIBRATION = Path(__file__).parent / "golden" / "imatrix_calibration.txt"


def test_imatrix_on_a_real_quantized_model_equals_llama_imatrix(
    smollm2_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SmolLM2's Q4_1 file, run by both on this machine: its quantized kernels differ between CPUs, so
    the reference is made here rather than stored."""
    from localrt.runtime.calibration import compute

    monkeypatch.chdir(CALIBRATION.parent)  # the dataset name is recorded as given, as -f records it
    tool(
        "llama-imatrix",
        *("-m", str(smollm2_gguf), "-f", CALIBRATION.name, "-o", str(tmp_path / "theirs.gguf")),
        *("-c", "64", "-t", "2"),
        cwd=CALIBRATION.parent,
    )
    ref = imx.read(tmp_path / "theirs.gguf")
    im = compute(smollm2_gguf, CALIBRATION.read_text(encoding="utf-8"), CALIBRATION.name, ctx=64, threads=2)
    mine = im.imatrix
    assert sorted(mine.entries) == sorted(ref.entries)
    assert [mine.chunk_count, mine.chunk_size] == [ref.chunk_count, ref.chunk_size]
    assert all(np.array_equal(mine.entries[n].counts, e.counts) for n, e in ref.entries.items())
    worst = max(
        float((np.abs(mine.entries[n].sums - e.sums) / np.maximum(np.abs(e.sums), 1e-30)).max())
        for n, e in ref.entries.items()
    )
    assert worst <= 1e-4, f"largest relative difference {worst:.3g}"


def test_imatrix_file_has_llama_imatrix_layout(work: Path, theirs: Path, ours: imx.Imatrix) -> None:
    from gguf import GGUFReader

    mine = imx.write(ours, work / "ours.gguf")
    a, b = GGUFReader(mine), GGUFReader(theirs)
    assert [k for k in a.fields if not k.startswith("GGUF.")] == [
        k for k in b.fields if not k.startswith("GGUF.")
    ]
    assert [(t.name, list(t.shape)) for t in a.tensors] == [(t.name, list(t.shape)) for t in b.tensors]


@pytest.mark.parametrize("file_type", WEIGHTED_TYPES)
def test_quantize_with_their_imatrix_is_byte_identical(work: Path, theirs: Path, file_type: str) -> None:
    tool(
        "llama-quantize",
        "--imatrix",
        "theirs.gguf",
        "oracle-f16.gguf",
        f"q-{file_type}.gguf",
        file_type,
        "2",
        cwd=work,
    )
    mine = requantize(
        work / "oracle-f16.gguf",
        work / f"ours-{file_type}.gguf",
        file_type,
        imatrix=imx.read(theirs),
        imatrix_label="theirs.gguf",
    )
    diffs = compare_gguf(mine, work / f"q-{file_type}.gguf")
    assert not diffs, "\n".join(diffs[:20])


@pytest.mark.parametrize("file_type", ["IQ4_NL", "IQ4_XS"])
def test_iq4_without_imatrix_is_byte_identical(work: Path, file_type: str) -> None:
    tool("llama-quantize", "oracle-f16.gguf", f"plain-{file_type}.gguf", file_type, "2", cwd=work)
    mine = requantize(work / "oracle-f16.gguf", work / f"ours-plain-{file_type}.gguf", file_type)
    assert mine.read_bytes() == (work / f"plain-{file_type}.gguf").read_bytes()


def test_legacy_dat_quantizes_like_llama_quantize(work: Path) -> None:
    tool(
        "llama-imatrix",
        "-m",
        "oracle-f16.gguf",
        "-f",
        "calib.txt",
        "-o",
        "theirs.dat",
        "-c",
        str(CTX),
        "-t",
        "2",
        "--output-format",
        "dat",
        cwd=work,
    )
    tool(
        "llama-quantize", "--imatrix", "theirs.dat", "oracle-f16.gguf", "q-dat.gguf", "Q4_K_M", "2", cwd=work
    )
    mine = requantize(
        work / "oracle-f16.gguf",
        work / "ours-dat.gguf",
        "Q4_K_M",
        imatrix=imx.read(work / "theirs.dat"),
        imatrix_label="theirs.dat",
    )
    assert mine.read_bytes() == (work / "q-dat.gguf").read_bytes()


def test_convert_with_imatrix_is_convert_then_llama_quantize(work: Path, theirs: Path) -> None:
    tool(
        "llama-quantize",
        "--imatrix",
        "theirs.gguf",
        "oracle-f16.gguf",
        "q-conv.gguf",
        "Q4_K_M",
        "2",
        cwd=work,
    )
    mine = convert(
        work / "model",
        work / "ours-conv.gguf",
        "Q4_K_M",
        imatrix=imx.read(theirs),
        imatrix_label="theirs.gguf",
    ).path
    diffs = compare_gguf(mine, work / "q-conv.gguf")
    assert not diffs, "\n".join(diffs[:20])
