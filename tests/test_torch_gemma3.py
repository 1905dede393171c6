"""Gemma 3 in the torch engine on tiny random models: sliding-window paging (only the window's blocks
are held, output equal to the dense reference), prefix caching across the window, batching is
invisible, exact speculation. The GGUF-level checks (transformers, llama.cpp, the real 270M file) are
in tests/test_torch_families.py."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from localrt.backends.base import SamplingParams  # noqa: E402
from localrt.backends.family_config import GemmaConfig  # noqa: E402
from localrt.backends.family_config import sliding_pattern  # noqa: E402
from localrt.backends.torch.attention import PagedAttention  # noqa: E402
from localrt.backends.torch.attention import SeqChunk  # noqa: E402
from localrt.backends.torch.engine import Engine  # noqa: E402
from localrt.backends.torch.engine import EngineConfig  # noqa: E402
from localrt.backends.torch.gemma3 import Gemma3  # noqa: E402
from localrt.backends.torch.gemma3 import random_gemma3  # noqa: E402
from localrt.backends.torch.kv_cache import KVCache  # noqa: E402
from localrt.backends.torch.llama import DenseCausal  # noqa: E402
from localrt.backends.torch.scheduler import Sequence  # noqa: E402
from tests.test_torch_engine import Req  # noqa: E402
from tests.test_torch_engine import random_requests  # noqa: E402
from tests.test_torch_engine import run_workload  # noqa: E402

VOCAB = 96
WINDOW = 20  # not a multiple of the block size (16): a window straddles blocks
GREEDY = SamplingParams(temperature=0.0)


def tiny_gemma3(seed: int = 0, layers: int = 6, window: int = WINDOW) -> Gemma3:
    cfg = GemmaConfig(
        "gemma3",
        VOCAB,
        1024,
        64,
        128,
        layers,
        4,
        2,
        16,
        1e-6,
        rope_freq_base=1e6,
        rope_neox=True,
        sliding_window=window,
        sliding_layers=sliding_pattern(None, layers),
        rope_freq_base_swa=1e4,
        attention_scale=0.25,
    )
    model = random_gemma3(cfg, seed=seed)
    for block in model.blk:  # random norms, so a wrong norm placement shows in the logits
        for name in ("attn_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm", "attn_q_norm"):
            norm = getattr(block, name)
            norm.weight.copy_(1 + 0.3 * torch.randn(norm.weight.shape))
    return model


@pytest.fixture(scope="module")
def model() -> Gemma3:
    return tiny_gemma3()


def make_engine(model: Gemma3, **overrides: object) -> Engine:
    options: dict[str, object] = {"context_length": 1024, "kv_cache_type": "f32"}
    options.update(overrides)
    return Engine(model, EngineConfig(**options))  # type: ignore[arg-type]


def dense_logits(model: Gemma3, tokens: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor(tokens), DenseCausal(len(tokens)))


def test_the_layer_pattern_is_llama_cpps() -> None:
    assert sliding_pattern(None, 12) == (*[True] * 5, False, *[True] * 5, False)
    assert sliding_pattern(2, 4) == (True, False, True, False)  # Gemma 2's period
    assert sliding_pattern(1, 3) == (False, False, False)
    assert sliding_pattern([True, False, False], 3) == (True, False, False)


def test_the_window_changes_the_output(model: Gemma3) -> None:
    """The dense reference honours the window: without it the logits past the window differ."""
    tokens = np.random.default_rng(0).integers(3, VOCAB, 60).tolist()
    windowed = dense_logits(model, tokens)

    class Unwindowed(DenseCausal):
        def attend(self, layer, q, k, v):  # type: ignore[no-untyped-def]
            return super().attend(replace(layer, window=0), q, k, v)

    with torch.inference_mode():
        full = model(torch.tensor(tokens), Unwindowed(len(tokens)))
    assert torch.allclose(windowed[:WINDOW], full[:WINDOW], atol=1e-5)  # inside the window: the same
    assert (windowed[WINDOW:] - full[WINDOW:]).abs().max() > 1e-2


def test_paged_sliding_layers_equal_dense(model: Gemma3) -> None:
    """Prompt in three chunks through a cache whose sliding layers have their own, sparse table."""
    bs, n = 16, 70
    tokens = np.random.default_rng(1).integers(3, VOCAB, n).tolist()
    cfg = model.cfg
    cache = KVCache(
        cfg.block_count, 8, 2, 16, "f32", torch.float32, "cpu", bs, [w > 0 for w in model.windows], 12
    )
    table = [7, 2, 5, 0, 3]  # global layers: every block of the context
    window_table = [11, 4, 9, 1, 6]  # sliding layers; entries out of the window are never read
    out = []
    with torch.inference_mode():
        for start, end in ((0, 30), (30, 31), (31, n)):
            used = -(-end // bs)
            low = max(0, start - WINDOW + 1) // bs
            sparse = [-1] * low + window_table[low:used]
            ctx = PagedAttention(cache, [SeqChunk(end - start, end, table[:used], sparse)], "cpu")
            out.append(model(torch.tensor(tokens[start:end]), ctx))
    torch.testing.assert_close(torch.cat(out), dense_logits(model, tokens), atol=1e-4, rtol=1e-4)


def held(seq: Sequence) -> int:
    return sum(1 for b in seq.window_table if b >= 0)


def test_a_long_sequence_holds_only_the_windows_blocks(model: Gemma3) -> None:
    """A sequence 10x the window keeps at most window/block_size + 1 sliding blocks between steps (its
    global layers keep all), and its greedy tokens are the dense reference's argmax at every step."""
    engine = make_engine(model, max_batch_tokens=32)
    bs = engine.config.block_size
    prompt = np.random.default_rng(2).integers(3, VOCAB, 45).tolist()
    seq = engine.new_sequence(prompt, GREEDY, max_new=160)
    engine.add(seq)
    most = 0
    with torch.inference_mode():
        while engine.has_work:
            engine.step()
            engine.pool.check()
            engine.window_pool.check()
            if not seq.finished:
                most = max(most, held(seq))
                assert len(seq.block_table) * bs >= seq.num_computed  # global layers: the whole context
    assert len(seq.tokens) == 45 + 160
    assert most <= WINDOW // bs + 1 + (WINDOW % bs > 0)  # ceil(window / bs) + 1 = 3 here
    assert most >= 2  # it did hold a window
    reference = dense_logits(model, seq.tokens[:-1]).argmax(-1).tolist()
    assert seq.tokens[45:] == reference[44:]
    assert engine.window_pool.num_used == 0  # all given back (cached ones are evictable)


