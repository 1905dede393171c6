"""The llama.cpp backend's one batched context: under batch invariance batching is invisible (concurrent
requests give exactly the tokens each gives alone); by default a lone request is still the same run to run,
the sequences share one KV pool, and a request that finds no room waits or is preempted and resumed; prefix
reuse across requests, cancellation frees KV at once, context shift."""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from dataclasses import field
from dataclasses import replace
from pathlib import Path

import pytest

pytest.importorskip("llama_cpp")

from localrt.backends.base import CancelToken  # noqa: E402
from localrt.backends.base import DoneEvent  # noqa: E402
from localrt.backends.base import GenerateRequest  # noqa: E402
from localrt.backends.base import LoadOptions  # noqa: E402
from localrt.backends.base import SamplingParams  # noqa: E402
from localrt.backends.base import TextEvent  # noqa: E402
from localrt.backends.llamacpp import LlamaCppBackend  # noqa: E402
from localrt.backends.llamacpp import LlamaCppModel  # noqa: E402
from localrt.backends.llamacpp import backend as llamacpp_backend  # noqa: E402
from localrt.backends.llamacpp.engine import Engine  # noqa: E402
from localrt.backends.llamacpp.lib import Batch  # noqa: E402
from localrt.backends.llamacpp.lib import context_params  # noqa: E402
from localrt.backends.llamacpp.lib import create_context  # noqa: E402
from localrt.backends.llamacpp.lib import logits_row  # noqa: E402
from localrt.backends.llamacpp.sequences import Sequence  # noqa: E402
from localrt.errors import LocalrtError  # noqa: E402

THREADS = int(os.environ.get("LOCALRT_TEST_THREADS", "1"))
CHAT = (
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n{q}<|im_end|>\n"
    "<|im_start|>assistant\n"
)
GREEDY = SamplingParams(temperature=0.0)
QUESTIONS = [
    "What is the capital of France?",
    "Name three colours of the rainbow.",
    "Write a haiku about autumn leaves falling in the quiet forest.",
    "Why is the sky blue?",
    "Describe a cat as JSON with name and age.",
    "List the planets of the solar system in order from the sun.",
    "What is 12 times 7?",
    "Tell me a short story about a brave little mouse who lived in a big old house.",
]

REPEAT = (
    "Repeat this text exactly:\nThe old lighthouse keeper climbed the narrow stairs every evening, lit the "
    "great lamp, and watched the ships pass safely through the rocky strait until dawn."
)


@dataclass
class Outcome:
    ids: list[int]
    done: DoneEvent | None
    logprobs: list[float] = field(default_factory=list)


@pytest.fixture(scope="module")
def model(smollm2_gguf: Path) -> Iterator[LlamaCppModel]:
    """Batch invariant: most tests here compare a request's tokens beside others with its tokens alone."""
    opts = LoadOptions(num_ctx=512, num_thread=THREADS, num_batch=128, num_parallel=16, batch_invariant=True)
    loaded = LlamaCppBackend.load(smollm2_gguf, opts)
    yield loaded
    loaded.unload()


def ask(model: LlamaCppModel, question: str) -> list[int]:
    return model.tokenize(CHAT.format(q=question), add_special=True, parse_special=True)


async def run_one(model: LlamaCppModel, req: GenerateRequest, cancel_after: int | None = None) -> Outcome:
    ids: list[int] = []
    logprobs: list[float] = []
    done = None
    events = model.generate(req)
    async for event in events:
        if isinstance(event, TextEvent):
            ids += event.token_ids
            logprobs += [lp.logprob for lp in event.logprobs or []]
            if cancel_after is not None and len(ids) >= cancel_after:
                await events.aclose()  # a client hanging up
                break
        else:
            done = event
    return Outcome(ids, done, logprobs)


def mixed_requests(model: LlamaCppModel) -> list[tuple[GenerateRequest, int | None]]:
    """16 requests: greedy and seeded, lengths, stop strings, a grammar, lookup speculation, cancellations."""
    out: list[tuple[GenerateRequest, int | None]] = []
    for i in range(16):
        q = QUESTIONS[i % len(QUESTIONS)]
        sampling = GREEDY if i % 2 == 0 else SamplingParams(temperature=0.9, top_k=40, top_p=0.95, seed=i)
        req = GenerateRequest(ask(model, q), sampling, num_predict=8 + 3 * i)
        if i % 5 == 1:
            req.stop = ["\n", "."]
        if i == 4:
            req.format = "json"
        if i in (2, 6, 9):
            req.speculative = "lookup"
        out.append((req, 5 if i in (3, 11) else None))
    return out


