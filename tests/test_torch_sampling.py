"""Torch engine sampling: the filters, llama.cpp's penalty rule, and per-request seeds that do not
depend on what else is in the batch."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from localrt.backends.base import SamplingParams  # noqa: E402
from localrt.backends.torch.engine import Engine  # noqa: E402
from localrt.backends.torch.engine import EngineConfig  # noqa: E402
from localrt.backends.torch.llama import LlamaConfig  # noqa: E402
from localrt.backends.torch.llama import random_transformer  # noqa: E402
from localrt.backends.torch.sampling import RequestSampler  # noqa: E402


def sampler(**kw: float) -> RequestSampler:
    params = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "seed": 1, **kw}
    return RequestSampler(SamplingParams(**params), "cpu", 64)  # type: ignore[arg-type]


LOGITS = torch.tensor([3.0, 2.0, 1.0, 0.0, -1.0, -2.0])


def support(probs: torch.Tensor) -> list[int]:
    return torch.nonzero(probs > 0).flatten().tolist()


def test_top_k_top_p_min_p() -> None:
    assert support(sampler(top_k=2).probs(LOGITS, [])) == [0, 1]
    p = torch.softmax(LOGITS, -1)  # 0.64, 0.23, 0.09, ...
    assert support(sampler(top_p=0.5).probs(LOGITS, [])) == [0]
    assert support(sampler(top_p=0.8).probs(LOGITS, [])) == [0, 1]  # the token crossing top_p stays
    assert support(sampler(min_p=0.2).probs(LOGITS, [])) == [0, 1]  # p >= 0.2 * 0.64
    torch.testing.assert_close(sampler().probs(LOGITS, []), p)
    hot = sampler(temperature=2.0).probs(LOGITS, [])
    torch.testing.assert_close(hot, torch.softmax(LOGITS / 2, -1))


def test_penalties_follow_llama_cpp() -> None:
    s = sampler(repeat_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25, repeat_last_n=3)
    out = s.penalized(LOGITS, [9, 0, 3, 3])  # window: the last 3 tokens -> {0: 1, 3: 2}
    expected = LOGITS.clone()
    expected[0] = 3.0 / 2.0 - 0.5 - 0.25  # positive logits are divided
    expected[3] = 0.0 * 2.0 - 2 * 0.5 - 0.25  # others multiplied; frequency counts occurrences
    torch.testing.assert_close(out, expected)


def test_draws_follow_the_distribution() -> None:
    s = sampler(temperature=1.0)
    probs = torch.softmax(LOGITS, -1)
    counts = np.bincount([s.draw(probs) for _ in range(6000)], minlength=6)
    np.testing.assert_allclose(counts / 6000, probs.numpy(), atol=0.02)


def test_seeds_reproducible_regardless_of_batch() -> None:
    model = random_transformer(LlamaConfig("llama", 96, 512, 64, 128, 2, 4, 2, 16), seed=6)
    params = SamplingParams(temperature=1.0, top_k=40, top_p=0.95, seed=1234)
    prompt = list(range(3, 30))

    def run(companions: int) -> list[int]:
        engine = Engine(model, EngineConfig(context_length=512, kv_cache_type="f32"))
        rng = np.random.default_rng(companions)
        others = [
            engine.new_sequence(
                rng.integers(3, 96, int(rng.integers(2, 50))).tolist(),
                SamplingParams(temperature=0.7, seed=int(rng.integers(0, 1000))),
                max_new=20,
            )
            for _ in range(companions)
        ]
        mine = engine.new_sequence(prompt, params, max_new=30)
        with torch.inference_mode():
            engine.run([*others[: companions // 2], mine, *others[companions // 2 :]])
        return mine.tokens[len(prompt) :]

    alone = run(0)
    assert run(5) == alone
    assert run(11) == alone
    other_seed = SamplingParams(**{**params.__dict__, "seed": 99})
    engine = Engine(model, EngineConfig(context_length=512, kv_cache_type="f32"))
    seq = engine.new_sequence(prompt, other_seed, max_new=30)
    with torch.inference_mode():
        engine.run([seq])
    assert seq.tokens[len(prompt) :] != alone
