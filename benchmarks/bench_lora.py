"""What LoRA adapters cost on the llama.cpp backend, through a real `localrt serve`.

The model is SmolLM2-135M Q4_1 (the test cache's); its adapter is a random rank-8 LoRA on every layer's
q_proj and v_proj, written as a PEFT folder and converted by localrt's converter for that GGUF. Three models
share the file: `base` (no adapter), `lora` (the adapter) and `lora2` (the same adapter again, a second
model on the same weights). Each case streams N requests at once (`/api/generate`, greedy, the same number
of new tokens each) and prints the aggregate tokens per second, with its ratio to `base`:

- `base`: no adapter;
- `lora, one scale set`: every request at the default scale (one set, batched together);
- `lora, two scale sets`: half the requests at scale 1.0, half at 0.5. llama.cpp sets adapters on a whole
  context, so the two sets take turns, step by step, and a change of set makes llama.cpp reserve its
  compute graph again;
- `lora + lora2, two models`: half the requests on each model: two contexts over one copy of the weights,
  each with its own step thread.

    python benchmarks/bench_lora.py --clients 4 --tokens 64 --rounds 3

Measure on a quiet machine; every round is printed, then the medians.
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
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.servers.serve import LocalrtServer  # noqa: E402

CACHED_GGUF = (
    Path(os.environ.get("LOCALRT_TEST_CACHE", Path.home() / ".cache" / "localrt-tests"))
    / "SmolLM2-135M-Instruct.Q4_1.gguf"
)
TOPICS = ["dragons", "the sea", "a city", "winter", "a robot", "the moon", "a garden", "trains"]


def random_peft(base_gguf: Path, out: Path, rank: int = 8, seed: int = 0) -> Path:
    """A PEFT LoRA folder on q_proj and v_proj of every layer, with the shapes `base_gguf`'s keys give."""
    from safetensors.numpy import save_file

    from localrt.store.gguf import read_gguf

    meta = read_gguf(base_gguf).metadata
    arch = meta["general.architecture"]
    hidden, n_layer = meta[f"{arch}.embedding_length"], meta[f"{arch}.block_count"]
    n_head, n_kv = meta[f"{arch}.attention.head_count"], meta[f"{arch}.attention.head_count_kv"]
    rows = {"q_proj": hidden, "v_proj": hidden // n_head * n_kv}
    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(n_layer):
        for module, n_out in rows.items():
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{prefix}.lora_A.weight"] = (rng.standard_normal((rank, hidden)) * 0.02).astype(
                np.float32
            )
            tensors[f"{prefix}.lora_B.weight"] = (rng.standard_normal((n_out, rank)) * 0.02).astype(
                np.float32
            )
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(rows)}
    (out / "adapter_config.json").write_text(json.dumps(config))
    return out


async def one(
    client: httpx.AsyncClient, url: str, model: str, prompt: str, tokens: int, lora: list | None
) -> int:
    body: dict = {
        "model": model,
        "prompt": prompt,
        "stream": True,
        "options": {"temperature": 0, "num_predict": tokens, "seed": 1},
    }
    if lora is not None:
        body["lora"] = lora
    count = 0
    async with client.stream("POST", f"{url}/api/generate", json=body, timeout=600) as r:
        async for line in r.aiter_lines():
            if line:
                chunk = json.loads(line)
                if chunk.get("done"):
                    count = chunk.get("eval_count", 0)
    return count


async def drive(url: str, jobs: list[tuple[str, list | None]], tokens: int, salt: int) -> float:
    """Tokens per second of `jobs` (model, lora) streamed at once."""
    async with httpx.AsyncClient() as client:
        start = time.perf_counter()
        counts = await asyncio.gather(
            *(
                one(
                    client,
                    url,
                    model,
                    f"Write a story about {TOPICS[(i + salt) % len(TOPICS)]} (#{salt}-{i}).",
                    tokens,
                    lora,
                )
                for i, (model, lora) in enumerate(jobs)
            )
        )
        return sum(counts) / (time.perf_counter() - start)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gguf", default=str(CACHED_GGUF))
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args()

    from localrt.store.importer import convert_peft_adapter
    from localrt.store.importer import import_gguf
    from localrt.store.modelfile import create
    from localrt.store.store import Store

    gguf = Path(a.gguf)
    work = Path(tempfile.mkdtemp(prefix="localrt-bench-lora-"))
    adapter = work / "lora.gguf"
    convert_peft_adapter(random_peft(gguf, work / "peft"), adapter, gguf)
    store = Store(work / "models")
    params = {"num_ctx": 1024, "num_thread": a.threads, "temperature": 0}
    import_gguf(store, "base", gguf, params=params)
    lines = "".join(f"PARAMETER {k} {v}\n" for k, v in params.items())
    for name in ("lora", "lora2"):
        create(name, modelfile_text=f"FROM {gguf}\nADAPTER {adapter}\n{lines}", store=store)
    env = {
        "LOCALRT_BACKEND": "llama.cpp",
        "LOCALRT_NUM_PARALLEL": str(a.clients),
        "LOCALRT_KEEP_ALIVE": "-1",
        "LOCALRT_MAX_LOADED_MODELS": "3",
    }
    n = a.clients
    half = [{"id": 0, "scale": 0.5}]
    cases = {
        "base": [("base", None)] * n,
        "lora, one scale set": [("lora", None)] * n,
        "lora, two scale sets": [("lora", None if i % 2 == 0 else half) for i in range(n)],
        "lora + lora2, two models": [("lora" if i % 2 == 0 else "lora2", None) for i in range(n)],
    }
    srv = LocalrtServer(work / "models", work / "serve.log", env=env)
    results: dict[str, list[float]] = {name: [] for name in cases}
    try:
        for jobs in cases.values():  # load each model and warm up
            asyncio.run(drive(srv.url, jobs[:2], 4, -1))
        print(
            f"GGUF {gguf.name}, {a.threads} threads, {n} clients x {a.tokens} new tokens, {a.rounds} rounds"
        )
        for r in range(a.rounds):
            for name, jobs in cases.items():
                results[name].append(asyncio.run(drive(srv.url, jobs, a.tokens, r)))
            print(
                f"round {r + 1}: "
                + ", ".join(f"{k} {v[-1]:.1f}" for k, v in results.items())
                + f" (loadavg {os.getloadavg()[0]:.2f})"
            )
    finally:
        srv.stop()
    base = statistics.median(results["base"])
    print("\n| case | tok/s (median) | vs base |\n|---|---|---|")
    for name, values in results.items():
        med = statistics.median(values)
        print(f"| {name} | {med:.1f} | {med / base:.2f}x |")


if __name__ == "__main__":
    main()
