"""Speculative decoding in the MLX engine (the batched engine the backend runs, one row at a time):
sampled output keeps the target's distribution (Monte Carlo) with each proposer, greedy output is
unchanged by every proposer, speculation switches itself off when it does not pay; and the numpy
sampler reads the runtime's parameters as the torch one does."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")

from localrt.backends.base import SamplingParams  # noqa: E402
from localrt.backends.mlx.cache import make_caches  # noqa: E402
from localrt.backends.mlx.engine import Engine  # noqa: E402
from localrt.backends.mlx.gguf_load import GGUFTensors  # noqa: E402
from localrt.backends.mlx.llama import Transformer  # noqa: E402
from localrt.backends.mlx.prompt_cache import PromptCache  # noqa: E402
from localrt.backends.mlx.runner import Runner  # noqa: E402
from localrt.backends.mlx.sampling import RowSampler  # noqa: E402
from localrt.backends.mlx.speculative import DraftModelProposer  # noqa: E402
from localrt.backends.mlx.speculative import SelfOnRow  # noqa: E402
from localrt.backends.sampler import Sampler  # noqa: E402
from localrt.backends.speculation import SpecState  # noqa: E402
from localrt.backends.speculation import break_even_acceptance  # noqa: E402
from localrt.backends.speculation import verify  # noqa: E402
from tests.gguf_factory import write_random_model  # noqa: E402
from tests.stats import assert_same_distribution  # noqa: E402
from tests.stats import de_bruijn_prompt  # noqa: E402
from tests.stats import exact_pair_distribution  # noqa: E402


def load(tmp: Path, name: str, **kwargs: object) -> Transformer:
    return Transformer(GGUFTensors(write_random_model(tmp / f"{name}.gguf", **kwargs)), mx.float32)  # type: ignore[arg-type]


def engine_for(target: Transformer, num_batch: int) -> Engine:
    """One row at a time; the prompt cache lets the next request reuse the prompt's caches."""
    return Engine("f32", num_batch, target, prompt_cache=PromptCache(1 << 22))


def draft_proposer(draft: Transformer, engine: Engine) -> DraftModelProposer:
    """A draft model on its own caches, which catch up with each request by prefix reuse."""
    return DraftModelProposer(Runner(draft, engine.kv_cache_type, engine.num_batch), 0.5)


def decode(
    engine: Engine,
    prompt: list[int],
    params: SamplingParams,
    n: int,
    mode: str = "off",
    draft: DraftModelProposer | None = None,
    k: int = 4,
    cost: float = 0.0,
    self_layers: int = 1,
) -> tuple[list[int], SpecState | None]:
    """One request's output tokens, and its speculation state (`draft`: the "draft" mode's proposer)."""
    row = engine.new_row(prompt, RowSampler(params, 1024), len(prompt) + n)
    if mode == "self":  # on the row's own caches, once the engine gives them
        row.proposer = SelfOnRow(row, self_layers, 0.0)
    elif mode == "draft":
        row.proposer = draft
    if mode != "off":  # "lookup": the SpecState's own n-gram index proposes
        row.spec = SpecState(mode, k, cost)
    engine.run([row])
    assert row.finish == "length"
    return row.output, row.spec


# ---- Monte Carlo on a model with a vocabulary of 8 ----------------------------------------------------
MC_VOCAB = 8


def target_pair_distribution(model: Transformer, prompt: list[int], params: SamplingParams) -> np.ndarray:
    """The target's P(t2, t3), t1 marginalised, from whole-sequence passes (no engine)."""
    sampler = Sampler(params, 1024)

    def next_probs(tokens: list[int]) -> np.ndarray:
        logits = np.array(model(mx.array(tokens), make_caches(model.cfg.block_count, "f32")))[-1]
        return sampler.probs(logits, tokens)

    return exact_pair_distribution(next_probs, prompt, MC_VOCAB)


@pytest.mark.parametrize("mode", ["self", "lookup", "draft"])
def test_speculative_sampling_keeps_the_target_distribution(tmp_path: Path, mode: str) -> None:
    dims = dict(n_vocab=MC_VOCAB, n_embd=32, n_head=2, n_head_kv=1, n_ff=64, context_length=256)
    target = load(tmp_path, "target", seed=2, **dims)
    engine = engine_for(target, num_batch=256)
    draft = draft_proposer(load(tmp_path, "draft", seed=9, **dims), engine) if mode == "draft" else None
    prompt = de_bruijn_prompt(MC_VOCAB)
    params = SamplingParams(temperature=0.9, top_k=6, top_p=0.97, min_p=0.0, repeat_penalty=1.0)
    trials = 1500
    counts = np.zeros(MC_VOCAB * MC_VOCAB)
    drafted = accepted = 0
    for i in range(trials):
        seeded = SamplingParams(**{**params.__dict__, "seed": 10_000 + i})
        # cost 0: keep speculating whatever the acceptance, this checks exactness
        tokens, spec = decode(engine, prompt, seeded, 3, mode, draft, k=3, cost=0.0)
        counts[tokens[1] * MC_VOCAB + tokens[2]] += 1
        assert spec is not None
        drafted, accepted = drafted + spec.drafted, accepted + spec.accepted
    assert drafted > trials // 2
    assert 0 < accepted < drafted
    assert_same_distribution(counts, target_pair_distribution(target, prompt, params))


