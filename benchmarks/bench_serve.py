"""localrt serve against llama.cpp's own llama-server: the same GGUF, threads and slots, the same load.

Both servers run on 127.0.0.1 and are driven by the official `openai` client with streaming chat
completions (greedy, `stream_options.include_usage`). For each concurrency the script prints the aggregate
completion tokens/s, the median and p95 time to first token, and localrt / llama-server ratios (tok/s:
higher is better for localrt; TTFT: lower). Three workloads:

- `load`: N clients, each with its own short question, at every `--concurrency`;
- `prefix`: 16 clients behind one ~1,000-token system prompt, against the same prompt made distinct per
  client by its first line (nothing to share: prefix reuse in effect off), TTFT compared;
- `grounded`: 16 clients each asking to repeat a different ~200-token passage from their prompt; localrt
  with prompt-lookup speculation inside the batch vs llama-server with `--spec-type` (`--server-spec`),
  and localrt's greedy outputs checked identical with speculation off;
- `agent`: `--agents` clients (8) each in a `--turns`-turn conversation (4) behind one shared ~1,000-token
  system prompt, every turn resending the whole history (the replies so far included): aggregate tok/s and
  the time to first token of each new turn (median over every turn, and over the turns after the first).

`--backend torch` adds the torch engine as a third column (another `localrt serve`).
llama-server comes from `tests/fixtures_hf.py::llama_cpp_tools()` (built once, cached outside the repo).

    python benchmarks/bench_serve.py --threads 2 --slots 16 --concurrency 1,4,16,32 --max-tokens 64
    python benchmarks/bench_serve.py --smoke   # tiny settings, to check that everything runs

At 1 client a round is a single request: `--rounds 3` (or more) runs each concurrency that many times, with
other questions each round, and pools the samples. The load keeps every server up at once and takes each
round on one server after the other, so a drift of the machine's speed moves them alike.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from dataclasses import field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
CACHED_GGUF = (
    Path(os.environ.get("LOCALRT_TEST_CACHE", Path.home() / ".cache" / "localrt-tests"))
    / "SmolLM2-135M-Instruct.Q4_1.gguf"
)
MODEL = "bench-serve:latest"
TOPICS = [
    "the sea", "mountains", "a library", "the moon", "a market", "trains", "winter", "a garden",
    "bees", "a lighthouse", "bread", "rivers", "clocks", "a violin", "the desert", "owls",
]  # fmt: skip
PASSAGE_WORDS = (
    "keeper lamp harbour tide rope sail gull storm lantern anchor cliff wave shore mast deck net "
    "island beacon compass chart fog bell pier hull oar reef dawn dusk salt spray current"
).split()


@dataclass
class Sample:
    ttft: float  # seconds to the first content token
    tokens: int
    text: str
    drafted: int = 0  # speculative draft tokens proposed and accepted (both servers report them)
    accepted: int = 0


@dataclass
class Row:
    name: str
    concurrency: int
    wall: float
    samples: list[Sample] = field(default_factory=list)

    @property
    def tok_s(self) -> float:
        return sum(s.tokens for s in self.samples) / self.wall if self.wall > 0 else 0.0

    def ttft(self, q: float) -> float:
        values = sorted(s.ttft for s in self.samples)
        return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


# ---- servers --------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_ready(url: str, proc: subprocess.Popen[bytes], timeout: float = 300.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode}: {url}")
        try:
            if httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"server did not come up: {url}")


@contextmanager
def llama_server(
    gguf: Path, threads: int, slots: int, ctx: int, spec: list[str] | None = None
) -> Iterator[str]:
    sys.path.insert(0, str(ROOT))
    from tests.fixtures_hf import llama_cpp_tools

    port = free_port()
    cmd = [
        str(llama_cpp_tools() / "llama-server"), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
        "-t", str(threads), "-tb", str(threads), "-np", str(slots), "-c", str(ctx * slots), "--kv-unified",
        "--no-webui", "--jinja", *(spec or []),
    ]  # fmt: skip
    log = Path(os.environ.get("BENCH_LLAMA_SERVER_LOG", os.devnull))
    with open(log, "ab") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_ready(url, proc)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@contextmanager
def localrt_server(gguf: Path, threads: int, slots: int, ctx: int, backend: str) -> Iterator[str]:
    """`backend` may carry the torch engine's numerics after a colon: `torch:dequantized`."""
    backend, _, numerics = backend.partition(":")
    root = Path(tempfile.mkdtemp(prefix="localrt-bench-serve-"))
    env = {
        **os.environ,
        "LOCALRT_MODELS": str(root / "models"),
        "LOCALRT_NUM_PARALLEL": str(slots),
        "LOCALRT_BACKEND": backend,
        "LOCALRT_KEEP_ALIVE": "-1",
    }
    sys.path.insert(0, str(ROOT))
    os.environ["LOCALRT_MODELS"] = env["LOCALRT_MODELS"]
    from localrt.store.importer import import_gguf
    from localrt.store.store import Store

    params: dict[str, Any] = {"num_thread": threads, "num_ctx": ctx, "temperature": 0}
    if numerics:
        params["numerics"] = numerics
    import_gguf(Store(root / "models"), MODEL, gguf, params=params)
    port = free_port()
    env["LOCALRT_HOST"] = f"127.0.0.1:{port}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "localrt", "serve"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        wait_ready(url, proc)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        shutil.rmtree(root, ignore_errors=True)


