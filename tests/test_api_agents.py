"""The APIs coding agents speak, against a real `localrt serve` on 127.0.0.1 with the real SmolLM2:
OpenAI's Responses API through the official `openai` package, Anthropic's Messages API through the
official `anthropic` package. Greedy decoding; assertions check properties, not exact texts.

Tool calls are forced with tool_choice (a named tool), which the translation layer enforces by
grammar, so SmolLM2 really emits a call and the whole round trip runs.
"""

from __future__ import annotations

import base64
import json
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import jsonschema
import openai
import pytest

from localrt.api.anthropic import CLIENT_TOOLS
from localrt.api.anthropic import COMPUTER_TOOLS
from localrt.api.anthropic import computer_tool
from localrt.store.catalog import load_catalog
from localrt.store.importer import import_gguf
from localrt.store.store import Store
from tests.agent_templates import official_template
from tests.fixtures_vision import png_bytes
from tests.servers.serve import LocalrtServer

MODEL = "smollm2:135m"
GREEDY = {"temperature": 0, "num_ctx": 2048}  # extra_body: localrt's options at top level
CITY_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
    "required": ["city", "country"],
}
WEATHER_PARAMS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
RESPONSES_TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "Get the current weather for a city",
    "parameters": WEATHER_PARAMS,
}
ANTHROPIC_TOOL = {
    "name": "get_weather",
    "description": "Get the current weather for a city",
    "input_schema": WEATHER_PARAMS,
}
QUESTION = "What is the capital of France?"
PNG = base64.b64encode(png_bytes(0)).decode()  # a real image: SmolLM2 has no vision, which the runtime says


@pytest.fixture(scope="module")
def server(smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalrtServer]:
    root = tmp_path_factory.mktemp("api-agents")
    # SmolLM2's own template shows no tools, so the official Qwen2.5 one (ChatML, as SmolLM2's) is given:
    # a model must support tools to be sent them
    template = official_template("Qwen-Qwen2.5-7B-Instruct.jinja")
    import_gguf(
        Store(root / "models"),
        MODEL,
        smollm2_gguf,
        system=load_catalog().find(MODEL).system,
        template=template,
    )
    srv = LocalrtServer(root / "models", root / "serve.log", env={"LOCALRT_KEEP_ALIVE": "10m"})
    yield srv
    assert srv.stop() in (0, -signal.SIGTERM)
    log = srv.log_path.read_text(errors="replace")
    assert "Traceback" not in log, log[-4000:]


@pytest.fixture(scope="module")
def oai(server: LocalrtServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def claude(server: LocalrtServer) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)


