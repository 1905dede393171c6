"""Torch engine throughput, side by side with llama-cpp-python and HF transformers on the same GGUF.

    python benchmarks/bench_torch.py [--model PATH] [--device cpu|cuda] [--threads N] [--new 64]
                                     [--numerics auto|quantized|dequantized|exact]

Prints, for concurrency 1 / 4 / 16: aggregate generated tokens per second of the torch engine
(plain, and with each speculative proposer on an input-grounded copy task and on open chat), of
llama-cpp-python (one slot: requests run one after another) and of transformers `generate`
(one padded batch). On CUDA it first checks the GPU path against the CPU path (greedy tokens) and
prints memory-bandwidth utilisation at batch 1 and 64 when --peak-gbps is given.
It also prints the resident weight bytes beside the GGUF's tensor bytes (quantized weights stay
within 1.5x; `--numerics dequantized` loads fp32 weights). Not a test: numbers depend on the machine;
run it alone.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path

import torch

from localrt.backends.base import GenerateRequest
from localrt.backends.base import LoadOptions
from localrt.backends.base import SamplingParams
from localrt.backends.torch import TorchBackend
from localrt.backends.torch.gguf_load import GGUFTensors
from localrt.backends.torch.llama import weight_bytes

DEFAULT_MODEL = Path.home() / ".cache" / "localrt-tests" / "SmolLM2-135M-Instruct.Q4_1.gguf"
CHAT = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n"
QUESTIONS = [
    "Write a short story about a lighthouse keeper.",
    "Explain how rain forms.",
    "Describe a busy market.",
    "Give advice to a new gardener.",
    "Tell me about the history of bread.",
    "Why is the sea salty?",
    "Describe your ideal weekend.",
    "How do airplanes fly?",
]
PARAGRAPH = (
    "The old lighthouse keeper climbed the narrow stairs every evening, lit the great lamp, and watched the "
    "ships pass safely through the rocky strait until dawn. In the morning he wrote the names of the ships "
    "in a worn leather book, made a pot of strong tea, and slept until the gulls woke him at noon."
)
GREEDY = SamplingParams(temperature=0.0, repeat_penalty=1.0)


def prompts(kind: str, n: int) -> list[str]:
    if kind == "copy":  # input-grounded: the answer repeats the input (prompt lookup's best case)
        return [CHAT.format(q=f"Repeat this text exactly:\n{PARAGRAPH}") for _ in range(n)]
    return [CHAT.format(q=QUESTIONS[i % len(QUESTIONS)]) for i in range(n)]


REPEAT = 1  # timed runs per cell; the best one is reported (--repeat, against noisy neighbours)


def bench_torch(model, texts: list[str], new: int, mode: str = "off") -> tuple[float, float]:
    """(aggregate tokens/s, acceptance rate) with all requests submitted at once."""
    ids = [model.tokenize(t, add_special=True, parse_special=True) for t in texts]

    async def one(tokens: list[int]) -> tuple[int, int, int]:
        req = GenerateRequest(tokens, GREEDY, num_predict=new, speculative=mode)
        done = None
        async for event in model.generate(req):
            done = event
        t = done.timings  # type: ignore[union-attr]
        return t.eval_count, t.draft_count, t.draft_accepted_count

    async def run() -> list[tuple[int, int, int]]:
        return await asyncio.gather(*(one(t) for t in ids))

    asyncio.run(run())  # warm-up (also fills the prefix cache, as a server would be)
    best, acceptance = 0.0, 0.0
    for _ in range(REPEAT):
        start = time.perf_counter()
        results = asyncio.run(run())
        rate = sum(r[0] for r in results) / (time.perf_counter() - start)
        if rate > best:
            drafted = sum(r[1] for r in results)
            best, acceptance = rate, (sum(r[2] for r in results) / drafted if drafted else 0.0)
    return best, acceptance


def bench_llama_cpp(path: Path, texts: list[str], new: int, threads: int) -> float:
    import llama_cpp

    llm = llama_cpp.Llama(str(path), n_ctx=2048, n_threads=threads, verbose=False)
    ids = [llm.tokenize(t.encode(), add_bos=True, special=True) for t in texts]
    llm.create_completion(ids[0], max_tokens=4, temperature=0.0)
    best = 0.0
    for _ in range(REPEAT):
        start, total = time.perf_counter(), 0
        for tokens in ids:  # one sequence slot: requests queue
            out = llm.create_completion(tokens, max_tokens=new, temperature=0.0)
            total += out["usage"]["completion_tokens"]
        best = max(best, total / (time.perf_counter() - start))
    llm.close()
    return best


def bench_transformers(path: Path, texts: list[str], new: int, device: str) -> float:
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    logging.set_verbosity_error()
    import llama_cpp

    vocab = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    hf = (
        AutoModelForCausalLM.from_pretrained(
            str(path.parent),
            gguf_file=path.name,
            torch_dtype=torch.float32 if device == "cpu" else torch.bfloat16,
        )
        .to(device)
        .eval()
    )
    ids = [vocab.tokenize(t.encode(), add_bos=True, special=True) for t in texts]
    width = max(len(i) for i in ids)
    pad = 0
    batch = torch.tensor([[pad] * (width - len(i)) + i for i in ids], device=device)  # left padding
    mask = torch.tensor([[0] * (width - len(i)) + [1] * len(i) for i in ids], device=device)
    with torch.inference_mode():
        hf.generate(batch[:1, -8:], attention_mask=mask[:1, -8:], max_new_tokens=2, do_sample=False)
        best = 0.0
        for _ in range(REPEAT):
            start = time.perf_counter()
            out = hf.generate(
                batch,
                attention_mask=mask,
                max_new_tokens=new,
                do_sample=False,
                min_new_tokens=new,
                pad_token_id=pad,
            )
            best = max(best, (out.shape[1] - width) * len(ids) / (time.perf_counter() - start))
    return best


def check_cuda_against_cpu(path: Path, threads: int) -> None:
    texts = prompts("chat", 4)
    outs = []
    for device in ("cpu", "cuda"):
        from localrt.backends.torch.backend import TorchModel

        m = TorchModel(path, LoadOptions(num_ctx=1024, num_thread=threads), device=device)
        ids = [m.tokenize(t, add_special=True, parse_special=True) for t in texts]

        async def run(model=m, ids=ids) -> list[list[int]]:
            async def one(tokens: list[int]) -> list[int]:
                got: list[int] = []
                async for e in model.generate(GenerateRequest(tokens, GREEDY, num_predict=24)):
                    got.extend(getattr(e, "token_ids", []))
                return got

            return list(await asyncio.gather(*(one(t) for t in ids)))

        outs.append(asyncio.run(run()))
        m.unload()
    same = sum(a == b for a, b in zip(*outs))
    print(f"CUDA vs CPU greedy: {same}/{len(texts)} identical (bf16 vs fp32 can differ at near-ties)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--new", type=int, default=64, help="tokens generated per request")
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--skip", default="", help="comma list of: llama,hf,spec")
    ap.add_argument("--repeat", type=int, default=1, help="timed runs per cell, best reported")
    ap.add_argument("--peak-gbps", type=float, default=0.0, help="memory bandwidth for utilisation (GPU)")
    ap.add_argument(
        "--numerics", default="auto", help="auto | quantized | dequantized | exact (the load option numerics)"
    )
    args = ap.parse_args()
    global REPEAT
    REPEAT = max(1, args.repeat)
    skip = set(filter(None, args.skip.split(",")))
    threads = args.threads or max(1, torch.get_num_threads())
    levels = [int(c) for c in args.concurrency.split(",")]
    if args.device == "cuda":
        check_cuda_against_cpu(args.model, threads)
        levels = sorted({*levels, 64})

    from localrt.backends.torch.backend import TorchModel

    opts = LoadOptions(num_ctx=2048, num_thread=threads, num_batch=512, num_parallel=max(levels))
    model = TorchModel(args.model, opts, device=args.device, numerics=args.numerics)
    assert isinstance(model, TorchModel) and TorchBackend.name == "torch"
    print(
        f"model {args.model.name}, device {args.device}, threads {threads}, {args.new} new tokens per request"
    )
    tensor_bytes = sum(t.n_bytes for t in GGUFTensors(args.model).info.tensors)
    print(
        f"weights resident {model.weight_bytes() / 1e6:.1f} MB ({model.weight_bytes() / tensor_bytes:.2f}x the "
        f"GGUF's {tensor_bytes / 1e6:.1f} MB of tensors), KV pool {model.engine.cache.nbytes / 1e6:.1f} MB "
        f"({max(levels)} sequences x 2048 tokens), numerics {args.numerics}"
    )
    header = f"{'concurrency':>11} | {'torch':>8} | {'lookup':>16} | {'self':>16} | {'llama.cpp':>9} | {'hf generate':>11}"
    for task in ("chat", "copy"):
        print(f"\n[{task}] aggregate tokens/s (speculative: tokens/s, acceptance)")
        print(header)
        for n in levels:
            texts = prompts(task, n)
            plain, _ = bench_torch(model, texts, args.new)
            cells = [f"{plain:8.1f}"]
            for mode in ("lookup", "self"):
                if "spec" in skip:
                    cells.append(f"{'-':>16}")
                    continue
                rate, acc = bench_torch(model, texts, args.new, mode)
                cells.append(f"{rate:8.1f} ({acc:4.0%}) ")
            cells.append(
                f"{bench_llama_cpp(args.model, texts, args.new, threads):9.1f}"
                if "llama" not in skip
                else f"{'-':>9}"
            )
            cells.append(
                f"{bench_transformers(args.model, texts, args.new, args.device):11.1f}"
                if "hf" not in skip
                else f"{'-':>11}"
            )
            print(f"{n:>11} | " + " | ".join(cells))
            if args.peak_gbps and n in (1, 64):
                steps_per_s = plain / n
                print(
                    f"{'':>11}   weights read {weight_bytes(model.model) * steps_per_s / 1e9:.1f} GB/s "
                    f"= {weight_bytes(model.model) * steps_per_s / 1e9 / args.peak_gbps:.0%} of peak"
                )
    engine = model.engine
    print(f"\nCUDA graphs: {engine.graph_replays} of {engine.steps} engine steps replayed a captured graph")
    model.unload()


if __name__ == "__main__":
    main()
