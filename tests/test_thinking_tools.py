"""Thinking and tool calls per model family, produced for real by llama.cpp and parsed by the runtime.

Each family is a tiny random-weight GGUF whose chat template and special tokens follow the family's
documented format (tests/families.py). A GBNF grammar (the `grammar` option) forces the reply token by
token, special tokens included, so the text the runtime parses is exactly the family's output format.
Streamed and not: thinking never reaches content, a call spelled over many tokens is assembled, a
malformed call comes back as plain content.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import ollama
import openai
import pytest

from localrt.errors import LocalrtError
from localrt.runtime.answers import Chunk
from localrt.runtime.front import Runtime
from localrt.runtime.thinking import ThinkError
from localrt.runtime.thinking import model_format
from localrt.store.importer import import_gguf
from localrt.store.store import Store
from tests.families import FAMILIES
from tests.families import FIRST_SPECIAL_ID
from tests.families import forced
from tests.servers.serve import LocalrtServer

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather for a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
            "required": ["city"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The time in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": ["Oslo"]}},
            "required": ["city"],
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
GREEDY = {"temperature": 0, "num_predict": 400, "num_thread": 1}


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Store:
    root = tmp_path_factory.mktemp("families")
    store = Store(root / "models")
    for name, family in FAMILIES.items():
        import_gguf(store, f"{name}:tiny", family.write(root / f"{name}.gguf"))
    return store


def run(store: Store, method: str, model: str, *args: Any, **kwargs: Any) -> list[Chunk]:
    async def go() -> list[Chunk]:
        rt = Runtime(store, keep_alive=0)
        try:
            return [c async for c in getattr(rt, method)(f"{model}:tiny", *args, **kwargs)]
        finally:
            await rt.close()

    return asyncio.run(go())


def render(store: Store, model: str, messages: list[dict[str, Any]], **kwargs: Any) -> str:
    async def go() -> str:
        rt = Runtime(store, keep_alive=0)
        try:
            return (await rt.render(f"{model}:tiny", messages, **kwargs))[0]
        finally:
            await rt.close()

    return asyncio.run(go())


def chat(store: Store, model: str, reply: str, *, stream: bool, **kwargs: Any) -> list[Chunk]:
    """The model's reply forced to `reply` (its special tokens as tokens)."""
    options = {**GREEDY, "grammar": forced(reply, FAMILIES[model])}
    return run(store, "chat", model, kwargs.pop("messages", ASK), options=options, stream=stream, **kwargs)


def joined(chunks: list[Chunk], field: str) -> str:
    return "".join(getattr(c, field) for c in chunks)


def calls(chunks: list[Chunk]) -> list[dict[str, Any]]:
    return [call for c in chunks for call in c.tool_calls or []]


# ---- what each family is ------------------------------------------------------------------------
@pytest.mark.parametrize(
    "family,thinking,hybrid,tool_style",
    [
        ("qwen3", "tags", True, "hermes"),
        ("deepseek-r1", "tags", False, "json"),
        ("gpt-oss", "harmony", False, "harmony"),
        ("llama3", "none", False, "llama3"),
        ("mistral", "none", False, "mistral"),
        ("granite", "none", False, "granite"),
        ("phi4", "none", False, "phi4"),
        ("qwen3-coder", "none", False, "hermes"),
    ],
)
def test_format_is_read_from_the_template(family: str, thinking: str, hybrid: bool, tool_style: str) -> None:
    fmt = model_format(FAMILIES[family].template)
    assert fmt.thinking == thinking
    assert fmt.hybrid is hybrid
    assert fmt.tool_style == tool_style


# ---- thinking -----------------------------------------------------------------------------------
THINKING_REPLIES = {
    "qwen3": "<think>\nThe user asks about Paris weather.\n</think>\n\nIt is sunny.",
    "deepseek-r1": "The user asks about Paris weather.\n</think>\n\nIt is sunny.",  # the prompt opened it
    "gpt-oss": "<|channel|>analysis<|message|>The user asks about Paris weather.<|end|>"
    "<|start|>assistant<|channel|>final<|message|>It is sunny.",
}


