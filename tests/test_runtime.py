"""The runtime on the real SmolLM2 GGUF: chat, prefix reuse across turns, keep-alive, LRU, queue limit,
and bad requests that fail clearly while the runtime keeps serving."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("llama_cpp")

from localrt.errors import BackendUnavailable  # noqa: E402
from localrt.errors import LocalrtError  # noqa: E402
from localrt.errors import ModelNotFound  # noqa: E402
from localrt.errors import OptionError  # noqa: E402
from localrt.errors import ServerBusy  # noqa: E402
from localrt.runtime.answers import Chunk  # noqa: E402
from localrt.runtime.front import Runtime  # noqa: E402
from localrt.runtime.templates import TemplateError  # noqa: E402
from localrt.store.store import Store  # noqa: E402

THREADS = int(os.environ.get("LOCALRT_TEST_THREADS", "1"))
# Greedy and a plain system prompt: SmolLM2-135M's own default system prompt makes it ramble.
PARAMS = {"temperature": 0, "num_ctx": 1024, "num_thread": THREADS, "num_batch": 256}
SYSTEM = "You are a helpful assistant."
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


def import_model(store: Store, name: str, gguf: Path, **layers: Any) -> None:
    from localrt.store.importer import import_gguf

    layers.setdefault("params", PARAMS)
    layers.setdefault("system", SYSTEM)
    import_gguf(store, name, gguf, **layers)


@pytest.fixture
def store(models_dir: Path, smollm2_gguf: Path) -> Store:
    s = Store(models_dir)
    import_model(s, "smollm2:135m", smollm2_gguf)
    return s


async def collect(stream: AsyncIterator[Chunk]) -> tuple[str, Chunk]:
    text, final = "", None
    async for chunk in stream:
        text += chunk.content
        if chunk.done:
            final = chunk
    assert final is not None
    assert final.metrics is not None
    return text, final


def test_chat_answers_and_reports_timings(store: Store) -> None:
    async def scenario() -> None:
        rt = Runtime(store)
        try:
            text, final = await collect(rt.chat("smollm2:135m", FRANCE))
            assert "Paris" in text
            assert final.done_reason == "stop"
            m = final.metrics
            assert m is not None
            assert m.load_ns > 0
            assert m.total_ns >= m.prompt_eval_ns + m.eval_ns
            assert m.prompt_eval_count > 10
            assert m.eval_count > 0
            # loaded once: the second request has no load time
            _, again = await collect(rt.chat("smollm2:135m", FRANCE, stream=False))
            assert again.metrics is not None
            assert again.metrics.load_ns == 0
            assert "Paris" in again.content  # stream=False: the whole answer in the final chunk
        finally:
            await rt.close()

    asyncio.run(scenario())


def test_two_turn_chat_keeps_context_and_evaluates_only_new_tokens(store: Store) -> None:
    async def scenario() -> None:
        rt = Runtime(store)
        try:
            first, done1 = await collect(rt.chat("smollm2:135m", FRANCE))
            history = [
                *FRANCE,
                {"role": "assistant", "content": first},
                {"role": "user", "content": "And what is the capital of Germany?"},
            ]
            second, done2 = await collect(rt.chat("smollm2:135m", history))
            assert "Berlin" in second
            _, p1 = await rt.render("smollm2:135m", [{"role": "system", "content": SYSTEM}, *FRANCE])
            _, p2 = await rt.render("smollm2:135m", [{"role": "system", "content": SYSTEM}, *history])
            assert done1.metrics is not None
            assert done2.metrics is not None
            assert done1.metrics.prompt_eval_count == len(p1)
            # what turn 2 adds: the end of the answer's turn and the new user turn (the answer itself
            # is in the cache already, from generating it)
            new_tokens = len(p2) - len(p1) - done1.metrics.eval_count + 1
            assert done2.metrics.prompt_eval_count <= new_tokens + 1
            assert done2.metrics.prompt_eval_count < len(p2) // 2
        finally:
            await rt.close()

    asyncio.run(scenario())


def test_generate_raw_context_and_json(store: Store) -> None:
    async def scenario() -> None:
        rt = Runtime(store)
        try:
            text, final = await collect(rt.generate("smollm2:135m", "What is the capital of France?"))
            assert "Paris" in text
            assert final.context
            assert len(final.context) > 10
            raw, _ = await collect(
                rt.generate(
                    "smollm2:135m",
                    "<|im_start|>user\nSay hello<|im_end|>\n<|im_start|>assistant\n",
                    raw=True,
                    options={"num_predict": 8},
                )
            )
            assert raw.strip()
            js, _ = await collect(
                rt.generate(
                    "smollm2:135m",
                    "A JSON object with a name and an age.",
                    format="json",
                    options={"num_predict": 60},
                )
            )
            assert isinstance(json.loads(js), dict)
            with pytest.raises(LocalrtError, match="raw mode"):
                await collect(rt.generate("smollm2:135m", "x", raw=True, system="s"))
        finally:
            await rt.close()

    asyncio.run(scenario())


def test_stop_option_logprobs_and_options_precedence(store: Store) -> None:
    async def scenario() -> None:
        rt = Runtime(store)
        try:
            text, final = await collect(rt.chat("smollm2:135m", FRANCE, options={"stop": ["Paris"]}))
            assert "Paris" not in text
            assert final.done_reason == "stop"
            _, final = await collect(
                rt.chat(
                    "smollm2:135m",
                    FRANCE,
                    options={"num_predict": 3},
                    logprobs=True,
                    top_logprobs=2,
                    stream=False,
                )
            )
            assert final.done_reason == "length"
            assert final.metrics
            assert final.metrics.eval_count == 3
            assert final.logprobs
            assert len(final.logprobs) == 3
            assert len(final.logprobs[0].top) == 2
        finally:
            await rt.close()

    asyncio.run(scenario())


def test_embed_tokenize_score(store: Store) -> None:
    async def scenario() -> None:
        rt = Runtime(store)
        try:
            result = await rt.embed("smollm2:135m", ["hello world", "goodbye"])
            assert len(result.embeddings) == 2
            assert len(result.embeddings[0]) == 576
            assert result.prompt_eval_count > 0
            ids = await rt.tokenize("smollm2:135m", "Hello world")
            assert await rt.detokenize("smollm2:135m", ids) == "Hello world"
            scored = await rt.score("smollm2:135m", "The capital of France is Paris.")
            assert (
                len(scored.logprobs)
                == len(await rt.tokenize("smollm2:135m", "The capital of France is Paris.")) - 1
            )
        finally:
            await rt.close()

    asyncio.run(scenario())


def test_keep_alive_zero_unloads_and_ps(store: Store) -> None:
    async def scenario() -> None:
        rt = Runtime(store)
        try:
            await collect(rt.chat("smollm2:135m", FRANCE, options={"num_predict": 2}, keep_alive="1m"))
            (row,) = rt.ps()
            assert row.name == "smollm2:135m"
            assert row.backend == "llama.cpp"
            assert row.context_length == 1024
            assert row.expires_at is not None
            assert row.size > 0
            await collect(rt.chat("smollm2:135m", FRANCE, options={"num_predict": 2}, keep_alive=0))
            assert rt.ps() == []
            # empty messages: load only, then unload with keep_alive 0
            _, loaded = await collect(rt.chat("smollm2:135m", []))
            assert loaded.done_reason == "load"
            assert len(rt.ps()) == 1
            _, unloaded = await collect(rt.chat("smollm2:135m", [], keep_alive=0))
            assert unloaded.done_reason == "unload"
            assert rt.ps() == []
        finally:
            await rt.close()

    asyncio.run(scenario())


def test_keep_alive_expiry_and_unload(store: Store) -> None:
    async def scenario() -> None:
        rt = Runtime(store)
        try:
            await collect(rt.chat("smollm2:135m", FRANCE, options={"num_predict": 1}, keep_alive=0.3))
            assert len(rt.ps()) == 1
            await asyncio.sleep(0.8)
            assert rt.ps() == []
            await collect(rt.chat("smollm2:135m", FRANCE, options={"num_predict": 1}, keep_alive=-1))
            assert rt.ps()[0].expires_at is None  # forever
            assert await rt.unload("smollm2:135m")
            assert rt.ps() == []
            assert not await rt.unload("smollm2:135m")
        finally:
            await rt.close()

    asyncio.run(scenario())


def test_a_request_cancelled_mid_load_leaves_the_model_loaded(store: Store) -> None:
    """A caller that goes away while its model loads (the server cancels it when its client hangs up):
    the load, a thread that cannot stop halfway, finishes and the pool keeps the model instead of
    leaking it, so the next request finds it loaded."""

    async def scenario() -> None:
        rt = Runtime(store)
        try:
            task = asyncio.ensure_future(collect(rt.chat("smollm2:135m", FRANCE, options={"num_predict": 2})))
            while not rt.pool._loading:  # the load has started (in its thread)
                await asyncio.sleep(0.001)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert rt.queue_depth() == {}  # the caller is gone at once, the load still running
            for _ in range(6000):  # a liveness bound (a load takes well under a second), not a speed target
                if rt.ps():
                    break
                await asyncio.sleep(0.01)
            assert [row.name for row in rt.ps()] == ["smollm2:135m"]
            _, final = await collect(rt.chat("smollm2:135m", FRANCE, options={"num_predict": 2}))
            assert final.metrics is not None
            assert final.metrics.load_ns == 0
        finally:
            await rt.close()

    asyncio.run(scenario())


def test_lru_unload_beyond_max_loaded(store: Store, smollm2_gguf: Path) -> None:
    import_model(store, "second:latest", smollm2_gguf)

    async def scenario() -> None:
        rt = Runtime(store, max_loaded=1)
        try:
            await collect(rt.chat("smollm2:135m", FRANCE, options={"num_predict": 1}))
            await collect(rt.chat("second", FRANCE, options={"num_predict": 1}))
            assert [r.name for r in rt.ps()] == ["second:latest"]
        finally:
            await rt.close()

    asyncio.run(scenario())


def test_queue_limit_answers_busy(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCALRT_NUM_PARALLEL", "1")  # one running, one waiting, the next one refused

    async def scenario() -> None:
        rt = Runtime(store, max_queue=1)
        try:
            story = [{"role": "user", "content": "Tell me a very long story about dragons."}]
            first = rt.chat("smollm2:135m", story, options={"num_predict": 300})
            await first.__anext__()  # running, holding the model
            waiting = asyncio.ensure_future(
                collect(rt.chat("smollm2:135m", FRANCE, options={"num_predict": 1}))
            )
            await asyncio.sleep(0.05)  # queued
            assert rt.queue_depth() == {"smollm2:135m": 2}
            with pytest.raises(
                ServerBusy, match="server busy, please try again.  maximum pending requests exceeded"
            ):
                await collect(rt.chat("smollm2:135m", FRANCE))
            await first.aclose()  # the client went away: generation stops, the queue moves on
            _, done = await waiting
            assert done.done_reason == "length"
        finally:
            await rt.close()

    asyncio.run(scenario())


@pytest.mark.parametrize("backend,parallel", [("llama.cpp", "2"), ("torch", "")])
def test_parallel_slots_serve_requests_side_by_side(
    store: Store, monkeypatch: pytest.MonkeyPatch, backend: str, parallel: str
) -> None:
    """Two slots on llama.cpp (LOCALRT_NUM_PARALLEL=2), the torch engine's batch by default: a short
    request finishes while a long one is still streaming."""
    if backend == "torch":
        pytest.importorskip("torch")
    monkeypatch.setenv("LOCALRT_NUM_PARALLEL", parallel)

    async def scenario() -> None:
        rt = Runtime(store)
        try:
            story = [{"role": "user", "content": "Tell me a very long story about dragons."}]
            long = rt.chat(
                "smollm2:135m",
                story,
                options={"num_predict": 900, "temperature": 0.8, "seed": 1, "backend": backend},
            )
            await long.__anext__()  # streaming, holding one slot
            text, done = await collect(rt.chat("smollm2:135m", FRANCE, options={"backend": backend}))
            assert "Paris" in text
            assert done.done_reason == "stop"
            assert rt.queue_depth() == {"smollm2:135m": 1}  # the story is still running
            await long.aclose()
        finally:
            await rt.close()

    asyncio.run(scenario())


def test_requests_sent_together_start_in_one_step(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """The runtime announces a request to its model while it renders the prompt, so the first of two
    requests sent at once waits for the other: one decode evaluates both prompts and samples both first
    tokens. The engine's hold is made long enough that timing cannot decide it."""
    monkeypatch.setenv("LOCALRT_NUM_PARALLEL", "2")

    async def scenario() -> None:
        rt = Runtime(store)
        try:
            await collect(rt.chat("smollm2:135m", []))  # loaded
            (entry,) = rt.pool._entries.values()
            engine = entry.model.engine
            engine.gather_s = 60.0
            steps = engine.steps
            one = {"num_predict": 1}
            await asyncio.gather(
                collect(rt.chat("smollm2:135m", FRANCE, options=one)),
                collect(rt.chat("smollm2:135m", [{"role": "user", "content": "Name a bird."}], options=one)),
            )
            assert engine.steps - steps == 1
        finally:
            await rt.close()

    asyncio.run(scenario())


