"""What a step of n rows of one sequence costs on the llama.cpp backend's kernels: the profile behind
prompt lookup's draft length (a verify step is the last token and its drafts, every row with logits).

llama-cpp-python's Llama on the same GGUF, one sequence at `--context` cells; each size is timed
`--rounds` times (median), with flash attention on (the default of llama.cpp and of localrt) or off.

    python benchmarks/bench_verify_rows.py --threads 2 --rounds 5
    python benchmarks/bench_verify_rows.py --threads 2 --rounds 5 --no-flash-attn
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

CACHED_GGUF = Path.home() / ".cache" / "localrt-tests" / "SmolLM2-135M-Instruct.Q4_1.gguf"
SIZES = (1, 2, 4, 8, 16, 32, 48, 63, 64, 96, 128)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gguf", default=str(CACHED_GGUF))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--context", type=int, default=250, help="cells the sequence holds before the step")
    p.add_argument("--no-flash-attn", action="store_true")
    a = p.parse_args()

    import llama_cpp

    llm = llama_cpp.Llama(
        a.gguf,
        n_ctx=2048,
        n_batch=512,
        n_ubatch=512,
        n_threads=a.threads,
        logits_all=True,
        flash_attn=not a.no_flash_attn,
        verbose=False,
    )
    text = "The keeper lit the lamp and watched the ships pass through the strait. " * 60
    tokens = llm.tokenize(text.encode())[: a.context + max(SIZES)]
    llm.eval(tokens[: a.context])
    times: dict[int, list[float]] = {n: [] for n in SIZES}
    for _ in range(a.rounds):
        for n in SIZES:
            llm.n_tokens = a.context  # the next eval drops what the last one added
            start = time.perf_counter()
            llm.eval(tokens[a.context : a.context + n])
            times[n].append(time.perf_counter() - start)
    one = statistics.median(times[1])
    fa = "off" if a.no_flash_attn else "on"
    print(
        f"one sequence at {a.context} cells, {a.threads} threads, flash attention {fa}, medians of {a.rounds}"
    )
    print(f"{'rows':>5} {'step ms':>9} {'ms per row after the first':>27} {'rows / step time':>17}")
    for n in SIZES:
        t = statistics.median(times[n])
        extra = f"{(t - one) / (n - 1) * 1000:.2f}" if n > 1 else "-"
        print(f"{n:>5} {t * 1000:>9.2f} {extra:>27} {n / t:>15.1f}/s")


if __name__ == "__main__":
    main()
