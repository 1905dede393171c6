"""MLX backend decode speed, side by side with llama.cpp and mlx-lm's own generate on the same model.

    python benchmarks/bench_mlx.py [--gguf PATH] [--hf DIR] [--threads 1] [--new 48] [--rounds 2]

Prints prompt and decode tokens/s, greedy, for:
  - localrt's MLX backend on the GGUF (weights kept quantized, e.g. Q4_1 -> MLX 4-bit, group 32),
  - localrt's llama.cpp backend on the same GGUF (`--threads` threads),
  - mlx-lm's `stream_generate` on the same model as an MLX 4-bit, group-32 conversion of the HF
    checkpoint (`--hf`, by default SmolLM2 built from the GGUF like the tests do) in the same compute
    dtype as localrt's (fp32 on a CPU, fp16 on an Apple GPU), when mlx-lm is installed (`pip install mlx-lm`; on Linux `mlx-lm[cpu]`).
Same chat prompt and token count everywhere; the best of `--rounds` is kept. Not a test: numbers
depend on the machine (on Linux MLX runs on its CPU backend; on Apple Silicon on the GPU).
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
from localrt.backends.base import DoneEvent, GenerateRequest, LoadOptions, SamplingParams  # noqa: E402

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
        from mlx_lm import convert, load, stream_generate
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
    args = ap.parse_args()

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
