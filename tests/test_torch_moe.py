"""Qwen3-MoE in the torch engine on a tiny random model: the batched expert dispatch equals a plain
per-token reference, batching is invisible, and speculation leaves greedy output unchanged. Logits
against transformers and llama.cpp: tests/test_torch_families.py."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from localrt.backends.base import SamplingParams  # noqa: E402
from localrt.backends.torch.engine import Engine  # noqa: E402
from localrt.backends.torch.engine import EngineConfig  # noqa: E402
from localrt.backends.torch.llama import LlamaConfig  # noqa: E402
from localrt.backends.torch.qwen3moe import MIN_WEIGHT_SUM  # noqa: E402
from localrt.backends.torch.qwen3moe import ExpertShape  # noqa: E402
from localrt.backends.torch.qwen3moe import Qwen3MoE  # noqa: E402
from tests.test_torch_engine import Req  # noqa: E402
from tests.test_torch_engine import random_requests  # noqa: E402
from tests.test_torch_engine import run_workload  # noqa: E402

VOCAB = 96
GREEDY = SamplingParams(temperature=0.0)


def tiny_moe(seed: int = 0, experts: int = 6, used: int = 2) -> Qwen3MoE:
    torch.manual_seed(seed)
    cfg = LlamaConfig("qwen3moe", VOCAB, 1024, 64, 128, 2, 4, 2, 16, rope_neox=True)
    model = Qwen3MoE(cfg, ExpertShape(experts, used, 48))
    for block in model.blk:
        for name in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"):
            getattr(block, name).weight.copy_(0.2 * torch.randn(getattr(block, name).weight.shape))
    model.requires_grad_(False)
    return model.eval()


@pytest.fixture(scope="module")
def model() -> Qwen3MoE:
    return tiny_moe()


def per_token_moe(block: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The routing written out token by token (the slow, obvious reading of llama.cpp's graph)."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        probs = torch.softmax(block.ffn_gate_inp(x[t]).float(), -1)
        weights, chosen = probs.topk(block.n_used)
        weights = weights / max(float(weights.sum()), MIN_WEIGHT_SUM)
        for w, e in zip(weights.tolist(), chosen.tolist()):
            gate = block.ffn_gate_exps.weight[e] @ x[t]
            up = block.ffn_up_exps.weight[e] @ x[t]
            out[t] += w * (block.ffn_down_exps.weight[e] @ (torch.nn.functional.silu(gate) * up))
    return out


def test_batched_dispatch_equals_the_per_token_reading(model: Qwen3MoE) -> None:
    x = torch.randn(37, 64)
    block = model.blk[0]
    with torch.inference_mode():
        batched = block.feed_forward(x)
        chosen = torch.softmax(block.ffn_gate_inp(x), -1).topk(2).indices
    assert len(set(chosen.flatten().tolist())) >= 4  # several experts in play
    torch.testing.assert_close(batched, per_token_moe(block, x), atol=1e-5, rtol=1e-5)


def test_batching_is_invisible(model: Qwen3MoE) -> None:
    reqs = random_requests(12, seed=7)
    engine = Engine(model, EngineConfig(context_length=1024, kv_cache_type="f32", max_batch_tokens=48))
    seqs = run_workload(engine, reqs)
    for req, seq in zip(reqs, seqs):
        alone_engine = Engine(
            model, EngineConfig(context_length=1024, kv_cache_type="f32", prefix_caching=False)
        )
        (alone,) = run_workload(alone_engine, [Req(req.prompt, req.max_new, req.sampling)])
        got, want = seq.tokens[seq.prompt_len :], alone.tokens[alone.prompt_len :]
        if req.cancel_at is not None and len(got) < len(want):
            assert got == want[: len(got)]
        else:
            assert got == want


@pytest.mark.parametrize("mode", ["lookup", "self"])
def test_greedy_output_identical_with_speculation(model: Qwen3MoE, mode: str) -> None:
    rng = np.random.default_rng(6)
    base = rng.integers(3, VOCAB, 14).tolist()
    prompts = [[*base, *base, *base[:5]], rng.integers(3, VOCAB, 30).tolist()]

    def runs(speculative: str) -> list[list[int]]:
        engine = Engine(model, EngineConfig(context_length=512, kv_cache_type="f32", self_spec_layers=1))
        seqs = [
            engine.new_sequence(p, GREEDY, max_new=30, speculative=speculative, num_draft=4) for p in prompts
        ]
        with torch.inference_mode():
            engine.run(seqs)
        if speculative != "off":
            assert sum(s.spec.drafted for s in seqs) > 0
        return [s.tokens[s.prompt_len :] for s in seqs]

    assert runs(mode) == runs("off")