def sse(server: LocalrtServer, path: str, body: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(event name, data) pairs of a raw SSE answer."""
    events, name = [], None
    with httpx.stream("POST", server.url + path, json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line.removeprefix("event: ")
            elif line.startswith("data: "):
                events.append((name, json.loads(line.removeprefix("data: "))))
    return events


# ---- OpenAI Responses ---------------------------------------------------------------------------
def test_responses_text(oai: openai.OpenAI) -> None:
    r = oai.responses.create(model=MODEL, input=QUESTION, max_output_tokens=48, extra_body=GREEDY)
    assert r.id.startswith("resp_")
    assert r.object == "response"
    assert "Paris" in r.output_text
    assert [item.type for item in r.output] == ["message"]
    assert r.status == ("incomplete" if r.incomplete_details else "completed")
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.usage.output_tokens > 0


def test_responses_instructions_reach_the_prompt(oai: openai.OpenAI) -> None:
    plain = oai.responses.create(model=MODEL, input="Hi", max_output_tokens=1, extra_body=GREEDY)
    told = oai.responses.create(
        model=MODEL,
        input="Hi",
        instructions="You are a pirate. Answer like one.",
        max_output_tokens=1,
        extra_body=GREEDY,
    )
    assert told.instructions == "You are a pirate. Answer like one."
    assert told.usage.input_tokens != plain.usage.input_tokens  # the model's own system prompt was replaced


def test_responses_stream_events_in_order(oai: openai.OpenAI) -> None:
    events = list(
        oai.responses.create(
            model=MODEL, input=QUESTION, max_output_tokens=48, stream=True, extra_body=GREEDY
        )
    )
    types = [e.type for e in events]
    assert types[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert types[-4:-1] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) > 2
    assert set(types[4 : 4 + len(deltas)]) == {"response.output_text.delta"}
    final = events[-1]
    assert final.type == f"response.{final.response.status}"
    assert "".join(d.delta for d in deltas) == final.response.output_text
    assert events[-2].item.content[0].text == final.response.output_text
    assert {e.response.id for e in events if hasattr(e, "response")} == {final.response.id}


def test_responses_stream_helper(oai: openai.OpenAI) -> None:
    with oai.responses.stream(
        model=MODEL, input="Say hello.", max_output_tokens=200, extra_body=GREEDY
    ) as stream:
        text = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert final.status == "completed"
    assert text
    assert final.output_text == text


def test_responses_json_schema(oai: openai.OpenAI) -> None:
    r = oai.responses.create(
        model=MODEL,
        input="Where is the Eiffel Tower? Answer in JSON.",
        text={"format": {"type": "json_schema", "name": "place", "schema": CITY_SCHEMA}},
        max_output_tokens=64,
        extra_body=GREEDY,
    )
    jsonschema.validate(json.loads(r.output_text), CITY_SCHEMA)


def test_responses_function_tool_round_trip(oai: openai.OpenAI) -> None:
    question = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = oai.responses.create(
        model=MODEL,
        input=question,
        tools=[RESPONSES_TOOL],
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=64,
        extra_body=GREEDY,
    )
    [call] = [item for item in first.output if item.type == "function_call"]
    assert call.name == "get_weather"
    assert isinstance(json.loads(call.arguments)["city"], str)
    assert call.call_id.startswith("call_")
    result = {"type": "function_call_output", "call_id": call.call_id, "output": '{"temperature": "21C"}'}
    stateful = oai.responses.create(
        model=MODEL,
        previous_response_id=first.id,
        input=[result],
        tools=[RESPONSES_TOOL],
        max_output_tokens=4,
        extra_body=GREEDY,
    )
    assert stateful.previous_response_id == first.id
    assert stateful.output
    assert stateful.usage.input_tokens > first.usage.input_tokens
    # the same conversation sent whole (stateless: every output item sent back) is the same prompt
    sent_back = [item.model_dump(exclude_none=True) for item in first.output]
    stateless = oai.responses.create(
        model=MODEL,
        input=[*question, *sent_back, result],
        tools=[RESPONSES_TOOL],
        max_output_tokens=4,
        extra_body=GREEDY,
    )
    assert stateless.usage.input_tokens == stateful.usage.input_tokens


def test_responses_function_call_streamed(oai: openai.OpenAI) -> None:
    with oai.responses.stream(
        model=MODEL,
        input="What is the weather in Paris?",
        tools=[RESPONSES_TOOL],
        tool_choice="required",
        parallel_tool_calls=False,  # one call, then the grammar ends the reply (more would reach the limit)
        max_output_tokens=64,
        extra_body=GREEDY,
    ) as stream:
        events = list(stream)
        final = stream.get_final_response()
    types = [e.type for e in events]
    assert "response.function_call_arguments.delta" in types
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert done.name == "get_weather"
    [call] = [item for item in final.output if item.type == "function_call"]
    assert call.arguments == done.arguments
    assert isinstance(json.loads(call.arguments)["city"], str)


def test_responses_kept_for_retrieval_unless_store_false(oai: openai.OpenAI) -> None:
    kept = oai.responses.create(model=MODEL, input="Hi", max_output_tokens=4, extra_body=GREEDY)
    assert oai.responses.retrieve(kept.id).output_text == kept.output_text
    gone = oai.responses.create(model=MODEL, input="Hi", max_output_tokens=4, store=False, extra_body=GREEDY)
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(gone.id)
    with pytest.raises(openai.BadRequestError) as err:
        oai.responses.create(model=MODEL, input="more", previous_response_id=gone.id, extra_body=GREEDY)
    assert err.value.body["param"] == "previous_response_id"


def test_responses_input_items_input_tokens_and_delete(oai: openai.OpenAI, server: LocalrtServer) -> None:
    conversation = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": QUESTION},
    ]
    r = oai.responses.create(
        model=MODEL, input=conversation, instructions="Be brief.", max_output_tokens=2, extra_body=GREEDY
    )
    items = oai.responses.input_items.list(r.id, order="asc")
    assert [item.role for item in items.data] == ["user", "assistant", "user"]
    assert items.data[2].content[0].text == QUESTION
    assert len({item.id for item in items.data}) == 3
    # newest first by default, one per page: the client follows the cursor through all of them
    paged = list(oai.responses.input_items.list(r.id, limit=1))
    assert [item.id for item in paged] == [item.id for item in reversed(items.data)]
    # the prompt the response started from, counted before generating (as count_tokens)
    count = oai.responses.input_tokens.count(
        model=MODEL, input=conversation, instructions="Be brief.", extra_body=GREEDY
    )
    assert count.input_tokens == r.usage.input_tokens
    continued = httpx.post(
        server.url + "/v1/responses/input_tokens",
        json={"model": MODEL, "input": "And Italy?", "previous_response_id": r.id},
    )
    assert continued.json()["input_tokens"] > count.input_tokens  # the stored conversation comes first
    wrong_method = httpx.get(server.url + "/v1/responses/input_tokens")
    assert wrong_method.status_code == 405  # a route, not a response id (found by schemathesis)
    oai.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        oai.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        oai.responses.input_items.list(r.id)
    with pytest.raises(openai.BadRequestError):
        oai.responses.create(model=MODEL, input="more", previous_response_id=r.id, extra_body=GREEDY)


def test_responses_errors(oai: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError):
        oai.responses.create(model="nosuch", input="Hi")
    image = {"type": "input_image", "image_url": "data:image/png;base64," + PNG}
    with pytest.raises(openai.BadRequestError, match="does not support images"):
        oai.responses.create(model=MODEL, input=[{"role": "user", "content": [image]}])
    hosted = oai.responses.with_raw_response.create(
        model=MODEL, input="Hi", tools=[{"type": "web_search"}], max_output_tokens=2, extra_body=GREEDY
    )
    assert "web_search" in hosted.headers["x-localrt-warning"]
    with pytest.raises(openai.BadRequestError, match="reasoning"):
        oai.responses.create(model=MODEL, input="Hi", reasoning={"effort": "enormous"})  # type: ignore[typeddict-item]
    with pytest.raises(openai.BadRequestError, match="no tool named"):
        oai.responses.create(
            model=MODEL, input="Hi", tools=[RESPONSES_TOOL], tool_choice={"type": "function", "name": "other"}
        )
    # reasoning effort "none" (thinking off) is fine for a model that does not think
    r = oai.responses.create(
        model=MODEL, input="Hi", reasoning={"effort": "none"}, max_output_tokens=2, extra_body=GREEDY
    )
    assert r.output


# ---- Anthropic Messages -------------------------------------------------------------------------
def test_messages_create_and_count_tokens(claude: anthropic.Anthropic) -> None:
    messages = [{"role": "user", "content": QUESTION}]
    m = claude.messages.create(model=MODEL, max_tokens=48, messages=messages, extra_body=GREEDY)
    assert m.id.startswith("msg_")
    assert m.role == "assistant"
    assert m.model == MODEL
    assert [b.type for b in m.content] == ["text"]
    assert "Paris" in m.content[0].text
    assert m.stop_reason in ("end_turn", "max_tokens")
    assert m.usage.output_tokens > 0
    count = claude.messages.count_tokens(model=MODEL, messages=messages, extra_body=GREEDY)
    # Anthropic's input_tokens leave out what was read from the cache
    assert count.input_tokens == m.usage.input_tokens + m.usage.cache_read_input_tokens


def test_messages_system_blocks_and_string_are_one_prompt(claude: anthropic.Anthropic) -> None:
    messages = [{"role": "user", "content": "Hi"}]
    as_string = claude.messages.count_tokens(
        model=MODEL, system="You are terse. Be brief.", messages=messages, extra_body=GREEDY
    )
    as_blocks = claude.messages.count_tokens(
        model=MODEL,
        system=[{"type": "text", "text": "You are terse."}, {"type": "text", "text": "Be brief."}],
        messages=messages,
        extra_body=GREEDY,
    )
    default = claude.messages.count_tokens(model=MODEL, messages=messages, extra_body=GREEDY)
    assert abs(as_string.input_tokens - as_blocks.input_tokens) <= 1  # a space vs a newline
    assert as_string.input_tokens != default.input_tokens


def test_messages_stream_helper(claude: anthropic.Anthropic) -> None:
    with claude.messages.stream(
        model=MODEL, max_tokens=200, messages=[{"role": "user", "content": "Say hello."}], extra_body=GREEDY
    ) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text
    assert final.content[0].text == text
    assert final.stop_reason == "end_turn"
    assert final.usage.output_tokens > 0


def test_messages_raw_event_sequence(server: LocalrtServer) -> None:
    events = sse(
        server,
        "/v1/messages",
        {
            "model": MODEL,
            "max_tokens": 16,
            "stream": True,
            "messages": [{"role": "user", "content": QUESTION}],
            **GREEDY,
        },
    )
    names = [name for name, _ in events]
    assert all(name == data["type"] for name, data in events)
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) == {"content_block_delta"}
    assert events[0][1]["message"]["content"] == []
    delta = events[-2][1]
    assert delta["delta"]["stop_reason"] in ("end_turn", "max_tokens")
    assert delta["usage"]["output_tokens"] >= len(names[3:-3])  # every delta is at least one token


def test_messages_tool_use_round_trip(claude: anthropic.Anthropic) -> None:
    question = {"role": "user", "content": "What is the weather in Paris?"}
    m = claude.messages.create(
        model=MODEL,
        max_tokens=64,
        messages=[question],
        tools=[ANTHROPIC_TOOL],
        # one call, then the grammar ends the reply: calls repeated up to max_tokens would stop at the limit
        tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
        extra_body=GREEDY,
    )
    assert m.stop_reason == "tool_use"
    [use] = [b for b in m.content if b.type == "tool_use"]
    assert use.name == "get_weather"
    assert isinstance(use.input["city"], str)
    assert use.id.startswith("toolu_")
    result = {"type": "tool_result", "tool_use_id": use.id, "content": '{"temperature": "21C"}'}
    follow_messages = [
        question,
        {"role": "assistant", "content": m.content},
        {"role": "user", "content": [result]},
    ]
    follow = claude.messages.create(
        model=MODEL, max_tokens=4, messages=follow_messages, tools=[ANTHROPIC_TOOL], extra_body=GREEDY
    )
    assert follow.content
    longer = claude.messages.count_tokens(
        model=MODEL, messages=follow_messages, tools=[ANTHROPIC_TOOL], extra_body=GREEDY
    )
    shorter = claude.messages.count_tokens(
        model=MODEL, messages=[question], tools=[ANTHROPIC_TOOL], extra_body=GREEDY
    )
    assert longer.input_tokens > shorter.input_tokens  # the call and its result are in the prompt


def test_messages_tool_use_streamed(claude: anthropic.Anthropic) -> None:
    with claude.messages.stream(
        model=MODEL,
        max_tokens=64,
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=[ANTHROPIC_TOOL],
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        extra_body=GREEDY,
    ) as stream:
        events = list(stream)
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use"
    [use] = [b for b in final.content if b.type == "tool_use"]
    partial = "".join(
        e.delta.partial_json
        for e in events
        if e.type == "content_block_delta" and e.delta.type == "input_json_delta"
    )
    assert json.loads(partial) == use.input
    assert isinstance(use.input["city"], str)


@pytest.mark.parametrize(
    "kind,name", [("bash_20250124", "bash"), ("text_editor_20250728", "str_replace_based_edit_tool")]
)
def test_messages_client_tool_call_fits_its_input_shape(
    claude: anthropic.Anthropic, kind: str, name: str
) -> None:
    """Anthropic's client tools come without a schema; the model is shown the input shape the API
    defines for them, so a forced call is one the agent's own tool runner can execute."""
    m = claude.messages.create(
        model=MODEL,
        max_tokens=96,
        messages=[{"role": "user", "content": "List the files in /tmp."}],
        tools=[{"type": kind, "name": name}],
        tool_choice={"type": "tool", "name": name},
        extra_body=GREEDY,
    )
    [use] = [b for b in m.content if b.type == "tool_use"]
    jsonschema.validate(use.input, CLIENT_TOOLS[kind][2])


def test_messages_client_tool_is_in_the_prompt(claude: anthropic.Anthropic) -> None:
    messages = [{"role": "user", "content": "List the files in /tmp."}]
    bare = claude.messages.count_tokens(model=MODEL, messages=messages, extra_body=GREEDY)
    with_bash = claude.messages.count_tokens(
        model=MODEL, messages=messages, tools=[{"type": "bash_20250124", "name": "bash"}], extra_body=GREEDY
    )
    assert with_bash.input_tokens > bare.input_tokens


def test_messages_client_tool_under_another_name_is_refused(claude: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.BadRequestError, match="must be named 'bash'"):
        claude.messages.create(
            model=MODEL,
            max_tokens=4,
            messages=[{"role": "user", "content": "Hi"}],
            tools=[{"type": "bash_20250124", "name": "shell"}],
        )


@pytest.mark.parametrize("kind", sorted(COMPUTER_TOOLS))
def test_messages_computer_tool_call_fits_its_input_shape(claude: anthropic.Anthropic, kind: str) -> None:
    """The computer-use tool is a client tool too: the agent takes the screenshots and runs the clicks."""
    tool = {"type": kind, "name": "computer", "display_width_px": 1024, "display_height_px": 768}
    m = claude.messages.create(
        model=MODEL,
        max_tokens=96,
        messages=[{"role": "user", "content": "Take a screenshot."}],
        tools=[tool],
        tool_choice={"type": "tool", "name": "computer", "disable_parallel_tool_use": True},
        extra_body=GREEDY,
    )
    [use] = [b for b in m.content if b.type == "tool_use"]
    jsonschema.validate(use.input, computer_tool(kind, tool)["function"]["parameters"])


def test_messages_computer_tool_needs_the_screen_size(claude: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.BadRequestError, match="display_width_px"):
        claude.messages.create(
            model=MODEL,
            max_tokens=4,
            messages=[{"role": "user", "content": "Hi"}],
            tools=[{"type": "computer_20250124", "name": "computer"}],
        )


SEARCH_TOOL = {
    "name": "ToolSearch",
    "input_schema": {"type": "object", "properties": {"query": {"type": "string"}}},
}
DEFERRED_TOOL = {**ANTHROPIC_TOOL, "defer_loading": True}


def searched(reference: str) -> list[dict[str, Any]]:
    """A conversation in which the agent's own tool search answered with a reference to a deferred tool."""
    found = [{"type": "tool_reference", "tool_name": reference}]
    return [
        {"role": "user", "content": "What is the weather in Paris?"},
        {
            "role": "assistant",
            "content": [
                {"type": "tool_use", "id": "toolu_1", "name": "ToolSearch", "input": {"query": "weather"}}
            ],
        },
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": "toolu_1",
                    "content": found,
                }
            ],
        },
    ]


