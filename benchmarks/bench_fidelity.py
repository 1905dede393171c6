"""Teacher-forced fidelity of the torch and MLX engines against llama.cpp builds, side by side.

    python benchmarks/bench_fidelity.py [--gguf PATH ...] [--tokens 2048] [--llama-cpp DIR ...]
                                        [--engines torch,torch-ggml,mlx] [--threads 2] [--json]

For each GGUF, the first `--tokens` tokens of real English (CPython's license and reference text,
as in the fidelity tests) are scored as one sequence through the backend protocol's `score`, and
every position's logits are compared with llama.cpp's on the same file:

- rows: our engines (`torch` = `numerics="dequantized"` fp32, `torch-ggml` = `numerics="llama.cpp"`, `mlx`) and
  llama.cpp itself decoding token by token (batch 1), which shows how well llama.cpp agrees with
  its own batched logits;
- columns: llama.cpp references at batch 512 (f16 KV cache, no flash attention), one per build:
  `default` is the llama-cpp-python installed here; `blas` is the same version compiled with
  `CMAKE_ARGS="-DGGML_BLAS=ON -DGGML_BLAS_VENDOR=OpenBLAS"` (built once, as the slow tests do) and
  run without repacked weights; any other `--llama-cpp DIR` is a directory holding another build
  (`pip install --target DIR llama-cpp-python`), also run without repacking.

Why two builds: llama.cpp's CPU kernels round every activation row to 8 bits before a quantized dot
product, so its logits carry noise that no other implementation can reproduce, and llama.cpp's own
batch-1 and batch-512 logits disagree on 3-4% of top-1 tokens of this small model. A BLAS build
multiplies batches of 32+ rows in fp32 on the dequantized weights, the exact function of the file,
so it measures whether an engine computes the same model (repacked weights, e.g. Q4_K on x86, would
stay on the 8-bit kernels, hence `use_extra_bufts = false`). Each llama.cpp run is a subprocess (two
builds cannot share a process); logits are compared in float64. Not a test: it takes minutes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_GGUF = Path.home() / ".cache" / "localrt-tests" / "SmolLM2-135M-Instruct.Q4_1.gguf"


def english_tokens(gguf: Path, n: int) -> list[int]:
    import llama_cpp

    from tests.test_torch_llama import english_text

    vocab = llama_cpp.Llama(str(gguf), vocab_only=True, verbose=False)
    try:
        return vocab.tokenize(english_text().encode())[:n]
    finally:
        vocab.close()


def llama_cpp_logits(build: str, gguf: Path, tokens: list[int], n_batch: int, threads: int) -> np.ndarray:
    from tests.fixtures_hf import llama_cpp_blas
    from tests.fixtures_hf import llama_cpp_logits_of_build

    where = None if build == "default" else llama_cpp_blas() if build == "blas" else Path(build)
    # a BLAS build runs without repacked weights: their matmuls would stay on the 8-bit CPU kernels
    logits, blas = llama_cpp_logits_of_build(where, gguf, tokens, n_batch, threads, repack=build == "default")
    print(f"  llama.cpp {build} ({'with' if blas else 'without'} BLAS), n_batch {n_batch}: done", flush=True)
    return logits


def engine_logits(engine: str, gguf: Path, tokens: list[int], threads: int) -> np.ndarray:
    """Logits [n-1, vocab] of `tokens` (rows 0..n-2, as `score` returns them) from one of our engines."""
    from localrt.backends import registry
    from localrt.backends.base import LoadOptions

    opts = LoadOptions(num_ctx=len(tokens) + 8, num_thread=threads, num_batch=512)
    if engine == "mlx":
        model = registry.get("mlx").load(gguf, opts)
    else:
        from localrt.backends.torch.backend import TorchModel

        model = TorchModel(
            gguf, opts, device="cpu", numerics="llama.cpp" if engine == "torch-ggml" else "dequantized"
        )
    try:
        result = asyncio.run(model.score(tokens, return_logits=True))
    finally:
        model.unload()
    assert result.logits is not None
    return result.logits


def compare(ours: np.ndarray, ref: np.ndarray, tokens: list[int]) -> dict[str, float]:
    """Top-1 agreement, perplexities and mean KL(ref || ours) over the n-1 predicted positions."""
    from localrt.backends.base import log_softmax

    targets = np.array(tokens[1:])
    rows = np.arange(len(targets))
    lo, lr = log_softmax(ours), log_softmax(ref)
    return {
        "top1": float((ours.argmax(-1) == ref.argmax(-1)).mean()),
        "ppl": float(np.exp(-lo[rows, targets].mean())),
        "ppl_ref": float(np.exp(-lr[rows, targets].mean())),
        "kl": float((np.exp(lr) * (lr - lo)).sum(-1).mean()),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--gguf", type=Path, action="append", help="GGUF files (default: the SmolLM2 Q4_1 test file)"
    )
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument(
        "--llama-cpp",
        action="append",
        default=None,
        help="'default' (the installed build), 'blas' (an OpenBLAS build made once under "
        "~/.cache/localrt-tests, as the slow tests do) or a directory holding another build; "
        "repeatable (default: default and blas)",
    )
    ap.add_argument("--engines", default="torch,torch-ggml,mlx")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", action="store_true", help="also print every figure as one JSON line")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))  # tests.test_torch_llama: the English text the fidelity tests use
    builds = args.llama_cpp or ["default", "blas"]
    engines = [e for e in args.engines.split(",") if e]
    figures: dict[str, dict[str, dict[str, dict[str, float]]]] = {}
    for gguf in args.gguf or [DEFAULT_GGUF]:
        tokens = english_tokens(gguf, args.tokens)
        print(f"\n{gguf.name}: {len(tokens)} tokens", flush=True)
        # score() returns rows 0..n-2 (row i predicts token i+1); llama.cpp gives all n rows
        refs = {b: llama_cpp_logits(b, gguf, tokens, 512, args.threads)[:-1] for b in builds}
        rows: dict[str, np.ndarray] = {}
        for engine in engines:
            rows[engine] = engine_logits(engine, gguf, tokens, args.threads)
        rows["llama.cpp batch 1"] = llama_cpp_logits(builds[0], gguf, tokens, 1, args.threads)[:-1]
        table = figures[gguf.name] = {}
        head = " | ".join(
            f"vs llama.cpp {b if b == 'default' else Path(b).name}: top-1, ppl ratio, KL" for b in builds
        )
        print(f"{'':>18} | {head}")
        for name, logits in rows.items():
            table[name] = {b: compare(logits, ref, tokens) for b, ref in refs.items()}
            cells = [
                f"{100 * c['top1']:6.2f}%, {c['ppl'] / c['ppl_ref']:.4f}, {c['kl']:.5f}"
                for c in table[name].values()
            ]
            print(f"{name:>18} | " + " | ".join(f"{cell:>38}" for cell in cells), flush=True)
        for b, c in table[engines[0] if engines else "llama.cpp batch 1"].items():
            print(f"{'':>18}   llama.cpp {b} perplexity {c['ppl_ref']:.4f}")
    if args.json:
        print(json.dumps(figures))


if __name__ == "__main__":
    main()
