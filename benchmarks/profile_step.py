"""Where a lone sequence's time goes in the llama.cpp backend: counts and CPU time, not wall-clock guesses.

Runs, in one process and one after the other, with the same GGUF and threads:

- `raw`: a minimal ctypes loop over llama.cpp (one context, one sequence, unified cache, n_ubatch 512, a
  greedy sampler) — what llama-server's slot loop costs without its HTTP server;
- `raw-streams`: the same loop on a context shaped like the backend's (one KV stream per sequence,
  n_seq_max sequences, the backend's n_ubatch);
- `localrt`: `LlamaCppModel.generate` (the step loop, the sampler chain, the text assembler, the thread
  bridge), with every `llama_decode` timed.

For each it prints the time to the first token, the time per generated token, the decodes and micro-batches
run, and for `localrt` the step thread's time outside `llama_decode` per step (the Python overhead). Use the
ratios between rows of one run; on a loaded machine say so next to any figure.

    python benchmarks/profile_step.py --threads 2 --prompt 40 --tokens 64 --repeat 3

`--breakdown` instead drives a `localrt serve` (one llama.cpp thread) with 1 and 16 streamed OpenAI chat
requests at once and prints, per generated token, the server's CPU time in the forward (`llama_decode`, or
the torch forward with `--backend torch`) and outside it, by where it goes: `engine` (the step thread
outside the forward: batch building, sampling, bookkeeping), `text` (detokenizing, UTF-8, stop strings,
wherever they run), `hand-off` (from the step's outputs to the backend's event stream: queues, the
backend's stream on the event loop, any other thread), `runtime` (the runtime's reply parsing, prompt
rendering in worker threads), `http+loop` (the rest of the event loop thread: the API's chunk encoding,
uvicorn, wakeups):

    python benchmarks/profile_step.py --breakdown --seqs 1,16 --tokens 128 --repeat 3

Most of `http+loop` is the socket write of each chunk (the kernel's loopback send), which any server that
streams token by token pays. `--versus` measures the host work side by side instead: one streamed client
against `localrt serve` and against llama-server, interleaved rounds, each server's CPU per token (every
thread) beside the raw loop's; with `--threads 1` no worker thread spins, so the difference is host work:

    python benchmarks/profile_step.py --versus --threads 1 --tokens 512 --repeat 3

`--beside` streams one client on a model alone, then with a second model loaded beside it and idle, in one
`localrt serve`: what an idle model costs a busy one (an engine thread that outlived its work kept an
OpenMP pool, and libgomp stops spinning while it has more threads than cores):

    python benchmarks/profile_step.py --beside --backend llama.cpp --tokens 256 --repeat 3

`--floor` measures what no Python server on this stack avoids per streamed token: a bare Starlette app on
uvicorn (httptools, uvloop, as `localrt serve` runs) streams SSE chunks of an OpenAI chunk's shape, each
handed over from a thread as an engine thread hands over a token. It prints the handing thread's CPU per
chunk (the event loop's wake-up) and the event loop's (the chunk's JSON, Starlette, uvicorn, the socket
write), the floor under `--breakdown`'s `hand-off` and `http+loop`:

    python benchmarks/profile_step.py --floor --tokens 1000 --repeat 3

Between two tokens a decode streams the model's weights through the caches, so the server's code runs on
cold caches. `--weights-mb 94` makes the handing thread read that many MB between chunks (SmolLM2-135M
Q4_1's file) instead of sleeping, for the floor under that pressure:

    python benchmarks/profile_step.py --floor --weights-mb 94 --tokens 1000 --repeat 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CACHED_GGUF = (
    Path(os.environ.get("LOCALRT_TEST_CACHE", Path.home() / ".cache" / "localrt-tests"))
    / "SmolLM2-135M-Instruct.Q4_1.gguf"
)
PROFILE_MODEL = "profile-step:latest"


def cpu_timed(fn, into: list[int]):  # type: ignore[no-untyped-def]
    """fn, appending the calling thread's CPU ns of each call to `into` (its result passed on)."""

    def timed(*args):  # type: ignore[no-untyped-def]
        t = time.thread_time_ns()
        try:
            return fn(*args)
        finally:
            into.append(time.thread_time_ns() - t)

    return timed