@pytest.mark.parametrize("family", sorted(THINKING_REPLIES))
@pytest.mark.parametrize("stream", [True, False])
def test_thinking_is_split_from_content(store: Store, family: str, stream: bool) -> None:
    chunks = chat(store, family, THINKING_REPLIES[family], stream=stream)
    assert joined(chunks, "thinking") == "The user asks about Paris weather."
    assert joined(chunks, "content") == "It is sunny."


@pytest.mark.parametrize("family", sorted(THINKING_REPLIES))
def test_thinking_streams_piece_by_piece_before_the_answer(store: Store, family: str) -> None:
    chunks = chat(store, family, THINKING_REPLIES[family], stream=True)
    thinking_at = [i for i, c in enumerate(chunks) if c.thinking]
    content_at = [i for i, c in enumerate(chunks) if c.content]
    assert len(thinking_at) > 3  # streamed as it is generated, not in one piece at the end
    assert max(thinking_at) < min(content_at)
    assert not any("analysis" in c.content or "think>" in c.content for c in chunks)


def test_thinking_tokens_count_in_eval_count(store: Store) -> None:
    final = chat(store, "qwen3", THINKING_REPLIES["qwen3"], stream=False)[-1]
    assert final.metrics is not None
    # every forced token was generated, the thinking ones included (plus the end-of-turn token)
    forced_tokens = run_tokenize(store, "qwen3", THINKING_REPLIES["qwen3"])
    assert final.metrics.eval_count >= forced_tokens


def run_tokenize(store: Store, model: str, text: str) -> int:
    async def go() -> int:
        rt = Runtime(store, keep_alive=0)
        try:
            return len(await rt.tokenize(f"{model}:tiny", text, add_special=False, parse_special=True))
        finally:
            await rt.close()

    return asyncio.run(go())


def test_think_false_switches_the_hybrid_template_off(store: Store) -> None:
    off = render(store, "qwen3", ASK, think=False)
    on = render(store, "qwen3", ASK, think=True)
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert on.endswith("<|im_start|>assistant\n")


def test_think_false_closes_a_prompt_that_opens_thinking(store: Store) -> None:
    assert render(store, "deepseek-r1", ASK).endswith("<｜Assistant｜><think>\n")
    assert render(store, "deepseek-r1", ASK, think=False).endswith("<think>\n\n</think>\n\n")


@pytest.mark.parametrize("level", ["low", "high"])
def test_reasoning_effort_reaches_the_harmony_system_message(store: Store, level: str) -> None:
    assert f"Reasoning: {level}\n" in render(store, "gpt-oss", ASK, think=level)


def test_think_false_never_leaks_thinking_into_content(store: Store) -> None:
    # a model that thinks although told not to: the thinking is dropped, the answer kept
    chunks = chat(store, "qwen3", THINKING_REPLIES["qwen3"], stream=True, think=False)
    assert joined(chunks, "thinking") == ""
    assert joined(chunks, "content") == "It is sunny."


def test_thinking_on_a_model_that_cannot_is_an_error_naming_it(store: Store) -> None:
    with pytest.raises(ThinkError, match='"llama3:tiny" does not support thinking'):
        chat(store, "llama3", "Hi.", stream=False, think=True)


def test_unfinished_thinking_stays_thinking(store: Store) -> None:
    chunks = chat(store, "qwen3", "<think>\nStill pondering", stream=True)
    assert joined(chunks, "thinking") == "Still pondering"
    assert joined(chunks, "content") == ""