def fresh(req: GenerateRequest) -> GenerateRequest:
    return replace(req, cancel=CancelToken())


def test_batching_is_invisible(model: LlamaCppModel) -> None:
    requests = mixed_requests(model)
    alone = [asyncio.run(run_one(model, fresh(r), cut)) for r, cut in requests]

    async def together() -> list[Outcome]:
        return list(await asyncio.gather(*(run_one(model, fresh(r), cut) for r, cut in requests)))

    side_by_side = asyncio.run(together())
    for i, (a, b) in enumerate(zip(alone, side_by_side)):
        assert b.ids == a.ids, f"request {i} changed when batched"
    finished = [o.done for o in side_by_side if o.done is not None]
    assert len(finished) == 14  # two hung up
    assert sum(d.timings.draft_count for d in finished) > 0  # lookup guessed inside the batch


def test_requests_at_once_start_no_thread_of_their_own(model: LlamaCppModel) -> None:
    """Every request's outputs come through the engine thread's one sink to the event loop: eight streams
    at once run on the threads that were there before them."""
    before = threading.active_count()
    counts: list[int] = []

    async def one(question: str) -> None:
        async for _ in model.generate(GenerateRequest(ask(model, question), GREEDY, num_predict=12)):
            counts.append(threading.active_count())

    async def together() -> None:
        await asyncio.gather(*(one(q) for q in QUESTIONS))

    asyncio.run(together())
    assert len(counts) >= len(QUESTIONS)
    assert max(counts) == before


def test_a_stop_string_keeps_the_sequence_cached(model: LlamaCppModel) -> None:
    """The reader ends a request at a stop string (text is assembled on the event loop); the cancel that
    follows is an end, so the conversation's cells stay for its next turn."""
    prompt = ask(model, "Name three colours of the rainbow, then explain each one in detail.")
    first = asyncio.run(run_one(model, GenerateRequest(prompt, GREEDY, num_predict=64, stop=[" "])))
    again = asyncio.run(run_one(model, GenerateRequest(prompt, GREEDY, num_predict=1)))
    assert first.done is not None
    assert first.done.stop_sequence == " "
    assert again.done is not None
    assert again.done.timings.cached_count == len(prompt) - 1  # all but the one token evaluated for logits


def test_a_cancelled_sequence_frees_its_cache_at_once(model: LlamaCppModel) -> None:
    engine = model.engine
    assert engine is not None
    req = GenerateRequest(ask(model, "Tell me a long story about dragons."), GREEDY, num_predict=200)
    out = asyncio.run(run_one(model, req, cancel_after=3))
    assert len(out.ids) >= 3
    sched, kv = engine.scheduler, engine.kv
    assert all(seq.seq < 0 or seq is not sched.owner[seq.seq] for seq in sched.running)
    seqs = [s for s in range(sched.n_seq_max) if kv.cells[s][: len(req.prompt_tokens)] == req.prompt_tokens]
    assert seqs == []  # the cancelled sequence kept nothing
    for s in range(sched.n_seq_max):
        held = kv.lib.llama_memory_seq_pos_max(kv.mem, s) + 1
        assert held == len(kv.cells[s])  # the record matches llama.cpp's memory


def test_a_second_request_evaluates_only_its_own_suffix(model: LlamaCppModel) -> None:
    system = "You are a helpful assistant who answers in one short sentence about geography and history. " * 3
    first = model.tokenize(
        f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\nWhere is Peru?<|im_end|>\n",
        add_special=True,
        parse_special=True,
    )
    second = model.tokenize(
        f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\nWho built Rome?<|im_end|>\n",
        add_special=True,
        parse_special=True,
    )
    shared = next(i for i, (a, b) in enumerate(zip(first, second)) if a != b)
    assert shared > 48
    a = asyncio.run(run_one(model, GenerateRequest(first, GREEDY, num_predict=4)))
    b = asyncio.run(run_one(model, GenerateRequest(second, GREEDY, num_predict=4)))
    assert a.done is not None
    assert b.done is not None
    assert b.done.timings.prompt_eval_count == len(second) - shared
    assert b.done.timings.cached_count == shared


