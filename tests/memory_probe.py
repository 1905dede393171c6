"""Run as a script: load one model in this fresh process, fill every sequence's context, and print the
resident growth beside the backend's estimate (JSON). The backend's module is imported first, so the
growth is what the load itself brings, its runtime's first-load costs (thread pools, kernels) included,
as in a server's first load of that backend. For llama.cpp also `allocated`: the bytes of each kind of
buffer llama.cpp itself reports allocating (model, KV, output, compute), which no other process's use
of the machine's memory can move, as it can move the resident growth."""

from __future__ import annotations

import asyncio
import ctypes
import gc
import json
import re
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


# "CPU_Mapped model buffer size = 242.08 MiB": the buffer type, the kind, the size
BUFFER = re.compile(r"(\w+) (\w+) buffer size =\s*([0-9.]+) MiB")
# where llama.cpp's CPU extra buffer types lay out a second copy of some weights for their kernels (its
# mapped pages of the file for those tensors are then never read, so they never become resident)
REPACKED = ("CPU_REPACK", "AMX")


def llama_log() -> list[str]:
    """llama.cpp's log lines, from now on, kept here (it reports each buffer it allocates)."""
    import llama_cpp

    lines: list[str] = []

    @llama_cpp.llama_log_callback
    def keep(level: int, text: bytes, user: ctypes.c_void_p) -> None:
        lines.append(text.decode(errors="replace"))

    llama_log.callback = keep  # type: ignore[attr-defined]  # alive as long as llama.cpp may call it
    llama_cpp.llama_log_set(keep, ctypes.c_void_p(0))
    return lines


def main() -> None:
    backend, path, parallel = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
    log = llama_log() if backend == "llama.cpp" else None
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
        if log is not None:
            log.clear()
        model = b.load(path, opts)
        asyncio.run(fill(model, context, parallel))
        row = {"context": context, "growth": proc.memory_info().rss - before, **estimate.as_dict()}
        if log is not None:
            allocated: dict[str, int] = {}
            for m in BUFFER.finditer("".join(log)):
                kind = "repacked" if m.group(1) in REPACKED and m.group(2) == "model" else m.group(2)
                allocated[kind] = allocated.get(kind, 0) + int(float(m.group(3)) * (1 << 20))
            row["allocated"] = allocated
        rows.append(row)
        model.unload()
        del model
        gc.collect()
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
