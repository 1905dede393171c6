"""Run as a script: load one model in this fresh process, fill every sequence's context, and print the
resident growth beside the backend's estimate (JSON). The backend's module is imported first, so the
growth is what the load itself brings, its runtime's first-load costs (thread pools, kernels) included,
as in a server's first load of that backend."""

from __future__ import annotations

import asyncio
import gc
import json
import sys
from dataclasses import replace
from pathlib import Path

import psutil

from localrt.backends import registry
from localrt.backends.base import GenerateRequest
from localrt.backends.base import LoadOptions
from localrt.backends.base import SamplingParams


async def fill(model, context: int, parallel: int) -> None:
    """Every sequence holds a prompt that fills its context to within a few tokens, then decodes."""
    base = model.tokenize("The quick brown fox jumps over the lazy dog. ", add_special=False)
    prompt = (base * (context // max(1, len(base)) + 1))[: context - 8]

    async def one(i: int) -> None:
        req = GenerateRequest(
            prompt_tokens=[*prompt[:-1], prompt[-1 - i]],
            num_predict=4,
            sampling=SamplingParams(temperature=0),
        )
        async for _ in model.generate(req):
            pass

    await asyncio.gather(*(one(i) for i in range(parallel)))


def main() -> None:
    backend, path, parallel = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
    contexts = [int(c) for c in sys.argv[4:]]
    b = registry.get(backend)
    opts = LoadOptions(num_ctx=64, num_parallel=1, num_thread=2)
    proc = psutil.Process()
    rows = []
    for context in contexts:
        opts = replace(opts, num_ctx=context, num_parallel=parallel)
        estimate = b.estimate(path, opts)
        gc.collect()
        before = proc.memory_info().rss
        model = b.load(path, opts)
        asyncio.run(fill(model, context, parallel))
        rows.append({"context": context, "growth": proc.memory_info().rss - before, **estimate.as_dict()})
        model.unload()
        del model
        gc.collect()
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