def test_messages_deferred_tool_is_not_in_the_prompt(claude: anthropic.Anthropic) -> None:
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    shown = claude.messages.count_tokens(
        model=MODEL, messages=messages, tools=[SEARCH_TOOL], extra_body=GREEDY
    )
    deferred = claude.messages.count_tokens(
        model=MODEL, messages=messages, tools=[SEARCH_TOOL, DEFERRED_TOOL], extra_body=GREEDY
    )
    assert deferred.input_tokens == shown.input_tokens


def test_messages_deferred_tool_referenced_by_a_tool_result_is_shown_as_any_tool(
    claude: anthropic.Anthropic,
) -> None:
    messages = searched("get_weather")
    shown = claude.messages.count_tokens(
        model=MODEL, messages=messages, tools=[SEARCH_TOOL, ANTHROPIC_TOOL], extra_body=GREEDY
    )
    revealed = claude.messages.count_tokens(
        model=MODEL, messages=messages, tools=[SEARCH_TOOL, DEFERRED_TOOL], extra_body=GREEDY
    )
    assert revealed.input_tokens == shown.input_tokens


def test_messages_deferred_tool_is_callable_once_referenced(claude: anthropic.Anthropic) -> None:
    m = claude.messages.create(
        model=MODEL,
        max_tokens=64,
        messages=searched("get_weather"),
        tools=[SEARCH_TOOL, DEFERRED_TOOL],
        tool_choice={"type": "tool", "name": "get_weather"},
        extra_body=GREEDY,
    )
    assert [b.name for b in m.content if b.type == "tool_use"] == ["get_weather"]


