"""The CUDA-graph decode path and the one-sync-per-step sampling, on the CPU.

The graph runner's static-buffer forward (what a graph records) runs eagerly here, with the Triton
kernel under its interpreter, and is compared with `PagedAttention`; graph capture itself needs a GPU.
"""

from __future__ import annotations

import importlib.util
import os

import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton decorates the kernel
torch = pytest.importorskip("torch")

from localrt.backends.base import SamplingParams  # noqa: E402
from localrt.backends.torch import engine as engine_module  # noqa: E402
from localrt.backends.torch import runner as runner_module  # noqa: E402
from localrt.backends.torch.attention import PagedAttention  # noqa: E402
from localrt.backends.torch.attention import SeqChunk  # noqa: E402
from localrt.backends.torch.cuda_graphs import DecodeGraphs  # noqa: E402
from localrt.backends.torch.engine import Engine  # noqa: E402
from localrt.backends.torch.engine import EngineConfig  # noqa: E402
from localrt.backends.torch.kv_cache import KVCache  # noqa: E402
from localrt.backends.torch.llama import LlamaConfig  # noqa: E402
from localrt.backends.torch.llama import Transformer  # noqa: E402
from localrt.backends.torch.llama import random_transformer  # noqa: E402
from localrt.backends.torch.sampling import RequestSampler  # noqa: E402

needs_triton = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None
    or (os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available()),
    reason="the decode kernel needs Triton and a GPU or Triton's interpreter",
)

GREEDY = SamplingParams(temperature=0.0)
CFG = LlamaConfig("llama", 64, 256, 64, 128, 2, 8, 2, 8)  # GQA: 4 query heads per KV head