def test_earlier_thinking_goes_back_through_the_template(store: Store) -> None:
    history = [
        *ASK,
        {"role": "assistant", "content": "It is sunny.", "thinking": "Sunny, says the forecast."},
        {"role": "user", "content": "And tomorrow?"},
    ]
    text = render(store, "qwen3", history)
    assert "It is sunny." in text
    # Qwen3's template drops thinking of turns before the last user message, as the real one does
    assert "Sunny, says the forecast." not in text


# ---- tool calls ---------------------------------------------------------------------------------
CALL_REPLIES = {
    "qwen3": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    "llama3": '{"name": "get_weather", "parameters": {"city": "Paris"}}',
    "mistral": '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]',
    "granite": '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}]',
    "phi4": 'functools[{"name": "get_weather", "arguments": {"city": "Paris"}}]',
    "gpt-oss": '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}',
    "qwen3-coder": "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n"
    "</tool_call>",
}
MALFORMED = {
    "qwen3": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par</tool_call>',
    "llama3": '{"name": "get_weather", "parameters": {"city": "Par',
    "mistral": '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city"',
    "granite": '<|tool_call|>[{"name": "get_weather", "argu',
    "phi4": 'functools[{"name": "get_weather"',
    "gpt-oss": '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Par',
    "qwen3-coder": "<tool_call>\n<function=get_weather>\n<parameter=city>\nPar</tool_call>",
}
# a call to a tool the request did not offer is text the model wrote, not a call
UNKNOWN_TOOL = {
    "qwen3": '<tool_call>\n{"name": "delete_files", "arguments": {"path": "/"}}\n</tool_call>',
    "llama3": '{"name": "delete_files", "parameters": {"path": "/"}}',
    "mistral": '[TOOL_CALLS][{"name": "delete_files", "arguments": {"path": "/"}}]',
    "gpt-oss": '<|channel|>commentary to=functions.delete_files <|constrain|>json<|message|>{"path": "/"}',
    "qwen3-coder": "<tool_call>\n<function=delete_files>\n<parameter=path>\n/\n</parameter>\n</function>\n"
    "</tool_call>",
}


@pytest.mark.parametrize("family", sorted(CALL_REPLIES))
@pytest.mark.parametrize("stream", [True, False])
def test_tool_call_is_parsed(store: Store, family: str, stream: bool) -> None:
    chunks = chat(store, family, CALL_REPLIES[family], stream=stream, tools=[WEATHER])
    found = calls(chunks)
    assert [c["function"]["name"] for c in found] == ["get_weather"]
    assert found[0]["function"]["arguments"] == {"city": "Paris"}
    assert found[0]["id"]
    assert joined(chunks, "content").strip() == ""
    final = chunks[-1]
    assert final.metrics is not None
    assert final.metrics.eval_count > 10  # spelled over many tokens, assembled into one call


@pytest.mark.parametrize("family", sorted(MALFORMED))
@pytest.mark.parametrize("stream", [True, False])
def test_malformed_call_comes_back_as_content(store: Store, family: str, stream: bool) -> None:
    chunks = chat(store, family, MALFORMED[family], stream=stream, tools=[WEATHER])
    assert calls(chunks) == []
    # given back as it was written (harmony: the message body, its header being no text of the answer)
    expected = MALFORMED[family].split("<|message|>")[-1] if family == "gpt-oss" else MALFORMED[family]
    assert joined(chunks, "content") == expected
    assert chunks[-1].done_reason == "stop"


@pytest.mark.parametrize("family", sorted(UNKNOWN_TOOL))
@pytest.mark.parametrize("stream", [True, False])
def test_call_to_a_tool_not_offered_comes_back_as_content(store: Store, family: str, stream: bool) -> None:
    chunks = chat(store, family, UNKNOWN_TOOL[family], stream=stream, tools=[WEATHER])
    assert calls(chunks) == []
    expected = UNKNOWN_TOOL[family].split("<|message|>")[-1] if family == "gpt-oss" else UNKNOWN_TOOL[family]
    assert joined(chunks, "content") == expected


