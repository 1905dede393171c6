"""The request fields the coding agents send, against a real `localrt serve`, with the official
`anthropic` and `openai` packages (raw httpx where a package cannot send a field).

Models: a tiny Qwen3-format GGUF (tests/families.py) whose template renders tools and thinking, with
replies forced by a grammar so the runtime really parses thinking and tool calls; and the same
file under a template with neither, for the capability refusals.
"""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest

from localrt.api.translate import think_from_anthropic
from localrt.store.importer import import_gguf
from localrt.store.store import Store
from tests import families
from tests.servers.serve import LocalrtServer

TOOLS_MODEL, PLAIN_MODEL = "qwen3:agents", "plain:agents"
PLAIN_TEMPLATE = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:"
QWEN3 = families.FAMILIES["qwen3"]
THOUGHT = "The user wants a file read."
READ_CALL = {"name": "Read", "arguments": {"file_path": "/tmp/notes.txt"}}
REPLY = f"<think>\n{THOUGHT}\n</think>\n\n<tool_call>\n{json.dumps(READ_CALL)}\n</tool_call>"
READ_TOOL = {
    "name": "Read",
    "description": "Read a file",
    "input_schema": {
        "type": "object",
        "properties": {"file_path": {"type": "string"}},
        "required": ["file_path"],
    },
}
ASK = "Read /tmp/notes.txt"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalrtServer]:
    root = tmp_path_factory.mktemp("agents-fields")
    gguf = QWEN3.write(root / "qwen3.gguf")
    store = Store(root / "models")
    import_gguf(store, TOOLS_MODEL, gguf)
    import_gguf(store, PLAIN_MODEL, gguf, template=PLAIN_TEMPLATE)
    srv = LocalrtServer(root / "models", root / "serve.log", env={"LOCALRT_KEEP_ALIVE": "10m"})
    yield srv
    assert srv.stop() in (0, -signal.SIGTERM)
    log = srv.log_path.read_text(errors="replace")
    assert "Traceback" not in log, log[-4000:]