def raw_loop(
    gguf: Path, prompt: list[int], n_new: int, threads: int, *, streams: int, n_ubatch: int, n_ctx: int
) -> dict[str, float]:
    from localrt.backends.base import LoadOptions
    from localrt.backends.base import SamplingParams
    from localrt.backends.llamacpp.lib import Batch
    from localrt.backends.llamacpp.lib import _lib
    from localrt.backends.llamacpp.lib import create_context
    from localrt.backends.llamacpp.lib import load_model
    from localrt.backends.llamacpp.lib import make_sampler
    from localrt.backends.llamacpp.lib import sample

    lib = _lib()
    opts = LoadOptions(num_thread=threads, num_ctx=n_ctx)
    model, _ = load_model(gguf, opts)
    p = lib.llama_context_default_params()
    p.n_ctx = n_ctx * streams
    p.n_batch = 512
    p.n_ubatch = n_ubatch
    p.n_seq_max = streams
    p.kv_unified = streams == 1
    p.n_threads = p.n_threads_batch = threads
    p.flash_attn_type = lib.LLAMA_FLASH_ATTN_TYPE_AUTO
    p.no_perf = True
    ctx = create_context(model, p)
    batch = Batch(512)
    sampler = make_sampler(model, n_ctx, SamplingParams(temperature=0), None, prompt)
    t0 = time.perf_counter()
    cpu0 = time.process_time()
    batch.clear()
    batch.add(prompt, 0, 0, [False] * (len(prompt) - 1) + [True])
    assert batch.decode(ctx.ctx) == 0
    token = sample(sampler, ctx.ctx, len(prompt) - 1)
    t_first = time.perf_counter() - t0
    first_cpu = (time.process_time() - cpu0) * 1000
    out = [token]
    pos = len(prompt)
    t1 = time.perf_counter()
    for _ in range(n_new - 1):
        batch.clear()
        batch.add([token], pos, 0, True)
        pos += 1
        assert batch.decode(ctx.ctx) == 0
        token = sample(sampler, ctx.ctx, 0)
        out.append(token)
    per_token = (time.perf_counter() - t1) / max(1, n_new - 1)
    cpu = (time.process_time() - cpu0) * 1000 / n_new
    sampler.close()
    batch.close()
    ctx.close()
    model.close()
    return {
        "ttft_ms": t_first * 1000,
        "per_token_ms": per_token * 1000,
        "tokens": out,
        "process_cpu_ms_per_token": cpu,
        "first_token_cpu_ms": first_cpu,
    }  # type: ignore[dict-item]


def localrt_run(gguf: Path, prompt: list[int], n_new: int, threads: int, slots: int, n_ctx: int) -> dict:
    from localrt.backends.base import GenerateRequest
    from localrt.backends.base import LoadOptions
    from localrt.backends.base import SamplingParams
    from localrt.backends.base import TextEvent
    from localrt.backends.llamacpp.backend import LlamaCppModel

    model = LlamaCppModel(gguf, LoadOptions(num_thread=threads, num_ctx=n_ctx, num_parallel=slots))
    engine = model.engine
    assert engine is not None
    decode_ns: list[int] = []
    rows: list[int] = []
    step_ns: list[int] = []
    orig_decode = engine.runner.batch.decode

    # CPU time of the step thread (with one llama.cpp thread the decode runs on it too): robust to load
    def timed_decode(ctx):  # type: ignore[no-untyped-def]
        t = time.thread_time_ns()
        rows.append(engine.runner.batch.n)
        ret = orig_decode(ctx)
        decode_ns.append(time.thread_time_ns() - t)
        return ret

    engine.runner.batch.decode = timed_decode  # type: ignore[method-assign]
    engine.step = cpu_timed(engine.step, step_ns)  # type: ignore[method-assign]

    async def go() -> tuple[float, float, list[int], int]:
        req = GenerateRequest(prompt_tokens=prompt, sampling=SamplingParams(temperature=0), num_predict=n_new)
        t0 = time.perf_counter()
        first = None
        ids: list[int] = []
        cpu0 = time.process_time()
        async for event in model.generate(req):
            if isinstance(event, TextEvent):
                if first is None:
                    first = time.perf_counter() - t0
                ids.extend(event.token_ids)
        total = time.perf_counter() - t0
        return first or total, total, ids, int((time.process_time() - cpu0) * 1e9)

    first, total, ids, cpu_ns = asyncio.run(go())
    model.unload()
    n_steps = len(step_ns)
    overhead = [s - d for s, d in zip(step_ns, decode_ns)]
    return {
        "ttft_ms": first * 1000,
        "per_token_ms": (total - first) * 1000 / max(1, len(ids) - 1),
        "tokens": ids,
        "steps": n_steps,
        "decodes": len(decode_ns),
        "prefill_rows": rows[0] if rows else 0,
        "decode_cpu_ms_median": statistics.median(decode_ns[1:]) / 1e6 if len(decode_ns) > 1 else 0.0,
        "step_overhead_cpu_ms_median": statistics.median(overhead[1:]) / 1e6 if len(overhead) > 1 else 0.0,
        "first_decode_cpu_ms": decode_ns[0] / 1e6 if decode_ns else 0.0,
        "process_cpu_ms_per_token": cpu_ns / 1e6 / max(1, len(ids)),
    }