def test_messages_deferred_tool_is_not_callable_before_it_is_referenced(claude: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.BadRequestError, match="get_weather"):
        claude.messages.create(
            model=MODEL,
            max_tokens=16,
            messages=[{"role": "user", "content": "What is the weather in Paris?"}],
            tools=[SEARCH_TOOL, DEFERRED_TOOL],
            tool_choice={"type": "tool", "name": "get_weather"},
            extra_body=GREEDY,
        )


def test_messages_tool_reference_to_an_unknown_tool_is_refused(claude: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.BadRequestError, match="'get_time', which is not among the tools"):
        claude.messages.create(
            model=MODEL, max_tokens=4, messages=searched("get_time"), tools=[SEARCH_TOOL, DEFERRED_TOOL]
        )


def test_messages_screenshot_in_a_tool_result_reaches_the_runtime(claude: anthropic.Anthropic) -> None:
    """A computer tool's screenshot is an image of the tool's turn: SmolLM2 cannot see, which it says."""
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG}}
    messages = searched("get_weather")[:2] + [
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": [image]}]}
    ]
    with pytest.raises(anthropic.BadRequestError, match="does not support images"):
        claude.messages.create(model=MODEL, max_tokens=4, messages=messages, tools=[SEARCH_TOOL])


WEB_SEARCH = {"type": "web_search_20250305", "name": "web_search"}


