"""The backend protocol, checked the same way for every installed backend on the real SmolLM2 GGUF.

MLX and torch join automatically once `backends/registry.py` reports them installed.
"""

from __future__ import annotations

import asyncio
import math
import os
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from localrt.backends import registry
from localrt.backends.base import Capabilities
from localrt.backends.base import DoneEvent
from localrt.backends.base import GenerateRequest
from localrt.backends.base import LoadedModel
from localrt.backends.base import LoadOptions
from localrt.backends.base import SamplingParams
from localrt.backends.base import TextEvent
from localrt.errors import LocalrtError

BACKENDS = registry.installed()
# One decode thread by default: on a busy 2-core runner, spinning thread pools slow down many-fold.
THREADS = int(os.environ.get("LOCALRT_TEST_THREADS", "1"))
pytestmark = pytest.mark.skipif(not BACKENDS, reason="no backend installed")

CHAT = (
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n{q}<|im_end|>\n"
    "<|im_start|>assistant\n"
)
GREEDY = SamplingParams(temperature=0.0, repeat_penalty=1.0)
PARAGRAPH = (
    "The old lighthouse keeper climbed the narrow stairs every evening, lit the great lamp, "
    "and watched the ships pass safely through the rocky strait until dawn."
)
COPY_PROMPT = CHAT.format(q=f"Repeat this text exactly:\n{PARAGRAPH}") + PARAGRAPH[:40]


def load_options(**extra: object) -> LoadOptions:
    """Batch invariant: the suite checks that batching is invisible, to the last bit."""
    return LoadOptions(num_ctx=1024, num_thread=THREADS, num_batch=256, batch_invariant=True, **extra)  # type: ignore[arg-type]


