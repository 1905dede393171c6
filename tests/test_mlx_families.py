"""The MLX engine on the newer families (Gemma 3, Gemma 2, Phi-3, Qwen3-MoE), from GGUFs made by llama.cpp's
own converter: logits against the torch engine's dequantized fp32 reference and against llama.cpp on the
same file, Gemma 3's rotating sliding-window caches past the window, batching and speculation staying
invisible on Gemma 3 and the mixture of experts, `localrt run --backend mlx`, and (slow) the real
Gemma 3 270M file against llama.cpp."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")
torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("llama_cpp")

from localrt.backends.base import CancelToken  # noqa: E402
from localrt.backends.base import LoadOptions  # noqa: E402
from localrt.backends.base import SamplingParams  # noqa: E402
from localrt.backends.mlx.architectures import load_model  # noqa: E402
from localrt.backends.mlx.cache import make_caches  # noqa: E402
from localrt.backends.mlx.engine import Engine  # noqa: E402
from localrt.backends.mlx.engine import Row  # noqa: E402
from localrt.backends.mlx.gguf_load import GGUFTensors  # noqa: E402
from localrt.backends.mlx.llama import Transformer  # noqa: E402
from localrt.backends.mlx.prompt_cache import PromptCache  # noqa: E402
from localrt.backends.mlx.runner import Runner  # noqa: E402
from localrt.backends.mlx.sampling import RowSampler  # noqa: E402
from localrt.backends.mlx.speculative import DraftModelProposer  # noqa: E402
from localrt.backends.mlx.speculative import SelfOnRow  # noqa: E402
from localrt.backends.speculation import SpecState  # noqa: E402
from tests.fixtures_families import GEMMA3_WINDOW  # noqa: E402
from tests.fixtures_families import family_gguf  # noqa: E402
from tests.fixtures_families import tiny_hf  # noqa: E402
from tests.test_torch_families import llama_cpp_logits  # noqa: E402
from tests.test_torch_families import run_cli  # noqa: E402
from tests.test_torch_families import tokens_for  # noqa: E402

FAMILIES = ["gemma3", "gemma2", "phi3", "qwen3moe"]
SMALL_SLACK = 8  # rotating caches drop old positions every few tokens (the default keeps 256); >= k below


@pytest.fixture(scope="module")
def family_files(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, str], Path]:
    """(family, file type) -> llama.cpp's GGUF of a tiny random checkpoint, each made once per module."""
    made: dict[str, tuple[Path, Path]] = {}

    def get(family: str, file_type: str) -> Path:
        if family not in made:
            hf = tiny_hf(tmp_path_factory.mktemp(f"{family}-hf") / "model", family)
            made[family] = (hf, tmp_path_factory.mktemp(f"{family}-gguf"))
        hf, work = made[family]
        return family_gguf(hf, work, file_type)

    return get


def load(path: Path, slack: int | None = None) -> Transformer:
    tensors = GGUFTensors(path)
    try:
        model = load_model(tensors, mx.float32)
    finally:
        tensors.close()
    if slack is not None:
        model.cache_slack = slack
    return model


def mlx_logits(model: Transformer, tokens: list[int], chunk: int) -> np.ndarray:
    """Logits of every position, the sequence fed `chunk` tokens at a time through the model's caches."""
    caches = model.make_caches("f32")
    out = [
        np.array(model(mx.array(tokens[s : s + chunk], dtype=mx.int32), caches))
        for s in range(0, len(tokens), chunk)
    ]
    return np.concatenate(out)


def torch_reference(path: Path, tokens: list[int]) -> tuple[np.ndarray, list[int]]:
    """The torch engine's dense fp32 forward of the same file (weights dequantized), and its windows."""
    from localrt.backends.torch.architectures import load_model as torch_load
    from localrt.backends.torch.gguf_load import GGUFTensors as TorchTensors
    from localrt.backends.torch.llama import DenseCausal

    tensors = TorchTensors(path)
    try:
        model = torch_load(tensors, torch.float32, "cpu")
    finally:
        tensors.close()
    with torch.inference_mode():
        return model(torch.tensor(tokens), DenseCausal(len(tokens))).numpy(), list(model.windows)