def test_messages_server_tool_is_left_out_with_a_warning(claude: anthropic.Anthropic) -> None:
    """Anthropic's server tools run on its side: the request is answered, the tool is not offered to the
    model, and the warning header names it."""
    raw = claude.messages.with_raw_response.create(
        model=MODEL,
        max_tokens=2,
        messages=[{"role": "user", "content": "Hi"}],
        tools=[ANTHROPIC_TOOL, WEB_SEARCH],
        extra_body=GREEDY,
    )
    assert "web_search" in raw.headers["x-localrt-warning"]


def test_messages_server_tool_is_not_in_the_prompt(claude: anthropic.Anthropic) -> None:
    messages = [{"role": "user", "content": "Hi"}]
    alone = claude.messages.count_tokens(
        model=MODEL, messages=messages, tools=[ANTHROPIC_TOOL], extra_body=GREEDY
    )
    with_server = claude.messages.count_tokens(
        model=MODEL, messages=messages, tools=[ANTHROPIC_TOOL, WEB_SEARCH], extra_body=GREEDY
    )
    assert with_server.input_tokens == alone.input_tokens


def test_messages_server_tool_demanded_by_tool_choice_is_refused(claude: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.BadRequestError, match="server tool 'web_search' cannot run here"):
        claude.messages.create(
            model=MODEL,
            max_tokens=2,
            messages=[{"role": "user", "content": "Hi"}],
            tools=[ANTHROPIC_TOOL, WEB_SEARCH],
            tool_choice={"type": "tool", "name": "web_search"},
        )