def test_one_slot_serves_waiting_requests_in_arrival_order(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LOCALRT_NUM_PARALLEL", "1")

    async def scenario() -> None:
        rt = Runtime(store)
        try:
            story = [{"role": "user", "content": "Tell me a very long story about dragons."}]
            first = rt.chat("smollm2:135m", story, options={"num_predict": 300})
            await first.__anext__()  # running, holding the only slot
            finished: list[int] = []

            async def ask(i: int) -> None:
                await collect(rt.chat("smollm2:135m", FRANCE, options={"num_predict": 2}))
                finished.append(i)

            waiting = []
            for i in range(4):
                waiting.append(asyncio.ensure_future(ask(i)))
                await asyncio.sleep(0.02)  # arrive one after another
            assert rt.queue_depth() == {"smollm2:135m": 5}
            await first.aclose()
            await asyncio.gather(*waiting)
            assert finished == [0, 1, 2, 3]
        finally:
            await rt.close()

    asyncio.run(scenario())


def test_each_conversation_keeps_its_slot_and_its_prefix(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two slots, two interleaved conversations: each second turn evaluates only its new tokens."""
    monkeypatch.setenv("LOCALRT_NUM_PARALLEL", "2")

    async def scenario() -> None:
        rt = Runtime(store)
        try:
            chats = [list(FRANCE), [{"role": "user", "content": "Write one sentence about the sea."}]]
            firsts = []
            for msgs in chats:
                answer, done = await collect(rt.chat("smollm2:135m", msgs, options={"num_predict": 24}))
                msgs += [{"role": "assistant", "content": answer}, {"role": "user", "content": "Thank you!"}]
                firsts.append(done)
            for msgs in chats:
                _, done = await collect(rt.chat("smollm2:135m", msgs, options={"num_predict": 4}))
                _, full = await rt.render("smollm2:135m", [{"role": "system", "content": SYSTEM}, *msgs])
                assert done.metrics is not None
                assert done.metrics.prompt_eval_count < len(full) // 3
        finally:
            await rt.close()

    asyncio.run(scenario())


def test_load_time_option_change_reloads(store: Store) -> None:
    async def scenario() -> None:
        rt = Runtime(store)
        try:
            await collect(rt.chat("smollm2:135m", FRANCE, options={"num_predict": 1}))
            _, final = await collect(
                rt.chat("smollm2:135m", FRANCE, options={"num_predict": 1, "num_ctx": 512})
            )
            assert final.metrics
            assert final.metrics.load_ns > 0
            assert rt.ps()[0].context_length == 512
        finally:
            await rt.close()

    asyncio.run(scenario())


def test_speculative_through_the_runtime(store: Store, smollm2_gguf: Path) -> None:
    import_model(store, "smollm2:draft", smollm2_gguf, draft=smollm2_gguf)
    copy = [
        {
            "role": "user",
            "content": "Repeat exactly: the quick brown fox jumps over the lazy dog, "
            "the quick brown fox jumps over the lazy dog.",
        }
    ]

    async def scenario() -> None:
        rt = Runtime(store)
        try:
            plain, _ = await collect(
                rt.chat("smollm2:135m", copy, options={"num_predict": 30, "speculative": "off"})
            )
            looked, fin = await collect(
                rt.chat("smollm2:135m", copy, options={"num_predict": 30, "speculative": "lookup"})
            )
            assert looked == plain
            assert fin.metrics
            assert fin.metrics.draft_count > 0
            drafted, fin = await collect(
                rt.chat("smollm2:draft", copy, options={"num_predict": 30})
            )  # auto -> draft
            assert drafted == plain
            assert fin.metrics
            assert fin.metrics.draft_accepted_count > 0
            with pytest.raises(OptionError, match="not supported"):
                await collect(rt.chat("smollm2:135m", copy, options={"speculative": "self"}))
        finally:
            await rt.close()

    asyncio.run(scenario())


def test_bad_requests_fail_clearly_and_the_runtime_keeps_serving(
    store: Store, smollm2_gguf: Path, without_mlx: None
) -> None:
    import_model(
        store, "evil:latest", smollm2_gguf, template="{{ cycler.__init__.__globals__.os.popen('id').read() }}"
    )
    import_model(store, "tiny:latest", smollm2_gguf, params={**PARAMS, "num_ctx": 64})

    async def scenario() -> None:
        rt = Runtime(store)
        try:
            cases: list[tuple[type[Exception], str, Any]] = [
                (ModelNotFound, "model 'nosuch:latest' not found", lambda: rt.chat("nosuch", FRANCE)),
                (
                    OptionError,
                    "unknown option 'temprature'",
                    lambda: rt.chat("smollm2:135m", FRANCE, options={"temprature": 0.5}),
                ),
                (
                    OptionError,
                    "'num_ctx' must be an integer, got a string",
                    lambda: rt.chat("smollm2:135m", FRANCE, options={"num_ctx": "2048"}),
                ),
                (
                    OptionError,
                    "'temperature' must be a number, got a boolean",
                    lambda: rt.chat("smollm2:135m", FRANCE, options={"temperature": True}),
                ),
                (TemplateError, "refused by the sandbox", lambda: rt.chat("evil", FRANCE)),
                (
                    LocalrtError,
                    "does not fit the context length of 64 tokens",
                    lambda: rt.chat("tiny", [{"role": "user", "content": "word " * 200}]),
                ),
                (
                    BackendUnavailable,
                    "backend mlx is not available",
                    lambda: rt.chat("smollm2:135m", FRANCE, options={"backend": "mlx"}),
                ),
                (LocalrtError, "invalid format", lambda: rt.chat("smollm2:135m", FRANCE, format="yaml")),
            ]
            for error, message, make in cases:
                with pytest.raises(error, match=message) as info:
                    await collect(make())
                assert 400 <= info.value.status < 600
            text, _ = await collect(rt.chat("smollm2:135m", FRANCE))  # still serving
            assert "Paris" in text
        finally:
            await rt.close()

    asyncio.run(scenario())


def test_a_variable_read_at_load_reloads_the_model(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """LOCALRT_BATCH_INVARIANT is read when the model loads: set while it is loaded, the next request finds
    the model loaded under another value and loads it again, as a changed load option would."""

    async def scenario() -> None:
        rt = Runtime(store)
        try:
            load = [{"role": "user", "content": "Hi"}]
            options = {"num_predict": 1}
            monkeypatch.setenv("LOCALRT_BATCH_INVARIANT", "0")
            _, first = await collect(rt.chat("smollm2:135m", load, options=options))
            _, warm = await collect(rt.chat("smollm2:135m", load, options=options))
            monkeypatch.setenv("LOCALRT_BATCH_INVARIANT", "1")
            _, changed = await collect(rt.chat("smollm2:135m", load, options=options))
            assert first.metrics is not None
            assert warm.metrics is not None
            assert changed.metrics is not None
            assert first.metrics.load_ns > 0
            assert warm.metrics.load_ns == 0
            assert changed.metrics.load_ns > 0  # reloaded under the new value
            assert len(rt.ps()) == 1  # the old load went
        finally:
            await rt.close()

    asyncio.run(scenario())