def test_a_short_shared_prefix_is_copied_when_the_copy_is_cheaper(model: LlamaCppModel) -> None:
    """A chat template's system part (well under 32 tokens) is copied from an idle sequence rather than
    evaluated again: a 512-cell stream of SmolLM2 costs less to copy than one token to evaluate."""
    first = ask(model, "Which river flows through Vienna?")
    second = ask(model, "How many legs does a spider have?")
    shared = next(i for i, (a, b) in enumerate(zip(first, second)) if a != b)
    assert shared < 32
    asyncio.run(run_one(model, GenerateRequest(first, GREEDY, num_predict=2)))
    b = asyncio.run(run_one(model, GenerateRequest(second, GREEDY, num_predict=2)))
    assert b.done is not None
    assert b.done.timings.cached_count >= shared
    assert b.done.timings.prompt_eval_count == len(second) - b.done.timings.cached_count


def test_a_request_copies_the_prefix_of_a_running_one(model: LlamaCppModel) -> None:
    system = " ".join(f"Rule {i}: answer politely and briefly." for i in range(8))
    prompts = [
        model.tokenize(CHAT.replace("You are a helpful assistant.", system).format(q=q), True, True)
        for q in ("Tell me a long story about a dragon.", "What is 2 + 2?")
    ]
    shared = next(i for i, (a, b) in enumerate(zip(*prompts)) if a != b)
    assert shared > 64

    async def scenario() -> tuple[Outcome, Outcome]:
        story = model.generate(GenerateRequest(prompts[0], GREEDY, num_predict=60))
        await story.__anext__()  # the story is decoding, holding the shared prefix
        short = await run_one(model, GenerateRequest(prompts[1], GREEDY, num_predict=4))
        rest = [e async for e in story]
        assert isinstance(rest[-1], DoneEvent)
        return short, Outcome([], rest[-1])

    short, _ = asyncio.run(scenario())
    assert short.done is not None
    assert short.done.timings.prompt_eval_count == len(prompts[1]) - shared
    alone = asyncio.run(run_one(model, GenerateRequest(prompts[1], GREEDY, num_predict=4)))
    assert short.ids == alone.ids


def test_context_shift_goes_past_the_context_end(smollm2_gguf: Path) -> None:
    opts = LoadOptions(num_ctx=64, num_thread=THREADS, num_batch=64, num_parallel=2)
    m = LlamaCppBackend.load(smollm2_gguf, opts)
    try:
        prompt = m.tokenize("1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11,", add_special=True)
        shifted = asyncio.run(run_one(m, GenerateRequest(prompt, GREEDY, num_predict=100, shift=True)))
        stopped = asyncio.run(run_one(m, GenerateRequest(prompt, GREEDY, num_predict=100, shift=False)))
        text = m.detokenize(shifted.ids)
    finally:
        m.unload()
    assert stopped.done is not None
    assert shifted.done is not None
    assert stopped.done.finish_reason == "length"
    assert stopped.done.timings.eval_count == 64 - len(prompt)
    assert shifted.done.timings.eval_count == 100  # well past the 64-token context
    counting = " " + " ".join(f"{i}," for i in range(12, 37))  # 4 tokens a number: 25 numbers
    assert text == counting  # still counting, right, after the shifts


@pytest.mark.parametrize(("invariant", "decodes"), [("1", 4), ("", 2)])
def test_a_long_prompt_takes_48_rows_a_step_under_batch_invariance(
    smollm2_gguf: Path, monkeypatch: pytest.MonkeyPatch, invariant: str, decodes: int
) -> None:
    monkeypatch.setenv("LOCALRT_BATCH_INVARIANT", invariant)
    opts = LoadOptions(num_ctx=512, num_thread=THREADS, num_batch=256, num_parallel=2)
    m = LlamaCppBackend.load(smollm2_gguf, opts)
    try:
        prompt = m.tokenize(REPEAT * 8, add_special=True)[:150]
        asyncio.run(run_one(m, GenerateRequest(prompt, GREEDY, num_predict=1)))
        assert m.engine is not None
        steps = m.engine.steps
    finally:
        m.unload()
    # 150 rows: 48 + 48 + 48 + 6; or all but the last at once, then the last on its own
    assert steps == decodes


