"""A soak: a real `localrt serve` under a mixed load for a given time, watched for errors and leaks.

N clients send, for `--minutes`, a mix of Ollama chat and generate (streamed and not), OpenAI and Anthropic
streamed chat, embeddings, streams dropped after three chunks, requests cancelled before their answer,
malformed bodies (400) and oversized ones (413, under a 256 KiB LOCALRT_MAX_BODY), against two models under
LOCALRT_MAX_LOADED_MODELS=1, so that switching models unloads and loads them. Before the run, a warm-up of
the same load, then a quiet spell, gives the idle figures; after it, another quiet spell gives the end ones.

It prints, per minute: requests answered, statuses, latency percentiles of the answered ones, and the
server's RSS, open file descriptors, threads and active requests (waiting or running on a model, as
/metrics' localrt_queue_depth counts them: a generation leaves it once its sequence is freed); then every
status by count, and the checks: no 5xx but the documented 503 ("server busy"), no stream ending in an
error, RSS grown less than 10% from the idle figure after the warm-up, descriptors and threads back to
their idle counts, no active request at the end. The exit status is 1 when a check fails. `--json FILE`
writes the figures for a test to read.

    python benchmarks/soak.py --minutes 10 --clients 8
    python benchmarks/soak.py --minutes 2 --clients 4 --warmup 20 --tiny   # what the default test run does

Linux only (the server's figures come from /proc). On a shared machine, say how loaded it was.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict
from dataclasses import dataclass
from dataclasses import field
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
CACHED_GGUF = (
    Path(os.environ.get("LOCALRT_TEST_CACHE", Path.home() / ".cache" / "localrt-tests"))
    / "SmolLM2-135M-Instruct.Q4_1.gguf"
)
MODELS = ("soak-a:latest", "soak-b:latest")
MAX_BODY = 256 << 10
TOKENS = 24  # per answer: short requests, many of them
POOL_CAP = min(32, (os.cpu_count() or 1) + 4)  # the loop's default executor's max_workers (asyncio, uvloop)
QUIET_S = 15.0  # idle worker threads (anyio's) end after 10 s without work
SETTLE_S = 60.0  # at most this long for the end figures to come back to the idle ones
QUESTIONS = [
    "Name three rivers.", "What is a lighthouse for?", "Say hello in French.", "Why do bees dance?",
    "Give me a word that rhymes with moon.", "What colour is the sky at dusk?", "Count to five.",
    "What is bread made of?",
]  # fmt: skip


@dataclass
class Sample:
    """The server's figures at one moment."""

    at: float
    rss_mb: float
    fds: int
    threads: int  # the process's, native ones included
    active: int
    pool: int  # of them, the event loop's thread pool (asyncio's default executor), per /metrics

    @property
    def others(self) -> int:
        """The threads beside the loop's pool, which grows on demand up to its cap and keeps its workers."""
        return self.threads - self.pool


@dataclass
class Outcome:
    at: float  # seconds since the run started
    kind: str
    status: str  # an HTTP status, "client-closed" (dropped or cancelled on purpose) or "stream-error"
    latency_s: float


@dataclass
class Report:
    minutes: float
    clients: int
    load_before: float
    outcomes: list[Outcome] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    idle: Sample | None = None
    end: Sample | None = None
    errors: list[str] = field(default_factory=list)  # the texts of unexpected answers (a few)
    tracebacks: int = 0  # in the server's log


# ---- the server ---------------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(root: Path, gguf: Path, threads: int, parallel: int) -> tuple[subprocess.Popen[bytes], str]:
    sys.path.insert(0, str(ROOT))
    from localrt.store.importer import import_gguf
    from localrt.store.store import Store

    store = Store(root / "models")
    for name, ctx in zip(MODELS, (1024, 768)):  # two loads of one file: comparable memory, real switches
        import_gguf(
            store,
            name,
            gguf,
            params={"num_thread": threads, "num_ctx": ctx, "num_predict": TOKENS, "temperature": 0},
        )
    port = free_port()
    env = {
        **os.environ,
        "LOCALRT_MODELS": str(root / "models"),
        "LOCALRT_HOST": f"127.0.0.1:{port}",
        "LOCALRT_MAX_LOADED_MODELS": "1",
        "LOCALRT_NUM_PARALLEL": str(parallel),
        "LOCALRT_KEEP_ALIVE": "-1",
        "LOCALRT_MAX_BODY": str(MAX_BODY),
    }
    log = open(root / "serve.log", "ab")  # noqa: SIM115 - the server writes it until it stops
    proc = subprocess.Popen([sys.executable, "-m", "localrt", "serve"], env=env, stdout=log, stderr=log)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"localrt serve exited: {(root / 'serve.log').read_text()[-2000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.2)
    raise SystemExit("localrt serve did not come up")


