"""Prompt-lookup speculative decoding vs plain decoding on an input-grounded task.

"Repeat this paragraph with one word changed": the answer is mostly a copy of the prompt, so n-gram
lookup drafts are usually right. Both modes run through localrt's Runtime, greedy, alternating, for
several rounds; the script checks that the outputs are token-identical and prints the acceptance rate
(accepted / drafted) and the decode speed-up (median over rounds).

    python benchmarks/bench_lookup.py --threads 2 --rounds 5 --num-draft 8
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

CACHED_GGUF = (
    Path(os.environ.get("LOCALRT_TEST_CACHE", Path.home() / ".cache" / "localrt-tests"))
    / "SmolLM2-135M-Instruct.Q4_1.gguf"
)
MODEL = "bench-lookup:latest"
PARAGRAPH = (
    "The old lighthouse keeper climbed the narrow stairs every evening, lit the great lamp, and watched the "
    "ships pass safely through the rocky strait until dawn. In the morning he wrote the names of the ships in "
    "a blue notebook, made a pot of strong tea, and slept until noon while the gulls cried outside."
)
TASK = f"Repeat this paragraph with one word changed ('blue' becomes 'red'):\n\n{PARAGRAPH}"


def find_gguf(explicit: str | None) -> Path:
    path = Path(explicit) if explicit else CACHED_GGUF
    if not path.is_file():
        raise SystemExit(
            f"no GGUF at {path}: pass --gguf PATH (running the test suite once caches SmolLM2 there)"
        )
    return path


def temp_store(gguf: Path, params: dict[str, Any]) -> None:
    from localrt.store.importer import import_gguf
    from localrt.store.store import Store

    root = Path(tempfile.mkdtemp(prefix="localrt-bench-")) / "models"
    import_gguf(Store(root), MODEL, gguf, params=params, system="You are a helpful assistant.")
    os.environ["LOCALRT_MODELS"] = str(root)


async def run_once(rt: Any, options: dict[str, Any]) -> tuple[str, Any]:
    text, final = "", None
    async for chunk in rt.chat(MODEL, [{"role": "user", "content": TASK}], options=options):
        text += chunk.content
        if chunk.done:
            final = chunk
    return text, final.metrics


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--gguf", help="model file (default: the test suite's cached SmolLM2)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--num-predict", type=int, default=160)
    parser.add_argument("--num-draft", type=int, default=8)
    args = parser.parse_args()

    from localrt.runtime.front import Runtime

    temp_store(
        find_gguf(args.gguf),
        {"temperature": 0, "num_thread": args.threads, "num_ctx": 2048, "num_predict": args.num_predict},
    )
    rt = Runtime()
    loop = asyncio.new_event_loop()
    plain_opts = {"speculative": "off"}
    lookup_opts = {"speculative": "lookup", "num_draft": args.num_draft}
    loop.run_until_complete(run_once(rt, {**plain_opts, "num_predict": 4}))  # load and warm up

    print(
        f"task: repeat a {len(PARAGRAPH.split())}-word paragraph with one word changed; greedy; "
        f"threads {args.threads}; num_draft {args.num_draft}; {args.rounds} rounds\n"
    )
    print(
        f"{'round':>5}  {'plain tok/s':>11}  {'lookup tok/s':>12}  {'speed-up':>8}  {'drafted':>7}  "
        f"{'accepted':>8}  {'accept %':>8}  identical"
    )
    speedups, rates, identical_all = [], [], True
    for r in range(1, args.rounds + 1):
        pairs = [("plain", plain_opts), ("lookup", lookup_opts)]
        if r % 2 == 0:  # alternate the order against drift in machine load
            pairs.reverse()
        results = {name: loop.run_until_complete(run_once(rt, opts)) for name, opts in pairs}
        (plain_text, pm), (lookup_text, lm) = results["plain"], results["lookup"]
        plain_rate = pm.eval_count / pm.eval_ns * 1e9
        lookup_rate = lm.eval_count / lm.eval_ns * 1e9
        same = plain_text == lookup_text and pm.eval_count == lm.eval_count
        identical_all &= same
        accept = lm.draft_accepted_count / lm.draft_count if lm.draft_count else 0.0
        speedups.append(lookup_rate / plain_rate)
        rates.append(accept)
        print(
            f"{r:>5}  {plain_rate:>11.1f}  {lookup_rate:>12.1f}  {lookup_rate / plain_rate:>7.2f}x  "
            f"{lm.draft_count:>7}  {lm.draft_accepted_count:>8}  {accept * 100:>7.1f}%  {same}",
            flush=True,
        )
    loop.run_until_complete(rt.close())
    print(f"\noutput ({pm.eval_count} tokens): {plain_text[:120]!r}...")
    print(f"greedy outputs identical in every round: {identical_all}")
    print(
        f"acceptance rate: {statistics.median(rates) * 100:.1f}%   "
        f"decode speed-up (median): {statistics.median(speedups):.2f}x"
    )
    if not identical_all:
        sys.exit(1)


if __name__ == "__main__":
    main()