# ---- the load -------------------------------------------------------------------------------------
def bench_client(url: str) -> Any:
    """The `openai` client of every run, with a fresh connection per request: llama-server may close a
    kept-alive connection after a streamed answer, and a request sent on it then fails with "Server
    disconnected without sending a response". Both servers are driven alike."""
    import httpx
    from openai import AsyncOpenAI

    http = httpx.AsyncClient(limits=httpx.Limits(max_keepalive_connections=0), timeout=3600)
    return AsyncOpenAI(base_url=f"{url}/v1", api_key="bench", max_retries=0, timeout=3600, http_client=http)


async def one_request(
    client: Any, model: str, messages: list[dict[str, str]], max_tokens: int, extra: dict
) -> Sample:
    start = time.perf_counter()
    first: float | None = None
    text, tokens, drafted, accepted = "", 0, 0, 0
    stream = await client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=extra,
    )
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            if first is None:
                first = time.perf_counter() - start
            text += chunk.choices[0].delta.content
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
            extra_usage = chunk.usage.model_extra or {}  # localrt's counts ride in usage
            drafted = extra_usage.get("draft_count", drafted)
            accepted = extra_usage.get("draft_accepted_count", accepted)
        timings = (chunk.model_extra or {}).get("timings") or {}  # llama-server's, on its last chunks
        drafted = timings.get("draft_n", drafted)
        accepted = timings.get("draft_n_accepted", accepted)
    ttft = first if first is not None else time.perf_counter() - start
    return Sample(ttft, tokens, text, drafted, accepted)


async def drive(
    url: str,
    model: str,
    conversations: list[list[dict[str, str]]],
    max_tokens: int,
    extra: dict | None = None,
) -> tuple[float, list[Sample]]:

    client = bench_client(url)
    await one_request(client, model, [{"role": "user", "content": "Hi"}], 2, extra or {})  # load, warm up
    start = time.perf_counter()
    samples = await asyncio.gather(
        *(one_request(client, model, c, max_tokens, extra or {}) for c in conversations)
    )
    wall = time.perf_counter() - start
    await client.close()
    return wall, list(samples)


def questions(n: int, salt: int = 0) -> list[list[dict[str, str]]]:
    return [
        [
            {
                "role": "user",
                "content": f"Write a long, detailed story about {TOPICS[(i + salt) % len(TOPICS)]} (#{i + salt}).",
            }
        ]
        for i in range(n)
    ]


def shared_prefix(n: int, distinct: bool, n_rules: int = 60) -> list[list[dict[str, str]]]:
    rules = " ".join(
        f"Rule {i}: be accurate, kind and brief, and cite the rule you follow." for i in range(n_rules)
    )
    out = []
    for i in range(n):
        head = f"Client {i}. " if distinct else ""  # a different first line: nothing in common to reuse
        system = f"{head}You are a careful assistant. {rules}"
        out.append(
            [
                {"role": "system", "content": system},
                {"role": "user", "content": f"Tell me about {TOPICS[i % 16]}."},
            ]
        )
    return out


AGENT_TURNS = (
    "Tell me about {topic}.",
    "Go on, with more detail about {topic}.",
    "Summarise what you said about {topic} in three points.",
    "Which of those points matters most, and why?",
)


