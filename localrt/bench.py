"""`localrt bench NAME`: time to first token, decode tokens/s and aggregate throughput per concurrency.

Requests go through the same runtime as `localrt run` and the server (templates, slots, queue), so the
figures are what a client would see. Greedy decoding with a fixed token count keeps rounds comparable.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import time
from dataclasses import asdict
from dataclasses import dataclass
from typing import Any

from localrt.errors import LocalrtError
from localrt.runtime.front import Runtime

# Different questions, so that a round measures decoding rather than the prefix cache.
QUESTIONS = [
    "Explain how a lighthouse works.",
    "Write a short poem about the sea.",
    "What causes the seasons?",
    "Describe a day in the life of a baker.",
    "How do bees make honey?",
    "Why is the sky blue?",
    "Tell me a story about a brave mouse.",
    "What is photosynthesis?",
    "How does a bicycle stay upright?",
    "Describe the water cycle.",
    "What makes a good friend?",
    "How do volcanoes form?",
    "Write a letter to a pen pal.",
    "Explain what a computer program is.",
    "Why do cats purr?",
    "How are rainbows formed?",
]
MAX_CONCURRENCY = 256


@dataclass
class Round:
    concurrency: int
    requests: int
    tokens: int  # generated, all requests
    wall_s: float
    aggregate_tps: float  # generated tokens per second of wall time, all requests together
    decode_tps_median: float  # one request's decode speed (its eval_count / eval time)
    ttft_ms_median: float  # submit to first text, queueing included
    ttft_ms_max: float
    acceptance: float | None  # speculative drafts accepted / drafted; None without drafts


def parse_concurrency(text: str) -> list[int]:
    try:
        levels = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        levels = []
    if not levels or any(not 1 <= n <= MAX_CONCURRENCY for n in levels):
        raise LocalrtError(
            f"--concurrency must be a comma-separated list of integers from 1 to "
            f"{MAX_CONCURRENCY}, got {text!r}"
        )
    return levels


async def _one(runtime: Runtime, model: str, question: str, options: dict[str, Any]) -> dict[str, Any]:
    start = time.perf_counter()
    first: float | None = None
    async for chunk in runtime.chat(model, [{"role": "user", "content": question}], options=options):
        if chunk.content and first is None:
            first = time.perf_counter()
        if chunk.done:
            m = chunk.metrics
            assert m is not None
            return {
                "ttft": (first or time.perf_counter()) - start,
                "tokens": m.eval_count,
                "eval_ns": m.eval_ns,
                "drafted": m.draft_count,
                "accepted": m.draft_accepted_count,
            }
    raise LocalrtError("the answer ended without a final chunk")


async def bench(
    model: str, levels: list[int], options: dict[str, Any], prompt: str | None = None
) -> tuple[str, list[Round]]:
    runtime = Runtime()
    try:
        async for _ in runtime.chat(model, [], options=options):  # load once, outside the timings
            pass
        backend = next((row.backend for row in runtime.ps()), "?")
        rounds = []
        for n in levels:
            questions = [prompt or QUESTIONS[i % len(QUESTIONS)] for i in range(n)]
            t0 = time.perf_counter()
            results = await asyncio.gather(*(_one(runtime, model, q, options) for q in questions))
            wall = time.perf_counter() - t0
            tokens = sum(r["tokens"] for r in results)
            drafted = sum(r["drafted"] for r in results)
            ttfts = [1000 * r["ttft"] for r in results]
            rounds.append(
                Round(
                    concurrency=n,
                    requests=n,
                    tokens=tokens,
                    wall_s=wall,
                    aggregate_tps=tokens / wall,
                    decode_tps_median=statistics.median(
                        r["tokens"] / (r["eval_ns"] / 1e9) if r["eval_ns"] else 0.0 for r in results
                    ),
                    ttft_ms_median=statistics.median(ttfts),
                    ttft_ms_max=max(ttfts),
                    acceptance=sum(r["accepted"] for r in results) / drafted if drafted else None,
                )
            )
        return backend, rounds
    finally:
        await runtime.close()


def bench_command(args: Any) -> int:
    levels = parse_concurrency(args.concurrency)
    if args.num_predict < 1:
        raise LocalrtError(f"--num-predict must be at least 1, got {args.num_predict}")
    options: dict[str, Any] = {"temperature": 0, "num_predict": args.num_predict}
    if args.backend:
        options["backend"] = args.backend
    if args.spec:
        options["speculative"] = args.spec
    backend, rounds = asyncio.run(bench(args.model, levels, options, args.prompt))
    if args.json:
        print(
            json.dumps(
                {
                    "model": args.model,
                    "backend": backend,
                    "num_predict": args.num_predict,
                    "speculative": args.spec or "auto",
                    "rounds": [asdict(r) for r in rounds],
                }
            )
        )
        return 0
    print(f"{args.model} on {backend}, {args.num_predict} tokens per request, greedy")
    header = [
        "concurrency",
        "aggregate tok/s",
        "decode tok/s",
        "TTFT ms (median)",
        "TTFT ms (max)",
        "acceptance",
    ]
    rows = [
        [
            str(r.concurrency),
            f"{r.aggregate_tps:.1f}",
            f"{r.decode_tps_median:.1f}",
            f"{r.ttft_ms_median:.0f}",
            f"{r.ttft_ms_max:.0f}",
            "-" if r.acceptance is None else f"{100 * r.acceptance:.1f}%",
        ]
        for r in rounds
    ]
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(header)]
    for line in (header, *rows):
        print("  ".join(cell.rjust(w) for cell, w in zip(line, widths)))
    sys.stdout.flush()
    return 0
