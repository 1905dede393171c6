"""The batched MLX engine: batching is invisible (concurrent requests give exactly the tokens each gives
alone), the on-device sampler draws from the numpy reference's distribution with per-request keys, and
the prompt cache keeps several conversations under a byte budget."""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass
from dataclasses import replace

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")

from localrt.backends import registry  # noqa: E402
from localrt.backends.base import CancelToken  # noqa: E402
from localrt.backends.base import DoneEvent  # noqa: E402
from localrt.backends.base import GenerateRequest  # noqa: E402
from localrt.backends.base import LoadOptions  # noqa: E402
from localrt.backends.base import SamplingParams  # noqa: E402
from localrt.backends.base import TextEvent  # noqa: E402
from localrt.backends.mlx.engine import Engine  # noqa: E402
from localrt.backends.mlx.engine import Row  # noqa: E402
from localrt.backends.mlx.gguf_load import GGUFTensors  # noqa: E402
from localrt.backends.mlx.llama import Transformer  # noqa: E402
from localrt.backends.mlx.prompt_cache import PromptCache  # noqa: E402
from localrt.backends.mlx.sampling import RowSampler  # noqa: E402
from localrt.backends.mlx.sampling import sample_rows  # noqa: E402
from localrt.backends.mlx.sampling import window_of  # noqa: E402
from localrt.backends.sampler import Sampler  # noqa: E402
from localrt.backends.speculation import SpecState  # noqa: E402
from tests.gguf_factory import write_random_model  # noqa: E402
from tests.gguf_factory import write_tiny_llama  # noqa: E402
from tests.stats import assert_same_distribution  # noqa: E402

THREADS = int(os.environ.get("LOCALRT_TEST_THREADS", "1"))
VOCAB = 96


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Transformer:
    path = write_random_model(
        tmp_path_factory.mktemp("batch") / "tiny.gguf", n_vocab=VOCAB, n_layer=3, weight_type="Q4_1", seed=3
    )
    return Transformer(GGUFTensors(path), mx.float32)


def engine_for(model: Transformer, budget: int = 1 << 30, rows: int = 8, num_batch: int = 16) -> Engine:
    return Engine("f16", num_batch, model, max_rows=rows, prompt_cache=PromptCache(budget), eog={2})


@dataclass
class Spec:
    prompt: list[int]
    params: SamplingParams
    new: int
    cancel_after: int | None = None
    lookup: bool = False
    logprobs: int = -1


def mixed_specs() -> list[Spec]:
    """8 requests: greedy and seeded, penalties, lengths 5..40, prompts over several chunks, lookup, cancels."""
    rng = np.random.default_rng(11)
    specs = []
    for i in range(8):
        n = [3, 17, 40, 9, 33, 1, 25, 50][i]
        prompt = rng.integers(3, VOCAB, n).tolist()
        if i == 2:  # repetitive text: prompt lookup finds draft tokens
            prompt = (prompt[:8] * 5)[:n]
        params = (
            SamplingParams(temperature=0.0)
            if i % 3 == 0
            else SamplingParams(temperature=0.9, top_k=20 + i, top_p=0.9, min_p=0.02 * (i % 2), seed=100 + i)
        )
        if i == 4:
            params = replace(params, repeat_penalty=1.3, frequency_penalty=0.2, repeat_last_n=16)
        specs.append(
            Spec(
                prompt,
                params,
                5 + 5 * i,
                cancel_after=4 if i in (1, 6) else None,
                lookup=i in (2, 7),
                logprobs=3 if i == 5 else -1,
            )
        )
    return specs


def row_for(engine: Engine, spec: Spec) -> Row:
    row = engine.new_row(
        spec.prompt,
        RowSampler(spec.params, 512),
        len(spec.prompt) + spec.new,
        cancel=CancelToken(),
        top_logprobs=spec.logprobs,
    )
    if spec.lookup:
        row.spec = SpecState("lookup", 4, 0.0)
    return row


def drive(engine: Engine, specs: list[Spec]) -> list[tuple[list[int], list[float]]]:
    """Run rows together; each client hangs up once it has `cancel_after` tokens."""
    rows = [row_for(engine, s) for s in specs]
    got: dict[int, tuple[list[int], list[float]]] = {r.id: ([], []) for r in rows}
    for row in rows:
        engine.add(row)
    while engine.has_work:
        for out in engine.step():
            ids, lps = got[out.request.id]
            spec = specs[[r.request for r in rows].index(out.request)]
            if spec.cancel_after is not None and len(ids) >= spec.cancel_after:
                continue  # the client has gone: what the engine still sends is not read
            ids += out.tokens
            lps += [lp[0] for lp in out.logprobs if lp is not None]
            if spec.cancel_after is not None and len(ids) >= spec.cancel_after:
                out.request.cancel.cancel()
    return [got[r.id] for r in rows]