@pytest.mark.parametrize(("work", "decodes"), [(1000, 2), (None, 1)])
def test_a_prompt_past_the_steps_prompt_work_waits_for_the_next_step(
    smollm2_gguf: Path, monkeypatch: pytest.MonkeyPatch, work: int | None, decodes: int
) -> None:
    """Two 40-token prompts admitted together: 40 rows over 40 cells is 1,600 of work, so under a budget
    of 1,000 the second waits a step; without one, both go in the first."""
    monkeypatch.setattr(llamacpp_backend, "PROMPT_WORK", work)
    opts = LoadOptions(num_ctx=512, num_thread=THREADS, num_batch=256, num_parallel=2)
    m = LlamaCppBackend.load(smollm2_gguf, opts)
    engine = m.engine
    assert engine is not None
    prompts = [m.tokenize(text * 8, add_special=True)[:40] for text in (REPEAT, QUESTIONS[0])]

    async def together() -> int:
        gate = threading.Event()
        engine.call(gate.wait)  # the step thread waits here until both requests are queued
        runs = [asyncio.create_task(run_one(m, GenerateRequest(p, GREEDY, num_predict=1))) for p in prompts]
        while len(engine._inbox) + len(engine.scheduler.waiting) < 2:  # queued, or taken and not admitted
            await asyncio.sleep(0.01)
        before = engine.steps
        gate.set()
        await asyncio.gather(*runs)
        return engine.steps - before

    try:
        steps = asyncio.run(together())
    finally:
        m.unload()
    assert steps == decodes


def test_clients_arriving_together_evaluate_a_shared_prompt_once(model: LlamaCppModel) -> None:
    system = " ".join(f"Law {i}: stay calm and answer with care." for i in range(12))
    prompts = [
        model.tokenize(CHAT.replace("You are a helpful assistant.", system).format(q=q), True, True)
        for q in ("Name a fruit.", "Name a tree.", "Name a bird.")
    ]
    shared = next(i for i, (a, b) in enumerate(zip(prompts[0], prompts[1])) if a != b)

    async def together() -> list[Outcome]:
        reqs = [GenerateRequest(p, GREEDY, num_predict=3) for p in prompts]
        return list(await asyncio.gather(*(run_one(model, r) for r in reqs)))

    outs = asyncio.run(together())
    evaluated = sorted(o.done.timings.prompt_eval_count for o in outs if o.done is not None)
    # one evaluates the shared part (less whatever an earlier test left cached), the others only their own
    assert evaluated[:2] == sorted([len(prompts[1]) - shared, len(prompts[2]) - shared])
    assert evaluated[2] > shared


def test_speculation_in_a_mixed_batch_stays_exact(smollm2_gguf: Path) -> None:
    """Draft-model and prompt-lookup guesses checked in the same step as plain decodes: every request,
    greedy or seeded, gives exactly the tokens it gives alone with speculation off."""
    opts = LoadOptions(
        num_ctx=512,
        num_thread=THREADS,
        num_batch=128,
        num_parallel=6,
        draft_model=smollm2_gguf,
        batch_invariant=True,
    )
    m = LlamaCppBackend.load(smollm2_gguf, opts)
    try:
        reqs = []
        # a text to repeat gives lookup guesses to check, wrong ones too where the copy ends
        questions = [*QUESTIONS[:2], REPEAT, QUESTIONS[3], REPEAT, REPEAT]
        for i, mode in enumerate(["draft", "draft", "lookup", "off", "draft", "lookup"]):
            sampling = GREEDY if i < 4 else SamplingParams(temperature=0.9, top_k=40, seed=40 + i)
            reqs.append(
                GenerateRequest(ask(m, questions[i]), sampling, num_predict=48, speculative=mode, num_draft=6)
            )
        plain = [asyncio.run(run_one(m, replace(fresh(r), speculative="off"))) for r in reqs]

        async def together() -> list[Outcome]:
            return list(await asyncio.gather(*(run_one(m, fresh(r)) for r in reqs)))

        mixed = asyncio.run(together())
    finally:
        m.unload()
    for i, (a, b) in enumerate(zip(plain, mixed)):
        assert b.ids == a.ids, f"request {i} changed under speculation"
    timings = [o.done.timings if o.done is not None else None for o in mixed]
    greedy_draft = [t for t in timings[:2] if t is not None]
    # the draft is the model itself: greedy, every guess is accepted
    assert sum(t.draft_count for t in greedy_draft) > 0
    assert sum(t.draft_accepted_count for t in greedy_draft) == sum(t.draft_count for t in greedy_draft)
    # lookup's guesses (greedy) and the draft model's (sampled: the target's own sampler checks them) are
    # partly rejected, rolled back inside the batch, and the tokens are still the plain ones
    for i in (2, 4):
        t = timings[i]
        assert t is not None
        assert 0 < t.draft_accepted_count < t.draft_count, f"request {i}: {t}"


