"""MLX backend decode speed, side by side with llama.cpp and mlx-lm's own generate on the same model.

    python benchmarks/bench_mlx.py [--gguf PATH] [--hf DIR] [--threads 1] [--new 48] [--rounds 2]
    python benchmarks/bench_mlx.py --concurrency 1,4,8 [--new 32] [--no-mlx-lm]

Prints prompt and decode tokens/s, greedy, for:
  - localrt's MLX backend on the GGUF (weights kept quantized, e.g. Q4_1 -> MLX 4-bit, group 32),
  - localrt's llama.cpp backend on the same GGUF (`--threads` threads),
  - mlx-lm's `stream_generate` on the same model as an MLX 4-bit, group-32 conversion of the HF
    checkpoint (`--hf`, by default SmolLM2 built from the GGUF like the tests do) in the same compute
    dtype as localrt's (fp32 on a CPU, fp16 on an Apple GPU), when mlx-lm is installed (`pip install mlx-lm`; on Linux `mlx-lm[cpu]`).
Same chat prompt and token count everywhere; the best of `--rounds` is kept. Not a test: numbers
depend on the machine (on Linux MLX runs on its CPU backend; on Apple Silicon on the GPU).

`--concurrency 1,4,8` measures batched decoding instead: N clients at once (different questions,
greedy, `--new` tokens each) through localrt's MLX backend (`num_parallel` = the largest N), and N
prompts through mlx-lm's `BatchGenerator` on the same 4-bit conversion where mlx-lm is installed.
It prints aggregate generated tokens/s (wall clock from the first request to the last token,
prefill included) and each engine's ratio to its own single stream.

`--blas openblas` (or a path) runs MLX's fp32 products on that library instead of the wheel's reference
BLAS, with localrt's weights dense (`LOCALRT_MLX_BLAS`, see backends/mlx/blas.py); mlx-lm's quantized
products are MLX's own kernels either way.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from localrt.backends import registry  # noqa: E402
from localrt.backends.base import DoneEvent  # noqa: E402
from localrt.backends.base import GenerateRequest  # noqa: E402
from localrt.backends.base import LoadOptions  # noqa: E402
from localrt.backends.base import SamplingParams  # noqa: E402

DEFAULT_GGUF = Path.home() / ".cache" / "localrt-tests" / "SmolLM2-135M-Instruct.Q4_1.gguf"
CHAT = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n"
QUESTION = "Write a short story about a lighthouse keeper."


def localrt_rates(backend: str, gguf: Path, threads: int, new: int, rounds: int) -> tuple[float, float, int]:
    """(prompt tok/s, decode tok/s, tokens generated) through the backend protocol."""
    model = registry.get(backend).load(gguf, LoadOptions(num_ctx=1024, num_thread=threads, num_batch=512))
    ids = model.tokenize(CHAT.format(q=QUESTION), add_special=True, parse_special=True)
    best = (0.0, 0.0, 0)

    async def one(prompt: list[int]) -> DoneEvent:
        done = None
        async for event in model.generate(
            GenerateRequest(prompt, SamplingParams(temperature=0.0), num_predict=new)
        ):
            if isinstance(event, DoneEvent):
                done = event
        assert done is not None
        return done

    try:
        for _ in range(rounds):
            t = asyncio.run(one(ids)).timings
            prompt_rate = t.prompt_eval_count / (t.prompt_eval_ns / 1e9)
            decode_rate = max(0, t.eval_count - 1) / (t.eval_ns / 1e9)  # eval_ns starts at the first token
            if decode_rate > best[1]:
                best = (prompt_rate, decode_rate, t.eval_count)
            ids = [ids[0], *ids]  # shift the prompt by one token: no prefix reuse, each round prefills it all
    finally:
        model.unload()
    return best


def mlx_lm_rates(hf_dir: Path, new: int, rounds: int) -> tuple[float, float, int] | None:
    try:
        from mlx_lm import convert
        from mlx_lm import load
        from mlx_lm import stream_generate
    except ImportError:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "mlx-q4-g32"
        import mlx.core as mx

        # the compute dtype localrt's MLX backend uses: fp32 on the CPU, fp16 on an Apple GPU
        dtype = "float16" if mx.default_device().type == mx.DeviceType.gpu else "float32"
        convert(str(hf_dir), str(out), quantize=True, q_group_size=32, q_bits=4, dtype=dtype)
        model, tokenizer = load(str(out))
        prompt = CHAT.format(q=QUESTION)
        ids = tokenizer.encode(prompt, add_special_tokens=False)
        best = (0.0, 0.0, 0)
        for _ in range(rounds):
            last = None
            for response in stream_generate(model, tokenizer, ids, max_tokens=new):
                last = response
            assert last is not None
            if last.generation_tps > best[1]:
                best = (last.prompt_tps, last.generation_tps, last.generation_tokens)
            ids = [ids[0], *ids]
        shutil.rmtree(out, ignore_errors=True)
    return best


QUESTIONS = [
    QUESTION,
    "Why is the sky blue?",
    "Name three colours of the rainbow.",
    "Describe a cat in two sentences.",
    "What is the capital of France?",
    "List the planets of the solar system.",
    "Tell me a fact about the moon.",
    "Write a haiku about autumn.",
]


def localrt_concurrent(gguf: Path, levels: list[int], threads: int, new: int) -> dict[int, float]:
    """Aggregate tokens/s of N concurrent greedy requests through the MLX backend, per N."""
    opts = LoadOptions(num_ctx=1024, num_thread=threads, num_batch=512, num_parallel=max(levels))
    model = registry.get("mlx").load(gguf, opts)
    prompts = [model.tokenize(CHAT.format(q=q), add_special=True, parse_special=True) for q in QUESTIONS]

    async def one(prompt: list[int]) -> int:
        done = None
        async for event in model.generate(
            GenerateRequest(prompt, SamplingParams(temperature=0.0), num_predict=new)
        ):
            if isinstance(event, DoneEvent):
                done = event
        assert done is not None
        return done.timings.eval_count

    async def level(n: int, shift: int) -> float:
        # a different first token per run: no prompt-cache hit carries a prefill over
        batch = [[prompts[i % len(prompts)][0]] * shift + prompts[i % len(prompts)] for i in range(n)]
        t0 = time.perf_counter()
        counts = await asyncio.gather(*(one(p) for p in batch))
        return sum(counts) / (time.perf_counter() - t0)

    rates = {}
    try:
        asyncio.run(level(1, 0))  # warm-up
        for i, n in enumerate(levels):
            rates[n] = asyncio.run(level(n, i + 1))
    finally:
        model.unload()
    return rates


def mlx_lm_concurrent(hf_dir: Path, levels: list[int], new: int) -> dict[int, float] | None:
    """Aggregate tokens/s of mlx-lm's BatchGenerator on N prompts, per N (None: not installed)."""
    try:
        from mlx_lm import convert
        from mlx_lm import load
        from mlx_lm.generate import BatchGenerator
    except ImportError:
        return None
    import mlx.core as mx

    rates = {}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "mlx-q4-g32"
        dtype = "float16" if mx.default_device().type == mx.DeviceType.gpu else "float32"
        convert(str(hf_dir), str(out), quantize=True, q_group_size=32, q_bits=4, dtype=dtype)
        model, tokenizer = load(str(out))
        prompts = [tokenizer.encode(CHAT.format(q=q), add_special_tokens=False) for q in QUESTIONS]
        for n in [1, *levels]:  # the first is a warm-up
            gen = BatchGenerator(model, max_tokens=new, stop_tokens=[])
            t0 = time.perf_counter()
            gen.insert([prompts[i % len(prompts)] for i in range(n)], [new] * n)
            produced, finished = 0, 0
            while finished < n:
                step = gen.next_generated() if hasattr(gen, "next_generated") else gen.next()
                for response in step:
                    produced += 1
                    finished += response.finish_reason is not None
            rates[n] = produced / (time.perf_counter() - t0)
            if hasattr(gen, "close"):
                gen.close()
    return rates