def test_batching_is_invisible_in_the_engine(tiny: Transformer) -> None:
    specs = mixed_specs()
    engine = engine_for(tiny)
    alone = [drive(engine, [s])[0] for s in specs]  # one after another: prompt-cache hits in between
    together = drive(engine, specs)
    fresh = drive(engine_for(tiny), specs)  # together on an empty prompt cache
    for i, (a, b, c) in enumerate(zip(alone, together, fresh)):
        assert b[0] == a[0], f"request {i} changed when batched"
        assert c[0] == a[0], f"request {i} changed when batched from a cold cache"
        assert b[1] == a[1], f"request {i}'s logprobs changed when batched"
    assert [len(a[0]) for a in alone][1] >= 4
    assert len(alone[5][1]) == len(alone[5][0]) > 0  # the logprobs row


def test_speculation_in_the_batch_is_exact_and_switches_off(tiny: Transformer) -> None:
    engine = engine_for(tiny)
    prompt = list(range(3, 11)) * 5
    plain = drive(engine, [Spec(prompt, SamplingParams(temperature=0.0), 100)])[0][0]
    row = row_for(engine, Spec(prompt, SamplingParams(temperature=0.0), 100, lookup=True))
    row.spec = SpecState("lookup", 4, 1.0)  # a draft token costs a step: only all-accepted would pay
    engine.run([row])
    assert row.output[: len(plain)] == plain
    assert row.spec.drafted > 0
    assert not row.spec.enabled  # below break-even: the row went back to plain (pipelined) steps


def test_a_finished_row_leaves_its_cache_to_the_prompt_cache(tiny: Transformer) -> None:
    engine = engine_for(tiny)
    prompt = list(range(3, 30))
    first = row_for(engine, Spec(prompt, SamplingParams(temperature=0.0), 6))
    engine.run([first])
    assert len(engine.prompt_cache.entries) == 1
    held = next(iter(engine.prompt_cache.entries.values()))
    assert held.caches[0].offset == len(held.tokens)  # the caches hold exactly the recorded tokens
    nxt = [*first.tokens, 40, 41, 42]
    second = row_for(engine, Spec(nxt, SamplingParams(temperature=0.0), 4))
    engine.run([second])
    assert second.cached_count == len(held.tokens)  # the next turn evaluated only what is new
    cold = row_for(engine_for(tiny), Spec(nxt, SamplingParams(temperature=0.0), 4))
    engine_for(tiny).run([cold])
    assert second.output == cold.output