# ---- logits ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("file_type", ["F32", "Q4_K_M"])
@pytest.mark.parametrize("family", FAMILIES)
def test_logits_equal_the_dequantized_fp32_reference(
    family: str, file_type: str, family_files: Callable[[str, str], Path]
) -> None:
    """MLX (Q4_K/Q5_K kept packed, the rest dequantized; experts through gathered products) computes
    the function of the file's dequantized weights: the torch engine's fp32 forward. Fed 16 tokens at
    a time, so the sliding layers attend across chunks of their rotating caches."""
    path = family_files(family, file_type)
    model = load(path, SMALL_SLACK)
    tokens = tokens_for(model.cfg.vocab_size)
    reference, windows = torch_reference(path, tokens)
    assert model.windows == windows
    np.testing.assert_allclose(mlx_logits(model, tokens, 16), reference, atol=1e-4, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_exact_llama_cpp(family: str, family_files: Callable[[str, str], Path]) -> None:
    """Q4_K_M against llama.cpp built with OpenBLAS (repacking off): its batched matmuls run in fp32 on
    the dequantized weights, the file's exact function. Its expert products (`MUL_MAT_ID`) are not
    offloaded to BLAS, so for the MoE they keep the CPU kernels' 8-bit activations, which flip near-tie
    expert choices: there the bar is the torch tests' (mean difference under a tenth of the logits)."""
    from tests.fixtures_hf import llama_cpp_blas
    from tests.fixtures_hf import llama_cpp_logits_of_build

    path = family_files(family, "Q4_K_M")
    model = load(path)
    tokens = tokens_for(model.cfg.vocab_size, seed=4)
    exact, has_blas = llama_cpp_logits_of_build(llama_cpp_blas(), path, tokens, 512, 1, repack=False)
    assert has_blas
    got = mlx_logits(model, tokens, 32)
    if family == "qwen3moe":
        assert np.abs(got - exact).mean() < 0.1 * np.abs(exact).mean()
    else:
        np.testing.assert_allclose(got, exact, atol=0.01, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_llama_cpp(family: str, family_files: Callable[[str, str], Path]) -> None:
    path = family_files(family, "F32")
    model = load(path)
    tokens = tokens_for(model.cfg.vocab_size, seed=2)
    np.testing.assert_allclose(
        mlx_logits(model, tokens, 32), llama_cpp_logits(path, tokens), atol=0.02, rtol=0
    )


def test_the_window_matters(family_files: Callable[[str, str], Path]) -> None:
    """Past the window a sliding layer's output differs from full attention's (else the tests above
    could not tell a window from none)."""
    path = family_files("gemma3", "F32")
    model = load(path)
    tokens = tokens_for(model.cfg.vocab_size)
    windowed = mlx_logits(model, tokens, 16)
    model.cfg.sliding_window = 0  # the caches' windows come from the config: every layer global
    model.cfg.sliding_layers = (False,) * model.cfg.block_count
    full = mlx_logits(model, tokens, 16)
    assert np.abs(windowed[:GEMMA3_WINDOW] - full[:GEMMA3_WINDOW]).max() < 1e-4
    assert np.abs(windowed[GEMMA3_WINDOW:] - full[GEMMA3_WINDOW:]).max() > 1e-2


def test_a_long_sequence_keeps_only_the_window_and_equals_dense(
    family_files: Callable[[str, str], Path],
) -> None:
    """150 tokens (six windows) fed 7 at a time: each sliding layer's cache holds at most the window,
    two slacks and a chunk, the global layer holds everything, and the logits are the dense forward's."""
    path = family_files("gemma3", "F32")
    model = load(path, SMALL_SLACK)
    tokens = tokens_for(model.cfg.vocab_size, 150, seed=5)
    caches = model.make_caches("f32")
    held_max = [0] * len(caches)
    out = []
    for s in range(0, len(tokens), 7):
        out.append(np.array(model(mx.array(tokens[s : s + 7], dtype=mx.int32), caches)))
        held_max = [max(m, c.held) for m, c in zip(held_max, caches)]
    reference, _ = torch_reference(path, tokens)
    np.testing.assert_allclose(np.concatenate(out), reference, atol=2e-3, rtol=0)
    bound = GEMMA3_WINDOW - 1 + 2 * SMALL_SLACK + 7
    assert max(h for h, w in zip(held_max, model.windows) if w) <= bound
    assert [c.held for c, w in zip(caches, model.windows) if not w] == [150]
    assert all(c.start > 0 for c, w in zip(caches, model.windows) if w)  # they did rotate


def test_an_8_bit_rotating_cache_stays_close(family_files: Callable[[str, str], Path]) -> None:
    """q8_0 caches rotate too: over the same 150 tokens their logits stay within a few percent of the
    fp32 caches' and pick the same tokens."""
    model = load(family_files("gemma3", "F32"), SMALL_SLACK)
    tokens = tokens_for(model.cfg.vocab_size, 150, seed=5)

    def logits(kind: str) -> tuple[np.ndarray, list[Any]]:
        caches = make_caches(model.cfg.block_count, kind, model.dtype, model.windows, SMALL_SLACK)
        rows = [
            np.array(model(mx.array(tokens[s : s + 7], dtype=mx.int32), caches)) for s in range(0, 150, 7)
        ]
        return np.concatenate(rows), caches

    exact, _ = logits("f32")
    packed, caches = logits("q8_0")
    assert all(c.start > 0 for c, w in zip(caches, model.windows) if w)
    assert np.abs(packed - exact).mean() < 0.05 * np.abs(exact).mean()
    assert (packed.argmax(-1) == exact.argmax(-1)).mean() >= 0.95


@pytest.mark.parametrize("arch", ["granite", "olmoe"])
def test_an_architecture_mlx_lacks_is_refused_by_name(arch: str, tmp_path: Path) -> None:
    """A file of another architecture is one clear error naming it and what MLX runs, not wrong logits."""
    from localrt.errors import LocalrtError
    from tests.gguf_factory import write_random_model

    path = write_random_model(tmp_path / "other.gguf", arch=arch)
    with pytest.raises(LocalrtError, match=rf"does not support the '{arch}' architecture.*gemma3.*qwen3moe"):
        load(path)


# ---- the batched engine -------------------------------------------------------------------------------
@dataclass
class Spec:
    prompt: list[int]
    params: SamplingParams
    new: int
    lookup: bool = False


def specs_for(vocab: int) -> list[Spec]:
    """Six requests: greedy and seeded, prompts of 3..70 tokens (past the window), one with lookup."""
    rng = np.random.default_rng(7)
    out = []
    for i, n in enumerate([3, 40, 70, 12, 55, 30]):
        prompt = rng.integers(3, min(vocab, 400), n).tolist()
        if i == 4:
            prompt = (prompt[:9] * 7)[:n]  # repetitive: lookup finds draft tokens
        params = (
            SamplingParams(temperature=0.0)
            if i % 2 == 0
            else SamplingParams(temperature=0.8, top_k=30, top_p=0.95, seed=50 + i)
        )
        out.append(Spec(prompt, params, 12 + 4 * i, lookup=i == 4))
    return out


def engine_for(model: Transformer) -> Engine:
    """Prompt chunks of up to 40 tokens: the MoE's (token, slot) pairs take the sorted dispatch in long
    prefill steps and the unsorted one in decode steps, alone and together."""
    return Engine("f32", 40, model, max_rows=6, prompt_cache=PromptCache(1 << 30), eog=set())


def row_for(engine: Engine, spec: Spec) -> Row:
    row = engine.new_row(
        spec.prompt, RowSampler(spec.params, 512), len(spec.prompt) + spec.new, cancel=CancelToken()
    )
    if spec.lookup:
        row.spec = SpecState("lookup", 4, 0.0)
    return row


def drive(engine: Engine, specs: list[Spec]) -> list[list[int]]:
    rows = [row_for(engine, s) for s in specs]
    engine.run(rows)
    return [r.output for r in rows]


@pytest.mark.parametrize("family", ["gemma3", "qwen3moe"])
def test_batching_is_invisible(family: str, family_files: Callable[[str, str], Path]) -> None:
    """Six concurrent requests give the tokens each gives alone (alone: one after another, with prompt
    cache hits; together; together on a cold prompt cache)."""
    model = load(family_files(family, "Q4_K_M"), SMALL_SLACK)
    specs = specs_for(model.cfg.vocab_size)
    engine = engine_for(model)
    alone = [drive(engine, [s])[0] for s in specs]
    together = drive(engine, specs)
    cold = drive(engine_for(model), specs)
    for i, (a, b, c) in enumerate(zip(alone, together, cold)):
        assert len(a) == specs[i].new
        assert b == a, f"request {i} changed when batched"
        assert c == a, f"request {i} changed when batched from a cold cache"


def test_the_prompt_cache_respects_the_window(family_files: Callable[[str, str], Path]) -> None:
    """A finished conversation's rotating caches serve its next turn (only the new tokens are
    evaluated), but not a prompt that leaves it before their kept tail: that one starts cold. Both
    answer as a cold engine does."""
    model = load(family_files("gemma3", "F32"), SMALL_SLACK)
    engine = engine_for(model)
    greedy = SamplingParams(temperature=0.0)
    first = row_for(engine, Spec(tokens_for(model.cfg.vocab_size, 60, seed=9), greedy, 10))
    engine.run([first])
    next_turn = [*first.tokens, 5, 6, 7]
    short = [*first.tokens[:20], 8, 9]  # shares 20 tokens, fewer than the sliding caches still hold
    (entry,) = engine.prompt_cache.entries.values()  # what the first request's caches hold
    for prompt, cached in ((next_turn, len(entry.tokens)), (short, 0)):
        warm = row_for(engine, Spec(prompt, greedy, 8))
        engine.run([warm])
        cold = row_for(engine_for(model), Spec(prompt, greedy, 8))
        engine_for(model).run([cold])
        assert warm.cached_count == cached
        assert warm.output == cold.output


def decode(
    model: Transformer, prompt: list[int], n: int, mode: str = "off", proposer: Any = None
) -> tuple[list[int], SpecState | None]:
    """Greedy, one row on a fresh engine (no prompt cache): `proposer` makes the row's proposer."""
    engine = Engine("f32", 16, model, eog=set())
    row = engine.new_row(prompt, RowSampler(SamplingParams(temperature=0.0), 1024), len(prompt) + n)
    if mode != "off":  # "lookup": the SpecState's own n-gram index proposes
        row.proposer = proposer(row) if proposer is not None else None
        row.spec = SpecState(mode, 5, 0.0)
    engine.run([row])
    return row.output, row.spec


@pytest.mark.parametrize("mode", ["self", "lookup", "draft"])
@pytest.mark.parametrize("family", ["gemma3", "qwen3moe"])
def test_greedy_output_identical_with_speculation(
    family: str, mode: str, family_files: Callable[[str, str], Path]
) -> None:
    """Draft tokens verified and the rejected ones trimmed (from the rotating caches too): the greedy
    output is exactly the plain decode's."""
    path = family_files(family, "Q4_K_M")
    model = load(path, SMALL_SLACK)
    rng = np.random.default_rng(3)
    base = rng.integers(3, min(model.cfg.vocab_size, 400), 10).tolist()
    prompt = [*base, *base, *base, *base[:4]]  # 34 tokens, repetitive: the proposers find drafts
    plain, _ = decode(model, prompt, 40)
    proposer: Any = {
        "self": lambda row: SelfOnRow(row, model.cfg.block_count - 1, 0.0),  # on the row's own caches
        "lookup": None,
        "draft": lambda row: DraftModelProposer(
            Runner(load(path, SMALL_SLACK), "f32", 16), 0.5
        ),  # the same weights
    }[mode]
    fast, spec = decode(model, prompt, 40, mode, proposer)
    assert fast == plain
    assert spec is not None
    assert spec.drafted > 0


# ---- through the CLI ------------------------------------------------------------------------------------
def answers(gguf: Path, prompt: str, tmp_path: Path, extra: str = "") -> tuple[str, str]:
    """`localrt run`'s greedy answer to a raw prompt (no chat template) on MLX and on llama.cpp."""
    modelfile = tmp_path / "Modelfile"
    modelfile.write_text(
        f"FROM {gguf}\nTEMPLATE {{{{ .Prompt }}}}\nPARAMETER temperature 0\nPARAMETER num_predict 12\n{extra}"
    )
    models = tmp_path / "models"
    created = run_cli("create", "raw", "-f", str(modelfile), models=models)
    assert created.returncode == 0, created.stderr
    outputs = []
    for backend in ("mlx", "llama.cpp"):
        run = run_cli("run", "raw", prompt, "--backend", backend, models=models)
        assert run.returncode == 0, run.stderr[-2000:]
        outputs.append(run.stdout)
    return outputs[0], outputs[1]


def test_localrt_run_answers_with_gemma3_on_mlx(
    family_files: Callable[[str, str], Path], tmp_path: Path
) -> None:
    """`localrt run --backend mlx` loads a Gemma 3 file and answers with llama.cpp's greedy continuation
    (the random model's plain greedy answer is newlines only; a repeat penalty makes it say something)."""
    mlx_answer, llama_answer = answers(
        family_files("gemma3", "F32"), "the quick brown fox", tmp_path, "PARAMETER repeat_penalty 1.5\n"
    )
    assert mlx_answer.strip()
    assert mlx_answer == llama_answer


def test_gemma3_270m_answers_on_the_mlx_backend(gemma3_gguf: Path, tmp_path: Path) -> None:
    """`localrt run --backend mlx` loads the PyPI file (a pretrained model: plain completion, no chat
    turns) and answers with llama.cpp's greedy continuation."""
    mlx_answer, llama_answer = answers(gemma3_gguf, "The capital of France is", tmp_path)
    assert len(mlx_answer.split()) >= 3
    assert mlx_answer == llama_answer


# ---- the real Gemma 3 270M (Q4_K_M, from PyPI) ---------------------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(7200)
def test_gemma3_270m_matches_llama_cpp(gemma3_gguf: Path) -> None:
    """4,096 tokens of English in windows of 1,024 (twice the sliding window), second halves scored as
    `localrt eval` scores them: MLX's perplexity within 1% of llama.cpp's (the default build and the
    exact OpenBLAS build), top-1 agreement with the exact build at least 98%."""
    from localrt.backends import registry
    from localrt.eval import evaluate
    from tests.fixtures_hf import LlamaCppBuildReference
    from tests.fixtures_hf import llama_cpp_blas
    from tests.test_torch_llama import english_text

    opts = LoadOptions(num_ctx=1024, num_thread=2, num_batch=512)
    model = registry.get("mlx").load(gemma3_gguf, opts)
    try:  # one MLX pass: its perplexity, and its agreement with the exact build window by window
        tokens = model.tokenize(english_text(), add_special=False)[:4096]
        blas = LlamaCppBuildReference(llama_cpp_blas(), gemma3_gguf, model, threads=2, repack=False)
        ours = asyncio.run(evaluate(model, tokens, 1024, blas))
    finally:
        model.unload()
    blas_alone = asyncio.run(evaluate(blas, tokens, 1024))
    reference = registry.get("llama.cpp").load(gemma3_gguf, opts)
    try:
        theirs = asyncio.run(evaluate(reference, tokens, 1024))
    finally:
        reference.unload()
    print(
        f"\nGemma 3 270M Q4_K_M: perplexity mlx {ours.perplexity:.4f} vs llama.cpp {theirs.perplexity:.4f}, "
        f"llama.cpp (OpenBLAS) {blas_alone.perplexity:.4f} over {ours.tokens} tokens; vs OpenBLAS top-1 "
        f"{100 * (ours.top1 or 0):.2f}% KL {ours.kl:.6f}"
    )
    assert ours.tokens >= 2000
    assert abs(ours.perplexity / theirs.perplexity - 1) < 0.01
    assert abs(ours.perplexity / blas_alone.perplexity - 1) < 0.01
    assert ours.top1 is not None
    assert ours.top1 >= 0.98