def concurrency_table(args: argparse.Namespace) -> None:
    import mlx.core as mx

    levels = [int(x) for x in args.concurrency.split(",")]
    print(
        f"{args.gguf.name}, {args.new} new tokens per request, greedy; MLX device {mx.default_device()}; "
        f"aggregate generated tokens/s (prefill included)\n"
    )
    ours = localrt_concurrent(args.gguf, levels, args.threads, args.new)
    peer = (
        None if args.no_mlx_lm else mlx_lm_concurrent(args.hf or default_hf_dir(args.gguf), levels, args.new)
    )
    base, peer_base = ours.get(1) or ours[levels[0]], None if peer is None else peer.get(1)
    print(
        f"{'clients':>8}{'localrt mlx':>14}{'x own 1':>9}{'mlx-lm batch':>14}{'x own 1':>9}{'mlx / mlx-lm':>14}"
    )
    for n in levels:
        theirs = (
            "" if peer is None else f"{peer[n]:>14.2f}{peer[n] / peer_base:>9.2f}{ours[n] / peer[n]:>14.2f}"
        )
        print(f"{n:>8}{ours[n]:>14.2f}{ours[n] / base:>9.2f}{theirs}")
    if peer is None:
        print("(mlx-lm not run: pip install mlx-lm, or mlx-lm[cpu] on Linux)")


