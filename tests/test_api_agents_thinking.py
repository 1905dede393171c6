"""Thinking through the Responses and Anthropic routes, with the official `openai` and `anthropic`
packages against a real `localrt serve`: a tiny Qwen3-format GGUF (the think track's
tests/families.py) whose reply is forced token by token by a grammar, so the runtime really splits
`<think>...</think>` and the routes must return it as reasoning items / thinking blocks, never as text.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import anthropic
import openai
import pytest

from localrt.store.importer import import_gguf
from localrt.store.store import Store
from tests import families
from tests.servers.serve import LocalrtServer

REPLY = "<think>\nThe user asks about Paris weather.\n</think>\n\nIt is sunny."
THOUGHT, ANSWER = "The user asks about Paris weather.", "It is sunny."
ASK = "What is the weather in Paris?"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalrtServer]:
    root: Path = tmp_path_factory.mktemp("agents-thinking")
    import_gguf(Store(root / "models"), "qwen3:tiny", families.FAMILIES["qwen3"].write(root / "qwen3.gguf"))
    srv = LocalrtServer(root / "models", root / "serve.log")
    yield srv
    srv.stop()
    assert "Traceback" not in srv.log_path.read_text(errors="replace")


@pytest.fixture(scope="module")
def forced() -> dict[str, object]:
    return {"temperature": 0, "num_thread": 1, "grammar": families.forced(REPLY, families.FAMILIES["qwen3"])}


def test_anthropic_thinking_blocks(server: LocalrtServer, forced: dict[str, object]) -> None:
    claude = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    kwargs = {
        "model": "qwen3:tiny",
        "max_tokens": 2048,
        "thinking": {"type": "enabled", "budget_tokens": 1024},
        "messages": [{"role": "user", "content": ASK}],
        "extra_body": forced,
    }
    m = claude.messages.create(**kwargs)
    assert [b.type for b in m.content] == ["thinking", "text"]
    assert m.content[0].thinking == THOUGHT
    assert m.content[1].text == ANSWER
    with claude.messages.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_message()
    deltas = [e.delta for e in events if e.type == "content_block_delta"]
    thinking = "".join(d.thinking for d in deltas if d.type == "thinking_delta")
    assert thinking == THOUGHT
    assert "".join(d.text for d in deltas if d.type == "text_delta") == ANSWER
    assert [b.type for b in final.content] == ["thinking", "text"]


def test_responses_reasoning_items(server: LocalrtServer, forced: dict[str, object]) -> None:
    oai = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    kwargs = {"model": "qwen3:tiny", "input": ASK, "reasoning": {"effort": "high"}, "extra_body": forced}
    r = oai.responses.create(**kwargs)
    assert [item.type for item in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text == THOUGHT
    assert r.output_text == ANSWER
    events = list(oai.responses.create(**kwargs, stream=True))
    reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert reasoning == THOUGHT
    assert text == ANSWER
    assert [item.type for item in events[-1].response.output] == ["reasoning", "message"]


# ---- a thinking budget ---------------------------------------------------------------------------
LONG_THOUGHT = "One two three four five six seven eight nine ten eleven twelve thirteen fourteen."
LONG_REPLY = f"<think>\n{LONG_THOUGHT}\n</think>\n\nIt is sunny."
BUDGET = 6


def test_anthropic_budget_tokens_close_the_thinking(server: LocalrtServer) -> None:
    # the grammar spells a thought far longer than the budget: the runtime ends it after BUDGET tokens,
    # closes it with </think>, and the answer is generated after that (free: the grammar spelled a reply
    # whose thinking was cut)
    claude = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    grammar = families.forced(LONG_REPLY, families.FAMILIES["qwen3"])
    kwargs = {
        "model": "qwen3:tiny",
        "max_tokens": 24,
        "thinking": {"type": "enabled", "budget_tokens": BUDGET},
        "messages": [{"role": "user", "content": ASK}],
        "extra_body": {"temperature": 0, "num_thread": 1, "grammar": grammar},
    }
    m = claude.messages.create(**kwargs)
    assert m.content[0].type == "thinking"
    thought = m.content[0].thinking
    assert thought
    assert LONG_THOUGHT.startswith(thought)
    assert len(thought) < len(LONG_THOUGHT) // 2  # cut after a few tokens
    assert m.usage.output_tokens > BUDGET  # the answer was generated after the cut
    assert "fourteen" not in "".join(b.text for b in m.content if b.type == "text")
    with claude.messages.stream(**kwargs) as stream:
        final = stream.get_final_message()
    assert final.content[0].thinking == thought
    assert final.usage.output_tokens == m.usage.output_tokens


def test_responses_reasoning_tokens(server: LocalrtServer, forced: dict[str, object]) -> None:
    oai = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    r = oai.responses.create(model="qwen3:tiny", input=ASK, extra_body=forced)
    reasoning = r.usage.output_tokens_details.reasoning_tokens
    assert reasoning > len("<think>")  # the thought is spelled over many tokens
    assert reasoning < r.usage.output_tokens  # the answer's tokens are no reasoning
    chat = oai.chat.completions.create(
        model="qwen3:tiny", messages=[{"role": "user", "content": ASK}], extra_body=forced
    )
    assert chat.usage.completion_tokens_details.reasoning_tokens == reasoning