@pytest.mark.parametrize("stream", [True, False])
def test_llama_pythonic_calls(store: Store, stream: bool) -> None:
    reply = '[get_weather(city="Paris"), get_time(city="Oslo")]'
    chunks = chat(store, "llama3", reply, stream=stream, tools=[WEATHER, TIME])
    found = calls(chunks)
    assert [c["function"]["name"] for c in found] == ["get_weather", "get_time"]
    assert [c["function"]["arguments"] for c in found] == [{"city": "Paris"}, {"city": "Oslo"}]
    assert joined(chunks, "content") == ""


def test_llama_pythonic_list_that_is_no_call_stays_content(store: Store) -> None:
    chunks = chat(store, "llama3", "[Paris, Rome] are both sunny.", stream=True, tools=[WEATHER])
    assert calls(chunks) == []
    assert joined(chunks, "content") == "[Paris, Rome] are both sunny."


def test_qwen3_coder_values_are_typed_by_the_schema(store: Store) -> None:
    forecast = {
        "type": "function",
        "function": {
            "name": "forecast",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            },
        },
    }
    reply = (
        "<tool_call>\n<function=forecast>\n<parameter=city>\n1984\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"
    )
    [call] = calls(chat(store, "qwen3-coder", reply, stream=True, tools=[forecast]))
    assert call["function"]["arguments"] == {"city": "1984", "days": 3}  # a string stays one


def test_text_before_a_hermes_call_stays_content(store: Store) -> None:
    reply = "Let me check.\n" + CALL_REPLIES["qwen3"]
    chunks = chat(store, "qwen3", reply, stream=True, tools=[WEATHER], think=False)
    assert joined(chunks, "content").strip() == "Let me check."
    assert len(calls(chunks)) == 1


def test_parallel_calls_and_parallel_tool_calls_false(store: Store) -> None:
    second = '\n<tool_call>\n{"name": "get_time", "arguments": {"city": "Oslo"}}\n</tool_call>'
    reply = CALL_REPLIES["qwen3"] + second
    both = calls(chat(store, "qwen3", reply, stream=True, tools=[WEATHER, TIME], think=False))
    assert [c["function"]["name"] for c in both] == ["get_weather", "get_time"]
    assert [c["function"]["index"] for c in both] == [0, 1]
    one = calls(
        chat(
            store, "qwen3", reply, stream=False, tools=[WEATHER, TIME], think=False, parallel_tool_calls=False
        )
    )
    assert [c["function"]["name"] for c in one] == ["get_weather"]


# two calls, the second with a long argument for the token limit to cut into
CUT_ARGUMENT = "Oslo, the capital of Norway, by the fjord"
SECOND_CALL = {
    "qwen3": '\n<tool_call>\n{"name": "get_time", "arguments": {"city": "CITY"}}\n</tool_call>',
    "llama3": '; {"name": "get_time", "parameters": {"city": "CITY"}}',
    "mistral": ', {"name": "get_time", "arguments": {"city": "CITY"}}]',
    "gpt-oss": "<|end|><|start|>assistant<|channel|>commentary to=functions.get_time "
    '<|constrain|>json<|message|>{"city": "CITY"}',
    "qwen3-coder": "\n<tool_call>\n<function=get_time>\n<parameter=city>\nCITY\n</parameter>\n</function>\n"
    "</tool_call>",
}
TWO_CALLS = {
    family: CALL_REPLIES[family].removesuffix("]" if family == "mistral" else "")
    + second.replace("CITY", CUT_ARGUMENT)
    for family, second in SECOND_CALL.items()
}


