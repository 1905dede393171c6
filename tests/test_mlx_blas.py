"""`LOCALRT_MLX_BLAS`: an optimized BLAS under MLX's fp32 products (backends/mlx/blas.py).

It must be loaded before MLX is, so the route itself is checked in fresh interpreters; the refusals in
this one (where the test session has imported MLX already)."""

from __future__ import annotations

import ctypes.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

mx = pytest.importorskip("mlx.core")

from localrt.backends.mlx import blas  # noqa: E402
from localrt.errors import OptionError  # noqa: E402

OPENBLAS = ctypes.util.find_library("openblas")  # Debian's libopenblas0, which the test machine has
ROOT = Path(__file__).resolve().parent.parent

ROUTE = """
import ctypes, json, sys
import numpy as np
from localrt.backends.mlx import blas
path = blas.install()
import mlx.core as mx
# the symbol MLX's matmul binds to (global scope first) is the loaded library's
bound = ctypes.cast(ctypes.CDLL(None).cblas_sgemm, ctypes.c_void_p).value
theirs = ctypes.cast(ctypes.CDLL(path).cblas_sgemm, ctypes.c_void_p).value
rng = np.random.default_rng(0)
x, w = rng.standard_normal((8, 576), dtype=np.float32), rng.standard_normal((1536, 576), dtype=np.float32)
err = float(np.abs(np.array(mx.array(x) @ mx.array(w).T) - x @ w.T).max())
from localrt.backends.mlx import rows
layout = rows.probe()
# laid out, rows 0..12 of a 13-row product and of a 40-row one equal each row alone
xs, ws = mx.array(rng.standard_normal((40, 576), dtype=np.float32)), mx.array(w)
alone = mx.concatenate([layout.matmul_t(xs[i : i + 1], ws) for i in range(13)])
same = all(mx.array_equal(layout.matmul_t(xs[:n], ws)[:13], alone).item() for n in (13, 40))
print(json.dumps({"path": path, "bound": bound == theirs, "err": err, "layout": layout is not None, "same": same}))
"""

BATCHING = """
import sys
from localrt.backends.mlx import blas, model, rows
blas.install()
rows.LAYOUT = rows.probe()
init = model.Transformer.__init__
def dense_init(self, *args, **kwargs):  # the tests' own models (quantized files) with dense weights, as the backend keeps them
    init(self, *args, **kwargs)
    self.dense_weights()
model.Transformer.__init__ = dense_init
import pytest
sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", *sys.argv[1:]]))
"""

GENERATE = """
import asyncio, json, sys
from localrt.backends import registry
from localrt.backends.base import GenerateRequest, LoadOptions, SamplingParams, TextEvent
from localrt.backends.mlx import blas
model = registry.get("mlx").load(sys.argv[1], LoadOptions(num_ctx=256, num_parallel=2))
from localrt.backends.mlx.gguf_load import QuantizedWeight  # after the load: it imports MLX
ids = model.tokenize("The capital of France is", add_special=True, parse_special=True)
async def text():
    out = ""
    async for e in model.generate(GenerateRequest(ids, SamplingParams(temperature=0.0), num_predict=8)):
        out += e.text if isinstance(e, TextEvent) else ""
    return out
dense = not isinstance(model.model.output.weight, QuantizedWeight)
print(json.dumps({"active": blas.active(), "dense": dense, "text": asyncio.run(text())}))
model.unload()
"""


def python(script: str, *args: str, blas_env: str | None) -> dict[str, object]:
    env = {k: v for k, v in os.environ.items() if k != blas.ENV}
    if blas_env is not None:
        env[blas.ENV] = blas_env
    out = subprocess.run(
        [sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=600, env=env, cwd=ROOT
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(OPENBLAS is None, reason="needs a system OpenBLAS (Debian: libopenblas0)")
def test_openblas_is_the_library_under_mlx_matmul() -> None:
    got = python(ROUTE, blas_env="openblas")
    assert got["bound"] is True
    assert float(got["err"]) < 1e-3  # type: ignore[arg-type]


@pytest.mark.skipif(OPENBLAS is None, reason="needs a system OpenBLAS (Debian: libopenblas0)")
def test_openblas_rows_laid_out_equal_each_row_alone() -> None:
    got = python(ROUTE, blas_env="openblas")
    assert got["layout"] is True  # rows.probe found a layout for this BLAS
    assert got["same"] is True


@pytest.mark.slow
@pytest.mark.skipif(OPENBLAS is None, reason="needs a system OpenBLAS (Debian: libopenblas0)")
def test_batching_and_speculation_stay_exact_on_openblas() -> None:
    """The batching-is-invisible and exact-speculation tests, rerun with dense weights on OpenBLAS
    (6 minutes on the loaded 2-core machine)."""
    env = {**os.environ, blas.ENV: "openblas"}
    tests = ["tests/test_mlx_batching.py", "tests/test_mlx_speculative.py"]
    out = subprocess.run(
        [sys.executable, "-c", BATCHING, *tests],
        capture_output=True,
        text=True,
        timeout=3600,
        env=env,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stdout[-3000:]


@pytest.mark.skipif(OPENBLAS is None, reason="needs a system OpenBLAS (Debian: libopenblas0)")
def test_the_backend_on_openblas_keeps_weights_dense_and_answers_as_by_default(smollm2_gguf: Path) -> None:
    routed = python(GENERATE, str(smollm2_gguf), blas_env="openblas")
    default = python(GENERATE, str(smollm2_gguf), blas_env=None)
    assert routed["active"] is True
    assert routed["dense"] is True
    assert default["dense"] is False
    assert routed["text"] == default["text"]  # dequantized fp32 products, the same greedy answer


def test_a_row_layout_puts_rows_in_the_first_places_of_full_blocks() -> None:
    from localrt.backends.mlx.rows import RowLayout

    layout = RowLayout(12, 6)
    x = mx.arange(1, 14, dtype=mx.float32).reshape(13, 1)  # rows 1..13
    packed = layout.pack(x)[:, 0].tolist()
    assert packed == [*range(1, 7), *[0] * 6, *range(7, 13), *[0] * 6, 13, *[0] * 11]
    assert mx.array_equal(layout.unpack(layout.pack(x), 13), x).item()


def test_an_unknown_library_is_one_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(blas, "_tried", False)
    monkeypatch.setenv(blas.ENV, "no-such-blas-library")
    with pytest.raises(OptionError, match="LOCALRT_MLX_BLAS=no-such-blas-library: no library by that name"):
        blas.install()


@pytest.mark.skipif(OPENBLAS is None, reason="needs a system OpenBLAS (Debian: libopenblas0)")
def test_after_mlx_is_imported_the_route_is_left_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(blas, "_tried", False)
    monkeypatch.setenv(blas.ENV, "openblas")
    assert blas.install() is None  # this session imported MLX already: too late to go under it