def count_ubatches(seq_of_row: list[int], n_ubatch: int) -> int:
    """How many micro-batches llama.cpp cuts a multi-stream batch into (its equal split, sequential seq ids:
    each micro-batch takes the same number of rows from a run of consecutive seq ids)."""
    left: dict[int, int] = {}
    for s in seq_of_row:
        left[s] = left.get(s, 0) + 1
    count = 0
    while left:
        run: list[int] = []
        for s in sorted(left):
            if run and s != run[-1] + 1:
                break
            run.append(s)
        run = run[: max(1, n_ubatch)]
        size = max(1, min(min(left[s] for s in run), n_ubatch // len(run)))
        for s in run:
            left[s] -= size
            if left[s] <= 0:
                del left[s]
        count += 1
    return count


def batch_run(gguf: Path, threads: int, slots: int, n_ctx: int, n_new: int, clients: int, spec: str) -> dict:
    """`clients` grounded requests at once (bench_serve's passages, ChatML-templated), in process: the step
    thread's CPU time per generated token (with one llama.cpp thread it runs every decode itself), steps,
    decodes and the greedy texts (to check them against another variant)."""
    from localrt.backends.base import GenerateRequest
    from localrt.backends.base import LoadOptions
    from localrt.backends.base import SamplingParams
    from localrt.backends.base import TextEvent
    from localrt.backends.llamacpp.backend import LlamaCppModel

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_serve import grounded

    model = LlamaCppModel(gguf, LoadOptions(num_thread=threads, num_ctx=n_ctx, num_parallel=slots))
    engine = model.engine
    assert engine is not None
    prompts = [
        model.tokenize(
            f"<|im_start|>user\n{conv[0]['content']}<|im_end|>\n<|im_start|>assistant\n", True, True
        )
        for conv in grounded(clients)
    ]
    step_ns: list[int] = []
    decode_ns: list[int] = []
    rows: list[int] = []
    orig_decode = engine.runner.batch.decode

    def timed_decode(ctx):  # type: ignore[no-untyped-def]
        t = time.thread_time_ns()
        rows.append(engine.runner.batch.n)
        ubatches.append(
            count_ubatches(
                [engine.runner.batch._seq_rows[i][0] for i in range(engine.runner.batch.n)], n_ubatch
            )
        )
        ret = orig_decode(ctx)
        decode_ns.append(time.thread_time_ns() - t)
        return ret

    n_ubatch = model.ctx_params.n_ubatch
    ubatches: list[int] = []
    engine.step = cpu_timed(engine.step, step_ns)  # type: ignore[method-assign]
    engine.runner.batch.decode = timed_decode  # type: ignore[method-assign]

    async def one(prompt: list[int]) -> list[int]:
        req = GenerateRequest(
            prompt_tokens=prompt, sampling=SamplingParams(temperature=0), num_predict=n_new, speculative=spec
        )
        ids: list[int] = []
        async for event in model.generate(req):
            if isinstance(event, TextEvent):
                ids.extend(event.token_ids)
        return ids

    async def go() -> list[list[int]]:
        return list(await asyncio.gather(*(one(p) for p in prompts)))

    steps0 = engine.steps
    t0, cpu0 = time.perf_counter(), time.process_time()
    outs = asyncio.run(go())
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    decodes = engine.steps - steps0
    model.unload()
    n_tok = sum(len(o) for o in outs)
    return {
        "prompt_tokens": sum(len(p) for p in prompts),
        "generated": n_tok,
        "steps": len(step_ns),
        "decodes": decodes,
        "rows": sum(rows),
        "ubatches": sum(ubatches),
        "step_thread_cpu_s": sum(step_ns) / 1e9,
        "decode_cpu_s": sum(decode_ns) / 1e9,
        "process_cpu_s": cpu,
        "wall_s": wall,
        "outputs": outs,
    }


def http_run(gguf: Path, threads: int, slots: int, n_ctx: int, n_new: int, repeat: int) -> None:
    """Through `localrt serve` (Ollama /api/chat, streamed): the client's time to first token and per token
    against the server's own prompt_eval / eval durations; the difference is the HTTP and runtime path."""
    import httpx

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import psutil
    from bench_serve import MODEL
    from bench_serve import localrt_server

    def cpu_by_thread(pid: int) -> tuple[float, float]:
        """(the server's main thread — the event loop: HTTP, runtime, SSE —, the whole process) CPU seconds."""
        proc = psutil.Process(pid)
        main = next((t for t in proc.threads() if t.id == pid), None)
        total = proc.cpu_times()
        return (main.user_time + main.system_time if main else 0.0), total.user + total.system

    with localrt_server(gguf, threads, slots, n_ctx, "llama.cpp") as url:
        server = next(c for c in psutil.Process().children() if "localrt" in " ".join(c.cmdline()))
        for i in range(repeat + 1):
            main0, total0 = cpu_by_thread(server.pid)
            body = {
                "model": MODEL,
                "messages": [{"role": "user", "content": f"Write a long, detailed story about owls (#{i})."}],
                "options": {"temperature": 0, "num_predict": n_new},
            }
            t0 = time.perf_counter()
            first = None
            stamps = []
            with httpx.stream("POST", f"{url}/api/chat", json=body, timeout=600) as r:
                for line in r.iter_lines():
                    now = time.perf_counter()
                    if not line:
                        continue
                    item = json.loads(line)
                    if not item.get("done"):
                        stamps.append(now)
                        first = first or now - t0
                    else:
                        done = item
            main1, total1 = cpu_by_thread(server.pid)
            if i == 0:
                continue  # warm-up
            n_tok = max(1, done["eval_count"])
            print(
                f"http: server CPU per generated token: event-loop thread {(main1 - main0) * 1000 / n_tok:5.2f} ms, "
                f"whole process {(total1 - total0) * 1000 / n_tok:5.2f} ms"
            )
            client_tok = (stamps[-1] - stamps[0]) / max(1, len(stamps) - 1) * 1000
            server_tok = done["eval_duration"] / 1e6 / max(1, done["eval_count"])
            print(
                f"http: first token client {first * 1000:7.1f} ms, server prompt_eval "
                f"{done['prompt_eval_duration'] / 1e6:7.1f} ms ({done['prompt_eval_count']} tokens), "
                f"total_duration {done['total_duration'] / 1e6:7.1f} ms; per token client {client_tok:5.2f} ms, "
                f"server {server_tok:5.2f} ms"
            )


def stream_answer(url: str, model: str, n: int) -> tuple[float, int]:
    """One streamed OpenAI chat answer of up to n tokens: (seconds from its first chunk to its end, tokens)."""
    import httpx

    body = {
        "model": model,
        "messages": [{"role": "user", "content": "Write a long story about a cat who sails the sea."}],
        "max_tokens": n,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    first = None
    tokens = 0
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                first = first or time.perf_counter()
                tokens = (json.loads(line[6:]).get("usage") or {}).get("completion_tokens", tokens)
    return time.perf_counter() - (first or time.perf_counter()), tokens


def beside_run(gguf: Path, backend: str, threads: int, n_ctx: int, n_new: int, repeat: int) -> None:
    """One streamed client on a model, alone and then with a second model loaded beside it and idle, in
    one `localrt serve` (`repeat` rounds of 3 answers each way): what an idle model costs a busy one."""
    import subprocess
    import tempfile

    import httpx

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_serve import free_port
    from bench_serve import wait_ready

    from localrt.store.importer import import_gguf
    from localrt.store.store import Store

    root = Path(tempfile.mkdtemp(prefix="localrt-beside-"))
    params = {"num_thread": threads, "num_ctx": n_ctx, "temperature": 0}
    for name in ("busy:latest", "idle:latest"):
        import_gguf(Store(root / "models"), name, gguf, params=params)
    port = free_port()
    env = {
        **os.environ,
        "LOCALRT_MODELS": str(root / "models"),
        "LOCALRT_BACKEND": backend,
        "LOCALRT_NUM_PARALLEL": "4",
        "LOCALRT_KEEP_ALIVE": "-1",
        "LOCALRT_HOST": f"127.0.0.1:{port}",
    }
    url = f"http://127.0.0.1:{port}"
    rows: dict[str, list[float]] = {}
    for _ in range(repeat):
        proc = subprocess.Popen(
            [sys.executable, "-m", "localrt", "serve"], env=env, stderr=subprocess.DEVNULL
        )
        try:
            wait_ready(url, proc)
            for label, loaded in (("alone", ("busy:latest",)), ("an idle model beside it", ("idle:latest",))):
                for name in loaded:
                    stream_answer(url, name, 8)  # loads it
                spans, tokens = zip(*(stream_answer(url, "busy:latest", n_new) for _ in range(3)))
                rows.setdefault(label, []).append(sum(spans) * 1e3 / sum(tokens))
            assert len(httpx.get(f"{url}/api/ps").json()["models"]) == 2, "the second model was not kept"
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    print(
        f"{backend}, one client, {n_new} new tokens, {threads} threads; load average {os.getloadavg()[0]:.1f}"
    )
    for label, runs in rows.items():
        print(f"{label:>24}: {' / '.join(f'{t:.2f}' for t in runs)} ms per token")


def versus_run(gguf: Path, threads: int, slots: int, n_ctx: int, n_new: int, repeat: int) -> None:
    """One streamed OpenAI chat client against `localrt serve` and llama-server in turn (`repeat` rounds,
    interleaved, 3 answers a round after a warm-up): the stream's time per token (first chunk to last)
    and the server's CPU per token (every thread: the forward, sampling, HTTP), beside the raw loop's.
    With --threads 1 no worker spins, so the CPU left over the raw loop's is the host work."""
    import httpx

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import psutil
    from bench_memory import listening_pid
    from bench_serve import llama_server
    from bench_serve import localrt_server

    from localrt.backends.engine_thread import on_a_thread_of_its_own

    servers = {
        "llama-server": lambda: llama_server(gguf, threads, slots, n_ctx),
        "localrt": lambda: localrt_server(gguf, threads, slots, n_ctx, "llama.cpp"),
    }
    prompt = [1] + [(i * 37) % 4000 + 100 for i in range(39)]
    rows: dict[str, list[tuple[float, float]]] = {}
    for _ in range(repeat):
        for name, server in servers.items():
            with server() as url:
                model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
                stream_answer(url, model, 16)
                proc = psutil.Process(listening_pid(int(url.rsplit(":", 1)[1])))
                cpu0 = sum(proc.cpu_times()[:2])
                spans, tokens = zip(*(stream_answer(url, model, n_new) for _ in range(3)))
                cpu = sum(proc.cpu_times()[:2]) - cpu0
            rows.setdefault(name, []).append((sum(spans) * 1e3 / sum(tokens), cpu * 1e6 / sum(tokens)))
        raw = on_a_thread_of_its_own(
            lambda: raw_loop(gguf, prompt, n_new, threads, streams=slots, n_ubatch=48, n_ctx=n_ctx),
            "raw-loop",
        )
        rows.setdefault("raw loop", []).append((raw["per_token_ms"], raw["process_cpu_ms_per_token"] * 1e3))
    print(f"one client, {n_new} new tokens, {threads} thread(s); load average {os.getloadavg()[0]:.1f}")
    print("| | ms per token (each round) | CPU us per token (each round) |\n|---|---|---|")
    for name, runs in rows.items():
        print(
            f"| {name} | {' / '.join(f'{t:.2f}' for t, _ in runs)} | {' / '.join(f'{c:.0f}' for _, c in runs)} |"
        )


# ---- the floor: a bare server on the same stack, per streamed chunk --------------------------------
FLOOR_GAP_S = 0.006  # a token's pace at one client (SmolLM2-135M, 2 threads)


def floor_app(n_chunks: int, weights_mb: int) -> object:
    """A Starlette app: POST /stream sends `n_chunks` SSE chunks handed over one by one from a thread
    (`call_soon_threadsafe`, as `EngineStreams.route` does); GET /stats gives each side's CPU per chunk
    of the last stream. Between chunks the thread sleeps a token's pace, or with `weights_mb` reads that
    many MB, as a decode reads the weights."""
    import numpy as np
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.responses import StreamingResponse
    from starlette.routing import Route

    stats: dict[str, float] = {}

    def hand_over(loop: asyncio.AbstractEventLoop, queue: asyncio.Queue) -> None:
        cpu = 0
        weights = np.ones(weights_mb << 18, dtype=np.float32)
        for i in [*range(n_chunks), None]:
            if weights.size:
                weights.sum()
            else:
                time.sleep(FLOOR_GAP_S)
            t = time.thread_time_ns()
            loop.call_soon_threadsafe(queue.put_nowait, i)
            cpu += time.thread_time_ns() - t
        stats["hand-off"] = cpu / 1000 / n_chunks

    async def stream(request: object) -> StreamingResponse:
        queue: asyncio.Queue = asyncio.Queue()
        threading.Thread(target=hand_over, args=(asyncio.get_running_loop(), queue), daemon=True).start()

        async def body():  # type: ignore[no-untyped-def]
            created, t0 = int(time.time()), time.thread_time_ns()
            while (i := await queue.get()) is not None:
                delta = {"content": f" word{i}"}
                choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}
                chunk = {"id": "chatcmpl-floor", "object": "chat.completion.chunk", "created": created}
                yield f"data: {json.dumps({**chunk, 'model': PROFILE_MODEL, 'choices': [choice]})}\n\n".encode()
            stats["event loop"] = (time.thread_time_ns() - t0) / 1000 / n_chunks
            yield b"data: [DONE]\n\n"

        return StreamingResponse(body(), media_type="text/event-stream")

    async def read_stats(request: object) -> JSONResponse:
        return JSONResponse(stats)

    routes = [Route("/stream", stream, methods=["POST"]), Route("/stats", read_stats)]
    return Starlette(routes=[*routes, Route("/health", read_stats)])  # bench_serve.wait_ready asks /health


def floor_run(n_chunks: int, repeat: int, weights_mb: int) -> None:
    import subprocess

    import httpx

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_serve import free_port
    from bench_serve import wait_ready

    port = free_port()
    cmd = [sys.executable, __file__, "--serve-floor", str(port), "--tokens", str(n_chunks)]
    cmd += ["--weights-mb", str(weights_mb)]
    proc = subprocess.Popen(cmd, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, proc)
        rows = []
        for _ in range(repeat):
            with httpx.stream("POST", f"{url}/stream", timeout=600) as r:
                for _ in r.iter_lines():
                    pass
            rows.append({**httpx.get(f"{url}/stats").json(), "load": os.getloadavg()[0]})
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    print(
        f"\nbare Starlette on uvicorn, {n_chunks} chunks a round, "
        + (f"{weights_mb} MB read between chunks, " if weights_mb else "")
        + "CPU us per chunk; loadavg after each round"
    )
    print("| round | hand-off (the handing thread) | event loop | load |")
    print("|---|---|---|---|")
    for i, row in enumerate(rows, 1):
        print(f"| {i} | {row['hand-off']:.0f} | {row['event loop']:.0f} | {row['load']:.2f} |")


# ---- the host overhead per token, by where it goes (through `localrt serve`) ----------------------
# The server runs in a child process with the hooks below installed; SIGUSR1 makes it write its counters.
# Every figure is CPU time (per-thread clocks, not the wall clock): other load on the machine slows the
# server down but does not bill it. The hooks themselves cost a few clock reads per token (each ~0.3 us).
STEP_THREAD_PREFIX = ("localrt-llamacpp-step", "torch-engine")
HOOK_BUCKETS = ("forward", "text_step", "text_loop", "backend_loop", "runtime_loop")


class _Timed:
    """Awaits `coro`, adding to counters[key] the CPU time of its own synchronous runs only (the time it is
    suspended, while the event loop serves others, is not counted); nested ones count inside their outer."""

    def __init__(self, coro, counters: dict, key: str) -> None:  # type: ignore[no-untyped-def]
        self.coro, self.counters, self.key = coro, counters, key

    def __await__(self):  # type: ignore[no-untyped-def]
        value, error = None, None
        while True:
            t = time.thread_time_ns()
            try:
                out = self.coro.throw(error) if error is not None else self.coro.send(value)
            except StopIteration as stop:
                self.counters[self.key] += time.thread_time_ns() - t
                return stop.value
            except BaseException:
                self.counters[self.key] += time.thread_time_ns() - t
                raise
            self.counters[self.key] += time.thread_time_ns() - t
            try:
                value, error = (yield out), None
            except BaseException as e:  # thrown into the awaited coroutine, as asyncio does
                value, error = None, e


class _TimedStream:
    """An async iterator whose every step (and close) is timed by _Timed."""

    def __init__(self, inner, counters: dict, key: str) -> None:  # type: ignore[no-untyped-def]
        self.inner, self.counters, self.key = inner, counters, key

    def __aiter__(self):  # type: ignore[no-untyped-def]
        return self

    def __anext__(self):  # type: ignore[no-untyped-def]
        return _Timed(self.inner.__anext__(), self.counters, self.key)

    async def aclose(self) -> None:
        close = getattr(self.inner, "aclose", None)
        if close is not None:
            await _Timed(close(), self.counters, self.key)


def _thread_clocks() -> dict[str, int]:
    """CPU ns of every live thread, by name (ident appended to tell apart pool threads of one name)."""
    out = {}
    for t in threading.enumerate():
        try:
            out[f"{t.name}#{t.ident}"] = time.clock_gettime_ns(time.pthread_getcpuclockid(t.ident))
        except (OSError, TypeError):
            pass
    return out


def install_hooks(backend: str, out_path: str) -> None:
    """In the server process: count the forward (llama_decode / the torch forward), text assembly, the
    backend's stream on the event loop and the runtime's; SIGUSR1 writes them with every thread's clock."""
    import functools
    import signal

    from localrt.backends import base
    from localrt.runtime.front import Runtime

    counters = dict.fromkeys(HOOK_BUCKETS, 0)
    counters["tokens"] = 0

    def on_step_thread() -> bool:
        return threading.current_thread().name.startswith(STEP_THREAD_PREFIX)

    def timed_method(cls, name: str, key_of) -> None:  # type: ignore[no-untyped-def]
        orig = getattr(cls, name)

        @functools.wraps(orig)
        def wrapper(*args, **kwargs):  # type: ignore[no-untyped-def]
            t = time.thread_time_ns()
            try:
                return orig(*args, **kwargs)
            finally:
                counters[key_of()] += time.thread_time_ns() - t

        setattr(cls, name, wrapper)

    if backend == "torch":
        from localrt.backends.torch.backend import TorchModel as Model
        from localrt.backends.torch.runner import ModelRunner

        timed_method(ModelRunner, "forward", lambda: "forward")
    else:
        from localrt.backends.llamacpp.backend import LlamaCppModel as Model
        from localrt.backends.llamacpp.lib import Batch

        timed_method(Batch, "decode", lambda: "forward")

    def text_key() -> str:
        return "text_step" if on_step_thread() else "text_loop"

    for name in ("add", "end"):
        timed_method(base.TextAssembler, name, text_key)

    def stream_of(cls, name: str, key: str) -> None:  # type: ignore[no-untyped-def]
        orig = getattr(cls, name)

        @functools.wraps(orig)
        def wrapper(*args, **kwargs):  # type: ignore[no-untyped-def]
            return _TimedStream(orig(*args, **kwargs), counters, key)

        setattr(cls, name, wrapper)

    stream_of(Model, "generate", "backend_loop")
    stream_of(Runtime, "chat", "runtime_loop")

    def dump(*_: object) -> None:
        snapshot = {
            "counters": dict(counters),
            "threads": _thread_clocks(),
            "process_ns": time.process_time_ns(),
        }
        Path(out_path).write_text(json.dumps(snapshot))

    signal.signal(signal.SIGUSR1, dump)


def _snapshot(proc, out_path: Path) -> dict:  # type: ignore[no-untyped-def]
    import signal

    out_path.unlink(missing_ok=True)
    proc.send_signal(signal.SIGUSR1)
    for _ in range(400):
        if out_path.is_file():
            try:
                return json.loads(out_path.read_text())
            except json.JSONDecodeError:
                pass
        time.sleep(0.01)
    raise SystemExit("the server wrote no profile snapshot")


def split(before: dict, after: dict, tokens: int) -> dict[str, float]:
    """Per generated token, in us: the forward, and the host time outside it by where it goes."""
    c0, c1 = before["counters"], after["counters"]
    d = {k: c1[k] - c0[k] for k in HOOK_BUCKETS}
    t0, t1 = before["threads"], after["threads"]
    threads = {name: ns - t0.get(name, 0) for name, ns in t1.items()}

    def by_prefix(*prefixes: str) -> int:
        return sum(ns for name, ns in threads.items() if name.split("#")[0].startswith(prefixes))

    main = by_prefix("MainThread")
    step = by_prefix(*STEP_THREAD_PREFIX)
    pool = by_prefix("asyncio_")  # asyncio.to_thread: prompt rendering, tokenizing
    process = after["process_ns"] - before["process_ns"]
    rest = process - main - step - pool  # any other thread (those that ended too)
    out = {
        "forward": d["forward"],
        "engine": step - d["forward"] - d["text_step"],
        "text": d["text_step"] + d["text_loop"],
        "hand-off": rest + d["backend_loop"] - d["text_loop"],
        "runtime": d["runtime_loop"] - d["backend_loop"] + pool,
        "http+loop": main - d["runtime_loop"],
    }
    out["host total"] = process - d["forward"]
    return {k: v / 1000 / max(1, tokens) for k, v in out.items()}


async def _stream_chat(client, url: str, prompt: str, n_new: int) -> int:  # type: ignore[no-untyped-def]
    body = {
        "model": PROFILE_MODEL,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": n_new,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    tokens = 0
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=600) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                usage = json.loads(line[6:]).get("usage")
                if usage:
                    tokens = usage["completion_tokens"]
    return tokens


def breakdown_run(gguf: Path, backend: str, n_ctx: int, n_new: int, seqs: int, repeat: int) -> list[dict]:
    """`seqs` streamed OpenAI chat requests at once through a hooked `localrt serve` (one llama.cpp
    thread, so the forward runs on the step thread alone), `repeat` rounds after a warm-up."""
    import subprocess
    import tempfile

    import httpx

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_serve import TOPICS
    from bench_serve import free_port
    from bench_serve import wait_ready

    from localrt.store.importer import import_gguf
    from localrt.store.store import Store

    root = Path(tempfile.mkdtemp(prefix="localrt-profile-"))
    params = {"num_thread": 1, "num_ctx": n_ctx, "temperature": 0}
    import_gguf(Store(root / "models"), PROFILE_MODEL, gguf, params=params)
    port = free_port()
    out_path = root / "profile.json"
    env = {
        **os.environ,
        "LOCALRT_MODELS": str(root / "models"),
        "LOCALRT_NUM_PARALLEL": str(max(seqs, 1)),
        "LOCALRT_BACKEND": backend,
        "LOCALRT_KEEP_ALIVE": "-1",
        "LOCALRT_HOST": f"127.0.0.1:{port}",
    }
    cmd = [sys.executable, __file__, "--serve-hooked", str(out_path), "--backend", backend]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    results = []
    try:
        wait_ready(url, proc)

        async def round_(salt: int) -> int:
            async with httpx.AsyncClient() as client:
                counts = await asyncio.gather(
                    *(
                        _stream_chat(
                            client,
                            url,
                            f"Write a long story about {TOPICS[(i + salt) % 16]} (#{salt}-{i}).",
                            n_new,
                        )
                        for i in range(seqs)
                    )
                )
            return sum(counts)

        asyncio.run(round_(-1))  # load and warm up
        for r in range(repeat):
            before = _snapshot(proc, out_path)
            tokens = asyncio.run(round_(r * seqs))
            after = _snapshot(proc, out_path)
            results.append({**split(before, after, tokens), "tokens": tokens, "load": os.getloadavg()[0]})
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    return results


def print_breakdown(backend: str, seqs: int, n_new: int, results: list[dict]) -> None:
    keys = [k for k in results[0] if k not in ("tokens", "load")]
    med = {k: statistics.median(r[k] for r in results) for k in keys}
    loads = ", ".join(f"{r['load']:.2f}" for r in results)
    print(
        f"\n{backend}, {seqs} sequence(s) x {n_new} new tokens, {len(results)} rounds, CPU us per generated "
        f"token (median); loadavg(1 min) after each round: {loads}"
    )
    print("| " + " | ".join(keys) + " |")
    print("|" + "---|" * len(keys))
    print("| " + " | ".join(f"{med[k]:.0f}" for k in keys) + " |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gguf", default=str(CACHED_GGUF))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--slots", type=int, default=16)
    p.add_argument("--ctx", type=int, default=2048)
    p.add_argument("--prompt", type=int, default=40, help="prompt tokens")
    p.add_argument("--tokens", type=int, default=64, help="new tokens")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--http", action="store_true", help="also through localrt serve: client vs server times")
    p.add_argument(
        "--versus",
        action="store_true",
        help="instead: one streamed client, localrt serve vs llama-server (per token: time, server CPU)",
    )
    p.add_argument(
        "--batch",
        type=int,
        default=0,
        help="instead: this many grounded requests at once (bench_serve's passages), speculation off and lookup",
    )
    p.add_argument(
        "--breakdown",
        action="store_true",
        help="instead: host CPU per generated token through localrt serve, by where it goes (see above)",
    )
    p.add_argument("--seqs", default="1,16", help="--breakdown: sequences at once, a comma list")
    p.add_argument("--backend", default="llama.cpp", help="--breakdown, --beside: llama.cpp or torch")
    p.add_argument(
        "--beside",
        action="store_true",
        help="instead: one streamed client on a model, alone and with a second model loaded and idle",
    )
    p.add_argument(
        "--floor",
        action="store_true",
        help="instead: a bare Starlette app on uvicorn streaming chunks handed from a thread (CPU per chunk)",
    )
    p.add_argument(
        "--weights-mb",
        type=int,
        default=0,
        help="--floor: MB read between chunks, as a decode reads the weights",
    )
    p.add_argument("--serve-hooked", metavar="OUT", help=argparse.SUPPRESS)  # the child server of --breakdown
    p.add_argument("--serve-floor", type=int, metavar="PORT", help=argparse.SUPPRESS)  # --floor's server
    a = p.parse_args()
    gguf = Path(a.gguf)
    if a.serve_hooked:
        install_hooks(a.backend, a.serve_hooked)
        from localrt.cli.main import main as cli

        raise SystemExit(cli(["serve"]))
    if a.serve_floor:
        import uvicorn

        uvicorn.run(
            floor_app(a.tokens, a.weights_mb), host="127.0.0.1", port=a.serve_floor, log_level="warning"
        )
        return
    if a.floor:
        floor_run(a.tokens, a.repeat, a.weights_mb)
        return
    if a.beside:
        beside_run(gguf, a.backend, a.threads, a.ctx, a.tokens, a.repeat)
        return
    if a.versus:
        versus_run(gguf, a.threads, a.slots, a.ctx, a.tokens, a.repeat)
        return
    if a.breakdown:
        for seqs in (int(s) for s in a.seqs.split(",") if s):
            results = breakdown_run(gguf, a.backend, a.ctx, a.tokens, seqs, a.repeat)
            print_breakdown(a.backend, seqs, a.tokens, results)
        return
    if a.batch:
        runs: dict[str, list[dict]] = {}
        for _ in range(a.repeat):
            for spec in ("off", "lookup"):
                runs.setdefault(spec, []).append(
                    batch_run(gguf, a.threads, a.slots, a.ctx, a.tokens, a.batch, spec)
                )
        print(
            f"load average {os.getloadavg()[0]:.1f}; {a.batch} grounded requests, {a.tokens} new, {a.threads} threads"
        )
        for spec, rs in runs.items():
            same = all(r["outputs"] == runs["off"][0]["outputs"] for r in rs)
            figures = {k: round(statistics.median(r[k] for r in rs), 3) for k in rs[0] if k != "outputs"}
            print(f"{spec:>8}: outputs as speculation off: {same} {figures}")
        return
    from localrt.backends.engine_thread import on_a_thread_of_its_own

    prompt = [1] + [(i * 37) % 4000 + 100 for i in range(a.prompt - 1)]
    rows: dict[str, list[dict]] = {}
    for _ in range(a.repeat):  # interleaved, so a load change hits every variant alike
        rows.setdefault("raw", []).append(
            on_a_thread_of_its_own(
                lambda: raw_loop(gguf, prompt, a.tokens, a.threads, streams=1, n_ubatch=512, n_ctx=a.ctx),
                "raw-loop",
            )
        )
        rows.setdefault("raw-streams", []).append(
            on_a_thread_of_its_own(
                lambda: raw_loop(
                    gguf, prompt, a.tokens, a.threads, streams=a.slots, n_ubatch=48, n_ctx=a.ctx
                ),
                "raw-loop",
            )
        )
        rows.setdefault("localrt", []).append(localrt_run(gguf, prompt, a.tokens, a.threads, a.slots, a.ctx))
    print(
        f"load average {os.getloadavg()[0]:.1f}; prompt {a.prompt} tokens, {a.tokens} new, {a.threads} threads"
    )
    base = rows["raw"]
    for name, runs in rows.items():
        ttft = statistics.median(r["ttft_ms"] for r in runs)
        tok = statistics.median(r["per_token_ms"] for r in runs)
        same = all(r["tokens"][: len(base[0]["tokens"])] == base[0]["tokens"] for r in runs)
        extra = {
            k: round(statistics.median(r[k] for r in runs), 3)
            for k in runs[0]
            if k not in ("ttft_ms", "per_token_ms", "tokens")
        }
        print(
            f"{name:>12}: first token {ttft:7.1f} ms ({ttft / statistics.median(r['ttft_ms'] for r in base):.2f}x raw), "
            f"{tok:6.2f} ms/token ({tok / statistics.median(r['per_token_ms'] for r in base):.2f}x raw), "
            f"same tokens as raw: {same} {extra}"
        )
    if a.http:
        http_run(gguf, a.threads, a.slots, a.ctx, a.tokens, a.repeat)


if __name__ == "__main__":
    main()