def decode_logits(
    model: Transformer,
    kv_type: str,
    lengths: list[int],
    tables: list[list[int]],
    max_seqs: int,
    static: bool,
    steps: int = 2,
) -> tuple[list[torch.Tensor], KVCache]:
    """Prefill every prompt but its last token, then `steps` greedy decode steps -> logits per step."""
    prompts = [
        torch.randint(0, 64, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in lengths
    ]
    cache = KVCache(2, 33, 2, 8, kv_type, torch.float32, "cpu")  # block 32: the graphs' scratch block
    graphs = DecodeGraphs(model, cache, 32, max_seqs, 256, torch.device("cpu"))
    out = []
    with torch.inference_mode():
        prefill = [SeqChunk(n - 1, n - 1, t) for n, t in zip(lengths, tables)]
        model(
            torch.tensor([x for p in prompts for x in p[:-1]]),
            PagedAttention(cache, prefill, "cpu", fused=False),
        )
        for _ in range(steps):
            chunks = [SeqChunk(1, len(p), t) for p, t in zip(prompts, tables)]
            feed = [p[-1] for p in prompts]
            if static:
                logits = graphs.run(feed, chunks).clone()
            else:
                logits = model(torch.tensor(feed), PagedAttention(cache, chunks, "cpu", fused=False))
            out.append(logits)
            for p, token in zip(prompts, logits.argmax(-1).tolist()):
                p.append(token)
    assert graphs.replays == 0
    assert graphs.runs == (steps if static else 0)
    return out, cache


@needs_triton
@pytest.mark.parametrize(
    ("kv_type", "lengths", "max_seqs"),
    [
        ("f32", [5, 33, 16], 16),  # batch 3 in bucket 4, mixed lengths, a block boundary crossed
        ("f32", [17], 16),  # bucket 1
        ("q8_0", [5, 33, 16, 47, 2], 6),  # bucket 6 (capped at max_seqs), quantized K/V written by the path
    ],
)
def test_static_decode_equals_paged_attention(kv_type: str, lengths: list[int], max_seqs: int) -> None:
    model = random_transformer(CFG, seed=3)
    tables = [[3, 7, 30, 31], [1, 2, 9, 10], [4, 5, 11, 12], [13, 14, 15, 20], [21, 22, 23, 24]][
        : len(lengths)
    ]
    ref, ref_cache = decode_logits(model, kv_type, lengths, tables, max_seqs, static=False)
    got, cache = decode_logits(model, kv_type, lengths, tables, max_seqs, static=True)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
        assert a.argmax(-1).tolist() == b.argmax(-1).tolist()
    # padded rows wrote only into the scratch block: every real block holds what PagedAttention wrote
    for layer in range(2):
        for mine, theirs in ((cache.k, ref_cache.k), (cache.v, ref_cache.v)):
            diff = (mine[layer][:32].float() - theirs[layer][:32].float()).abs().max()
            assert diff <= (1 if cache.quantized else 1e-4)


def run_each(
    model: Transformer, requests: list[tuple[list[int], SamplingParams]], together: bool, **config: object
) -> list[list[int]]:
    options: dict[str, object] = {"context_length": 256, "kv_cache_type": "f32", "max_seqs": 3, **config}

    def engine() -> Engine:
        return Engine(model, EngineConfig(**options))  # type: ignore[arg-type]

    with torch.inference_mode():
        if together:
            e = engine()
            seqs = [e.new_sequence(p, s, max_new=12) for p, s in requests]
            e.run(seqs)
            return [s.tokens[s.prompt_len :] for s in seqs]
        out = []
        for p, s in requests:
            e = engine()
            seq = e.new_sequence(p, s, max_new=12)
            e.run([seq])
            out.append(seq.tokens[seq.prompt_len :])
        return out


REQUESTS = [
    (list(range(3, 20)), GREEDY),
    (list(range(10, 50)), SamplingParams(temperature=0.0, repeat_penalty=1.3, repeat_last_n=16)),
    (list(range(5, 12)), SamplingParams(temperature=0.9, top_k=20, top_p=0.9, seed=7)),
    (list(range(30, 37)), SamplingParams(temperature=1.1, min_p=0.05, frequency_penalty=0.5, seed=11)),
    ([7, 8, 9], GREEDY),
]


def test_batched_sampling_matches_each_request_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """Greedy, penalised and seeded requests sampled together give each one's solo tokens, one sync a step."""
    model = random_transformer(LlamaConfig("llama", 96, 256, 64, 128, 2, 4, 2, 16), seed=5)
    alone = run_each(model, REQUESTS, together=False)
    calls = []
    batch = runner_module.sample_batch

    def counted(*args: object) -> object:
        calls.append(len(args[0]))  # type: ignore[arg-type]
        return batch(*args)  # type: ignore[arg-type]

    def per_sequence(*_: object) -> int:
        raise AssertionError("plain decodes are sampled in the batch")

    monkeypatch.setattr(runner_module, "sample_batch", counted)
    monkeypatch.setattr(RequestSampler, "sample", per_sequence)
    assert run_each(model, REQUESTS, together=True) == alone
    assert max(calls) == 3  # max_seqs sequences shared a step's sampling


@needs_triton
def test_engine_decodes_through_the_static_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine with the graph runner (eager on a CPU) gives the tokens of the plain path."""
    model = random_transformer(LlamaConfig("llama", 96, 256, 64, 128, 2, 4, 2, 16), seed=5)
    plain = run_each(model, REQUESTS, together=True)
    monkeypatch.setattr(engine_module, "_graphs_available", lambda device: True)
    runs = []
    original = DecodeGraphs.run

    def run(self: DecodeGraphs, *args: object) -> torch.Tensor:
        runs.append(self)
        return original(self, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(DecodeGraphs, "run", run)
    assert run_each(model, REQUESTS, together=True) == plain
    assert runs
    assert runs[0].buckets == [1, 2, 3]
    assert runs[0].replays == 0
    assert runs[0].cache.num_blocks == runs[0].scratch_block + 1  # the scratch block is past the pool's
    off = Engine(model, EngineConfig(context_length=256, cuda_graphs=False))
    assert off.graphs is None
    assert off.graph_replays == 0
