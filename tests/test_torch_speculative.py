"""Speculative decoding in the torch engine: the verifier keeps the target's distribution (Monte Carlo),
greedy output is unchanged by every proposer, and speculation switches itself off when it does not pay."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from localrt.backends.base import SamplingParams  # noqa: E402
from localrt.backends.speculation import SpecState  # noqa: E402
from localrt.backends.speculation import break_even_acceptance  # noqa: E402
from localrt.backends.speculation import expected_tokens  # noqa: E402
from localrt.backends.speculation import verify  # noqa: E402
from localrt.backends.torch.engine import Engine  # noqa: E402
from localrt.backends.torch.engine import EngineConfig  # noqa: E402
from localrt.backends.torch.llama import DenseCausal  # noqa: E402
from localrt.backends.torch.llama import LlamaConfig  # noqa: E402
from localrt.backends.torch.llama import Transformer  # noqa: E402
from localrt.backends.torch.llama import random_transformer  # noqa: E402
from localrt.backends.torch.sampling import RequestSampler  # noqa: E402
from tests.stats import assert_same_distribution  # noqa: E402
from tests.stats import de_bruijn_prompt  # noqa: E402
from tests.stats import exact_pair_distribution  # noqa: E402

# ---- the verifier alone, on synthetic distributions -------------------------------------------------
SAMPLED = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=11)


@pytest.mark.parametrize("proposer", ["sampled", "deterministic"])
def test_verifier_first_token_follows_target(proposer: str) -> None:
    """Whatever the guesses, the first token the verifier emits is distributed as the target's p_0."""
    gen = torch.Generator().manual_seed(0)
    vocab, k, trials = 6, 3, 12000
    target_logits = torch.randn(k + 1, vocab, generator=gen) * 1.5
    draft_q = torch.softmax(torch.randn(k, vocab, generator=gen).double() * 1.5, -1)
    sampler = RequestSampler(SAMPLED, "cpu", 64)
    rng = np.random.default_rng(1)
    counts = np.zeros(vocab)
    lengths = []
    for _ in range(trials):
        if proposer == "sampled":
            drafts = [int(rng.choice(vocab, p=draft_q[j].numpy())) for j in range(k)]
            tokens, accepted = verify(sampler, target_logits, drafts, draft_q, [])
        else:
            drafts = [2, 4, 1]  # prompt-lookup style: no distribution, q = one-hot
            tokens, accepted = verify(sampler, target_logits, drafts, None, [])
        assert len(tokens) == accepted + 1
        assert tokens[:accepted] == drafts[:accepted]
        counts[tokens[0]] += 1
        lengths.append(len(tokens))
    assert_same_distribution(counts, torch.softmax(target_logits[0], -1).double().numpy())
    assert max(lengths) > 1  # some guesses were accepted


def test_greedy_verification_is_token_equality() -> None:
    logits = torch.tensor([[0.0, 5.0, 1.0], [4.0, 0.0, 1.0], [0.0, 0.0, 9.0], [1.0, 0.0, 0.0]])
    greedy = RequestSampler(SamplingParams(temperature=0.0), "cpu", 64)
    assert verify(greedy, logits, [1, 0, 2], None, []) == ([1, 0, 2, 0], 3)  # all accepted + bonus
    assert verify(greedy, logits, [1, 2, 2], None, []) == ([1, 0], 1)  # correction at the mismatch


def test_break_even() -> None:
    assert expected_tokens(0.0, 4) == 1.0
    assert expected_tokens(1.0, 4) == 5.0
    free = break_even_acceptance(4, 0.0)
    assert free < 1e-6  # guesses that cost nothing always pay
    costly = break_even_acceptance(4, 0.5)  # 3x the work per step: needs E[tokens] >= 3
    assert expected_tokens(costly, 4) == pytest.approx(3.0, abs=1e-6)


def test_free_drafts_count_in_usage_not_in_the_policy() -> None:
    """Draft tokens that rode in rows a step ran anyway are reported, and do not shrink k or the
    acceptance rate the policy judges by."""
    state = SpecState("lookup", 16, 0.25, k_max=63)
    state.record(40, 16, free=24)  # all 16 asked-for drafts kept, none of the 24 that filled the step
    assert (state.drafted, state.accepted) == (40, 16)
    assert state.acceptance == 1.0
    assert state.k == 32


# ---- end to end on a tiny model with a small vocabulary --------------------------------------------
MC_VOCAB = 8