def test_verifier_over_numpy_keeps_the_first_token_distribution() -> None:
    rng = np.random.default_rng(0)
    vocab, k, trials = 6, 3, 6000
    target_logits = rng.standard_normal((k + 1, vocab)).astype(np.float32) * 1.5
    q = rng.standard_normal((k, vocab)) * 1.5
    draft_q = np.exp(q) / np.exp(q).sum(-1, keepdims=True)
    sampler = Sampler(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=11), 64)
    counts = np.zeros(vocab)
    for _ in range(trials):
        drafts = [int(rng.choice(vocab, p=draft_q[j])) for j in range(k)]
        tokens, n = verify(sampler, target_logits, drafts, draft_q, [])
        assert len(tokens) == n + 1
        assert tokens[:n] == drafts[:n]
        counts[tokens[0]] += 1
    p0 = np.exp(target_logits[0].astype(np.float64))
    assert_same_distribution(counts, p0 / p0.sum())


# ---- greedy: identical output with every proposer ---------------------------------------------------
@pytest.fixture(scope="module")
def greedy_models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Transformer, Transformer]:
    tmp = tmp_path_factory.mktemp("spec")
    dims = dict(n_vocab=96, n_embd=64, n_layer=3, n_head=4, n_head_kv=2, n_ff=128, weight_type="Q8_0")
    return load(tmp, "target", seed=4, **dims), load(tmp, "other", seed=8, **dims)


@pytest.mark.parametrize("penalty", [1.0, 1.3])
@pytest.mark.parametrize("mode", ["self", "lookup", "draft-same", "draft-other"])
def test_greedy_output_identical_with_each_proposer(
    greedy_models: tuple[Transformer, Transformer], mode: str, penalty: float
) -> None:
    target, other = greedy_models
    draft = target if mode == "draft-same" else other
    params = SamplingParams(temperature=0.0, repeat_penalty=penalty, repeat_last_n=16)
    rng = np.random.default_rng(2)
    base = rng.integers(3, 96, 12).tolist()
    method = mode.split("-")[0]
    for prompt in ([*base, *base, *base[:5]], rng.integers(3, 96, 30).tolist()):
        plain, _ = decode(engine_for(target, 64), prompt, params, 30)
        engine = engine_for(target, 64)
        proposer = draft_proposer(draft, engine) if method == "draft" else None
        fast, spec = decode(engine, prompt, params, 30, method, proposer, k=5, self_layers=2)
        assert fast == plain
        assert spec is not None
        assert spec.drafted > 0


def test_speculation_switches_off_below_break_even(greedy_models: tuple[Transformer, Transformer]) -> None:
    target, other = greedy_models  # a draft that rarely agrees
    engine = engine_for(target, 64)
    _, spec = decode(
        engine,
        list(range(3, 40)),
        SamplingParams(temperature=0.0),
        120,
        "draft",
        draft_proposer(other, engine),
        k=4,
        cost=0.5,
    )
    assert spec is not None
    assert not spec.enabled
    assert spec.drafted < 60  # it stopped drafting early, not after 120 tokens
    assert spec.accepted / spec.drafted < break_even_acceptance(4, 0.5)


# ---- the numpy sampler reads the parameters as the torch engine's sampler does ----------------------
@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.7, top_k=5, top_p=1.0, min_p=0.0),
        SamplingParams(temperature=1.2, top_k=0, top_p=0.8, min_p=0.0),
        SamplingParams(
            temperature=1.0,
            top_k=40,
            top_p=0.95,
            min_p=0.1,
            repeat_penalty=1.3,
            frequency_penalty=0.2,
            presence_penalty=0.1,
            repeat_last_n=8,
        ),
        SamplingParams(temperature=0.0, repeat_penalty=1.5),
    ],
)
def test_sampler_matches_the_torch_sampler(params: SamplingParams) -> None:
    torch = pytest.importorskip("torch")
    from localrt.backends.torch.sampling import RequestSampler

    rng = np.random.default_rng(7)
    logits = (rng.standard_normal(64) * 2).astype(np.float32)
    history = rng.integers(0, 64, 20).tolist()
    ours = Sampler(params, 128).probs(logits, history)
    theirs = RequestSampler(params, "cpu", 128).probs(torch.from_numpy(logits), history).double().numpy()
    np.testing.assert_allclose(ours, theirs, atol=1e-6)
    if params.greedy:
        assert Sampler(params, 128).sample(logits, history) == int(np.argmax(theirs))