@pytest.mark.parametrize("family", sorted(TWO_CALLS))
@pytest.mark.parametrize("stream", [True, False])
def test_a_call_cut_by_the_token_limit_is_dropped(store: Store, family: str, stream: bool) -> None:
    think = False if family == "qwen3" else None
    grammar = forced(TWO_CALLS[family], FAMILIES[family])
    whole = run(
        store,
        "chat",
        family,
        ASK,
        options={**GREEDY, "grammar": grammar},
        tools=[WEATHER, TIME],
        think=think,
        logprobs=True,
        stream=False,
    )
    assert [c["function"]["name"] for c in calls(whole)] == ["get_weather", "get_time"]  # uncut: both
    texts = [lp.token for lp in whole[-1].logprobs or []]
    # the limit: the first tokens up to a few words into the second call's argument
    limit = next(i for i in range(len(texts)) if CUT_ARGUMENT[:12] in "".join(texts[:i]))
    chunks = run(
        store,
        "chat",
        family,
        ASK,
        options={**GREEDY, "grammar": grammar, "num_predict": limit},
        tools=[WEATHER, TIME],
        think=think,
        stream=stream,
    )
    assert chunks[-1].done_reason == "length"
    assert [c["function"]["name"] for c in calls(chunks)] == ["get_weather"]  # the complete call is kept
    assert calls(chunks)[0]["function"]["arguments"] == {"city": "Paris"}
    assert joined(chunks, "content").strip() == ""  # no markup of the cut call
    assert CUT_ARGUMENT[:4] not in joined(chunks, "content") + joined(chunks, "thinking")


def test_thinking_then_a_call(store: Store) -> None:
    reply = "<think>\nI need the weather tool.\n</think>\n\n" + CALL_REPLIES["qwen3"]
    chunks = chat(store, "qwen3", reply, stream=True, tools=[WEATHER])
    assert joined(chunks, "thinking") == "I need the weather tool."
    assert len(calls(chunks)) == 1
    assert "tool_call" not in joined(chunks, "content")


def test_harmony_thinking_then_a_call(store: Store) -> None:
    reply = "<|channel|>analysis<|message|>Use the tool.<|end|><|start|>assistant" + CALL_REPLIES["gpt-oss"]
    chunks = chat(store, "gpt-oss", reply, stream=True, tools=[WEATHER])
    assert joined(chunks, "thinking") == "Use the tool."
    assert calls(chunks)[0]["function"]["arguments"] == {"city": "Paris"}


TOOL_TURN = [
    *ASK,
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": "call_k3j9x0ab", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
        ],
    },
    {"role": "tool", "tool_call_id": "call_k3j9x0ab", "tool_name": "get_weather", "content": "21C and clear"},
]
TOOL_RESULT_MARKERS = {
    "qwen3": "<tool_response>\n21C and clear\n</tool_response>",
    "llama3": "<|start_header_id|>ipython<|end_header_id|>\n\n21C and clear<|eot_id|>",
    "mistral": '[TOOL_RESULTS]{"content": "21C and clear", "call_id": "',
    "granite": "<|start_of_role|>tool_response<|end_of_role|>21C and clear",
    "gpt-oss": '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"21C and clear"',
    "qwen3-coder": "<tool_response>\n21C and clear\n</tool_response>",
}


@pytest.mark.parametrize("family", sorted(TOOL_RESULT_MARKERS))
def test_tool_results_are_rendered_through_the_template(store: Store, family: str) -> None:
    text = render(store, family, TOOL_TURN, tools=[WEATHER])
    assert TOOL_RESULT_MARKERS[family] in text
    assert "get_weather" in text  # the assistant's call is in the history too


def test_mistral_call_ids_are_made_nine_characters_both_ways(store: Store) -> None:
    text = render(store, "mistral", TOOL_TURN, tools=[WEATHER])
    sent = json.loads(text.split("[TOOL_RESULTS]", 1)[1].split("[/TOOL_RESULTS]", 1)[0])
    assert len(sent["call_id"]) == 9
    assert f'"id": "{sent["call_id"]}"' in text