def test_an_evicted_conversation_comes_back_from_the_ram_cache(smollm2_gguf: Path) -> None:
    """Two sequences, three conversations: the first loses its sequence to the third, its state is saved in
    RAM, and its next turn evaluates only the new tokens, with the tokens a fresh model gives."""
    opts = LoadOptions(num_ctx=512, num_thread=THREADS, num_batch=128, num_parallel=2, batch_invariant=True)
    system = " ".join(f"Rule {i}: answer with care and in full sentences." for i in range(6))
    chat = CHAT.replace("You are a helpful assistant.", system)
    m = LlamaCppBackend.load(smollm2_gguf, opts)
    try:
        first = m.tokenize(chat.format(q="Where is Peru?"), True, True)
        answer = asyncio.run(run_one(m, GenerateRequest(first, GREEDY, num_predict=6)))
        for q in ("Name a fruit.", "Name a tree."):  # two other conversations: the first one's seq is reused
            other = m.tokenize(CHAT.format(q=q), True, True)
            asyncio.run(run_one(m, GenerateRequest(other, GREEDY, num_predict=3)))
        follow = first + answer.ids + m.tokenize("<|im_end|>\n<|im_start|>user\nAnd Chile?", False, True)
        again = asyncio.run(run_one(m, GenerateRequest(follow, GREEDY, num_predict=6)))
        saved_after = len(m.engine.kv.saved) if m.engine is not None else -1
    finally:
        m.unload()
    fresh_model = LlamaCppBackend.load(smollm2_gguf, opts)
    try:
        scratch = asyncio.run(run_one(fresh_model, GenerateRequest(follow, GREEDY, num_predict=6)))
    finally:
        fresh_model.unload()
    assert again.done is not None
    assert scratch.done is not None
    assert again.done.timings.cached_count >= len(first)  # restored: the whole first turn
    assert again.done.timings.prompt_eval_count == len(follow) - again.done.timings.cached_count
    assert scratch.done.timings.cached_count == 0
    assert again.ids == scratch.ids
    assert saved_after >= 1  # the "tree" conversation's seq was saved in turn when the first came back


def test_the_ram_cache_keeps_the_newest_states_within_its_budget(smollm2_gguf: Path) -> None:
    """One sequence, three conversations of equal size, a budget that holds one saved state: the older
    evicted conversation is dropped from RAM (its next turn evaluates from scratch), the newest comes back
    restored."""
    opts = LoadOptions(num_ctx=512, num_thread=THREADS, num_batch=128, num_parallel=1)
    m = LlamaCppBackend.load(smollm2_gguf, opts)

    def prompt(topic: str) -> list[int]:
        system = " ".join(f"Rule {i}: speak of {topic} with care." for i in range(6))
        return m.tokenize(CHAT.replace("You are a helpful assistant.", system).format(q=topic), True, True)

    try:
        assert m.engine is not None
        first = {t: prompt(t) for t in ("rivers", "mountains", "forests")}
        answers = {}
        for topic in ("rivers", "mountains"):  # the second conversation evicts the first: saved in RAM
            answers[topic] = asyncio.run(run_one(m, GenerateRequest(first[topic], GREEDY, num_predict=4)))
        one_state = max(len(s.data) for s in m.engine.kv.saved)
        m.engine.kv.ram_cache_bytes = one_state + one_state // 4  # room for one state, not two
        answers["forests"] = asyncio.run(run_one(m, GenerateRequest(first["forests"], GREEDY, num_predict=4)))
        # saving "mountains" went past the budget: the oldest saved state ("rivers") was dropped

        def follow_up(topic: str) -> Outcome:
            more = m.tokenize("<|im_end|>\n<|im_start|>user\nAnd more?", False, True)
            return asyncio.run(
                run_one(m, GenerateRequest(first[topic] + answers[topic].ids + more, GREEDY, 2))
            )

        newest = follow_up("mountains")
        oldest = follow_up("rivers")
    finally:
        m.unload()
    assert newest.done is not None
    assert oldest.done is not None
    assert newest.done.timings.cached_count >= len(first["mountains"])  # restored from RAM
    assert oldest.done.timings.cached_count < len(first["rivers"]) // 2  # dropped: evaluated again


