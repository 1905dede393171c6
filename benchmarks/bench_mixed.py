"""A chat streaming while another client embeds documents, through a real `localrt serve`.

One client streams a chat of `--tokens` new tokens (`/api/chat`, greedy); another embeds `--passages`
passages of about 300 words each (`/api/embed`, one request). The model is SmolLM2-135M Q4_1 (the test
cache's) on the llama.cpp backend. Each round runs four cases on the one loaded model:

- `chat alone`: the chat's gaps between tokens;
- `embed alone`: the embed's time;
- `together`: the chat starts, and once it streams the embed starts beside it; the chat's gaps while the
  embed runs, and the embed's time.

It prints, per round and as medians, the chat's median and largest gap alone and during the embed, and
the embed's time alone and beside the chat, with the ratios the engine aims at: the largest gap during
the embed at most 3x the largest gap alone, the embed beside the chat at most 1.3x its time alone.

    python benchmarks/bench_mixed.py --rounds 3

Measure on a quiet machine; every round is printed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.servers.serve import LocalrtServer  # noqa: E402

CACHED_GGUF = (
    Path(os.environ.get("LOCALRT_TEST_CACHE", Path.home() / ".cache" / "localrt-tests"))
    / "SmolLM2-135M-Instruct.Q4_1.gguf"
)
MODEL = "smol"
WORDS = (
    "river hill road town market bridge harvest winter lantern orchard mill harbour forest meadow stone "
    "village letter candle garden kettle"
).split()


def passages(n: int, words: int = 300) -> list[str]:
    """n passages of `words` words each, every one different."""
    return [
        " ".join(f"{WORDS[(i * 7 + j * 3) % len(WORDS)]}{'.' if j % 12 == 11 else ''}" for j in range(words))
        + f" (passage {i})"
        for i in range(n)
    ]


async def chat(client: httpx.AsyncClient, url: str, tokens: int, started: asyncio.Event) -> list[float]:
    """The chat's arrival times of its tokens (seconds, perf_counter)."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Write a very long story about a dragon who bakes bread."}],
        "stream": True,
        "options": {"temperature": 0, "num_predict": tokens, "seed": 1},
    }
    times: list[float] = []
    async with client.stream("POST", f"{url}/api/chat", json=body, timeout=3600) as r:
        async for line in r.aiter_lines():
            if not line:
                continue
            chunk = json.loads(line)
            if chunk.get("message", {}).get("content"):
                times.append(time.perf_counter())
                started.set()
    return times


async def embed(client: httpx.AsyncClient, url: str, texts: list[str]) -> tuple[float, float, float]:
    """(start, end, seconds) of one embed request of `texts`."""
    start = time.perf_counter()
    r = await client.post(f"{url}/api/embed", json={"model": MODEL, "input": texts}, timeout=3600)
    r.raise_for_status()
    assert len(r.json()["embeddings"]) == len(texts)
    end = time.perf_counter()
    return start, end, end - start


def gaps(times: list[float], start: float = float("-inf"), end: float = float("inf")) -> list[float]:
    """Gaps between consecutive tokens whose later token came within [start, end]."""
    return [b - a for a, b in zip(times, times[1:]) if start <= b <= end]


async def round_(url: str, tokens: int, texts: list[str]) -> dict[str, float]:
    async with httpx.AsyncClient() as client:
        alone = gaps(await chat(client, url, tokens, asyncio.Event()))
        embed_alone = (await embed(client, url, texts))[2]
        started = asyncio.Event()
        chat_task = asyncio.create_task(chat(client, url, tokens, started))
        await started.wait()
        e_start, e_end, embed_beside = await embed(client, url, texts)
        times = await chat_task
        during = gaps(times, e_start, e_end)
    if not during:
        raise RuntimeError("the chat ended before the embed did: raise --tokens")
    return {
        "median gap alone": statistics.median(alone),
        "largest gap alone": max(alone),
        "median gap during embed": statistics.median(during),
        "largest gap during embed": max(during),
        "embed alone": embed_alone,
        "embed beside chat": embed_beside,
        "tokens during embed": len(during),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gguf", default=str(CACHED_GGUF))
    p.add_argument("--tokens", type=int, default=300)
    p.add_argument("--passages", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args()

    from localrt.store.importer import import_gguf
    from localrt.store.store import Store

    work = Path(tempfile.mkdtemp(prefix="localrt-bench-mixed-"))
    store = Store(work / "models")
    import_gguf(store, MODEL, Path(a.gguf), params={"num_ctx": 2048, "num_thread": a.threads})
    env = {"LOCALRT_BACKEND": "llama.cpp", "LOCALRT_KEEP_ALIVE": "-1"}
    srv = LocalrtServer(work / "models", work / "serve.log", env=env)
    texts = passages(a.passages)
    rounds: list[dict[str, float]] = []
    try:
        asyncio.run(_warm(srv.url, texts[:2]))
        print(f"{Path(a.gguf).name}, {a.threads} threads, chat of {a.tokens} tokens, {a.passages} passages")
        for r in range(a.rounds):
            got = asyncio.run(round_(srv.url, a.tokens, texts))
            rounds.append(got)
            print(f"round {r + 1}: {_line(got)} (loadavg {os.getloadavg()[0]:.2f})")
    finally:
        srv.stop()
    median = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
    print(f"median:  {_line(median)}")


async def _warm(url: str, texts: list[str]) -> None:
    """Load the model and run each path once."""
    async with httpx.AsyncClient() as client:
        await chat(client, url, 4, asyncio.Event())
        await embed(client, url, texts)


def _line(r: dict[str, float]) -> str:
    gap_ratio = r["largest gap during embed"] / r["largest gap alone"]
    embed_ratio = r["embed beside chat"] / r["embed alone"]
    return (
        f"chat gaps alone median {1000 * r['median gap alone']:.1f} ms, largest {1000 * r['largest gap alone']:.1f}"
        f" ms; during the embed median {1000 * r['median gap during embed']:.1f} ms, largest"
        f" {1000 * r['largest gap during embed']:.1f} ms ({gap_ratio:.2f}x, {r['tokens during embed']:.0f} tokens);"
        f" embed alone {r['embed alone']:.2f} s, beside the chat {r['embed beside chat']:.2f} s"
        f" ({embed_ratio:.2f}x)"
    )


if __name__ == "__main__":
    main()