def test_the_prompt_cache_keeps_conversations_under_its_budget(tiny: Transformer) -> None:
    def converse(engine: Engine, prompt: list[int]) -> Row:
        row = row_for(engine, Spec(prompt, SamplingParams(temperature=0.0), 3))
        engine.run([row])
        return row

    a, b, c = ([k, *range(5, 40)] for k in (3, 4, 6))  # three conversations, same length
    roomy = engine_for(tiny)
    first_a = converse(roomy, a)
    converse(roomy, b)  # another conversation does not push A out
    again = converse(roomy, [*first_a.tokens, 50])
    assert again.cached_count == len(first_a.tokens) - 1  # all but its last token, never fed
    one = next(iter(roomy.prompt_cache.entries.values())).nbytes
    tight = engine_for(tiny, budget=2 * one + one // 2)  # room for two conversations
    first_a = converse(tight, a)
    converse(tight, b)
    converse(tight, c)  # over budget: the least recently used (A) goes
    assert converse(tight, [*first_a.tokens, 50]).cached_count == 0
    assert tight.prompt_cache.nbytes <= tight.prompt_cache.budget_bytes
    lru = engine_for(tiny, budget=2 * one + one // 2)
    first_a = converse(lru, a)
    converse(lru, b)
    converse(lru, [*a[:-1], 60])  # A's prefix used again: now B is the least recent
    converse(lru, c)
    assert converse(lru, [*first_a.tokens, 50]).cached_count > 0


# ---- the on-device sampler ---------------------------------------------------------------------------
LOGITS = np.array([3.0, 2.5, 2.0, 1.2, 1.0, 0.3, 0.0, -0.5, -1.0, -2.0, 1.9, 0.7], dtype=np.float32)
HISTORY = [0, 3, 3, 7, 1]
PARAMS = [
    SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0),
    SamplingParams(temperature=0.7, top_k=5, top_p=1.0, min_p=0.0),
    SamplingParams(temperature=1.3, top_k=0, top_p=0.8, min_p=0.0),
    SamplingParams(temperature=1.0, top_k=8, top_p=0.9, min_p=0.1),
    SamplingParams(
        temperature=0.9,
        top_k=0,
        top_p=0.95,
        repeat_penalty=1.4,
        frequency_penalty=0.3,
        presence_penalty=0.2,
        repeat_last_n=4,
    ),
]


@pytest.mark.parametrize(
    "params", PARAMS, ids=lambda p: f"k{p.top_k}-p{p.top_p}-m{p.min_p}-r{p.repeat_penalty}"
)
def test_device_sampler_draws_from_the_numpy_reference_distribution(params: SamplingParams) -> None:
    reference = Sampler(params, 64).probs(LOGITS, HISTORY)
    trials = 6000
    samplers = [RowSampler(replace(params, seed=5000 + i), 64) for i in range(trials)]
    rows = mx.broadcast_to(mx.array(LOGITS)[None], (trials, LOGITS.size))
    tokens = sample_rows(samplers, rows, [window_of(s, HISTORY) for s in samplers])  # one batched call
    counts = np.bincount(np.array(tokens), minlength=LOGITS.size)
    assert_same_distribution(counts, reference)
    np.testing.assert_allclose(samplers[0].probs(LOGITS, HISTORY), reference, atol=1e-6)


def test_a_seeded_row_draws_the_same_alone_and_in_a_batch() -> None:
    rng = np.random.default_rng(1)
    logits = mx.array(rng.standard_normal((5, 4000)).astype(np.float32) * 3)
    params = [SamplingParams(temperature=0.8, top_k=40, top_p=0.9, seed=s) for s in (1, 2, 3)] + [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.1, min_p=0.05, seed=9),
    ]

    def draws(rows: list[int], steps: int = 4) -> dict[int, list[int]]:
        samplers = {i: RowSampler(params[i], 64) for i in rows}
        out: dict[int, list[int]] = {i: [] for i in rows}
        for _ in range(steps):
            picked = sample_rows([samplers[i] for i in rows], logits[mx.array(rows)], [None] * len(rows))
            for i, t in zip(rows, picked.tolist()):
                out[i].append(t)
        return out

    batch = draws([0, 1, 2, 3, 4])
    for i in range(5):
        assert draws([i])[i] == batch[i]
    assert batch[0] != batch[1]  # other seeds, other draws


# ---- through the backend: concurrent requests ----------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_backend(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    path = write_tiny_llama(tmp_path_factory.mktemp("mlxb") / "tiny-llama.gguf", file_type="Q8_0", n_layer=3)
    opts = LoadOptions(num_ctx=256, num_thread=THREADS, num_batch=16, num_parallel=8)
    model = registry.get("mlx").load(path, opts)
    yield model
    model.unload()


async def ask(
    model: object, req: GenerateRequest, cancel_after: int | None
) -> tuple[list[int], DoneEvent | None]:
    ids: list[int] = []
    done = None
    events = model.generate(req)  # type: ignore[attr-defined]
    async for event in events:
        if isinstance(event, TextEvent):
            ids += event.token_ids
            if cancel_after is not None and len(ids) >= cancel_after:
                await events.aclose()  # a client hanging up
                break
        else:
            done = event
    return ids, done


def test_batching_is_invisible_through_the_backend(tiny_backend: object) -> None:
    assert tiny_backend.capabilities.parallel_slots == 8  # type: ignore[attr-defined]
    requests = []
    for s in mixed_specs():
        req = GenerateRequest(s.prompt, s.params, num_predict=s.new)
        if s.lookup:
            req.speculative = "lookup"
        if s.logprobs >= 0:
            req.top_logprobs = s.logprobs
        requests.append((req, s.cancel_after))
    requests[3][0].stop = ["e"]
    fresh = [(replace(r, cancel=CancelToken()), cut) for r, cut in requests]
    alone = [asyncio.run(ask(tiny_backend, r, cut)) for r, cut in fresh]

    async def together() -> list[tuple[list[int], DoneEvent | None]]:
        return list(
            await asyncio.gather(
                *(ask(tiny_backend, replace(r, cancel=CancelToken()), cut) for r, cut in requests)
            )
        )

    side_by_side = asyncio.run(together())
    for i, (a, b) in enumerate(zip(alone, side_by_side)):
        assert b[0] == a[0], f"request {i} changed when batched"
    finished = [d for _, d in side_by_side if d is not None]
    assert len(finished) == 6  # two hung up
    assert sum(d.timings.draft_count for d in finished) > 0  # lookup drafted inside the batch
    assert all(d.timings.eval_count > 0 for d in finished)