def test_drafts_of_a_step_are_evened_to_the_length_that_keeps_most_rows() -> None:
    """Unequal draft lengths cost llama.cpp a micro-batch each (equal rows per KV stream): one length per step."""
    from localrt.backends.engine import EngineRequest
    from localrt.backends.llamacpp.engine import _even_drafts
    from localrt.backends.llamacpp.sequences import Sequence

    seqs = [Sequence(EngineRequest(GenerateRequest([1]))) for _ in range(4)]
    for seq, drafts in zip(seqs, ([5, 6, 7, 8, 9], [1, 2, 3, 4, 5, 6], [7, 8], [])):
        seq.drafts = drafts
    _even_drafts(seqs)
    # length 5 keeps 2 x 5 rows, length 2 keeps 3 x 2: the short draft goes, the long one is cut
    assert [len(s.drafts) for s in seqs] == [5, 5, 0, 0]
    assert seqs[1].drafts == [1, 2, 3, 4, 5]


def test_embeddings_are_computed_on_the_step_thread(
    model: LlamaCppModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A graph run on any other thread leaves libgomp a second pool of workers, which slows every
    later step (see `EngineThread`): an embedding is rows of the step's own decodes."""
    threads: list[str] = []
    decode = Batch.decode

    def recorded(batch: Batch, ctx: object) -> int:
        threads.append(threading.current_thread().name)
        return decode(batch, ctx)

    monkeypatch.setattr(Batch, "decode", recorded)
    asyncio.run(model.embed(["The cat sat on the mat.", "Quantum chromodynamics"]))
    assert threads
    assert set(threads) == {Engine.thread_name}


def test_the_step_thread_ends_when_the_model_is_idle(model: LlamaCppModel) -> None:
    """Its OpenMP workers go with it, so an idle model does not slow a busy one down (`idle_end`)."""
    asyncio.run(run_one(model, GenerateRequest(ask(model, QUESTIONS[0]), GREEDY, num_predict=2)))
    assert model.engine is not None
    stepper = model.engine.call(threading.current_thread).result(timeout=30)
    stepper.join(timeout=30)
    assert not stepper.is_alive()


def test_end_of_generation_is_llama_cpps_for_every_token(model: LlamaCppModel) -> None:
    """The step loop remembers llama.cpp's end-of-generation answer per token (`ends_generation`)."""
    engine = model.engine
    assert engine is not None
    runner = engine.runner
    lib, vocab = runner.lib, runner.model.vocab
    ids = range(runner.n_vocab)
    truth = [bool(lib.llama_vocab_is_eog(vocab, t)) for t in ids]
    first = [runner.ends_generation(t) for t in ids]  # asked of llama.cpp (most of them), then kept
    again = [runner.ends_generation(t) for t in ids]
    assert first == truth
    assert again == truth


def test_a_batch_row_without_logits_is_an_error_not_a_read(model: LlamaCppModel) -> None:
    """`logits_row` reads llama.cpp's buffer at the address it returns; a row the batch did not ask
    logits for has none, and reading there would be a read of freed or foreign memory."""
    tokens = ask(model, QUESTIONS[0])[:3]
    ctx = create_context(
        model.model, context_params(LoadOptions(num_ctx=64), 256, 16, 1, THREADS, unified=False)
    )
    batch = Batch(len(tokens))
    try:
        batch.add(tokens, 0, 0, [False, False, True])
        assert batch.decode(ctx.ctx) == 0
        assert logits_row(ctx.ctx, 2, model.n_vocab).shape == (model.n_vocab,)
        with pytest.raises(LocalrtError, match="no logits for batch row 0"):
            logits_row(ctx.ctx, 0, model.n_vocab)
    finally:
        batch.close()
        ctx.close()


# ---- by default: one KV pool, a lone request the same run to run, waiting and preemption --------------
PASSAGE = " ".join(
    f"Sentence {i} tells of rivers, hills and the old roads between the towns." for i in range(40)
)


LIGHTHOUSE = (
    "The old lighthouse keeper climbed the narrow stairs every evening, lit the great lamp, and watched the "
    "ships pass safely through the rocky strait until dawn. In the morning he wrote the names of the ships "
    "in a worn leather book, made a pot of strong tea, and slept until the gulls woke him at noon. His daughter "
    "rowed across from the village twice a week with bread, letters and news of the harbour, and stayed for supper."
)


def recorded_verify_steps(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int, int]]:
    """(drafted, accepted, free) of every verify step from now on, as the speculation policy hears them."""
    from localrt.backends.speculation import SpecState

    steps: list[tuple[int, int, int]] = []
    record = SpecState.record

    def logged(self: SpecState, n: int, accepted: int, free: int = 0) -> None:
        steps.append((n, accepted, free))
        record(self, n, accepted, free)

    monkeypatch.setattr(SpecState, "record", logged)
    return steps