def sample(pid: int, url: str, at: float) -> Sample:
    status = Path(f"/proc/{pid}/status").read_text()
    rss = int(re.search(r"^VmRSS:\s+(\d+) kB", status, re.M)[1]) / 1024  # type: ignore[index]
    threads = int(re.search(r"^Threads:\s+(\d+)", status, re.M)[1])  # type: ignore[index]
    fds = len(os.listdir(f"/proc/{pid}/fd"))
    text = httpx.get(url + "/metrics", timeout=30).text
    active = sum(int(n) for n in re.findall(r"^localrt_queue_depth\{[^}]*\} (\d+)$", text, re.M))
    pool = sum(
        int(n) for n in re.findall(r'^localrt_threads\{name="(?:asyncio|uvloop)"\} (\d+)$', text, re.M)
    )
    return Sample(at, rss, fds, threads, active, pool)


# ---- the clients ----------------------------------------------------------------------------------------------
def chat_body(model: str, stream: bool) -> dict[str, Any]:
    # greedy on every route (OpenAI's and Anthropic's default temperature is 1): a question's answers are
    # then the same each time, so the RAM prompt cache (up to 512 MiB a model, by design) holds a bounded
    # set, and what grows is a leak
    question = [{"role": "user", "content": random.choice(QUESTIONS)}]
    return {"model": model, "messages": question, "stream": stream, "temperature": 0}


KINDS: list[tuple[str, float]] = [
    ("ollama-chat-stream", 0.16),
    ("ollama-chat", 0.10),
    ("ollama-generate-stream", 0.08),
    ("ollama-generate", 0.08),
    ("openai-chat-stream", 0.10),
    ("anthropic-stream", 0.06),
    ("embed", 0.12),
    ("drop-mid-stream", 0.10),
    ("cancel", 0.06),
    ("malformed", 0.07),
    ("oversized", 0.03),
    ("unknown-model", 0.04),
]
EXPECTED = {"malformed": "400", "oversized": "413", "unknown-model": "404"}


async def one_request(http: httpx.AsyncClient, kind: str, model: str, report: Report) -> str:
    """Send one request of `kind`; its status as recorded."""
    if kind == "malformed":
        r = await http.post("/api/chat", content=b'{"model": "soak-a", "messages": [', headers=JSON)
        return str(r.status_code)
    if kind == "oversized":
        r = await http.post(
            "/api/chat", content=b'{"pad": "' + b"x" * (MAX_BODY + 1024) + b'"}', headers=JSON
        )
        return str(r.status_code)
    if kind == "unknown-model":
        r = await http.post("/api/chat", json=chat_body("no-such-model:1", False))
        return str(r.status_code)
    if kind == "embed":
        r = await http.post("/api/embed", json={"model": model, "input": random.sample(QUESTIONS, 2)})
        return str(r.status_code)
    if kind == "cancel":
        task = asyncio.ensure_future(http.post("/api/chat", json=chat_body(model, False)))
        await asyncio.sleep(random.uniform(0.05, 0.5))
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            return "client-closed"
        return str(task.result().status_code)
    path, body = {
        "ollama-chat-stream": ("/api/chat", chat_body(model, True)),
        "ollama-chat": ("/api/chat", chat_body(model, False)),
        "ollama-generate-stream": (
            "/api/generate",
            {"model": model, "prompt": random.choice(QUESTIONS), "temperature": 0},
        ),
        "ollama-generate": (
            "/api/generate",
            {"model": model, "prompt": random.choice(QUESTIONS), "stream": False, "temperature": 0},
        ),
        "openai-chat-stream": ("/v1/chat/completions", chat_body(model, True) | {"max_tokens": TOKENS}),
        "anthropic-stream": ("/v1/messages", chat_body(model, True) | {"max_tokens": TOKENS}),
        "drop-mid-stream": ("/api/chat", chat_body(model, True)),
    }[kind]
    async with http.stream("POST", path, json=body) as r:
        lines = 0
        async for line in r.aiter_lines():
            if not line:
                continue
            lines += 1
            if kind == "drop-mid-stream" and lines == 3:
                return "client-closed"  # leaving the block closes the connection mid-answer
            if '"error"' in line and r.status_code == 200:
                report.errors.append(f"{kind}: {line[:300]}")
                return "stream-error"
        if r.status_code >= 400:
            report.errors.append(f"{kind}: HTTP {r.status_code} {(await r.aread())[:300]!r}")
        return str(r.status_code)


