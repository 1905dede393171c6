"""`localrt eval --compare`: several models against one reference in one pass (exact math on fakes), the
table and the plot, and the IQ4 dequantizers of the torch and MLX loaders against gguf-py's."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import numpy as np
import pytest

from localrt.errors import LocalrtError
from localrt.eval import compare
from localrt.eval import evaluate
from tests.test_eval import FakeModel


class CountingModel(FakeModel):
    def __init__(self, table: np.ndarray) -> None:
        super().__init__(table)
        self.calls = 0

    async def score(self, tokens, return_logits: bool = False):  # type: ignore[no-untyped-def]
        self.calls += 1
        return await super().score(tokens, return_logits)


def test_compare_equals_separate_evaluations() -> None:
    rng = np.random.default_rng(3)
    ref_table = (rng.standard_normal((30, 30)) * 2).astype(np.float32)
    tokens = rng.integers(1, 30, 400).tolist()
    others = {
        f"m{i}": FakeModel(ref_table + rng.standard_normal((30, 30)).astype(np.float32) * s)
        for i, s in enumerate((0.1, 0.5))
    }
    ref = CountingModel(ref_table)
    scores = asyncio.run(compare(ref, others, tokens, ctx=64))
    for name, m in others.items():
        alone = asyncio.run(evaluate(m, tokens, ctx=64, reference=FakeModel(ref_table)))
        sc = scores[name]
        assert math.isclose(math.exp(sc.nll / sc.n), alone.perplexity, rel_tol=1e-9)
        assert math.isclose(float(np.concatenate(sc.kl).mean()), alone.kl, rel_tol=1e-6)
        assert math.isclose(sc.agree / sc.n, alone.top1, rel_tol=1e-12)
    n_windows = len(range(0, len(tokens), 63))
    assert ref.calls == n_windows  # the reference is scored once per window, not once per model


def test_more_distorted_model_has_larger_kl() -> None:
    rng = np.random.default_rng(4)
    ref_table = (rng.standard_normal((30, 30)) * 2).astype(np.float32)
    noise = rng.standard_normal((30, 30)).astype(np.float32)
    models = {"near": FakeModel(ref_table + 0.1 * noise), "far": FakeModel(ref_table + noise)}
    scores = asyncio.run(compare(FakeModel(ref_table), models, rng.integers(1, 30, 300).tolist(), ctx=64))
    assert np.concatenate(scores["near"].kl).mean() < np.concatenate(scores["far"].kl).mean()


def test_compare_refuses_another_vocabulary() -> None:
    with pytest.raises(LocalrtError, match="same vocabulary"):
        asyncio.run(
            compare(FakeModel(np.zeros((20, 20))), {"x": FakeModel(np.zeros((30, 30)))}, [1, 2, 3] * 20, 16)
        )


def test_table_and_plot(tmp_path: Path) -> None:
    from localrt.eval import CompareRow
    from localrt.eval import plot_compare
    from localrt.eval import print_compare

    pytest.importorskip("matplotlib")
    rows = [
        CompareRow("ref.gguf", 300_000_000, 16.0, 10.0, 0.0, 0.0, 1.0),
        CompareRow("q4_0.gguf", 80_000_000, 4.5, 11.0, 0.05, 0.4, 0.9),
        CompareRow("q4_0-imatrix.gguf", 80_000_000, 4.5, 10.6, 0.03, 0.3, 0.93),
    ]
    out = tmp_path / "t.txt"
    with out.open("w") as f:
        print_compare(rows, 1234, f)
    lines = out.read_text().splitlines()
    assert lines[0].split() == ["MODEL", "SIZE", "(MB)", "BPW", "PPL", "KL", "MEAN", "KL", "P99", "TOP-1"]
    assert lines[2].split()[:3] == ["q4_0.gguf", "80.0", "4.50"]
    plot_compare(rows, tmp_path / "kl.png")
    assert (tmp_path / "kl.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("qname", ["IQ4_NL", "IQ4_XS"])
def test_iq4_dequantizers_match_gguf_py(qname: str) -> None:
    import gguf
    from gguf import GGMLQuantizationType

    from localrt.converters import quants

    qtype = GGMLQuantizationType[qname]
    x = (np.random.default_rng(0).standard_normal((8, 512)) * 0.05).astype(np.float32)
    q = quants.quantize(x, qtype)
    want = gguf.quants.dequantize(q, qtype)
    torch = pytest.importorskip("torch")
    from localrt.backends.torch.gguf_load import dequantize as torch_dequantize

    got = torch_dequantize(torch.from_numpy(q.reshape(-1).copy()), qname, (512, 8)).numpy()
    assert np.array_equal(got, want)
    pytest.importorskip("mlx.core")
    from localrt.backends.mlx.gguf_load import dequantize as mlx_dequantize

    assert np.array_equal(mlx_dequantize(q.reshape(-1), qname, (512, 8)), want)