# ---- tool_choice ---------------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["qwen3", "llama3", "mistral", "granite", "phi4"])
def test_tool_choice_required_forces_a_call(store: Store, family: str) -> None:
    # no forced reply here: the random model answers, the grammar makes it a call in the family's syntax
    chunks = run(
        store,
        "chat",
        family,
        ASK,
        options=GREEDY,
        tools=[WEATHER, TIME],
        tool_choice="required",
        parallel_tool_calls=False,
        think=False if family == "qwen3" else None,
        stream=True,
    )
    found = calls(chunks)
    assert len(found) == 1, chunks
    assert found[0]["function"]["name"] in ("get_weather", "get_time")


def test_tool_choice_names_the_function(store: Store) -> None:
    chunks = run(
        store,
        "chat",
        "qwen3",
        ASK,
        options=GREEDY,
        tools=[WEATHER, TIME],
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        think=False,
        stream=False,
    )
    assert [c["function"]["name"] for c in calls(chunks)] == ["get_time"]
    assert calls(chunks)[0]["function"]["arguments"] == {"city": "Oslo"}


def test_tool_choice_none_renders_no_tools(store: Store) -> None:
    chunks = chat(
        store, "qwen3", CALL_REPLIES["qwen3"], stream=False, tools=[WEATHER], tool_choice="none", think=False
    )
    assert calls(chunks) == []
    assert "get_weather" in joined(chunks, "content")


# ---- through a real `localrt serve`, with the official clients ----------------------------------
@pytest.fixture(scope="module")
def server(store: Store, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalrtServer]:
    srv = LocalrtServer(store.root, tmp_path_factory.mktemp("serve") / "serve.log")
    yield srv
    srv.stop()
    assert "Traceback" not in srv.log_path.read_text(errors="replace")


def test_ollama_client_think(server: LocalrtServer) -> None:
    client = ollama.Client(host=server.url)
    options = {**GREEDY, "grammar": forced(THINKING_REPLIES["qwen3"], FAMILIES["qwen3"])}
    whole = client.chat("qwen3:tiny", messages=ASK, think=True, options=options)
    assert whole.message.thinking == "The user asks about Paris weather."
    assert whole.message.content == "It is sunny."
    parts = list(client.chat("qwen3:tiny", messages=ASK, think="high", options=options, stream=True))
    assert "".join(p.message.thinking or "" for p in parts) == whole.message.thinking
    assert "".join(p.message.content for p in parts) == whole.message.content
    generated = client.generate(
        "deepseek-r1:tiny",
        "Weather?",
        options={**GREEDY, "grammar": forced(THINKING_REPLIES["deepseek-r1"], FAMILIES["deepseek-r1"])},
    )
    assert generated.thinking == "The user asks about Paris weather."
    assert generated.response == "It is sunny."


def test_ollama_client_tool_call_streamed(server: LocalrtServer) -> None:
    client = ollama.Client(host=server.url)
    options = {**GREEDY, "grammar": forced(CALL_REPLIES["mistral"], FAMILIES["mistral"])}
    parts = list(client.chat("mistral:tiny", messages=ASK, tools=[WEATHER], options=options, stream=True))
    found = [c for p in parts for c in p.message.tool_calls or []]
    assert [c.function.name for c in found] == ["get_weather"]
    assert found[0].function.arguments == {"city": "Paris"}


def test_show_capabilities_per_family(server: LocalrtServer) -> None:
    client = ollama.Client(host=server.url)
    assert client.show("qwen3:tiny").capabilities == ["completion", "tools", "thinking"]
    assert client.show("deepseek-r1:tiny").capabilities == ["completion", "thinking"]
    assert client.show("gpt-oss:tiny").capabilities == ["completion", "tools", "thinking"]
    assert client.show("llama3:tiny").capabilities == ["completion", "tools"]