JSON = {"content-type": "application/json"}


async def client(url: str, until: float, started: float, switch: float, report: Report | None) -> None:
    rng_kinds, weights = zip(*KINDS)
    record = report or Report(0, 0, 0)  # the warm-up's answers are not kept
    async with httpx.AsyncClient(base_url=url, timeout=300) as http:
        while time.monotonic() < until:
            kind = random.choices(rng_kinds, weights)[0]
            model = MODELS[1] if random.random() < switch else MODELS[0]
            t0 = time.monotonic()
            try:
                status = await one_request(http, kind, model, record)
            except httpx.HTTPError as e:
                status = f"transport-error ({type(e).__name__})"
            if kind in EXPECTED and status != EXPECTED[kind]:
                record.errors.append(f"{kind}: HTTP {status}, expected {EXPECTED[kind]}")
            record.outcomes.append(Outcome(t0 - started, kind, status, time.monotonic() - t0))


async def load(
    url: str, seconds: float, clients: int, switch: float, report: Report | None, pid: int
) -> None:
    started = time.monotonic()
    until = started + seconds
    workers = [asyncio.ensure_future(client(url, until, started, switch, report)) for _ in range(clients)]
    while report is not None and time.monotonic() < until:
        await asyncio.sleep(min(60.0, until - time.monotonic()))
        report.samples.append(await asyncio.to_thread(sample, pid, url, time.monotonic() - started))
    await asyncio.gather(*workers)


def settle(pid: int, url: str, idle: Sample | None) -> Sample:
    """The figures once the server has been quiet: QUIET_S, then until they are back to `idle` (or
    SETTLE_S), with the first model loaded again (the one loaded when the idle figures were taken)."""
    httpx.post(url + "/api/chat", json=chat_body(MODELS[0], False), timeout=300)
    time.sleep(QUIET_S)
    deadline = time.monotonic() + SETTLE_S
    now = sample(pid, url, 0)
    while idle is not None and (now.fds > idle.fds or now.others > idle.others or now.active):
        if time.monotonic() > deadline:
            break
        time.sleep(1.0)
        now = sample(pid, url, 0)
    return now


# ---- the report ---------------------------------------------------------------------------------------------
def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def checks(report: Report) -> dict[str, bool]:
    statuses = Counter(o.status for o in report.outcomes)
    assert report.idle is not None and report.end is not None
    return {
        "no 5xx but 503": not [s for s in statuses if s.startswith("5") and s != "503"],
        "no stream ended in an error": statuses["stream-error"] == 0,
        "no transport error": not [s for s in statuses if s.startswith("transport-error")],
        "every bad request got its 4xx": not [e for e in report.errors if "expected" in e],
        "RSS grew less than 10%": report.end.rss_mb < 1.10 * report.idle.rss_mb,
        "file descriptors back to idle": report.end.fds <= report.idle.fds,
        "threads back to idle (the loop's pool within its cap)": report.end.others <= report.idle.others
        and report.end.pool <= POOL_CAP,
        "no active request at the end": report.end.active == 0,
        "the server logged no traceback": report.tracebacks == 0,
    }