@pytest.fixture(scope="module")
def claude(server: LocalrtServer) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def oai(server: LocalrtServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def forced(text: str) -> dict[str, Any]:
    return {"temperature": 0, "num_thread": 1, "grammar": families.forced(text, QWEN3)}


# ---- Anthropic Messages as Claude Code sends it -------------------------------------------------------
CLAUDE_CODE_FIELDS: dict[str, Any] = {
    "system": [
        {"type": "text", "text": "You are a coding agent."},
        {"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}},
    ],
    "thinking": {"type": "adaptive"},
    "output_config": {"effort": "high"},
    "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
    "metadata": {"user_id": "someone"},
}


def test_claude_code_request_is_answered_with_thinking_and_a_tool_call(claude: anthropic.Anthropic) -> None:
    m = claude.beta.messages.create(
        model=TOOLS_MODEL,
        max_tokens=256,
        betas=["claude-code-20250219", "interleaved-thinking-2025-05-14", "context-management-2025-06-27"],
        messages=[
            {"role": "user", "content": ASK},
            {"role": "system", "content": [{"type": "text", "text": "<system-reminder>x</system-reminder>"}]},
        ],
        tools=[READ_TOOL],
        extra_body={**CLAUDE_CODE_FIELDS, **forced(REPLY)},
    )
    assert [b.type for b in m.content] == ["thinking", "tool_use"]
    assert m.content[0].thinking == THOUGHT
    assert m.content[1].input == READ_CALL["arguments"]
    assert m.stop_reason == "tool_use"


def stream_events(server: LocalrtServer, body: dict[str, Any]) -> list[dict[str, Any]]:
    events = []
    with httpx.stream("POST", server.url + "/v1/messages?beta=true", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
    return events


def test_stream_sends_events_in_the_order_claude_code_reads_them(server: LocalrtServer) -> None:
    body = {
        "model": TOOLS_MODEL,
        "max_tokens": 256,
        "stream": True,
        "messages": [{"role": "user", "content": ASK}],
        "tools": [READ_TOOL],
        **CLAUDE_CODE_FIELDS,
        **forced(REPLY),
    }
    events = stream_events(server, body)
    kinds = [e["type"] if e["type"] != "content_block_delta" else e["delta"]["type"] for e in events]
    collapsed = [k for i, k in enumerate(kinds) if i == 0 or k != kinds[i - 1]]
    assert collapsed == [
        "message_start",
        "ping",
        "content_block_start",
        "thinking_delta",
        "signature_delta",
        "content_block_stop",
        "content_block_start",
        "input_json_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]


def test_stream_with_the_sdk_accumulates_the_same_blocks(claude: anthropic.Anthropic) -> None:
    with claude.messages.stream(
        model=TOOLS_MODEL,
        max_tokens=256,
        messages=[{"role": "user", "content": ASK}],
        tools=[READ_TOOL],
        thinking={"type": "enabled", "budget_tokens": 1024},
        extra_body=forced(REPLY),
    ) as stream:
        final = stream.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "tool_use"]


def count(claude: anthropic.Anthropic, messages: list[dict[str, Any]]) -> int:
    return claude.messages.count_tokens(model=TOOLS_MODEL, messages=messages, tools=[READ_TOOL]).input_tokens


def tool_loop(thinking_block: dict[str, Any]) -> list[dict[str, Any]]:
    """A conversation after one tool call, with the call's thinking block as the client sends it back."""
    call = {"type": "tool_use", "id": "toolu_1", "name": "Read", "input": READ_CALL["arguments"]}
    return [
        {"role": "user", "content": ASK},
        {"role": "assistant", "content": [thinking_block, call]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "hello"}]},
    ]


def test_omitted_thinking_is_restored_from_its_signature(claude: anthropic.Anthropic) -> None:
    m = claude.messages.create(
        model=TOOLS_MODEL,
        max_tokens=256,
        messages=[{"role": "user", "content": ASK}],
        tools=[READ_TOOL],
        thinking={"type": "enabled", "budget_tokens": 1024, "display": "omitted"},
        extra_body=forced(REPLY),
    )
    block = m.content[0]
    assert block.thinking == ""
    assert THOUGHT not in block.signature
    restored = count(claude, tool_loop({"type": "thinking", "thinking": "", "signature": block.signature}))
    shown = count(claude, tool_loop({"type": "thinking", "thinking": THOUGHT, "signature": ""}))
    assert restored == shown


def test_a_forged_signature_restores_nothing(claude: anthropic.Anthropic) -> None:
    forged = count(
        claude,
        tool_loop({"type": "thinking", "thinking": "", "signature": "lrt1.AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA"}),
    )
    none = count(claude, tool_loop({"type": "thinking", "thinking": "", "signature": ""}))
    assert forged == none


def test_clear_thinking_drops_old_thinking_from_the_prompt(server: LocalrtServer) -> None:
    history = [
        {"role": "user", "content": "First question"},
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "Old thought here.", "signature": ""},
                {"type": "text", "text": "One."},
            ],
        },
        {"role": "user", "content": "Second question"},
    ]

    def counted(edits: list[dict[str, Any]]) -> int:
        body = {"model": TOOLS_MODEL, "messages": history, "context_management": {"edits": edits}}
        r = httpx.post(server.url + "/v1/messages/count_tokens", json=body, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["input_tokens"]

    # the template shows thinking of turns after the last user message only, so check via the answer
    body = {
        "model": TOOLS_MODEL,
        "max_tokens": 4,
        "messages": history,
        "context_management": {
            "edits": [{"type": "clear_thinking_20251015", "keep": {"type": "thinking_turns", "value": 0}}]
        },
        **forced("Two."),
    }
    r = httpx.post(server.url + "/v1/messages", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["context_management"]["applied_edits"][0]["cleared_thinking_turns"] == 1
    assert counted([{"type": "clear_thinking_20251015", "keep": "all"}]) >= counted([])


def test_clear_tool_uses_with_a_token_trigger_is_reported_not_applied(server: LocalrtServer) -> None:
    body = {
        "model": TOOLS_MODEL,
        "max_tokens": 4,
        "messages": [{"role": "user", "content": "Hi"}],
        "context_management": {"edits": [{"type": "clear_tool_uses_20250919"}]},
        **forced("Hello."),
    }
    r = httpx.post(server.url + "/v1/messages", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert "clear_tool_uses_20250919" in r.headers["x-localrt-warning"]


def test_prompt_too_long_is_worded_as_anthropic_words_it(claude: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.BadRequestError) as caught:
        claude.messages.create(
            model=TOOLS_MODEL,
            max_tokens=4,
            messages=[{"role": "user", "content": "word " * 400}],
            extra_body={"options": {"num_ctx": 256}},
        )
    assert "prompt is too long: " in caught.value.message
    assert "tokens > 256 maximum" in caught.value.message


# ---- OpenAI Responses as Codex sends it ---------------------------------------------------------------
NAMESPACE = {
    "type": "namespace",
    "name": "multi_agent_v1",
    "description": "Agents",
    "tools": [
        {
            "type": "function",
            "name": "spawn_agent",
            "description": "Start an agent",
            "parameters": {
                "type": "object",
                "properties": {"task": {"type": "string"}},
                "required": ["task"],
            },
        }
    ],
}
SPAWN = {"name": "multi_agent_v1.spawn_agent", "arguments": {"task": "lint"}}
CODEX_FIELDS: dict[str, Any] = {
    "store": False,
    "include": ["reasoning.encrypted_content"],
    "prompt_cache_key": "session-1",
    "client_metadata": {"thread_id": "t1"},
    "truncation": "auto",
}


def codex_request(oai: openai.OpenAI, reply: str, **extra: Any) -> Any:
    return oai.responses.with_raw_response.create(
        model=TOOLS_MODEL,
        input=[
            {
                "type": "message",
                "role": "developer",
                "content": [{"type": "input_text", "text": "Be brief."}],
            },
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Lint it"}]},
        ],
        tools=[NAMESPACE, {"type": "web_search", "external_web_access": False}],
        reasoning={"summary": "auto", "effort": "high"},
        parallel_tool_calls=True,
        extra_body={**CODEX_FIELDS, **forced(reply)},
        **extra,
    )


CODEX_REPLY = f"<think>\nLint needs an agent.\n</think>\n\n<tool_call>\n{json.dumps(SPAWN)}\n</tool_call>"


def test_codex_namespace_call_comes_back_named_by_its_namespace(oai: openai.OpenAI) -> None:
    r = codex_request(oai, CODEX_REPLY).parse()
    call = next(item for item in r.output if item.type == "function_call")
    assert (getattr(call, "namespace", None) or call.model_extra.get("namespace"), call.name) == (
        "multi_agent_v1",
        "spawn_agent",
    )


def test_hosted_tools_are_named_in_a_warning(oai: openai.OpenAI) -> None:
    raw = codex_request(oai, CODEX_REPLY)
    assert "web_search" in raw.headers["x-localrt-warning"]


def test_a_tool_choice_that_demands_a_hosted_tool_is_a_400(server: LocalrtServer) -> None:
    body = {
        "model": TOOLS_MODEL,
        "input": "Search",
        "tools": [{"type": "web_search"}],
        "tool_choice": {"type": "web_search"},
    }
    r = httpx.post(server.url + "/v1/responses", json=body, timeout=60)
    assert r.status_code == 400
    assert "web_search" in r.json()["error"]["message"]


def test_reasoning_summary_and_sealed_reasoning(oai: openai.OpenAI) -> None:
    r = codex_request(oai, CODEX_REPLY).parse()
    reasoning = r.output[0]
    assert reasoning.summary[0].text == "Lint needs an agent."
    assert "Lint needs" not in reasoning.encrypted_content


def input_tokens(server: LocalrtServer, reasoning_item: dict[str, Any]) -> int:
    body = {
        "model": TOOLS_MODEL,
        "tools": [NAMESPACE],
        "input": [
            {"type": "message", "role": "user", "content": "Lint it"},
            reasoning_item,
            {
                "type": "function_call",
                "call_id": "c1",
                "name": "spawn_agent",
                "namespace": "multi_agent_v1",
                "arguments": '{"task": "lint"}',
            },
            {"type": "function_call_output", "call_id": "c1", "output": "done"},
        ],
    }
    r = httpx.post(server.url + "/v1/responses/input_tokens", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["input_tokens"]


def test_encrypted_reasoning_is_restored_for_a_stateless_client(
    server: LocalrtServer, oai: openai.OpenAI
) -> None:
    sealed = codex_request(oai, CODEX_REPLY).parse().output[0].encrypted_content
    restored = input_tokens(server, {"type": "reasoning", "summary": [], "encrypted_content": sealed})
    shown = input_tokens(
        server,
        {
            "type": "reasoning",
            "summary": [],
            "content": [{"type": "reasoning_text", "text": "Lint needs an agent."}],
        },
    )
    assert restored == shown


def test_forged_encrypted_reasoning_is_ignored_with_a_warning(server: LocalrtServer) -> None:
    body = {
        "model": TOOLS_MODEL,
        "max_output_tokens": 4,
        "input": [
            {"type": "message", "role": "user", "content": "Hi"},
            {"type": "reasoning", "summary": [], "encrypted_content": "lrt1.forged-by-the-client"},
            {"type": "message", "role": "assistant", "content": "Hello"},
            {"type": "message", "role": "user", "content": "Again"},
        ],
        **forced("Hi."),
    }
    r = httpx.post(server.url + "/v1/responses", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert "encrypted_content" in r.headers["x-localrt-warning"]


def test_second_turn_reports_the_cached_prefix(claude: anthropic.Anthropic, oai: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Tell me about the weather in Paris today. " * 20}]
    claude.messages.create(model=TOOLS_MODEL, max_tokens=2, messages=messages, extra_body=forced("Ok"))
    again = claude.messages.create(
        model=TOOLS_MODEL, max_tokens=2, messages=messages, extra_body=forced("Ok")
    )
    assert again.usage.cache_read_input_tokens > 0
    ask = "Tell me about the weather in Rome today. " * 20
    oai.responses.create(model=TOOLS_MODEL, input=ask, max_output_tokens=16, extra_body=forced("Ok"))
    second = oai.responses.create(model=TOOLS_MODEL, input=ask, max_output_tokens=16, extra_body=forced("Ok"))
    assert second.usage.input_tokens_details.cached_tokens > 0


# ---- capabilities ---------------------------------------------------------------------------------------
FUNCTION = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
TOOL_ROUTES = {
    "/api/chat": {"messages": [{"role": "user", "content": "Hi"}], "tools": [FUNCTION], "stream": False},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "Hi"}], "tools": [FUNCTION]},
    "/v1/messages": {"max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}], "tools": [READ_TOOL]},
    "/v1/messages/count_tokens": {"messages": [{"role": "user", "content": "Hi"}], "tools": [READ_TOOL]},
    "/v1/responses": {"input": "Hi", "tools": [{"type": "function", "name": "f", "parameters": {}}]},
}


def error_message(r: httpx.Response) -> str:
    """The message of an error in Ollama's, OpenAI's or Anthropic's shape."""
    error = r.json()["error"]
    return error if isinstance(error, str) else error["message"]


@pytest.mark.parametrize("path", sorted(TOOL_ROUTES))
def test_tools_for_a_model_without_tool_support_are_a_400(server: LocalrtServer, path: str) -> None:
    r = httpx.post(server.url + path, json={"model": PLAIN_MODEL, **TOOL_ROUTES[path]}, timeout=60)
    assert r.status_code == 400
    assert error_message(r) == f'"{PLAIN_MODEL}" does not support tools'


def test_thinking_for_a_model_without_it_is_a_400(server: LocalrtServer) -> None:
    body = {
        "model": PLAIN_MODEL,
        "messages": [{"role": "user", "content": "Hi"}],
        "think": True,
        "stream": False,
    }
    r = httpx.post(server.url + "/api/chat", json=body, timeout=60)
    assert r.status_code == 400
    assert "does not support thinking" in r.text


def test_truncation_disabled_refuses_what_auto_cuts(oai: openai.OpenAI) -> None:
    history = [
        {"type": "message", "role": "user", "content": "word " * 300},
        {"type": "message", "role": "assistant", "content": "Ok."},
        {"type": "message", "role": "user", "content": "Hi"},
    ]
    kwargs = {"model": TOOLS_MODEL, "input": history, "max_output_tokens": 4}
    cut = oai.responses.create(
        **kwargs, extra_body={"truncation": "auto", "options": {"num_ctx": 256}, **forced("Hi.")}
    )
    assert cut.status == "completed"
    with pytest.raises(openai.BadRequestError):
        oai.responses.create(**kwargs, extra_body={"truncation": "disabled", "options": {"num_ctx": 256}})


@pytest.mark.parametrize(
    ("thinking", "effort", "think"),
    [
        ({"type": "adaptive"}, "xhigh", "high"),
        ({"type": "adaptive"}, "max", "high"),
        ({"type": "adaptive"}, None, None),
        ({"type": "enabled", "budget_tokens": 2048}, None, True),
        ({"type": "disabled"}, "high", False),
    ],
)
def test_anthropic_effort_maps_to_think_levels_as_ollama_maps_them(
    thinking: dict[str, Any], effort: str | None, think: Any
) -> None:
    assert think_from_anthropic(thinking, effort) == think