def test_messages_stop_sequences_and_options(claude: anthropic.Anthropic) -> None:
    m = claude.messages.create(
        model=MODEL,
        max_tokens=48,
        messages=[{"role": "user", "content": "Count from 1 to 10, separated by commas."}],
        stop_sequences=["never", "5"],
        extra_body=GREEDY,
    )
    assert "5" not in m.content[0].text
    assert m.stop_reason == "stop_sequence"
    assert m.stop_sequence == "5"
    with claude.messages.stream(
        model=MODEL,
        max_tokens=48,
        messages=[{"role": "user", "content": "Count from 1 to 10, separated by commas."}],
        stop_sequences=["5"],
        extra_body=GREEDY,
    ) as stream:
        streamed = stream.get_final_message()
    assert streamed.stop_reason == "stop_sequence"
    assert streamed.stop_sequence == "5"
    # thinking asked of a model that cannot think is answered without it (as Claude Code needs)
    thought = claude.messages.create(
        model=MODEL,
        max_tokens=2048,
        thinking={"type": "enabled", "budget_tokens": 1024},
        messages=[{"role": "user", "content": "Hi"}],
        extra_body={**GREEDY, "options": {"num_predict": 4}},
    )
    assert [b.type for b in thought.content] == ["text"]


def test_messages_errors_have_anthropic_shape(claude: anthropic.Anthropic, server: LocalrtServer) -> None:
    with pytest.raises(anthropic.NotFoundError) as err:
        claude.messages.create(model="nosuch", max_tokens=4, messages=[{"role": "user", "content": "Hi"}])
    assert err.value.body == {
        "type": "error",
        "error": {
            "type": "not_found_error",
            "message": "model 'nosuch:latest' not found, try pulling it first",
        },
    }
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG}}
    with pytest.raises(anthropic.BadRequestError, match="does not support images"):
        claude.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": [image]}])
    r = httpx.post(
        server.url + "/v1/messages", json={"model": MODEL, "messages": [{"role": "user", "content": "x"}]}
    )
    assert r.status_code == 400
    assert r.json()["type"] == "error"
    assert r.json()["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in r.json()["error"]["message"]
    r = httpx.post(server.url + "/v1/messages", content=b"{not json")
    assert r.status_code == 400
    assert r.json()["error"]["message"] == "invalid JSON in request body"