def print_report(report: Report) -> None:
    print(f"\n{'minute':>6} {'answered':>8} {'2xx':>5} {'4xx':>5} {'5xx':>5} {'closed':>6} {'p50 ms':>7} "
          f"{'p90 ms':>7} {'p99 ms':>7} {'rss MB':>7} {'fds':>4} {'threads':>7} {'active':>6}")  # fmt: skip
    for i, s in enumerate(report.samples):
        mine = [
            o
            for o in report.outcomes
            if (s.at - 60) <= o.at < s.at or (i == len(report.samples) - 1 and o.at >= s.at)
        ]
        ok = [o.latency_s * 1000 for o in mine if o.status.startswith("2")]
        by = Counter(o.status[0] if o.status[0].isdigit() else o.status for o in mine)
        print(
            f"{i + 1:>6} {len(mine) - by['client-closed']:>8} {by['2']:>5} {by['4']:>5} {by['5']:>5} "
            f"{by['client-closed']:>6} {percentile(ok, 0.5):>7.0f} {percentile(ok, 0.9):>7.0f} "
            f"{percentile(ok, 0.99):>7.0f} {s.rss_mb:>7.1f} {s.fds:>4} {s.threads:>7} {s.active:>6}"
        )
    statuses = Counter(o.status for o in report.outcomes)
    print("\nstatuses: " + ", ".join(f"{k} x {v}" for k, v in sorted(statuses.items())))
    print(
        "by kind: "
        + ", ".join(f"{k} x {v}" for k, v in sorted(Counter(o.kind for o in report.outcomes).items()))
    )
    idle, end = report.idle, report.end
    assert idle is not None and end is not None
    print(
        f"idle after the warm-up: RSS {idle.rss_mb:.1f} MB, {idle.fds} fds, {idle.threads} threads "
        f"({idle.pool} of the loop's pool, cap {POOL_CAP})"
    )
    print(
        f"end, after {QUIET_S:.0f} s quiet: RSS {end.rss_mb:.1f} MB ({100 * (end.rss_mb / idle.rss_mb - 1):+.1f}%), "
        f"{end.fds} fds, {end.threads} threads ({end.pool} of the loop's pool), {end.active} active"
    )
    for text in report.errors[:10]:
        print(f"unexpected: {text}")
    for name, ok in checks(report).items():
        print(f"check: {name}: {'ok' if ok else 'FAILED'}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument(
        "--warmup", type=float, default=60.0, help="seconds of the same load before the idle figures"
    )
    p.add_argument("--switch", type=float, default=0.15, help="share of requests for the second model")
    p.add_argument("--threads", type=int, default=1, help="llama.cpp threads per model")
    p.add_argument("--parallel", type=int, default=4, help="LOCALRT_NUM_PARALLEL")
    p.add_argument("--gguf", type=Path, default=CACHED_GGUF)
    p.add_argument(
        "--tiny",
        action="store_true",
        help="a tiny random-weight Llama instead (the server's own work shows more)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None, help="write the figures here")
    a = p.parse_args()
    random.seed(a.seed)
    root = Path(tempfile.mkdtemp(prefix="localrt-soak-"))
    if a.tiny:
        sys.path.insert(0, str(ROOT))
        from tests.gguf_factory import write_tiny_llama

        a.gguf = write_tiny_llama(root / "tiny.gguf", context_length=2048)
    if not a.gguf.is_file():
        raise SystemExit(f"no GGUF at {a.gguf} (run the test suite once, or pass --gguf or --tiny)")
    report = Report(a.minutes, a.clients, os.getloadavg()[0])
    proc, url = start_server(root, a.gguf, a.threads, a.parallel)
    try:
        print(
            f"soak: {a.minutes:g} min, {a.clients} clients, load average {report.load_before:.1f} at the start"
        )
        for model in (MODELS[1], MODELS[0]):  # both load once; the first stays loaded
            httpx.post(url + "/api/chat", json=chat_body(model, False), timeout=300)
        asyncio.run(load(url, a.warmup, a.clients, a.switch, None, proc.pid))
        report.idle = settle(proc.pid, url, None)
        asyncio.run(load(url, a.minutes * 60, a.clients, a.switch, report, proc.pid))
        report.end = settle(proc.pid, url, report.idle)
    finally:
        proc.terminate()
        proc.wait(60)
    log = (root / "serve.log").read_text(errors="replace")
    report.tracebacks = log.count("Traceback")
    print_report(report)
    if report.tracebacks:
        print("the server's log, from its first traceback:\n" + log[log.index("Traceback") :][:4000])
    if a.json:
        a.json.write_text(json.dumps({**asdict(report), "checks": checks(report)}, indent=1))
    shutil.rmtree(root, ignore_errors=True)
    return 0 if all(checks(report).values()) else 1


if __name__ == "__main__":
    sys.exit(main())