def pooled_model(gguf: Path, **extra: int) -> LlamaCppModel:
    settings = {"num_ctx": 512, "num_thread": THREADS, "num_batch": 128, "batch_invariant": False, **extra}
    return LlamaCppBackend.load(gguf, LoadOptions(**settings))  # type: ignore[arg-type]


def test_a_lone_request_is_the_same_run_to_run_without_batch_invariance(smollm2_gguf: Path) -> None:
    """Without the switch a prompt goes in chunks of num_batch rows, through the tiled attention kernel
    from 64 rows on; its last row is evaluated on its own, as it is when the rest of the prompt is cached,
    so the same request alone gives the same tokens and logprobs whether its prompt was cached or not."""
    m = pooled_model(smollm2_gguf, num_parallel=4)
    try:
        prompt = m.tokenize(PASSAGE, add_special=True)[:356]  # chunks of 128, 128 and 100 rows
        runs = [
            asyncio.run(run_one(m, GenerateRequest(prompt, GREEDY, num_predict=12, logprobs=True)))
            for _ in range(3)
        ]
    finally:
        m.unload()
    dones = [r.done for r in runs]
    assert len(prompt) == 356
    assert dones[0] is not None
    assert dones[1] is not None
    assert dones[0].timings.cached_count == 0
    assert dones[1].timings.cached_count == len(prompt) - 1
    for run in runs[1:]:
        assert run.ids == runs[0].ids
        assert run.logprobs == runs[0].logprobs


def test_the_sequences_share_one_pool_and_a_shared_prefix_takes_its_cells_once(smollm2_gguf: Path) -> None:
    """The context is one pool of num_parallel x num_ctx cells (or what LoadOptions.kv_pool asks, never
    less than a context), and a prefix copied from another sequence shares that sequence's cells."""
    m = pooled_model(smollm2_gguf, num_parallel=4)
    small = pooled_model(smollm2_gguf, num_parallel=4, kv_pool=100)
    try:
        assert m.engine is not None
        assert small.engine is not None
        lib = m.engine.kv.lib
        sizes = [(x.engine.kv.pool, lib.llama_n_ctx(x.engine.runner.ctx.ctx)) for x in (m, small)]
        system = " ".join(f"Rule {i}: answer politely and briefly." for i in range(8))
        prompts = [
            m.tokenize(CHAT.replace("You are a helpful assistant.", system).format(q=q), True, True)
            for q in ("Name a fruit.", "Name a tree.")
        ]
        shared = next(i for i, (a, b) in enumerate(zip(*prompts)) if a != b)
        for prompt in prompts:
            asyncio.run(run_one(m, GenerateRequest(prompt, GREEDY, num_predict=4)))
        kv = m.engine.kv
        held = sorted(len(c) for c in kv.cells if c)
        used = kv.used
    finally:
        m.unload()
        small.unload()
    assert sizes == [(2048, 2048), (512, 512)]
    assert len(held) == 2
    assert used == sum(held) - shared


def test_requests_past_the_pool_wait_or_are_preempted_and_all_complete(smollm2_gguf: Path) -> None:
    """Eight requests of 300 prompt tokens and 100 new ones on a pool of 1,024 cells: at most three hold
    their cells at once. The others wait for room, and one that runs out of room while it decodes is
    preempted (its state kept in RAM) and resumed where it stopped: every request ends with all its
    tokens, and the record of each sequence's cells still matches llama.cpp's memory."""
    m = pooled_model(smollm2_gguf, num_parallel=8, kv_pool=1024)
    try:
        assert m.engine is not None
        scheduler, peak = m.engine.scheduler, [0]
        admit = scheduler.admit

        def counted_admit() -> list[Sequence]:  # the most sequences running at once
            admitted = admit()
            peak[0] = max(peak[0], len(scheduler.running))
            return admitted

        scheduler.admit = counted_admit  # type: ignore[method-assign]
        base = m.tokenize(PASSAGE, add_special=False)
        prompts = [m.tokenize(f"Story {i}:", add_special=True) + base[i * 7 : i * 7 + 290] for i in range(8)]

        async def together() -> list[Outcome]:
            reqs = [GenerateRequest(p, GREEDY, num_predict=100) for p in prompts]
            return list(await asyncio.gather(*(run_one(m, r) for r in reqs)))

        outs = asyncio.run(together())
        engine = m.engine
        kv = engine.kv
        matches = [kv.lib.llama_memory_seq_pos_max(kv.mem, s) + 1 == len(kv.cells[s]) for s in range(8)]
        preemptions = engine.scheduler.preemptions
    finally:
        m.unload()
    assert all(len(p) > 290 for p in prompts)
    assert [o.done.finish_reason if o.done else None for o in outs] == ["length"] * 8
    assert [len(o.ids) for o in outs] == [100] * 8
    assert peak[0] <= 3  # the others waited for room
    assert peak[0] >= 2  # the pool is shared
    assert preemptions >= 1
    assert all(matches)


