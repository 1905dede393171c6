"""Phi-3's LongRoPE past `rope.scaling.original_context_length` in the torch engine: when the context
is longer than the original one, llama.cpp divides the RoPE frequencies by `rope_factors_long` (for
every position, decided once per context); the torch engine does the same, so its logits on a
sequence that runs past the original context equal llama.cpp's and transformers' (which switches on
the sequence length, the same factors for a sequence that long)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
llama_cpp = pytest.importorskip("llama_cpp")

from localrt.backends.base import LoadOptions  # noqa: E402
from localrt.backends.base import SamplingParams  # noqa: E402
from localrt.backends.torch.engine import Engine  # noqa: E402
from localrt.backends.torch.engine import EngineConfig  # noqa: E402
from tests.fixtures_families import PHI3  # noqa: E402
from tests.fixtures_families import family_gguf  # noqa: E402
from tests.fixtures_families import tiny_hf  # noqa: E402
from tests.test_torch_families import load  # noqa: E402
from tests.test_torch_families import ours  # noqa: E402
from tests.test_torch_families import tokens_for  # noqa: E402
from tests.test_torch_families import transformers_logits  # noqa: E402

ORIGINAL = PHI3["original_max_position_embeddings"]  # 512
CONTEXT = PHI3["max_position_embeddings"]  # 1024
N_TOKENS = ORIGINAL + 88  # the last 88 positions are past the original context


@pytest.fixture(scope="module")
def phi3(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(HF directory, llama.cpp's F32 conversion of it)."""
    hf = tiny_hf(tmp_path_factory.mktemp("phi3-hf") / "model", "phi3")
    return hf, family_gguf(hf, tmp_path_factory.mktemp("phi3-gguf"), "F32")


def llama_cpp_logits(path: Path, tokens: list[int], n_ctx: int) -> np.ndarray:
    llm = llama_cpp.Llama(
        str(path), logits_all=True, n_ctx=n_ctx, n_batch=n_ctx, n_threads=1, verbose=False, type_k=0, type_v=0
    )
    try:
        llm.eval(tokens)
        return np.array(llm.scores[: len(tokens)])
    finally:
        llm.close()


def test_long_factors_past_the_original_context_match_llama_cpp(phi3: tuple[Path, Path]) -> None:
    hf, path = phi3
    model = load(path)
    tokens = tokens_for(model.cfg.vocab_size, N_TOKENS, seed=3)
    theirs = llama_cpp_logits(path, tokens, CONTEXT)
    short = ours(model, tokens)
    # the short factors are not llama.cpp's function in this context (so the check below can fail)
    assert np.abs(short - theirs).max() > 0.1
    model.fit_context(CONTEXT)
    assert model.rope_factors == "long"
    got = ours(model, tokens)
    np.testing.assert_allclose(got, theirs, atol=0.02, rtol=0)
    np.testing.assert_allclose(got, transformers_logits(hf, tokens), atol=2e-4, rtol=0)


def test_short_factors_within_the_original_context(phi3: tuple[Path, Path]) -> None:
    """A context no longer than the original keeps the short factors, as llama.cpp does."""
    _, path = phi3
    model = load(path)
    model.fit_context(ORIGINAL)
    assert model.rope_factors == "short"
    tokens = tokens_for(model.cfg.vocab_size, 100, seed=4)
    np.testing.assert_allclose(
        ours(model, tokens), llama_cpp_logits(path, tokens, ORIGINAL), atol=0.02, rtol=0
    )


def test_engine_runs_past_the_original_context(phi3: tuple[Path, Path]) -> None:
    """Through the paged engine: a prompt past the original context, greedy tokens equal llama.cpp's
    argmax at every generated position."""
    _, path = phi3
    model = load(path)
    model.fit_context(CONTEXT)
    engine = Engine(model, EngineConfig(context_length=CONTEXT, kv_cache_type="f32", max_batch_tokens=128))
    prompt = tokens_for(model.cfg.vocab_size, ORIGINAL + 20, seed=5)
    seq = engine.new_sequence(prompt, SamplingParams(temperature=0.0), max_new=16)
    with torch.inference_mode():
        engine.run([seq])
    reference = llama_cpp_logits(path, seq.tokens[:-1], CONTEXT).argmax(-1).tolist()
    assert seq.tokens[len(prompt) :] == reference[len(prompt) - 1 :]


def test_backend_loads_the_whole_context_with_long_factors(phi3: tuple[Path, Path]) -> None:
    """`num_ctx` past the original context is not capped: the backend loads it and picks the
    long factors (the short ones for a context within the original)."""
    from localrt.backends.torch import TorchModel

    _, path = phi3
    for num_ctx, factors in ((CONTEXT, "long"), (ORIGINAL, "short")):
        model = TorchModel(path, LoadOptions(num_ctx=num_ctx, num_thread=1))
        try:
            assert model.context_length == num_ctx
            assert model.model.rope_factors == factors
        finally:
            model.unload()
