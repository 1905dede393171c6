"""Decode tokens/s through localrt vs bare llama-cpp-python, side by side in one run.

Same GGUF, same threads, same prompt tokens, greedy, flash attention on in both (localrt's default).
Each round runs, in turn: bare `Llama.create_completion(stream=True)`, localrt's Runtime in-process,
and `localrt run --verbose` as a subprocess. Rates are decode-only (first token to last token), and
the reported ratio is the median over rounds of localrt/bare. Target: >= 0.97.

    python benchmarks/bench_overhead.py --threads 2 --rounds 5 --num-predict 128
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

CACHED_GGUF = (
    Path(os.environ.get("LOCALRT_TEST_CACHE", Path.home() / ".cache" / "localrt-tests"))
    / "SmolLM2-135M-Instruct.Q4_1.gguf"
)
MODEL = "bench-overhead:latest"
QUESTION = "Write a long story about a dragon who learns to cook."


def find_gguf(explicit: str | None) -> Path:
    path = Path(explicit) if explicit else CACHED_GGUF
    if not path.is_file():
        raise SystemExit(
            f"no GGUF at {path}: pass --gguf PATH (running the test suite once caches SmolLM2 there)"
        )
    return path


def temp_store(gguf: Path, name: str, params: dict[str, Any], system: str | None = None) -> Path:
    """A throw-away store holding `gguf` as `name`, exported as LOCALRT_MODELS (for `localrt run` too)."""
    from localrt.store.importer import import_gguf
    from localrt.store.store import Store

    root = Path(tempfile.mkdtemp(prefix="localrt-bench-")) / "models"
    import_gguf(Store(root), name, gguf, params=params, system=system)
    os.environ["LOCALRT_MODELS"] = str(root)
    return root


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def rates(stamps: list[tuple[float, float]]) -> tuple[float, float]:
    """Tokens/s between the first and the last token: by the wall clock and by this process's CPU time
    (the second shrugs off other load on the machine, which here is real: sessions share the cores)."""
    n = len(stamps) - 1
    return n / (stamps[-1][0] - stamps[0][0]), n / max(1e-9, stamps[-1][1] - stamps[0][1])


def bare_rate(llm: object, prompt: str, num_predict: int) -> tuple[float, float, int]:
    stamps = []
    for chunk in llm.create_completion(
        prompt,
        max_tokens=num_predict,
        temperature=0.0,
        top_k=1,  # type: ignore[attr-defined]
        repeat_penalty=1.0,
        stream=True,
    ):
        if chunk["choices"][0]["text"]:  # the last chunk only carries finish_reason
            stamps.append((time.perf_counter(), time.process_time()))
    return *rates(stamps), len(stamps)


async def runtime_rate(rt: object, num_predict: int) -> tuple[float, float, int]:
    stamps, final = [], None
    messages = [{"role": "user", "content": QUESTION}]
    async for chunk in rt.chat(MODEL, messages, options={"num_predict": num_predict}):  # type: ignore[attr-defined]
        if chunk.content:
            stamps.append((time.perf_counter(), time.process_time()))
        if chunk.done:
            final = chunk
    return *rates(stamps), final.metrics.eval_count


def cli_rate(num_predict: int) -> float:
    out = subprocess.run(
        [sys.executable, "-m", "localrt", "run", MODEL, QUESTION, "--verbose"],
        capture_output=True,
        text=True,
        check=True,
        env=os.environ.copy(),
    )
    match = re.search(r"eval rate:\s+([\d.]+) tokens/s\s*$", out.stderr)
    if not match:
        raise SystemExit(f"no eval rate in: {out.stderr}")
    return float(match.group(1))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--gguf", help="model file (default: the test suite's cached SmolLM2)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--num-predict", type=int, default=128)
    parser.add_argument("--num-ctx", type=int, default=2048)
    parser.add_argument("--no-cli", action="store_true", help="skip the `localrt run` subprocess")
    args = parser.parse_args()

    from llama_cpp import Llama

    from localrt.runtime.front import Runtime

    gguf = find_gguf(args.gguf)
    params = {
        "temperature": 0,
        "repeat_penalty": 1.0,
        "num_thread": args.threads,
        "num_ctx": args.num_ctx,
        "num_predict": args.num_predict,
        "num_batch": 512,
    }
    temp_store(gguf, MODEL, params)
    llm = Llama(
        str(gguf),
        n_ctx=args.num_ctx,
        n_batch=512,
        n_threads=args.threads,
        n_threads_batch=args.threads,
        flash_attn=True,
        verbose=False,
    )

    loop = asyncio.new_event_loop()
    rt = Runtime()
    prompt, tokens = loop.run_until_complete(rt.render(MODEL, [{"role": "user", "content": QUESTION}]))
    print(
        f"model {gguf.name}, threads {args.threads}, prompt {len(tokens)} tokens, "
        f"{args.num_predict} new tokens, greedy, {args.rounds} rounds\n"
    )
    header = (
        f"{'round':>5}  {'bare tok/s':>10}  {'localrt tok/s':>13}  {'ratio':>6}  "
        f"{'bare tok/cpu-s':>14}  {'localrt tok/cpu-s':>17}  {'ratio':>6}"
    )
    if not args.no_cli:
        header += f"  {'localrt run':>11}  {'ratio':>6}"
    print(header)
    ratios, cpu_ratios, cli_ratios = [], [], []
    bare_rate(llm, prompt, 8)  # warm both paths up once
    loop.run_until_complete(runtime_rate(rt, 8))
    for r in range(1, args.rounds + 1):
        # alternate which side goes first, so drift in machine load does not favour one
        if r % 2:
            b, bc, nb = bare_rate(llm, prompt, args.num_predict)
            ours, oc, n = loop.run_until_complete(runtime_rate(rt, args.num_predict))
        else:
            ours, oc, n = loop.run_until_complete(runtime_rate(rt, args.num_predict))
            b, bc, nb = bare_rate(llm, prompt, args.num_predict)
        ratios.append(ours / b)
        cpu_ratios.append(oc / bc)
        line = (
            f"{r:>5}  {b:>10.1f}  {ours:>13.1f}  {ours / b:>6.3f}  {bc:>14.1f}  {oc:>17.1f}  {oc / bc:>6.3f}"
        )
        if not args.no_cli:
            c = cli_rate(args.num_predict)
            cli_ratios.append(c / b)
            line += f"  {c:>11.1f}  {c / b:>6.3f}"
        print(line + ("" if n == nb else f"   (token counts differ: {nb} vs {n})"), flush=True)
    loop.run_until_complete(rt.close())
    print("\nmedian of per-round ratios (target >= 0.97):")
    print(f"  localrt runtime / bare llama-cpp-python, wall clock: {median(ratios):.3f}")
    print(f"  localrt runtime / bare llama-cpp-python, CPU time:   {median(cpu_ratios):.3f}")
    if cli_ratios:
        print(f"  localrt run     / bare llama-cpp-python, wall clock: {median(cli_ratios):.3f}")


if __name__ == "__main__":
    main()