def agent_system(n_rules: int = 60) -> str:
    """The agents' shared system prompt: the prefix workload's, ~1,000 tokens at 60 rules."""
    return shared_prefix(1, False, n_rules)[0][0]["content"]


async def agent_conversation(
    client: Any, model: str, i: int, system: str, turns: int, max_tokens: int
) -> list[Sample]:
    """One agent: `turns` turns, each resending the system prompt, the questions and the replies so far."""
    messages = [{"role": "system", "content": system}]
    samples = []
    for t in range(turns):
        messages.append(
            {"role": "user", "content": AGENT_TURNS[t % len(AGENT_TURNS)].format(topic=TOPICS[i % 16])}
        )
        sample = await one_request(client, model, messages, max_tokens, {})
        samples.append(sample)
        messages.append({"role": "assistant", "content": sample.text})
    return samples


async def drive_agents(
    url: str, model: str, agents: int, turns: int, system: str, max_tokens: int
) -> tuple[float, list[list[Sample]]]:

    client = bench_client(url)
    await one_request(client, model, [{"role": "user", "content": "Hi"}], 2, {})  # load, warm up
    start = time.perf_counter()
    runs = await asyncio.gather(
        *(agent_conversation(client, model, i, system, turns, max_tokens) for i in range(agents))
    )
    wall = time.perf_counter() - start
    await client.close()
    return wall, list(runs)


def grounded(n: int, n_words: int = 150) -> list[list[dict[str, str]]]:
    out = []
    for i in range(n):
        words = [PASSAGE_WORDS[(i * 7 + j * 3) % len(PASSAGE_WORDS)] for j in range(n_words)]
        passage = " ".join(words)
        task = f"Repeat this passage exactly, word for word:\n\n{passage}"
        out.append([{"role": "user", "content": task}])
    return out


# ---- the runs -------------------------------------------------------------------------------------
@dataclass
class Config:
    gguf: Path
    threads: int
    slots: int
    ctx: int
    max_tokens: int
    concurrency: list[int]
    backends: list[str]
    server_spec: str
    skip: set[str]
    with_llama_server: bool = True
    rounds: int = 1  # rounds per concurrency (one round = N requests at once); more rounds, steadier figures
    scale: float = 1.0  # of the prefix and passage lengths (smoke runs use a tenth)
    grounded_tokens: int = 0  # new tokens per grounded request; 0: --max-tokens
    agents: int = 8  # clients of the agent run
    turns: int = 4  # turns per agent conversation


def servers(cfg: Config) -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    if cfg.with_llama_server:
        out.append(("llama-server", lambda: llama_server(cfg.gguf, cfg.threads, cfg.slots, cfg.ctx)))
    for backend in cfg.backends:
        out.append(
            (
                f"localrt/{backend}",
                lambda b=backend: localrt_server(cfg.gguf, cfg.threads, cfg.slots, cfg.ctx, b),
            )
        )
    return out


def run_load(cfg: Config) -> dict[str, list[Row]]:
    """Every server up at once and each round taken by one server after the other: a machine whose speed
    drifts (this shared VM runs 10-20% slower for a minute at a time) then moves every server's figure
    alike instead of the ratio between them."""
    results: dict[str, list[Row]] = {}
    with contextlib.ExitStack() as stack:
        urls = {name: stack.enter_context(start()) for name, start in servers(cfg)}
        for c in cfg.concurrency:
            rows = {name: Row(name, c, 0.0) for name in urls}
            for r in range(cfg.rounds):  # each round asks other questions: no prompt is repeated
                for name, url in urls.items():
                    model = MODEL if name.startswith("localrt") else "default"
                    wall, samples = asyncio.run(drive(url, model, questions(c, salt=r * c), cfg.max_tokens))
                    rows[name].wall += wall
                    rows[name].samples += samples
            for name, row in rows.items():
                results.setdefault(name, []).append(row)
    return results


def run_prefix(cfg: Config, clients: int) -> dict[str, dict[str, Row]]:
    results: dict[str, dict[str, Row]] = {}
    for name, start in servers(cfg):
        model = MODEL if name.startswith("localrt") else "default"
        with start() as url:
            for label, distinct in (("shared", False), ("distinct", True)):
                wall, samples = asyncio.run(
                    drive(
                        url,
                        model,
                        shared_prefix(clients, distinct, max(1, int(60 * cfg.scale))),
                        cfg.max_tokens,
                    )
                )
                results.setdefault(name, {})[label] = Row(name, clients, wall, samples)
    return results


