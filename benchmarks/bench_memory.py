"""Resident memory of a server with its model loaded and its sequences used: llama-server against
`localrt serve` on the llama.cpp backend and on the torch engine, same GGUF, threads, context per sequence
and parallel sequences (the goal: the torch engine's server at most 1.5x the llama.cpp backend's).

Each server answers `--slots` concurrent requests first, so the weights are read and every sequence's
KV has been written; then the resident set of the server and its children is read (psutil). The
servers are the ones `bench_serve.py` starts.

    python benchmarks/bench_memory.py --threads 2 --slots 16 --ctx 2048
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
            asyncio.run(bs.drive(url, model, bs.questions(a.slots), cfg.max_tokens))
            sizes[name] = resident_bytes(listening_pid(int(url.rsplit(":", 1)[1])))
        print(f"{name:>20}: {sizes[name] / 2**20:8.1f} MiB resident")
    base = sizes.get("localrt/llama.cpp")
    if base:
        for name, size in sizes.items():
            print(f"{name:>20}: {size / base:.2f}x localrt/llama.cpp")


if __name__ == "__main__":
    main()