def test_openai_reasoning_content(server: LocalrtServer) -> None:
    oai = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    extra = {"grammar": forced(THINKING_REPLIES["gpt-oss"], FAMILIES["gpt-oss"]), "num_thread": 1}
    r = oai.chat.completions.create(
        model="gpt-oss:tiny", messages=ASK, reasoning_effort="low", max_tokens=400, extra_body=extra
    )
    assert r.choices[0].message.content == "It is sunny."
    assert r.choices[0].message.model_extra["reasoning_content"] == "The user asks about Paris weather."
    stream = oai.chat.completions.create(
        model="gpt-oss:tiny",
        messages=ASK,
        reasoning_effort="high",
        max_tokens=400,
        extra_body=extra,
        stream=True,
    )
    deltas = [c.choices[0].delta for c in stream if c.choices]
    thinking = "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas)
    assert thinking == "The user asks about Paris weather."
    assert "".join(d.content or "" for d in deltas) == "It is sunny."
    with pytest.raises(openai.BadRequestError):
        oai.chat.completions.create(model="llama3:tiny", messages=ASK, reasoning_effort="low", max_tokens=4)


def test_openai_tool_choice_required(server: LocalrtServer) -> None:
    oai = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    r = oai.chat.completions.create(
        model="llama3:tiny",
        messages=ASK,
        tools=[WEATHER, TIME],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=200,
        extra_body={"num_thread": 1},
    )
    assert r.choices[0].finish_reason == "tool_calls"
    [call] = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments)["city"] in ("Paris", "Rome")  # as the schema allows
    stream = oai.chat.completions.create(
        model="qwen3:tiny",
        messages=ASK,
        tools=[WEATHER, TIME],
        tool_choice="required",
        parallel_tool_calls=False,
        reasoning_effort="none",
        max_tokens=200,
        extra_body={"num_thread": 1},
        stream=True,
    )
    chunks = list(stream)
    calls_seen = [t for c in chunks if c.choices for t in c.choices[0].delta.tool_calls or []]
    assert len(calls_seen) == 1
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # the result goes back and renders through the template
    follow = oai.chat.completions.create(
        model="qwen3:tiny",
        messages=[
            *ASK,
            {"role": "assistant", "content": None, "tool_calls": [calls_seen[0].model_dump()]},
            {"role": "tool", "tool_call_id": calls_seen[0].id, "content": "21C"},
        ],
        reasoning_effort="none",
        max_tokens=4,
        extra_body={"num_thread": 1},
    )
    assert follow.choices[0].finish_reason in ("stop", "length")


