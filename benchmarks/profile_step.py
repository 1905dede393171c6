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
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CACHED_GGUF = (
    Path(os.environ.get("LOCALRT_TEST_CACHE", Path.home() / ".cache" / "localrt-tests"))
    / "SmolLM2-135M-Instruct.Q4_1.gguf"
)


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
    orig_decode, orig_step = engine.batch.decode, engine.step

    # CPU time of the step thread (with one llama.cpp thread the decode runs on it too): robust to load
    def timed_decode(ctx):  # type: ignore[no-untyped-def]
        t = time.thread_time_ns()
        rows.append(engine.batch.n)
        ret = orig_decode(ctx)
        decode_ns.append(time.thread_time_ns() - t)
        return ret

    def timed_step():  # type: ignore[no-untyped-def]
        t = time.thread_time_ns()
        orig_step()
        step_ns.append(time.thread_time_ns() - t)

    engine.batch.decode = timed_decode  # type: ignore[method-assign]
    engine.step = timed_step  # type: ignore[method-assign]

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
    orig_step, orig_decode = engine.step, engine.batch.decode

    def timed_step():  # type: ignore[no-untyped-def]
        t = time.thread_time_ns()
        orig_step()
        step_ns.append(time.thread_time_ns() - t)

    def timed_decode(ctx):  # type: ignore[no-untyped-def]
        t = time.thread_time_ns()
        rows.append(engine.batch.n)
        ubatches.append(
            count_ubatches([engine.batch._seq_rows[i][0] for i in range(engine.batch.n)], n_ubatch)
        )
        ret = orig_decode(ctx)
        decode_ns.append(time.thread_time_ns() - t)
        return ret

    n_ubatch = model.ctx_params.n_ubatch
    ubatches: list[int] = []
    engine.step = timed_step  # type: ignore[method-assign]
    engine.batch.decode = timed_decode  # type: ignore[method-assign]

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
        "--batch",
        type=int,
        default=0,
        help="instead: this many grounded requests at once (bench_serve's passages), speculation off and lookup",
    )
    a = p.parse_args()
    gguf = Path(a.gguf)
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
    prompt = [1] + [(i * 37) % 4000 + 100 for i in range(a.prompt - 1)]
    rows: dict[str, list[dict]] = {}
    for _ in range(a.repeat):  # interleaved, so a load change hits every variant alike
        rows.setdefault("raw", []).append(
            raw_loop(gguf, prompt, a.tokens, a.threads, streams=1, n_ubatch=512, n_ctx=a.ctx)
        )
        rows.setdefault("raw-streams", []).append(
            raw_loop(gguf, prompt, a.tokens, a.threads, streams=a.slots, n_ubatch=48, n_ctx=a.ctx)
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
