"""A tool call cut by the token limit, on every route that takes tools, streamed and not: the complete
calls before it are kept, none of its markup reaches the text, and the stop reason is the limit's.

A real `localrt serve` with the tiny Qwen3 stand-in (tests/families.py); a grammar (the `grammar` option,
which every route takes) forces the reply to two calls, and the limit falls inside the second one. The
limit is found from the uncut reply's own tokens (Ollama's logprobs), so it is the same on every route:
each sends the same conversation, with thinking off.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest

from localrt.store.importer import import_gguf
from localrt.store.store import Store
from tests.families import FAMILIES
from tests.families import forced
from tests.servers.serve import LocalrtServer

MODEL = "qwen3:tiny"
CUT_ARGUMENT = "Oslo, the capital of Norway, by the fjord"
REPLY = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {"city": "' + CUT_ARGUMENT + '"}}\n</tool_call>'
)
GRAMMAR = forced(REPLY, FAMILIES["qwen3"])
PARAMS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
NAMES = ("get_weather", "get_time")
CHAT_TOOLS = [
    {"type": "function", "function": {"name": n, "description": n, "parameters": PARAMS}} for n in NAMES
]
RESPONSES_TOOLS = [{"type": "function", "name": n, "description": n, "parameters": PARAMS} for n in NAMES]
ANTHROPIC_TOOLS = [{"name": n, "description": n, "input_schema": PARAMS} for n in NAMES]
ASK = [{"role": "user", "content": "What is the weather in Paris, and the time in Oslo?"}]
OPTIONS = {"temperature": 0, "grammar": GRAMMAR}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalrtServer]:
    root = tmp_path_factory.mktemp("cut-calls")
    import_gguf(Store(root / "models"), MODEL, FAMILIES["qwen3"].write(root / "qwen3.gguf"))
    srv = LocalrtServer(root / "models", root / "serve.log", env={"LOCALRT_KEEP_ALIVE": "10m"})
    yield srv
    srv.stop()
    assert "Traceback" not in srv.log_path.read_text(errors="replace")


def ollama_chat(server: LocalrtServer, **fields: Any) -> httpx.Response:
    body = {"model": MODEL, "messages": ASK, "tools": CHAT_TOOLS, "think": False, **fields}
    return httpx.post(server.url + "/api/chat", json=body, timeout=300)


@pytest.fixture(scope="module")
def limit(server: LocalrtServer) -> int:
    """The number of reply tokens that ends a few words into the second call's argument."""
    r = ollama_chat(server, stream=False, options=OPTIONS, logprobs=True)
    whole = r.json()
    assert [c["function"]["name"] for c in whole["message"]["tool_calls"]] == list(NAMES)  # uncut: both
    texts = [lp["token"] for lp in whole["logprobs"]]
    return next(i for i in range(len(texts)) if CUT_ARGUMENT[:12] in "".join(texts[:i]))


def assert_no_markup(text: str | None) -> None:
    assert "<tool_call>" not in (text or "")
    assert CUT_ARGUMENT[:4] not in (text or "")
    assert (text or "").strip() == ""


def lines(r: httpx.Response) -> list[dict[str, Any]]:
    return [json.loads(line) for line in r.iter_lines() if line]


@pytest.mark.parametrize("stream", [False, True])
def test_ollama_chat(server: LocalrtServer, limit: int, stream: bool) -> None:
    # the limit as a top-level max_tokens, as OpenAI-style clients send it to /api/chat
    r = ollama_chat(server, stream=stream, options=OPTIONS, max_tokens=limit)
    assert r.status_code == 200, r.text
    parts = lines(r) if stream else [r.json()]
    final = parts[-1]
    assert final["done_reason"] == "length"
    assert final["eval_count"] == limit
    calls = [c for p in parts for c in p["message"].get("tool_calls") or []]
    assert [c["function"]["name"] for c in calls] == ["get_weather"]
    assert calls[0]["function"]["arguments"] == {"city": "Paris"}
    assert_no_markup("".join(p["message"]["content"] for p in parts))


@pytest.mark.parametrize("stream", [False, True])
def test_openai_chat(server: LocalrtServer, limit: int, stream: bool) -> None:
    oai = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    args: dict[str, Any] = {
        "model": MODEL,
        "messages": ASK,
        "tools": CHAT_TOOLS,
        "max_tokens": limit,
        "reasoning_effort": "none",
        "temperature": 0,
        "extra_body": {"grammar": GRAMMAR},
    }
    if not stream:
        choice = oai.chat.completions.create(**args).choices[0]
        reason, content, calls = choice.finish_reason, choice.message.content, choice.message.tool_calls or []
    else:
        chunks = [c for c in oai.chat.completions.create(**args, stream=True) if c.choices]
        reason = chunks[-1].choices[0].finish_reason
        content = "".join(c.choices[0].delta.content or "" for c in chunks)
        calls = [t for c in chunks for t in c.choices[0].delta.tool_calls or []]
    assert reason == "length"
    assert [c.function.name for c in calls] == ["get_weather"]
    assert json.loads(calls[0].function.arguments or "{}") == {"city": "Paris"}
    assert_no_markup(content)


@pytest.mark.parametrize("stream", [False, True])
def test_responses(server: LocalrtServer, limit: int, stream: bool) -> None:
    oai = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    args: dict[str, Any] = {
        "model": MODEL,
        "input": ASK[0]["content"],
        "tools": RESPONSES_TOOLS,
        "max_output_tokens": limit,
        "reasoning": {"effort": "none"},
        "temperature": 0,
        "extra_body": {"grammar": GRAMMAR},
    }
    if not stream:
        response = oai.responses.create(**args)
    else:
        events = list(oai.responses.create(**args, stream=True))
        assert events[-1].type == "response.incomplete"
        response = events[-1].response
    assert response.status == "incomplete"
    assert response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens"
    calls = [item for item in response.output if item.type == "function_call"]
    assert [c.name for c in calls] == ["get_weather"]
    assert json.loads(calls[0].arguments) == {"city": "Paris"}
    assert_no_markup(response.output_text)


@pytest.mark.parametrize("stream", [False, True])
def test_anthropic_messages(server: LocalrtServer, limit: int, stream: bool) -> None:
    claude = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    args: dict[str, Any] = {
        "model": MODEL,
        "messages": ASK,
        "tools": ANTHROPIC_TOOLS,
        "max_tokens": limit,
        "thinking": {"type": "disabled"},
        "extra_body": OPTIONS,
    }
    if not stream:
        message = claude.messages.create(**args)
    else:
        with claude.messages.stream(**args) as events:
            message = events.get_final_message()
    assert message.stop_reason == "max_tokens"
    uses = [b for b in message.content if b.type == "tool_use"]
    assert [b.name for b in uses] == ["get_weather"]
    assert uses[0].input == {"city": "Paris"}
    assert_no_markup("".join(b.text for b in message.content if b.type == "text"))
