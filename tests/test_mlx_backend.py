"""The MLX backend beyond the shared conformance suite: load-time options (8-bit KV cache, draft model
checks), sampling through the backend, `auto` dispatch, and the message when MLX cannot load.

The slow checks measure fidelity against llama.cpp and the torch engine's exact fp32 reference on 2,000+
scored tokens of real English text
(`python -m pytest -m slow tests/test_mlx_backend.py`)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("mlx.core")

from localrt.backends import registry  # noqa: E402
from localrt.backends.base import DoneEvent  # noqa: E402
from localrt.backends.base import GenerateRequest  # noqa: E402
from localrt.backends.base import LoadOptions  # noqa: E402
from localrt.backends.base import SamplingParams  # noqa: E402
from localrt.backends.base import TextEvent  # noqa: E402
from localrt.errors import LocalrtError  # noqa: E402
from localrt.errors import OptionError  # noqa: E402
from localrt.eval import evaluate  # noqa: E402
from tests.gguf_factory import write_tiny_llama  # noqa: E402

THREADS = int(os.environ.get("LOCALRT_TEST_THREADS", "1"))
CHAT = (
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n{q}<|im_end|>\n"
    "<|im_start|>assistant\n"
)


def opts(**extra: object) -> LoadOptions:
    return LoadOptions(num_ctx=512, num_thread=THREADS, num_batch=256, **extra)  # type: ignore[arg-type]


def run(model: object, request: GenerateRequest) -> tuple[list[int], str, DoneEvent]:
    async def collect() -> tuple[list[int], str, DoneEvent]:
        ids: list[int] = []
        text = ""
        done = None
        async for event in model.generate(request):  # type: ignore[attr-defined]
            if isinstance(event, TextEvent):
                ids += event.token_ids
                text += event.text
            else:
                done = event
        assert done is not None, "every stream ends in a DoneEvent"
        return ids, text, done

    return asyncio.run(collect())


@pytest.fixture(scope="module")
def q8_model(smollm2_gguf: Path):  # type: ignore[no-untyped-def]
    model = registry.get("mlx").load(smollm2_gguf, opts(kv_cache_type="q8_0"))
    yield model
    model.unload()


def test_8bit_kv_cache_generates_the_same_answer(q8_model: object) -> None:
    ids = q8_model.tokenize(CHAT.format(q="What is the capital of France?"), parse_special=True)  # type: ignore[attr-defined]
    _, text, done = run(q8_model, GenerateRequest(ids, SamplingParams(temperature=0.0), num_predict=10))
    assert "Paris" in text
    assert done.timings.prompt_eval_count == len(ids)


def test_seeded_sampling_is_reproducible_and_speculation_keeps_it_valid(q8_model: object) -> None:
    ids = q8_model.tokenize(CHAT.format(q="Name three fruits."), parse_special=True)  # type: ignore[attr-defined]
    params = SamplingParams(temperature=0.9, top_k=40, top_p=0.95, seed=7)
    first, _, _ = run(q8_model, GenerateRequest(ids, params, num_predict=6))
    again, _, _ = run(q8_model, GenerateRequest(ids, params, num_predict=6))
    assert first == again
    assert len(first) == 6
    spec, _, done = run(q8_model, GenerateRequest(ids, params, num_predict=6, speculative="lookup"))
    assert len(spec) == 6
    assert all(0 <= t < q8_model.n_vocab for t in spec)
    assert done.finish_reason == "length"


def test_bad_load_options_are_one_clear_error(smollm2_gguf: Path, tmp_path: Path) -> None:
    backend = registry.get("mlx")
    with pytest.raises(OptionError, match="kv_cache_type 'q4_0' is not supported by the MLX backend"):
        backend.load(smollm2_gguf, opts(kv_cache_type="q4_0"))
    other = write_tiny_llama(tmp_path / "other-vocab.gguf")
    with pytest.raises(LocalrtError, match="does not share the model's vocabulary"):
        backend.load(smollm2_gguf, opts(draft_model=other))
    with pytest.raises(LocalrtError, match="model file not found"):
        backend.load(tmp_path / "missing.gguf", opts())


def test_draft_mode_without_a_draft_model_is_refused(q8_model: object) -> None:
    with pytest.raises(OptionError, match="needs a draft model"):
        run(
            q8_model,
            GenerateRequest([1, 2, 3], SamplingParams(temperature=0.0), num_predict=1, speculative="draft"),
        )


def test_auto_picks_mlx_on_apple_silicon(monkeypatch: pytest.MonkeyPatch) -> None:
    assert registry.status("mlx").installed
    assert registry.resolve("mlx") == "mlx"  # --backend mlx works anywhere MLX is installed
    monkeypatch.setattr(registry, "is_apple_silicon", lambda: True)
    assert registry.auto_order()[0] == "mlx"
    assert registry.resolve("auto") == "mlx"


def test_mlx_that_cannot_load_is_a_clear_message() -> None:
    """Linux with plain `pip install mlx` (no CPU library): `import mlx.core` fails; say what to install."""
    script = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'mlx.core':\n"
        "            raise ImportError('libmlx.so: cannot open shared object file')\n"
        "sys.meta_path.insert(0, Block())\n"
        "from localrt.backends import registry\n"
        "from localrt.errors import BackendUnavailable\n"
        "st = registry.status('mlx')\n"
        "assert not st.installed, st\n"
        "try:\n"
        "    registry.resolve('mlx')\n"
        "except BackendUnavailable as e:\n"
        "    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    message = out.stdout.strip()
    assert "backend mlx is not available" in message
    assert "localrt[mlx]" in message
    assert "libmlx" in message
    assert "\n" not in message


# ---- fidelity against llama.cpp (slow: MLX's CPU matmuls are slow on Linux) --------------------------
def fidelity_text() -> str:
    """~4,100 tokens of real English: the start of the GPL-3 (Python's own docs where it is missing)."""
    gpl = Path("/usr/share/common-licenses/GPL-3")
    if gpl.is_file():
        text = gpl.read_text(encoding="utf-8")
    else:
        from pydoc_data.topics import topics

        text = "\n\n".join(topics[k] for k in sorted(topics))
    return text[:19_300]


class ScoredOnce:
    """A loaded model whose `score` runs once per window (MLX's CPU backend on Linux is slow), so it
    can be measured against several references."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.seen: dict[tuple[int, ...], Any] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)

    async def score(self, tokens: list[int], return_logits: bool = False) -> Any:
        key = tuple(tokens)
        if key not in self.seen:
            self.seen[key] = await self.model.score(tokens, return_logits=True)
        return self.seen[key]


@pytest.mark.slow
@pytest.mark.timeout(7200)
@pytest.mark.parametrize("file_type", ["Q4_1", "Q4_K_M"])
def test_fidelity_against_llamacpp_and_the_exact_reference(
    file_type: str, smollm2_file: Callable[[str], Path]
) -> None:
    """The fidelity bar (top-1 at least 98%, perplexity within 1% over 2,000+ tokens, as `localrt eval`
    measures) against llama.cpp built with OpenBLAS, whose batched matmuls compute the file's exact
    function. The default CPU build of llama.cpp rounds activations to 8 bits before each quantized
    dot product, noise that it does not reproduce itself (batch 1 vs 512: ~97% top-1); against it MLX
    agrees as well as llama.cpp agrees with itself. And MLX equals the torch engine's fp32 reference."""
    from tests.fixtures_hf import LlamaCppBuildReference
    from tests.fixtures_hf import llama_cpp_blas

    path = smollm2_file(file_type)  # Q4_K_M: Q4_K, Q5_0, Q8_0 and (dequantized) Q6_K tensors
    model = ScoredOnce(registry.get("mlx").load(path, LoadOptions(num_ctx=512, num_batch=512)))
    llama = registry.get("llama.cpp").load(path, LoadOptions(num_ctx=512, num_thread=THREADS))
    exact = registry.get("torch").load(
        path, LoadOptions(num_ctx=512, num_thread=THREADS, numerics="dequantized")
    )
    try:
        tokens = model.tokenize(fidelity_text(), add_special=False)
        blas = LlamaCppBuildReference(llama_cpp_blas(), path, model, threads=THREADS, repack=False)
        vs_blas = asyncio.run(evaluate(model, tokens, 512, blas))
        blas_alone = asyncio.run(evaluate(blas, tokens, 512))
        vs_llama = asyncio.run(evaluate(model, tokens, 512, llama))
        llama_alone = asyncio.run(evaluate(llama, tokens, 512))
        vs_exact = asyncio.run(evaluate(exact, tokens, 512, model))  # the reference's logits come from MLX
        exact_alone = asyncio.run(evaluate(exact, tokens, 512))
    finally:
        for m in (model, llama, exact):
            m.unload()
    print(
        f"{file_type}: mlx ppl {vs_llama.perplexity:.4f}, llama.cpp (OpenBLAS) {blas_alone.perplexity:.4f}, "
        f"llama.cpp {llama_alone.perplexity:.4f}, torch fp32 {exact_alone.perplexity:.4f}; "
        f"vs llama.cpp (OpenBLAS) top-1 {100 * (vs_blas.top1 or 0):.2f}% KL {vs_blas.kl:.6f}; "
        f"vs llama.cpp top-1 {100 * (vs_llama.top1 or 0):.2f}% KL {vs_llama.kl:.6f}; "
        f"vs torch top-1 {100 * (vs_exact.top1 or 0):.2f}% KL {vs_exact.kl:.2e}"
    )
    assert vs_blas.tokens >= 2000
    assert vs_blas.top1 is not None, vs_blas
    assert vs_blas.top1 >= 0.98, vs_blas
    assert abs(vs_blas.perplexity / blas_alone.perplexity - 1) < 0.01, (vs_blas, blas_alone)
    assert vs_exact.top1 is not None
    assert vs_exact.top1 >= 0.995
    assert abs(vs_llama.perplexity / exact_alone.perplexity - 1) < 0.001
    assert vs_llama.top1 is not None
    assert vs_llama.top1 >= 0.94
    assert abs(vs_llama.perplexity / llama_alone.perplexity - 1) < 0.02