def run_grounded(cfg: Config, clients: int) -> dict[str, Row]:
    work = grounded(clients, max(10, int(150 * cfg.scale)))
    n_new = cfg.grounded_tokens or cfg.max_tokens
    spec = ["--spec-type", cfg.server_spec] if cfg.server_spec else []
    results: dict[str, Row] = {}
    if cfg.with_llama_server:
        with llama_server(cfg.gguf, cfg.threads, cfg.slots, cfg.ctx, spec) as url:
            wall, samples = asyncio.run(drive(url, "default", work, n_new))
            results[f"llama-server {cfg.server_spec or 'no spec'}"] = Row(
                "llama-server", clients, wall, samples
            )
    for label, mode in (("localrt lookup", "lookup"), ("localrt off", "off")):
        # a fresh server per mode: on one server the second run would find every prompt cached
        with localrt_server(cfg.gguf, cfg.threads, cfg.slots, cfg.ctx, "llama.cpp") as url:
            wall, samples = asyncio.run(drive(url, MODEL, work, n_new, {"speculative": mode}))
            results[label] = Row(label, clients, wall, samples)
    same = [
        a.text == b.text for a, b in zip(results["localrt lookup"].samples, results["localrt off"].samples)
    ]
    print(f"grounded: localrt greedy output identical with lookup on and off: {sum(same)}/{len(same)}")
    return results


def run_agent(cfg: Config) -> dict[str, tuple[Row, Row]]:
    """Per server: (every turn, the turns after the first) of the agent conversations."""
    system = agent_system(max(1, int(60 * cfg.scale)))
    results: dict[str, tuple[Row, Row]] = {}
    for name, start in servers(cfg):
        model = MODEL if name.startswith("localrt") else "default"
        with start() as url:
            wall, runs = asyncio.run(drive_agents(url, model, cfg.agents, cfg.turns, system, cfg.max_tokens))
        every = Row(name, cfg.agents, wall, [s for run in runs for s in run])
        later = Row(name, cfg.agents, wall, [s for run in runs for s in run[1:]])
        results[name] = (every, later)
    return results


# ---- printing -------------------------------------------------------------------------------------
def print_load(results: dict[str, list[Row]]) -> None:
    names = list(results)
    print("\nload: aggregate tok/s | TTFT median / p95 (ms)")
    print(
        f"{'clients':>8} "
        + " ".join(f"{n:>34}" for n in names)
        + "   ratios vs llama-server (tok/s, TTFT med)"
    )
    base = results.get("llama-server", [])
    for i, row0 in enumerate(results[names[0]]):
        cells = []
        for n in names:
            r = results[n][i]
            cells.append(f"{r.tok_s:9.1f} | {r.ttft(0.5) * 1000:7.0f} / {r.ttft(0.95) * 1000:7.0f}")
        ratios = []
        if base:
            b = base[i]
            for n in names:
                if n != "llama-server":
                    r = results[n][i]
                    ratios.append(f"{n}: {r.tok_s / b.tok_s:.2f}x, {r.ttft(0.5) / b.ttft(0.5):.2f}x")
        print(f"{row0.concurrency:>8} " + " ".join(f"{c:>34}" for c in cells) + "   " + "; ".join(ratios))


def print_prefix(results: dict[str, dict[str, Row]]) -> None:
    print("\nshared prefix (one ~1,000-token system prompt) vs distinct prefixes: TTFT median (ms), tok/s")
    for name, rows in results.items():
        s, d = rows["shared"], rows["distinct"]
        print(
            f"{name:>20}: shared {s.ttft(0.5) * 1000:7.0f} ms {s.tok_s:7.1f} tok/s | distinct "
            f"{d.ttft(0.5) * 1000:7.0f} ms {d.tok_s:7.1f} tok/s | TTFT {d.ttft(0.5) / s.ttft(0.5):.2f}x lower shared"
        )


