"""The translation layer on its own (localrt/api/translate.py): runtime chunks -> content blocks ->
each protocol's events, and protocol requests -> the runtime's chat request.

The chunks here are the runtime's own `Chunk` values, shaped as a thinking model streams them
(thinking pieces, then content, then a tool call in the final chunk); the server tests in
tests/test_api_agents.py drive the same code with a real model that does not think.
"""

from __future__ import annotations

import json

import pytest

from localrt.api import anthropic
from localrt.api import responses
from localrt.api.translate import Assembler
from localrt.api.translate import ParamError
from localrt.api.translate import budget_from_anthropic
from localrt.api.translate import call_schema
from localrt.api.translate import constrain_tools
from localrt.api.translate import effort_setting
from localrt.api.translate import function_tool
from localrt.api.translate import think_from_anthropic
from localrt.runtime.answers import Chunk
from localrt.runtime.answers import Metrics

WEATHER = function_tool(
    "get_weather", "weather", {"type": "object", "properties": {"city": {"type": "string"}}}, "tools"
)


def thinking_stream() -> list[Chunk]:
    return [
        Chunk(model="m", thinking="Let me"),
        Chunk(model="m", thinking=" think."),
        Chunk(model="m", content="Calling"),
        Chunk(model="m", content=" now."),
        Chunk(
            model="m",
            done=True,
            done_reason="stop",
            tool_calls=[{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
            metrics=Metrics(prompt_eval_count=4, prompt_tokens=10, eval_count=9),
        ),
    ]


def test_assembler_blocks_in_order() -> None:
    answer = Assembler()
    events = [ev for chunk in thinking_stream() for ev in answer.feed(chunk)]
    assert [b.kind for b in answer.blocks] == ["thinking", "text", "tool_call"]
    assert answer.thinking == "Let me think."
    assert answer.text == "Calling now."
    assert answer.calls[0]["name"] == "get_weather"
    assert answer.calls[0]["arguments"] == {"city": "Paris"}
    assert answer.ending == "tool_calls"
    assert (answer.input_tokens, answer.cached_tokens, answer.output_tokens) == (10, 6, 9)
    # every block is started, then extended, then stopped, before the next one starts
    opened: list[int] = []
    for ev in events:
        if ev.kind == "start":
            assert not opened
            opened.append(ev.block.index)
        elif ev.kind == "delta":
            assert opened == [ev.block.index]
        else:
            assert opened.pop() == ev.block.index
    assert not opened


def test_not_streamed_gives_the_same_blocks() -> None:
    whole = Assembler()
    whole.feed(
        Chunk(
            model="m",
            thinking="Let me think.",
            content="Calling now.",
            done=True,
            done_reason="stop",
            tool_calls=[{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
        )
    )
    assert [b.kind for b in whole.blocks] == ["thinking", "text", "tool_call"]
    assert whole.history_message()["thinking"] == "Let me think."
    assert whole.history_message()["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}


def test_anthropic_stream_of_a_thinking_answer() -> None:
    answer = Assembler()
    events = [
        e for chunk in thinking_stream() for ev in answer.feed(chunk) for e in anthropic.stream_events(ev)
    ]
    starts = [e for e in events if e["type"] == "content_block_start"]
    assert [s["index"] for s in starts] == [0, 1, 2]  # dense, in start order (the SDK indexes by it)
    assert starts[0]["content_block"] == {"type": "thinking", "thinking": "", "signature": ""}
    assert starts[2]["content_block"]["type"] == "tool_use"
    thinking = "".join(
        e["delta"]["thinking"] for e in events if e.get("delta", {}).get("type") == "thinking_delta"
    )
    assert thinking == "Let me think."
    [args] = [
        e["delta"]["partial_json"] for e in events if e.get("delta", {}).get("type") == "input_json_delta"
    ]
    assert json.loads(args) == {"city": "Paris"}
    message = anthropic.message("msg_x", "m", answer)
    assert [b["type"] for b in message["content"]] == ["thinking", "text", "tool_use"]
    assert message["stop_reason"] == "tool_use"
    assert message["usage"] == {
        "input_tokens": 4,
        "cache_read_input_tokens": 6,
        "cache_creation_input_tokens": 0,
        "output_tokens": 9,
    }


def test_responses_stream_of_a_thinking_answer() -> None:
    envelope = responses.Envelope("resp_x", 0, {"model": "m"})
    writer = responses.EventWriter(envelope)
    answer = Assembler()
    events = writer.opening() + [
        e for chunk in thinking_stream() for ev in answer.feed(chunk) for e in writer.block(ev)
    ]
    types = [e["type"] for e in events]
    assert types[:5] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.reasoning_text.delta",
    ]
    assert "response.reasoning_text.done" in types
    assert types.index("response.reasoning_text.done") < types.index("response.output_text.delta")
    assert types[-3:] == [
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
    ]
    added = [e for e in events if e["type"] == "response.output_item.added"]
    done = [e for e in events if e["type"] == "response.output_item.done"]
    assert [e["item"]["id"] for e in added] == [e["item"]["id"] for e in done]  # one identity per item
    assert [e["output_index"] for e in added] == [0, 1, 2]
    final = responses.finished(envelope, answer)
    assert [i["type"] for i in final["output"]] == ["reasoning", "message", "function_call"]
    assert final["output"][0]["content"] == [{"type": "reasoning_text", "text": "Let me think."}]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))


def test_response_store_is_bounded_lru() -> None:
    kept = responses.ResponseStore(limit=2)
    for name in ("a", "b"):
        kept.put(name, responses.Stored({}, []))
    assert kept.get("a") is not None  # a is now the most recent
    kept.put("c", responses.Stored({}, []))
    assert kept.get("b") is None
    assert len(kept) == 2


def test_one_effort_mapping_for_every_route() -> None:
    # /v1/chat/completions reads reasoning_effort with the runtime's mapping; Responses and Anthropic go
    # through translate.effort_setting, which must say the same for every effort
    from localrt.runtime.thinking import EFFORTS
    from localrt.runtime.thinking import think_from_effort as runtime_mapping

    for effort in EFFORTS:
        wanted = runtime_mapping(effort)
        assert effort_setting(effort, "p") == (wanted.level if wanted.enabled else False), effort


def test_thinking_mappings() -> None:
    assert effort_setting(None, "p") is None
    assert effort_setting("none", "p") is False
    assert effort_setting("minimal", "p") == "low"
    assert effort_setting("medium", "p") == "medium"
    assert effort_setting("xhigh", "p") == "high"
    with pytest.raises(ParamError):
        effort_setting("enormous", "p")
    assert think_from_anthropic({"type": "enabled", "budget_tokens": 2048}, None) is True
    assert think_from_anthropic({"type": "enabled", "budget_tokens": 2048}, "low") == "low"
    assert think_from_anthropic({"type": "disabled"}, None) is False
    assert think_from_anthropic(None, "max") == "high"
    with pytest.raises(ParamError):
        think_from_anthropic({"type": "sometimes"}, None)


def test_budget_tokens() -> None:
    assert budget_from_anthropic({"type": "enabled", "budget_tokens": 2048}) == 2048
    assert budget_from_anthropic({"type": "enabled"}) is None
    assert budget_from_anthropic({"type": "disabled", "budget_tokens": 2048}) is None
    with pytest.raises(ParamError, match="budget_tokens"):
        budget_from_anthropic({"type": "enabled", "budget_tokens": 0})


def test_stop_sequence_reaches_anthropic_only_when_one_matched() -> None:
    by_stop = Assembler()
    by_stop.feed(Chunk(model="m", content="1, 2, 3, 4, "))
    by_stop.feed(Chunk(model="m", done=True, done_reason="stop", stop_sequence="5", metrics=Metrics()))
    message = anthropic.message("msg_1", "m", by_stop)
    assert message["stop_reason"] == "stop_sequence"
    assert message["stop_sequence"] == "5"
    by_end = Assembler()
    by_end.feed(Chunk(model="m", content="Hi.", done=True, done_reason="stop", metrics=Metrics()))
    assert anthropic.message("msg_2", "m", by_end)["stop_reason"] == "end_turn"
    assert anthropic.message("msg_2", "m", by_end)["stop_sequence"] is None


def test_tool_choice() -> None:
    assert constrain_tools([WEATHER], "none", None, "p") == (None, None)
    assert constrain_tools([WEATHER], "auto", "json", "p") == ([WEATHER], "json")
    tools, fmt = constrain_tools([WEATHER], "get_weather", None, "p")
    assert fmt == call_schema([WEATHER])
    assert fmt["properties"]["name"]["enum"] == ["get_weather"]
    other = function_tool("get_time", None, None, "tools")
    assert "anyOf" in constrain_tools([WEATHER, other], "required", None, "p")[1]
    with pytest.raises(ParamError, match="no tool named"):
        constrain_tools([WEATHER], "get_time", None, "p")
    with pytest.raises(ParamError, match="response format"):
        constrain_tools([WEATHER], "required", {"type": "object"}, "p")
    with pytest.raises(ParamError, match="no tools"):
        constrain_tools(None, "required", None, "p")


def test_anthropic_history_translation() -> None:
    f = {
        "system": [{"type": "text", "text": "Be brief."}],
        "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "Use the tool.", "signature": ""},
                    {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_1",
                        "content": [{"type": "text", "text": "21C"}],
                    },
                    {"type": "text", "text": "Thanks. And tomorrow?"},
                ],
            },
        ],
    }
    messages = anthropic.messages_from(f)
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "user"]
    assert messages[2]["thinking"] == "Use the tool."
    assert messages[2]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": {"city": "Paris"}}
    assert messages[3] == {
        "role": "tool",
        "content": "21C",
        "tool_call_id": "toolu_1",
        "tool_name": "get_weather",
    }


def test_responses_history_translation() -> None:
    items = [
        {"role": "developer", "content": "Be brief."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
        {
            "type": "reasoning",
            "id": "rs_1",
            "summary": [],
            "content": [{"type": "reasoning_text", "text": "Tool."}],
        },
        {
            "type": "function_call",
            "call_id": "call_1",
            "name": "get_weather",
            "arguments": '{"city": "Paris"}',
        },
        {"type": "function_call_output", "call_id": "call_1", "output": "21C"},
    ]
    messages = responses.input_messages({"input": items}, [])
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool"]
    assert messages[2]["thinking"] == "Tool."
    assert messages[2]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert messages[3]["tool_name"] == "get_weather"
    with pytest.raises(ParamError, match="unknown input item type"):
        responses.input_messages({"input": [{"type": "web_search_call"}]}, [])


def test_continuation_leaves_the_stored_history_alone() -> None:
    stored = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "", "tool_calls": []}]
    call = {"type": "function_call", "call_id": "call_2", "name": "f", "arguments": "{}"}
    messages = responses.input_messages({"input": [call]}, stored)
    assert len(messages[-1]["tool_calls"]) == 1  # the call joined the stored assistant turn ...
    assert stored[-1]["tool_calls"] == []  # ... in a copy
