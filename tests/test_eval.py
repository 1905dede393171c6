"""`localrt eval`: perplexity, KL divergence and top-1 agreement, on fakes (exact math) and on the real
SmolLM2 through the llama.cpp backend."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest

from localrt.backends.base import ScoreResult
from localrt.backends.base import log_softmax
from localrt.errors import LocalrtError
from localrt.eval import eval_command
from localrt.eval import evaluate
from localrt.eval import windows

TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg developed "
    "a system of movable metal type in the German city of Mainz. Before his invention, books in Europe were "
    "copied by hand, and a single volume could take months to complete. Within a few decades, presses had "
    "spread to more than two hundred cities across the continent, and millions of books were in circulation."
)


class FakeModel:
    """A 'model' whose logits for a position are a fixed function of the previous token."""

    def __init__(self, table: np.ndarray, bos: int | None = 0) -> None:
        self.table = table  # (n_vocab, n_vocab): logits after token t
        self.n_vocab = table.shape[0]
        self.bos_token_id = bos
        self.add_bos = bos is not None

    async def score(self, tokens: Sequence[int], return_logits: bool = False) -> ScoreResult:
        logits = self.table[list(tokens[:-1])].astype(np.float32)
        lp = log_softmax(logits)[np.arange(len(tokens) - 1), list(tokens[1:])]
        return ScoreResult(lp, logits if return_logits else None)


def test_uniform_model_has_perplexity_vocab_size() -> None:
    model = FakeModel(np.zeros((50, 50)))
    res = asyncio.run(evaluate(model, list(range(1, 50)) * 3, ctx=32))
    assert math.isclose(res.perplexity, 50.0, rel_tol=1e-9)
    assert res.kl is None
    assert res.top1 is None


def test_identical_reference_gives_zero_kl_and_full_agreement() -> None:
    rng = np.random.default_rng(0)
    model = FakeModel(rng.standard_normal((40, 40)) * 3)
    res = asyncio.run(evaluate(model, rng.integers(1, 40, 300).tolist(), ctx=64, reference=model))
    assert res.kl == pytest.approx(0.0, abs=1e-12)
    assert res.top1 == 1.0


def test_kl_and_top1_match_a_direct_computation() -> None:
    rng = np.random.default_rng(1)
    ref_table = (rng.standard_normal((30, 30)) * 2).astype(np.float32)
    noisy = (ref_table + rng.standard_normal((30, 30)) * 0.5).astype(np.float32)
    tokens = rng.integers(1, 30, 200).tolist()
    res = asyncio.run(evaluate(FakeModel(noisy), tokens, ctx=40, reference=FakeModel(ref_table)))
    # recompute over exactly the scored positions
    kls, agree = [], []
    for w in windows(tokens, 40, 0):
        prev = w[len(w) // 2 : -1]
        p, q = log_softmax(ref_table[prev]), log_softmax(noisy[prev])
        kls += list((np.exp(p) * (p - q)).sum(-1))
        agree += list(ref_table[prev].argmax(-1) == noisy[prev].argmax(-1))
    assert res.tokens == len(kls)
    assert res.kl == pytest.approx(float(np.mean(kls)), rel=1e-9)
    assert res.top1 == pytest.approx(float(np.mean(agree)))


def test_windows_start_with_bos_and_cover_the_text() -> None:
    tokens = list(range(1, 101))
    ws = windows(tokens, 32, 0)
    assert all(w[0] == 0 and len(w) <= 32 for w in ws)
    assert [t for w in ws for t in w[1:]] == tokens
    assert [t for w in windows(tokens, 32, None) for t in w] == tokens


def test_vocabularies_must_match() -> None:
    with pytest.raises(LocalrtError, match="same vocabulary"):
        asyncio.run(
            evaluate(FakeModel(np.zeros((10, 10))), [1, 2, 3, 4, 5], 8, FakeModel(np.zeros((12, 12))))
        )


# ---- the real thing: SmolLM2 through the llama.cpp backend -------------------------------------------
def test_eval_command_on_smollm2(
    smollm2_gguf: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("llama_cpp")
    text = tmp_path / "text.txt"
    text.write_text(TEXT)
    args = argparse.Namespace(
        model=str(smollm2_gguf),
        text=str(text),
        reference=str(smollm2_gguf),
        backend="llama.cpp",
        ctx=64,
        json=True,
    )
    assert eval_command(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) == {"perplexity", "tokens", "kl", "top1"}
    assert 1.0 < out["perplexity"] < 100.0, out  # English prose for a small instruct model
    assert out["tokens"] > 20
    assert out["kl"] == pytest.approx(0.0, abs=1e-6)
    assert out["top1"] == 1.0
    args.json, args.reference = False, None
    assert eval_command(args) == 0
    assert "perplexity:" in capsys.readouterr().out


def test_reference_on_another_backend(
    smollm2_gguf: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--reference-backend: the torch engine measured against llama.cpp on the same file. Same weights,
    other kernels: KL small but not zero (zero would mean both sides ran on one backend)."""
    pytest.importorskip("llama_cpp")
    pytest.importorskip("torch")
    text = tmp_path / "text.txt"
    text.write_text(TEXT)
    args = argparse.Namespace(
        model=str(smollm2_gguf),
        text=str(text),
        reference=str(smollm2_gguf),
        backend="torch",
        reference_backend="llama.cpp",
        ctx=64,
        json=True,
    )
    assert eval_command(args) == 0
    across = json.loads(capsys.readouterr().out)
    assert 1e-7 < across["kl"] < 0.05, across
    assert across["top1"] >= 0.85, across
    args.reference_backend = None  # the reference on the model's own backend: identical logits
    assert eval_command(args) == 0
    same = json.loads(capsys.readouterr().out)
    assert same["kl"] == pytest.approx(0.0, abs=1e-7)
    assert same["top1"] == 1.0
    assert same["perplexity"] == pytest.approx(across["perplexity"])


def test_missing_text_file(smollm2_gguf: Path, tmp_path: Path) -> None:
    args = argparse.Namespace(
        model=str(smollm2_gguf),
        text=str(tmp_path / "nope.txt"),
        reference=None,
        backend="llama.cpp",
        ctx=64,
        json=False,
    )
    with pytest.raises(LocalrtError, match="cannot read"):
        eval_command(args)