def print_grounded(results: dict[str, Row]) -> None:
    print("\ngrounded (repeat a ~200-token passage): aggregate tok/s")
    base = next((r for k, r in results.items() if k.startswith("llama-server")), None)
    for name, row in results.items():
        ratio = f" ({row.tok_s / base.tok_s:.2f}x llama-server)" if base and base.tok_s else ""
        drafted = sum(s.drafted for s in row.samples)
        accepted = sum(s.accepted for s in row.samples)
        drafts = f", drafts accepted {accepted}/{drafted} ({accepted / drafted:.0%})" if drafted else ""
        print(f"{name:>28}: {row.tok_s:7.1f} tok/s{ratio}, TTFT median {row.ttft(0.5) * 1000:.0f} ms{drafts}")


def print_agent(results: dict[str, tuple[Row, Row]], agents: int, turns: int) -> None:
    print(
        f"\nagent ({agents} clients x {turns} turns, shared ~1,000-token system prompt, history resent): "
        "aggregate tok/s | TTFT median (ms) of every turn / of the turns after the first"
    )
    base = results.get("llama-server")
    for name, (every, later) in results.items():
        ratio = ""
        if base is not None and name != "llama-server" and base[0].tok_s and later.samples:
            ratio = (
                f"   vs llama-server: {every.tok_s / base[0].tok_s:.2f}x tok/s, "
                f"new-turn TTFT {later.ttft(0.5) / base[1].ttft(0.5):.2f}x"
            )
        print(
            f"{name:>20}: {every.tok_s:7.1f} tok/s | {every.ttft(0.5) * 1000:7.0f} / "
            f"{later.ttft(0.5) * 1000:7.0f}{ratio}"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gguf", default=str(CACHED_GGUF))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--slots", type=int, default=16)
    p.add_argument("--ctx", type=int, default=2048, help="context per sequence")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--concurrency", default="1,4,16,32")
    p.add_argument("--clients", type=int, default=16, help="clients of the prefix and grounded runs")
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="rounds per concurrency of the load run (one at 1 "
        "client is a single request: use 3 or more for its figures)",
    )
    p.add_argument(
        "--backend",
        action="append",
        default=[],
        help="extra localrt backend column (torch, or torch:NUMERICS, e.g. torch:dequantized)",
    )
    p.add_argument("--server-spec", default="ngram-simple", help="llama-server --spec-type for grounded")
    p.add_argument(
        "--grounded-tokens",
        type=int,
        default=0,
        help="new tokens per grounded request (default: --max-tokens; 200 lets each client repeat its whole passage)",
    )
    p.add_argument("--agents", type=int, default=8, help="clients of the agent run")
    p.add_argument("--turns", type=int, default=4, help="turns per agent conversation")
    p.add_argument("--skip", default="", help="comma list of load,prefix,grounded,agent to skip")
    p.add_argument("--no-llama-server", action="store_true", help="localrt columns only")
    p.add_argument("--smoke", action="store_true", help="tiny settings: check that every part runs")
    a = p.parse_args()
    gguf = Path(a.gguf)
    if not gguf.is_file():
        raise SystemExit(f"no GGUF at {gguf}: pass --gguf PATH (running the test suite once caches SmolLM2)")
    cfg = Config(
        gguf=gguf,
        threads=a.threads,
        slots=a.slots,
        ctx=a.ctx,
        max_tokens=a.max_tokens,
        concurrency=[int(c) for c in a.concurrency.split(",") if c],
        backends=["llama.cpp", *a.backend],
        server_spec=a.server_spec,
        skip={s for s in a.skip.split(",") if s},
        with_llama_server=not a.no_llama_server,
        rounds=max(1, a.rounds),
        grounded_tokens=a.grounded_tokens,
        agents=a.agents,
        turns=a.turns,
    )
    clients = a.clients
    if a.smoke:
        cfg.threads, cfg.slots, cfg.max_tokens, cfg.concurrency, clients = 1, 2, 4, [1, 2], 2
        cfg.scale = 0.1
        cfg.agents, cfg.turns = 2, 2
    print(
        f"GGUF {gguf.name}, {cfg.threads} threads, {cfg.slots} slots, ctx {cfg.ctx}, {cfg.max_tokens} new tokens"
    )
    if "load" not in cfg.skip:
        print_load(run_load(cfg))
    if "prefix" not in cfg.skip:
        print_prefix(run_prefix(cfg, clients))
    if "grounded" not in cfg.skip:
        print_grounded(run_grounded(cfg, clients))
    if "agent" not in cfg.skip:
        print_agent(run_agent(cfg), cfg.agents, cfg.turns)


if __name__ == "__main__":
    main()