# ---- `localrt run` -------------------------------------------------------------------------------
def localrt_run(store: Store, *args: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "LOCALRT_MODELS": str(store.root), "LOCALRT_HOST": "127.0.0.1:9"}
    return subprocess.run(
        [sys.executable, "-m", "localrt", "run", *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )


@pytest.fixture(scope="module")
def forced_qwen3(store: Store, tmp_path_factory: pytest.TempPathFactory) -> str:
    """Qwen3 whose Modelfile parameters force the thinking reply (as `PARAMETER grammar ...` would)."""
    path = FAMILIES["qwen3"].write(tmp_path_factory.mktemp("forced") / "q.gguf")
    params = {**GREEDY, "grammar": forced(THINKING_REPLIES["qwen3"], FAMILIES["qwen3"])}
    import_gguf(store, "qwen3-forced:tiny", path, params=params)
    return "qwen3-forced:tiny"


def test_run_prints_thinking_before_the_answer(store: Store, forced_qwen3: str) -> None:
    result = localrt_run(store, forced_qwen3, "Weather?")
    assert result.returncode == 0, result.stderr
    assert result.stdout == (
        "Thinking...\nThe user asks about Paris weather.\n...done thinking.\n\nIt is sunny.\n"
    )


def test_run_hidethinking_and_nothink(store: Store, forced_qwen3: str) -> None:
    hidden = localrt_run(store, forced_qwen3, "Weather?", "--hidethinking")
    assert hidden.stdout == "It is sunny.\n"
    off = localrt_run(store, forced_qwen3, "--nothink", "Weather?")
    assert off.stdout == "It is sunny.\n"  # the thinking the grammar still forces is dropped, not shown


def test_run_think_on_a_model_that_cannot_is_one_line(store: Store) -> None:
    result = localrt_run(store, "llama3:tiny", "--think", "high", "Hi")
    assert result.returncode != 0
    assert result.stderr.strip() == 'Error: "llama3:tiny" does not support thinking'


def test_interactive_set_think_and_nothink(
    store: Store, forced_qwen3: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import argparse
    import io

    from localrt.cli.repl import Session

    monkeypatch.setenv("LOCALRT_MODELS", str(store.root))
    monkeypatch.setenv("LOCALRT_HOST", "127.0.0.1:9")  # no server: the chat runs in this process
    out = io.StringIO()
    session = Session(argparse.Namespace(model=forced_qwen3), out=out, err=io.StringIO())
    try:
        session.command("/set nothink")
        session.ask("Weather?")
        session.command("/set think low")
        session.ask("Weather?")
    finally:
        session.close()
    text = out.getvalue()
    assert "Set 'nothink' mode." in text
    assert "Set 'think' mode (low)." in text
    assert text.count("It is sunny.") == 2
    assert text.count("Thinking...") == 1  # only after /set think
    assert session.messages[-1]["thinking"] == "The user asks about Paris weather."


def test_grammar_naming_a_partial_byte_token_is_refused(store: Store) -> None:
    # llama.cpp aborts the whole process on such a grammar; the runtime refuses it first
    byte_fc = FIRST_SPECIAL_ID + len(FAMILIES["qwen3"].specials) + 0xFC  # <0xFC>, half a character
    options = {**GREEDY, "grammar": f'root ::= <[{byte_fc}]> "a"'}
    with pytest.raises(LocalrtError, match="is not a whole-text token"):
        run(store, "chat", "qwen3", ASK, options=options, stream=False)
    assert joined(chat(store, "qwen3", "Still here.", stream=False, think=False), "content") == "Still here."


# ---- a thinking budget ----------------------------------------------------------------------------
def test_thinking_budget_appends_the_close_tag_and_counts_reasoning(store: Store) -> None:
    from localrt.runtime.thinking import Think

    thought = "One two three four five six seven eight nine ten eleven twelve thirteen."
    reply = f"<think>\n{thought}\n</think>\n\nOk."
    options = {**GREEDY, "num_predict": 20, "grammar": forced(reply, FAMILIES["qwen3"])}

    async def go() -> tuple[list[Chunk], str]:
        rt = Runtime(store, keep_alive=0)
        try:
            budget = Think(True, "medium", budget=5)
            chunks = [c async for c in rt.generate("qwen3:tiny", "Weather?", options=options, think=budget)]
            _, prompt = await rt.render("qwen3:tiny", [{"role": "user", "content": "Weather?"}], think=True)
            context = chunks[-1].context or []
            return chunks, await rt.detokenize("qwen3:tiny", context[len(prompt) :])
        finally:
            await rt.close()

    chunks, written = asyncio.run(go())
    metrics = chunks[-1].metrics
    assert metrics is not None
    assert metrics.reasoning_tokens == 5  # the budget, all spent inside the thinking
    assert metrics.eval_count > 5  # then the answer
    # (the tiny SentencePiece vocabulary puts a space before text that follows a special token)
    spent, closing, answer = written.partition("</think>")
    assert closing  # the runtime's close tag follows the cut in what the model was given
    assert spent.startswith("<think>\n")
    assert f"<think>\n{thought}".startswith(spent.rstrip())  # cut inside the forced thought
    assert len(spent) < len(thought) // 2
    assert joined(chunks, "thinking") == spent.removeprefix("<think>\n").strip()
    assert joined(chunks, "content") == answer.lstrip()