def test_prefix_hits_across_the_window(model: Gemma3) -> None:
    """A second request with the same long prompt reuses the cached prefix (global blocks and the
    window's sliding blocks) and gets the same tokens; with the window's blocks evicted, the hit
    shrinks to what is whole and the tokens are still the same."""
    prompt = np.random.default_rng(3).integers(3, VOCAB, 90).tolist()
    engine = make_engine(model)
    first = engine.new_sequence(prompt, GREEDY, max_new=12)
    with torch.inference_mode():
        engine.run([first])
        hits = engine.prefix.hit_tokens
        second = engine.new_sequence(prompt + [5, 6], GREEDY, max_new=12)
        engine.run([second])
    assert engine.prefix.hit_tokens - hits >= 64  # most of the prompt came from the cache
    assert second.request.timings.prompt_eval_count < 30
    reference = dense_logits(model, second.tokens[:-1]).argmax(-1).tolist()
    assert second.tokens[92:] == reference[91:]

    # the sliding pool only has room for about one window: the first request's blocks get evicted
    small = make_engine(model, kv_budget_seqs=1, max_seqs=1, max_batch_tokens=16)
    other = np.random.default_rng(4).integers(3, VOCAB, 60).tolist()
    with torch.inference_mode():
        small.run([small.new_sequence(prompt, GREEDY, max_new=4)])
        small.run([small.new_sequence(other, GREEDY, max_new=40)])
        again = small.new_sequence(prompt, GREEDY, max_new=12)
        small.run([again])
    # the global layers still had the prompt; its window's sliding blocks were reused by `other`
    assert again.request.timings.prompt_eval_count == len(prompt)
    reference = dense_logits(model, again.tokens[:-1]).argmax(-1).tolist()
    assert again.tokens[90:] == reference[89:]
    small.pool.check()
    small.window_pool.check()


def test_batching_is_invisible(model: Gemma3) -> None:
    """16 requests (lengths past the window, arrivals, seeds, cancellations) -> their solo tokens."""
    reqs = random_requests(16, seed=5)
    engine = make_engine(model, max_batch_tokens=48)
    seqs = run_workload(engine, reqs)
    engine.window_pool.check()
    for req, seq in zip(reqs, seqs):
        alone_engine = make_engine(model, prefix_caching=False)
        (alone,) = run_workload(alone_engine, [Req(req.prompt, req.max_new, req.sampling)])
        got, want = seq.tokens[seq.prompt_len :], alone.tokens[alone.prompt_len :]
        if req.cancel_at is not None and len(got) < len(want):
            assert got == want[: len(got)]
        else:
            assert got == want


