"""Resident memory of a server with its model loaded and its sequences used: llama-server against
`localrt serve` on the llama.cpp backend and on the torch engine, same GGUF, threads, context per sequence
and parallel sequences (the goal: the torch engine's server at most 1.5x the llama.cpp backend's).

Each server answers `--slots` concurrent requests first, so the weights are read and every sequence's
KV has been written; then the resident set of the server and its children is read (psutil). The
servers are the ones `bench_serve.py` starts. `--prompt-words N` makes each request an agent-sized one:
a distinct prompt of about N words (8,000 words are about 10k tokens on Gemma 3's vocabulary).

    python benchmarks/bench_memory.py --threads 2 --slots 16 --ctx 2048
    python benchmarks/bench_memory.py --gguf GEMMA3 --slots 4 --ctx 32768 --backend llama.cpp --prompt-words 8000
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_serve as bs  # noqa: E402


def listening_pid(port: int) -> int:
    for conn in psutil.net_connections("tcp"):
        if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == port and conn.pid:
            return conn.pid
    raise SystemExit(f"no process listens on port {port}")


def resident_bytes(pid: int) -> int:
    proc = psutil.Process(pid)
    return proc.memory_info().rss + sum(c.memory_info().rss for c in proc.children(recursive=True))


def long_prompts(n: int, words: int) -> list[list[dict[str, str]]]:
    """n distinct user prompts of about `words` words each, ending in a short question."""
    vocabulary = "file function test branch commit module error value result change review build".split()
    out = []
    for i in range(n):
        body = " ".join(vocabulary[(i * 5 + j * 7) % len(vocabulary)] for j in range(words))
        out.append([{"role": "user", "content": f"Request {i}. {body}\nSummarize the above in one line."}])
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gguf", type=Path, default=bs.CACHED_GGUF)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--slots", type=int, default=16)
    p.add_argument("--ctx", type=int, default=2048, help="context per sequence")
    p.add_argument(
        "--backend",
        action="append",
        default=[],
        help="localrt backends (default llama.cpp, torch; torch:dequantized for the fp32 weights)",
    )
    p.add_argument("--no-llama-server", action="store_true")
    p.add_argument("--prompt-words", type=int, default=0, help="agent-sized requests: words per prompt")
    a = p.parse_args()
    cfg = bs.Config(
        gguf=a.gguf,
        threads=a.threads,
        slots=a.slots,
        ctx=a.ctx,
        max_tokens=16,
        concurrency=[a.slots],
        backends=a.backend or ["llama.cpp", "torch"],
        server_spec="",
        skip=set(),
        with_llama_server=not a.no_llama_server,
    )
    print(
        f"GGUF {a.gguf.name} ({a.gguf.stat().st_size / 2**20:.1f} MiB), {a.slots} sequences x {a.ctx} tokens"
    )
    sizes: dict[str, int] = {}
    for name, start in bs.servers(cfg):
        model = bs.MODEL if name.startswith("localrt") else "default"
        with start() as url:
            prompts = long_prompts(a.slots, a.prompt_words) if a.prompt_words else bs.questions(a.slots)
            asyncio.run(bs.drive(url, model, prompts, cfg.max_tokens))
            sizes[name] = resident_bytes(listening_pid(int(url.rsplit(":", 1)[1])))
        print(f"{name:>20}: {sizes[name] / 2**20:8.1f} MiB resident")
    for base_name in ("llama-server", "localrt/llama.cpp"):
        base = sizes.get(base_name)
        if base:
            for name, size in sizes.items():
                if name != base_name:
                    print(f"{name:>20}: {size / base:.2f}x {base_name}")


if __name__ == "__main__":
    main()