@pytest.fixture(scope="module", params=BACKENDS)
def backend_name(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def model(backend_name: str, smollm2_gguf: Path) -> Iterator[LoadedModel]:
    loaded = registry.get(backend_name).load(smollm2_gguf, load_options())
    yield loaded
    loaded.unload()


def prompt_ids(model: LoadedModel, question: str) -> list[int]:
    return model.tokenize(CHAT.format(q=question), add_special=True, parse_special=True)


def run(model: LoadedModel, request: GenerateRequest) -> tuple[list[TextEvent], DoneEvent]:
    async def collect() -> tuple[list[TextEvent], DoneEvent]:
        texts: list[TextEvent] = []
        done = None
        async for event in model.generate(request):
            if isinstance(event, DoneEvent):
                done = event
            else:
                texts.append(event)
        assert done is not None, "every stream ends in a DoneEvent"
        return texts, done

    return asyncio.run(collect())


def ids_of(events: list[TextEvent]) -> list[int]:
    return [t for e in events for t in e.token_ids]


def text_of(events: list[TextEvent]) -> str:
    return "".join(e.text for e in events)


def test_load_reports_shape(model: LoadedModel, backend_name: str) -> None:
    assert isinstance(model, LoadedModel)
    assert model.backend_name == backend_name
    assert isinstance(model.capabilities, Capabilities)
    assert model.context_length == 1024
    assert model.n_vocab == 49152
    assert model.memory_bytes > 50_000_000
    assert "tokenizer.chat_template" in model.metadata
    assert model.eos_token_ids
    assert "<|im_end|>" in model.special_tokens()


def test_tokenize_round_trip(model: LoadedModel) -> None:
    text = "Hello, world! Ünïcödé — 東京 🚀 and code: def f(x): return x**2"
    ids = model.tokenize(text, add_special=False)
    assert ids
    assert all(0 <= t < model.n_vocab for t in ids)
    assert model.detokenize(ids) == text


def test_special_tokens_parse_only_when_asked(model: LoadedModel) -> None:
    assert len(model.tokenize("<|im_start|>", add_special=False, parse_special=True)) == 1
    assert len(model.tokenize("<|im_start|>", add_special=False, parse_special=False)) > 1


def test_greedy_is_deterministic(model: LoadedModel) -> None:
    ids = prompt_ids(model, "What is the capital of France?")
    first, _ = run(model, GenerateRequest(ids, GREEDY, num_predict=12))
    second, _ = run(model, GenerateRequest(ids, GREEDY, num_predict=12))
    assert ids_of(first) == ids_of(second)
    assert "Paris" in text_of(first)


def test_num_predict_ends_with_length(model: LoadedModel) -> None:
    events, done = run(
        model, GenerateRequest(prompt_ids(model, "Count from one to fifty."), GREEDY, num_predict=5)
    )
    assert done.finish_reason == "length"
    assert done.timings.eval_count == 5
    assert len(ids_of(events)) == 5


def test_eos_ends_with_stop(model: LoadedModel) -> None:
    _, done = run(
        model, GenerateRequest(prompt_ids(model, "What is the capital of France?"), GREEDY, num_predict=64)
    )
    assert done.finish_reason == "stop"
    assert done.stop_sequence is None  # an end token, not a stop string


def test_stop_string_is_not_emitted(model: LoadedModel) -> None:
    ids = prompt_ids(model, "What is the capital of France?")
    plain = text_of(run(model, GenerateRequest(ids, GREEDY, num_predict=12))[0])
    assert "France" in plain
    events, done = run(model, GenerateRequest(ids, GREEDY, num_predict=12, stop=["nowhere", "France"]))
    assert done.finish_reason == "stop"
    assert done.stop_sequence == "France"  # which stop string ended it (Anthropic's stop_sequence)
    assert text_of(events) == plain[: plain.index("France")]


def test_cancel_ends_with_cancel(model: LoadedModel) -> None:
    async def scenario() -> DoneEvent:
        request = GenerateRequest(
            prompt_ids(model, "Write a long story about a dragon."), GREEDY, num_predict=500
        )
        done = None
        async for event in model.generate(request):
            if isinstance(event, DoneEvent):
                done = event
            elif event.token_ids:
                request.cancel.cancel()
        assert done is not None
        return done

    done = asyncio.run(scenario())
    assert done.finish_reason == "cancel"
    assert done.timings.eval_count < 20


def test_closing_the_stream_frees_the_model(model: LoadedModel) -> None:
    async def scenario() -> None:
        stream = model.generate(
            GenerateRequest(prompt_ids(model, "Tell me a story."), GREEDY, num_predict=500)
        )
        async for _ in stream:
            break
        await stream.aclose()  # type: ignore[attr-defined]

    asyncio.run(scenario())
    _, done = run(model, GenerateRequest(prompt_ids(model, "Hi"), GREEDY, num_predict=2))
    assert done.finish_reason in ("length", "stop")


def test_logprobs_with_top_alternatives(model: LoadedModel) -> None:
    ids = prompt_ids(model, "What is the capital of France?")
    events, _ = run(model, GenerateRequest(ids, GREEDY, num_predict=6, logprobs=True, top_logprobs=5))
    lps = [lp for e in events for lp in (e.logprobs or [])]
    assert len(lps) == len(ids_of(events)) == 6
    for lp in lps:
        assert lp.logprob <= 0.0
        assert len(lp.top) == 5
        assert [t.logprob for t in lp.top] == sorted((t.logprob for t in lp.top), reverse=True)
        assert sum(math.exp(t.logprob) for t in lp.top) <= 1.0 + 1e-6
        assert lp.top[0].token_id == lp.token_id  # greedy picks the most likely token
        assert lp.logprob == pytest.approx(lp.top[0].logprob)


def test_score_matches_generation_logprobs(model: LoadedModel) -> None:
    ids = prompt_ids(model, "What is the capital of France?")
    events, _ = run(model, GenerateRequest(ids, GREEDY, num_predict=6, logprobs=True))
    generated = ids_of(events)
    gen_lps = np.array([lp.logprob for e in events for lp in (e.logprobs or [])])
    result = asyncio.run(model.score(ids + generated, return_logits=True))
    assert result.logprobs.shape == (len(ids) + len(generated) - 1,)
    assert np.all(np.isfinite(result.logprobs))
    assert np.all(result.logprobs <= 0)
    assert result.logits is not None
    assert result.logits.shape == (len(result.logprobs), model.n_vocab)
    np.testing.assert_allclose(result.logprobs[-len(generated) :], gen_lps, atol=0.02)


def test_embed(model: LoadedModel) -> None:
    if not model.capabilities.embedding:
        pytest.skip("backend has no embeddings")
    a, b, a2 = asyncio.run(
        model.embed(["The cat sat on the mat.", "Quantum chromodynamics", "The cat sat on the mat."])
    )
    assert len(a) == len(b) > 100
    assert np.linalg.norm(a) == pytest.approx(1.0, abs=1e-4)
    np.testing.assert_allclose(a, a2, atol=1e-5)
    assert not np.allclose(a, b)


def test_timings_are_filled(model: LoadedModel) -> None:
    """Both durations are measured (not the 1 ns floor they are clamped to when nothing was measured) and
    together they lie within the call's own time."""
    ids = prompt_ids(model, "Name a colour.")
    start = time.perf_counter_ns()
    _, done = run(model, GenerateRequest(ids + [198], GREEDY, num_predict=3))  # a fresh suffix to evaluate
    wall = time.perf_counter_ns() - start
    t = done.timings
    assert t.prompt_eval_count > 0
    assert t.eval_count > 0
    assert t.prompt_eval_ns > 1
    assert t.eval_ns > 1
    assert t.prompt_eval_ns + t.eval_ns <= wall


STORY = CHAT.format(q="Write a long story about a dragon who learns to bake bread in a small village.")
PASSAGE = " ".join(
    f"Passage sentence {i} tells of rivers, hills and the old roads between towns." for i in range(40)
)


def test_batching_is_invisible(model: LoadedModel) -> None:
    """Requests sent together, greedy and seeded, give exactly the tokens each gives alone."""
    questions = ["What is the capital of France?", "Name three colours.", "Why is the sky blue?"]
    samplings = [GREEDY, SamplingParams(temperature=0.9, top_k=40, seed=3), GREEDY]
    requests = [
        lambda q=q, s=s: GenerateRequest(prompt_ids(model, q), s, num_predict=16)
        for q, s in zip(questions, samplings)
    ]
    alone = [ids_of(run(model, make())[0]) for make in requests]

    async def together() -> list[list[int]]:
        async def one(request: GenerateRequest) -> list[int]:
            return [t async for e in model.generate(request) if isinstance(e, TextEvent) for t in e.token_ids]

        return list(await asyncio.gather(*(one(make()) for make in requests)))

    assert asyncio.run(together()) == alone


def test_an_embedding_runs_beside_a_stream(model: LoadedModel) -> None:
    """An embedding is a sequence in the steps, not a pause between them: while it is computed, a
    stream running beside it keeps getting tokens, step after step, and they are the tokens it gets
    alone; and the embedding moves while the stream runs, rather than waiting for it to end."""
    engine = model.engine  # type: ignore[attr-defined]
    story = model.tokenize(STORY, add_special=True, parse_special=True)
    alone = ids_of(run(model, GenerateRequest(story, GREEDY, num_predict=120))[0])
    before = engine.steps
    asyncio.run(model.embed([PASSAGE]))
    embed_alone = engine.steps - before
    log: list[str] = []

    async def scenario() -> tuple[list[int], int, int]:
        streamed: list[int] = []
        stream_ended = 0

        async def chat() -> None:
            nonlocal stream_ended
            async for event in model.generate(GenerateRequest(story, GREEDY, num_predict=120)):
                if isinstance(event, TextEvent) and event.token_ids:
                    streamed.extend(event.token_ids)
                    log.append("token")
            stream_ended = engine.steps

        task = asyncio.create_task(chat())
        while not streamed:
            await asyncio.sleep(0.001)
        before = engine.steps
        log.append("embed")
        await model.embed([PASSAGE])
        log.append("embedded")
        embedded = engine.steps
        await task
        return streamed, embedded - before, max(0, embedded - stream_ended)

    streamed, steps, steps_after_stream = asyncio.run(scenario())
    during = log[log.index("embed") : log.index("embedded")].count("token")
    assert len(model.tokenize(PASSAGE)) > 400
    assert steps >= 2  # the embedding was split across steps
    assert during >= 2  # and the stream was served between its chunks
    # what was left of it when the stream ended took fewer steps than all of it alone: it moved meanwhile
    assert steps_after_stream < embed_alone
    assert streamed == alone


def test_prefix_reuse_evaluates_only_new_tokens(model: LoadedModel) -> None:
    first = prompt_ids(model, "What is the capital of France?")
    events, first_done = run(model, GenerateRequest(first, GREEDY, num_predict=8))
    follow_up = model.tokenize(
        "<|im_end|>\n<|im_start|>user\nAnd of Germany?<|im_end|>\n<|im_start|>assistant\n",
        add_special=False,
        parse_special=True,
    )
    second = first + ids_of(events) + follow_up
    _, done = run(model, GenerateRequest(second, GREEDY, num_predict=4))
    # a last token sampled at the num_predict limit was never evaluated, so it counts as new
    unevaluated = 1 if first_done.finish_reason == "length" else 0
    assert done.timings.prompt_eval_count == len(follow_up) + unevaluated
    assert done.timings.prompt_eval_count < len(second)


def test_prompt_past_context_is_an_error(model: LoadedModel) -> None:
    ids = model.tokenize("word " * 1100, add_special=False)
    with pytest.raises(LocalrtError, match="context length"):
        run(model, GenerateRequest(ids, GREEDY, num_predict=4))
    _, done = run(model, GenerateRequest(prompt_ids(model, "Hi"), GREEDY, num_predict=2))  # still serving
    assert done.finish_reason in ("length", "stop")


@pytest.mark.parametrize("kind", ["lookup", "draft", "self"])
def test_speculative_greedy_matches_plain(
    kind: str, model: LoadedModel, backend_name: str, smollm2_gguf: Path
) -> None:
    if kind not in model.capabilities.speculative:
        with pytest.raises(LocalrtError, match="not supported"):
            run(model, GenerateRequest(prompt_ids(model, "Hi"), GREEDY, num_predict=2, speculative=kind))
        return
    target = model
    if kind == "draft":  # the model drafts for itself: same vocabulary by construction
        target = registry.get(backend_name).load(smollm2_gguf, load_options(draft_model=smollm2_gguf))
    try:
        ids = target.tokenize(COPY_PROMPT, add_special=True, parse_special=True)
        plain, _ = run(target, GenerateRequest(ids, GREEDY, num_predict=40))
        fast, done = run(target, GenerateRequest(ids, GREEDY, num_predict=40, speculative=kind, num_draft=6))
        assert ids_of(fast) == ids_of(plain)
        drafted, accepted = done.timings.draft_count, done.timings.draft_accepted_count
        if kind == "draft":
            # the model drafts for itself: a guess is rejected only if batched and one-token logits differ
            assert accepted == drafted
            assert drafted > 0
        else:
            # some guesses rejected and rolled back, and still the plain tokens: the rollback is exact
            assert 0 < accepted < drafted
    finally:
        if target is not model:
            target.unload()


SCHEMA = {
    "type": "object",
    # maxLength: the grammar itself bounds the answer, so a sampled run closes within the token budget
    # whatever a backend's random stream draws (unbounded, a 135M model can wander on inside a string)
    "properties": {"city": {"type": "string", "maxLength": 40}, "population": {"type": "integer"}},
    "required": ["city", "population"],
}


@pytest.mark.parametrize("fmt", ["json", "schema"])
def test_format_constrains_the_output(model: LoadedModel, fmt: str) -> None:
    """`format`: the answer parses (json) and validates (schema), greedy or sampled, on every backend.
    Unconstrained, this question gets prose; the grammar is what makes it JSON."""
    import json

    import jsonschema

    assert model.capabilities.grammar
    ids = prompt_ids(model, "Give the capital of France and its population.")
    plain, _ = run(model, GenerateRequest(ids, GREEDY, num_predict=40))
    with pytest.raises(ValueError):
        json.loads(text_of(plain))
    # sampled too (seeded, so each backend repeats its run), for the schema: its shape bounds the answer
    samplings = [GREEDY] if fmt == "json" else [GREEDY, SamplingParams(temperature=0.5, seed=7)]
    if fmt == "json":  # any JSON value: ask for a small one, so that it closes within the budget
        ids = prompt_ids(model, "Describe a cat as JSON with name and age.")
    for sampling in samplings:
        request = GenerateRequest(ids, sampling, num_predict=300, format="json" if fmt == "json" else SCHEMA)
        events, done = run(model, request)
        value = json.loads(text_of(events))
        assert done.finish_reason == "stop"
        if fmt == "schema":
            jsonschema.validate(value, SCHEMA)
    with pytest.raises(LocalrtError, match="JSON schema"):
        run(model, GenerateRequest(ids, GREEDY, num_predict=4, format={"type": "object", "oneOf": 3}))


def test_unload(backend_name: str, smollm2_gguf: Path) -> None:
    loaded = registry.get(backend_name).load(smollm2_gguf, LoadOptions(num_ctx=256, num_thread=THREADS))
    loaded.unload()
    with pytest.raises(LocalrtError):
        run(loaded, GenerateRequest([1, 2, 3], GREEDY, num_predict=1))