def test_preemption_under_a_tight_budget_is_invisible(model: Gemma3) -> None:
    reqs = [Req(np.random.default_rng(10 + i).integers(3, VOCAB, 50).tolist(), 40, GREEDY) for i in range(4)]
    engine = make_engine(model, context_length=128, kv_budget_seqs=2, max_batch_tokens=32)
    seqs = run_workload(engine, reqs)
    assert engine.scheduler.num_preemptions > 0
    for seq in seqs:
        reference = dense_logits(model, seq.tokens[:-1]).argmax(-1).tolist()
        assert seq.tokens[50:] == reference[49:]


@pytest.mark.parametrize("mode", ["lookup", "draft", "self"])
def test_greedy_output_identical_with_speculation(model: Gemma3, mode: str) -> None:
    draft = tiny_gemma3(seed=8, layers=2) if mode == "draft" else None
    rng = np.random.default_rng(6)
    base = rng.integers(3, VOCAB, 14).tolist()
    prompts = [[*base, *base, *base[:5]], rng.integers(3, VOCAB, 30).tolist(), [5, 6, 7, 5, 6, 7, 5, 6]]

    def runs(speculative: str) -> list[list[int]]:
        engine = Engine(model, EngineConfig(context_length=512, kv_cache_type="f32"), draft_model=draft)
        seqs = [
            engine.new_sequence(p, GREEDY, max_new=40, speculative=speculative, num_draft=5) for p in prompts
        ]
        with torch.inference_mode():
            engine.run(seqs)
        engine.window_pool.check()
        assert engine.window_pool.num_used == 0
        if speculative != "off":
            assert sum(s.spec.drafted for s in seqs) > 0
        return [s.tokens[s.prompt_len :] for s in seqs]

    assert runs(mode) == runs("off")


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["lookup", "draft", "self"])
def test_sampled_speculation_keeps_the_target_distribution(mode: str) -> None:
    """Monte Carlo, as for Llama (tests/test_torch_speculative.py): with guesses verified against a
    Gemma 3 whose window is shorter than the prompt, the two tokens after the first are distributed
    exactly as the target's own P(t2, t3)."""
    from tests.stats import assert_same_distribution
    from tests.stats import de_bruijn_prompt
    from tests.test_torch_speculative import MC_VOCAB
    from tests.test_torch_speculative import target_pair_distribution

    def mc_gemma(seed: int) -> Gemma3:
        cfg = GemmaConfig(
            "gemma3", MC_VOCAB, 256, 32, 64, 2, 2, 1, 16, 1e-6, rope_neox=True, sliding_window=6,
            sliding_layers=(True, False), attention_scale=0.25,
        )  # fmt: skip
        return random_gemma3(cfg, seed=seed)

    target = mc_gemma(2)
    draft = mc_gemma(9) if mode == "draft" else None
    engine = Engine(
        target,
        EngineConfig(
            context_length=256,
            kv_cache_type="f32",
            max_seqs=64,
            kv_budget_seqs=40,
            max_batch_tokens=4096,
            self_spec_layers=1,  # self: the sliding layer alone drafts, through the window's blocks
        ),
        draft_model=draft,
    )
    prompt = de_bruijn_prompt(MC_VOCAB)
    assert len(prompt) > 6  # the window slides over the prompt
    params = SamplingParams(temperature=0.9, top_k=6, top_p=0.97, min_p=0.0, repeat_penalty=1.0)
    trials = 2000
    seqs = []
    for i in range(trials):
        seeded = SamplingParams(**{**params.__dict__, "seed": 10_000 + i})
        seqs.append(engine.new_sequence(prompt, seeded, max_new=3, speculative=mode, num_draft=3))
        seqs[-1].spec.cost_per_draft = 0.0  # keep speculating whatever the acceptance: this tests exactness
    with torch.inference_mode():
        engine.run(seqs)
    counts = np.zeros(MC_VOCAB * MC_VOCAB)
    for s in seqs:
        t2, t3 = s.tokens[len(prompt) + 1 : len(prompt) + 3]
        counts[t2 * MC_VOCAB + t3] += 1
    drafted = sum(s.spec.drafted for s in seqs)
    accepted = sum(s.spec.accepted for s in seqs)
    assert drafted > trials // 2
    assert 0 < accepted < drafted
    assert_same_distribution(counts, target_pair_distribution(target, prompt, params))
    assert engine.window_pool.num_used == 0