@pytest.mark.slow
@pytest.mark.timeout(1800)  # 7 minutes at 2 threads on a busy 2-core machine, over 10 at one thread
def test_eight_4k_token_requests_on_a_16k_pool_all_complete(smollm2_gguf: Path) -> None:
    """The agent-sized case of the test above: eight requests of about 4,000 prompt tokens at once on a
    pool of 16,384 cells (four of them fit)."""
    m = pooled_model(smollm2_gguf, num_parallel=8, kv_pool=16384, num_ctx=4608, num_batch=512)
    try:
        base = m.tokenize(PASSAGE * 8, add_special=False)
        prompts = [
            m.tokenize(f"Story {i}:", add_special=True) + base[i * 11 : i * 11 + 4000] for i in range(8)
        ]

        async def together() -> list[Outcome]:
            reqs = [GenerateRequest(p, GREEDY, num_predict=32) for p in prompts]
            return list(await asyncio.gather(*(run_one(m, r) for r in reqs)))

        outs = asyncio.run(together())
    finally:
        m.unload()
    assert all(len(p) > 4000 for p in prompts)
    assert [o.done.finish_reason if o.done else None for o in outs] == ["length"] * 8
    assert [len(o.ids) for o in outs] == [32] * 8


def test_lookup_drafts_grow_to_a_tiled_verify_step_without_batch_invariance(
    smollm2_gguf: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A copy of the prompt is drafted by prompt lookup; while every draft is accepted the drafts double
    past the lookup default, up to a verify step of TILED_ROWS rows (the tiled attention kernel), no more."""
    from localrt.backends.llamacpp.sequences import TILED_ROWS
    from localrt.backends.speculation import DEFAULT_NUM_DRAFT

    steps = recorded_verify_steps(monkeypatch)
    m = pooled_model(smollm2_gguf, num_ctx=2048, num_parallel=1, num_batch=512)
    try:
        text = " ".join(f"Sentence {i} tells of rivers and hills." for i in range(12))
        prompt = m.tokenize(f"Repeat this text exactly: {text}\n\n{text}", add_special=True)
        asyncio.run(run_one(m, GenerateRequest(prompt, GREEDY, num_predict=160, speculative="lookup")))
    finally:
        m.unload()
    assert max(n for n, _, _ in steps) > DEFAULT_NUM_DRAFT["lookup"]
    assert max(n for n, _, _ in steps) <= TILED_ROWS - 1


def test_a_verify_step_past_half_a_tile_is_filled_to_the_tiled_kernel(
    smollm2_gguf: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without batch invariance a decoding step of 33 to 63 rows (the row-at-a-time attention kernel,
    costlier than 64 rows through the tiled one) is filled to TILED_ROWS rows with longer lookup drafts,
    and the rows that fill it are not held against the sequence's draft policy."""
    from localrt.backends.llamacpp.sequences import TILED_ROWS

    steps = recorded_verify_steps(monkeypatch)
    m = pooled_model(smollm2_gguf, num_ctx=2048, num_parallel=1, num_batch=512)
    try:
        # no numbers that change from sentence to sentence: the copy is drafted right, and the drafts
        # double up to 16, then 32 (a step of 33 rows)
        prompt = m.tokenize(f"Repeat this text exactly: {LIGHTHOUSE}", add_special=True)
        asyncio.run(run_one(m, GenerateRequest(prompt, GREEDY, num_predict=160, speculative="lookup")))
    finally:
        m.unload()
    filled = [s for s in steps if s[2] > 0]
    assert filled, steps
    assert all(n + 1 == TILED_ROWS for n, _, _ in filled), filled