def mc_model(seed: int) -> Transformer:
    return random_transformer(LlamaConfig("llama", MC_VOCAB, 256, 32, 64, 2, 2, 1, 16), seed=seed)


def target_pair_distribution(model: Transformer, prompt: list[int], params: SamplingParams) -> np.ndarray:
    """The target's P(t2, t3), t1 marginalised, from dense passes (no engine)."""
    sampler = RequestSampler(params, "cpu", 256)

    def next_probs(tokens: list[int]) -> np.ndarray:
        with torch.inference_mode():
            logits = model(
                torch.tensor(tokens), DenseCausal(len(tokens)), rows=torch.tensor([len(tokens) - 1])
            )
        return sampler.probs(logits[0], tokens).double().numpy()

    return exact_pair_distribution(next_probs, prompt, MC_VOCAB)


@pytest.mark.parametrize("mode", ["self", "lookup", "draft"])
def test_speculative_sampling_keeps_the_target_distribution(mode: str) -> None:
    target = mc_model(seed=2)
    draft = mc_model(seed=9) if mode == "draft" else None
    # room for 64 sequences in the draft model's cache too (it has no prefix sharing)
    engine = Engine(
        target,
        EngineConfig(
            context_length=256,
            kv_cache_type="f32",
            max_seqs=64,
            kv_budget_seqs=40,
            max_batch_tokens=4096,
            self_spec_layers=1,
        ),
        draft_model=draft,
    )
    prompt = de_bruijn_prompt(MC_VOCAB)
    params = SamplingParams(temperature=0.9, top_k=6, top_p=0.97, min_p=0.0, repeat_penalty=1.0)
    trials = 2000
    seqs = []
    for i in range(trials):
        seed_params = SamplingParams(**{**params.__dict__, "seed": 10_000 + i})
        seqs.append(engine.new_sequence(prompt, seed_params, max_new=3, speculative=mode, num_draft=3))
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
    assert engine.pool.num_free == engine.pool.num_blocks


def greedy_runs(
    engine: Engine, prompts: list[list[int]], mode: str, params: SamplingParams
) -> list[list[int]]:
    seqs = [engine.new_sequence(p, params, max_new=40, speculative=mode, num_draft=5) for p in prompts]
    with torch.inference_mode():
        engine.run(seqs)
    engine.pool.check()
    assert engine.pool.num_free == engine.pool.num_blocks
    if mode != "off":
        assert sum(s.spec.drafted for s in seqs) > 0
    return [s.tokens[s.prompt_len :] for s in seqs]


@pytest.mark.parametrize("penalty", [1.0, 1.3])
@pytest.mark.parametrize("mode", ["self", "lookup", "draft-same", "draft-other"])
def test_greedy_output_identical_with_each_proposer(mode: str, penalty: float) -> None:
    target = random_transformer(LlamaConfig("llama", 96, 512, 64, 128, 3, 4, 2, 16), seed=4)
    draft = None
    if mode.startswith("draft"):
        draft = target if mode == "draft-same" else random_transformer(target.cfg, seed=8)
    params = SamplingParams(temperature=0.0, repeat_penalty=penalty, repeat_last_n=16)
    rng = np.random.default_rng(2)
    base = rng.integers(3, 96, 12).tolist()
    prompts = [[*base, *base, *base[:5]], rng.integers(3, 96, 30).tolist(), [5, 6, 7, 5, 6, 7, 5, 6]]

    def engine() -> Engine:
        return Engine(
            target,
            EngineConfig(context_length=512, kv_cache_type="f32", self_spec_layers=2),
            draft_model=draft,
        )

    plain = greedy_runs(engine(), prompts, "off", params)
    fast = greedy_runs(engine(), prompts, mode.split("-")[0], params)
    assert fast == plain


def test_speculation_switches_off_below_break_even() -> None:
    target = random_transformer(LlamaConfig("llama", 96, 512, 64, 128, 2, 4, 2, 16), seed=4)
    other = random_transformer(target.cfg, seed=8)  # a draft that rarely agrees
    engine = Engine(target, EngineConfig(context_length=512, kv_cache_type="f32"), draft_model=other)
    seq = engine.new_sequence(
        list(range(3, 40)), SamplingParams(temperature=0.0), max_new=150, speculative="draft", num_draft=4
    )
    with torch.inference_mode():
        engine.run([seq])
    assert seq.spec is not None
    assert not seq.spec.enabled
    assert seq.spec.drafted < 60  # it stopped guessing early, not after 150 tokens
    assert seq.spec.acceptance < break_even_acceptance(4, seq.spec.cost_per_draft)
