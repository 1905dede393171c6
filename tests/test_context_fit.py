"""Prompts that do not fit the context (Ollama's `truncate`) and answers that reach its end (`shift`),
through the runtime on the real SmolLM2."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("llama_cpp")

from localrt.runtime.answers import ContextLengthError  # noqa: E402
from localrt.runtime.front import Runtime  # noqa: E402
from localrt.runtime.options import OPEN_ENDED_CONTEXTS  # noqa: E402
from localrt.runtime.truncate import fit_messages  # noqa: E402
from localrt.runtime.truncate import fit_tokens  # noqa: E402
from localrt.store.store import Store  # noqa: E402
from tests.conftest import async_test  # noqa: E402
from tests.test_runtime import PARAMS  # noqa: E402
from tests.test_runtime import collect  # noqa: E402
from tests.test_runtime import import_model  # noqa: E402

SYSTEM = "You are a helpful assistant."
SMALL = {**PARAMS, "num_ctx": 160}


@pytest.fixture
def store(models_dir: Path, smollm2_gguf: Path) -> Store:
    s = Store(models_dir)
    import_model(s, "smollm2:135m", smollm2_gguf, params=SMALL, system=SYSTEM)
    return s


def conversation(turns: int) -> list[dict[str, str]]:
    msgs = []
    for i in range(turns):
        msgs.append({"role": "user", "content": f"Question {i}: tell me something about the number {i}."})
        msgs.append(
            {"role": "assistant", "content": f"The number {i} comes after {i - 1} and before {i + 1}."}
        )
    msgs.append({"role": "user", "content": "And what is 2 + 2?"})
    return msgs


def test_fit_messages_keeps_system_and_the_newest() -> None:
    msgs = [{"role": "system", "content": "s"}, *[{"role": "user", "content": str(i)} for i in range(6)]]
    kept = fit_messages(msgs, len, 4)
    assert kept == [msgs[0], msgs[5], msgs[6]]
    assert fit_tokens(list(range(100)), 50, 4) == [0, 1, 2, 3, *range(100 - 23, 100)]


def test_chat_truncation_keeps_the_system_prompt_and_the_newest_turns(store: Store) -> None:
    async def scenario() -> None:
        rt = Runtime(store)
        try:
            msgs = conversation(12)
            full = (await rt.render("smollm2:135m", [{"role": "system", "content": SYSTEM}, *msgs]))[1]
            assert len(full) > SMALL["num_ctx"]
            # the expected prompt: the system prompt and the longest run of newest messages that fits
            expected: list[int] = []
            for start in range(len(msgs)):
                tokens = (
                    await rt.render("smollm2:135m", [{"role": "system", "content": SYSTEM}, *msgs[start:]])
                )[1]
                if len(tokens) < SMALL["num_ctx"]:
                    expected = tokens
                    break
            assert expected
            _, done = await collect(rt.chat("smollm2:135m", msgs, options={"num_predict": 4}))
            m = done.metrics
            assert m is not None
            assert m.prompt_eval_count + m.cached_count == len(expected)
            with pytest.raises(ContextLengthError, match=rf"{len(full)} tokens.*{SMALL['num_ctx']} tokens"):
                await collect(rt.chat("smollm2:135m", msgs, truncate=False))
        finally:
            await rt.close()

    asyncio.run(scenario())


async def counted_past_the_end(store: Store, opts: dict[str, int]) -> tuple[Any, Any]:
    """The final chunks of one counting prompt answered with `shift` on and with it off."""
    rt = Runtime(store)
    try:
        count = "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11,"  # greedy SmolLM2 goes on counting
        _, shifted = await collect(rt.generate("smollm2:135m", count, raw=True, options=opts))
        _, stopped = await collect(rt.generate("smollm2:135m", count, raw=True, options=opts, shift=False))
        return shifted, stopped
    finally:
        await rt.close()


@async_test
async def test_generation_shifts_past_the_context_or_stops_there(store: Store) -> None:
    shifted, stopped = await counted_past_the_end(store, {"num_predict": 240})
    assert stopped.done_reason == "length"
    assert (
        stopped.metrics.prompt_eval_count + stopped.metrics.cached_count + stopped.metrics.eval_count
        == (SMALL["num_ctx"])
    )
    assert shifted.done_reason == "length"
    assert shifted.metrics.eval_count == 240  # past the 160-token context


@async_test
async def test_a_default_answer_shifts_past_the_context_and_stops_at_ten_contexts(store: Store) -> None:
    """num_predict -1 (the default): Ollama's open-ended answer goes past the context end, shifting it,
    and stops at 10 x num_ctx new tokens; with shift off it stops at the context end. A 64-token
    context keeps the 640 tokens quick."""
    shifted, stopped = await counted_past_the_end(store, {"num_ctx": 64})
    assert shifted.done_reason == "length"
    assert shifted.metrics.eval_count == OPEN_ENDED_CONTEXTS * 64
    assert stopped.done_reason == "length"
    assert stopped.metrics.prompt_tokens + stopped.metrics.eval_count == 64