def default_hf_dir(gguf: Path) -> Path:
    from tests.fixtures_hf import smollm2_hf_dir

    return smollm2_hf_dir(gguf)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", type=Path, default=DEFAULT_GGUF)
    ap.add_argument("--hf", type=Path, default=None, help="HF checkpoint of the same model, for mlx-lm")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--new", type=int, default=48, help="tokens to generate")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--concurrency", default=None, help="e.g. 1,4,8: batched decoding instead")
    ap.add_argument(
        "--no-mlx-lm", action="store_true", help="skip mlx-lm (its conversion needs transformers)"
    )
    ap.add_argument("--blas", default=None, help="e.g. openblas: MLX's fp32 products on that BLAS")
    args = ap.parse_args()
    if args.blas:
        import os

        from localrt.backends.mlx import blas

        os.environ[blas.ENV] = args.blas
        print(f"MLX's BLAS: {blas.install()}")  # before anything imports MLX
    if args.concurrency:
        concurrency_table(args)
        return

    import mlx.core as mx

    print(
        f"{args.gguf.name}, {args.new} new tokens, greedy, best of {args.rounds}; "
        f"MLX device {mx.default_device()}, llama.cpp threads {args.threads}\n"
    )
    rows = []
    for name in ("mlx", "llama.cpp"):
        t0 = time.perf_counter()
        rows.append(
            (
                f"localrt {name}",
                *localrt_rates(name, args.gguf, args.threads, args.new, args.rounds),
                time.perf_counter() - t0,
            )
        )
    t0 = time.perf_counter()
    peer = mlx_lm_rates(args.hf or default_hf_dir(args.gguf), args.new, args.rounds)
    if peer is not None:
        rows.append(("mlx-lm stream_generate (4-bit, g32)", *peer, time.perf_counter() - t0))
    print(f"{'engine':<38}{'prompt tok/s':>14}{'decode tok/s':>14}{'tokens':>8}{'wall s':>8}")
    for label, prompt_rate, decode_rate, n, wall in rows:
        print(f"{label:<38}{prompt_rate:>14.1f}{decode_rate:>14.2f}{n:>8}{wall:>8.0f}")
    if peer is None:
        print("(mlx-lm is not installed: pip install mlx-lm, or mlx-lm[cpu] on Linux)")


if __name__ == "__main__":
    main()
