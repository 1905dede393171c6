"""Tool calls (and thinking) of every family whose official chat template llama.cpp ships, read from the
exact text each template renders for an assistant's call.

Unit part: the reply parser on those exact strings, whole and split at every size (markers cut across
chunks), with unknown tools and cut-off calls coming back as text. Server part: one real `localrt serve`
holding a tiny random-weight GGUF per family with the official template as its chat template and the
format's markers as special tokens; a grammar forces the model's reply, token by token, to the family's
call, which must come back as a structured call on /api/chat and /v1/chat/completions, streamed and not.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import ollama
import openai
import pytest

from localrt.runtime.callformats import FAMILY_STYLES
from localrt.runtime.callformats import gemma_value
from localrt.runtime.templates import ChatTemplate
from localrt.runtime.thinking import ReplyParser
from localrt.runtime.thinking import Think
from localrt.runtime.thinking import model_format
from localrt.runtime.thinking import template_variables
from localrt.store.importer import import_gguf
from localrt.store.store import Store
from tests.families import OFFICIAL
from tests.families import Official
from tests.families import forced
from tests.gguf_factory import write_tiny_llama
from tests.servers.serve import LocalrtServer

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather for a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "The city"},
                "days": {"type": "integer", "description": "How many days"},
            },
            "required": ["city"],
        },
    },
}
ARGS = {"city": "Paris", "days": 3}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
CALL_ID = "abcDEF123"  # nine alphanumerics, as Mistral's templates insist
HISTORY = [
    *ASK,
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": CALL_ID, "type": "function", "function": {"name": "get_weather", "arguments": ARGS}}
        ],
    },
    {"role": "tool", "tool_call_id": CALL_ID, "name": "get_weather", "content": "21C and clear"},
]
# templates localrt's sandbox cannot render yet: they append to a list (`.append`), which the immutable
# sandbox refuses
SANDBOX_REFUSED = {"kimi-k2-instruct", "kimi-k2-thinking"}
# the reply as the model writes it differs from how the template renders a past call: gpt-oss renders
# the recipient before the channel; LFM2's first template renders no past call at all
NOT_RENDERED_AS_WRITTEN = {"gpt-oss-official", "lfm2"}


def template_of(family: Official) -> ChatTemplate:
    return ChatTemplate(family.template, bos_token="<s>", eos_token="</s>")


def parse(family: Official, text: str, sizes: int = 0, prompt: str = "") -> tuple[str, str, list[Any]]:
    """(content, thinking, calls) of `text` fed whole (sizes=0) or in pieces of `sizes` characters."""
    parser = ReplyParser(model_format(family.template), think=Think(), prompt_text=prompt, tools=[WEATHER])
    pieces = [text] if sizes == 0 else [text[i : i + sizes] for i in range(0, len(text), sizes)]
    content, thinking, calls = "", "", []
    for piece in [*pieces, None]:
        out = parser.finish() if piece is None else parser.feed(piece)
        content += out.content
        thinking += out.thinking
        calls.extend(out.tool_calls)
    return content, thinking, calls


ALL = sorted(OFFICIAL)
SIZES = [0, 1, 2, 3, 5, 8, 13]


# ---- the format, read from the template -------------------------------------------------------------
@pytest.mark.parametrize("name", ALL)
def test_style_is_read_from_the_official_template(name: str) -> None:
    family = OFFICIAL[name]
    assert model_format(family.template).tool_style == family.style


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(n, marks=pytest.mark.xfail(strict=True, reason="the sandbox refuses list.append"))
        if n in SANDBOX_REFUSED
        else n
        for n in ALL
        if n not in NOT_RENDERED_AS_WRITTEN
    ],
)
def test_the_reply_is_the_templates_own_call(name: str) -> None:
    family = OFFICIAL[name]
    rendered = template_of(family).render(HISTORY, tools=[WEATHER], add_generation_prompt=False).text
    assert family.call.strip() in rendered


# ---- the parser on the exact strings -----------------------------------------------------------------
@pytest.mark.parametrize("sizes", SIZES)
@pytest.mark.parametrize("name", ALL)
def test_call_is_parsed_whole_and_split(name: str, sizes: int) -> None:
    content, _, calls = parse(OFFICIAL[name], OFFICIAL[name].call, sizes)
    assert [c["function"]["name"] for c in calls] == ["get_weather"]
    assert calls[0]["function"]["arguments"] == ARGS
    assert content.strip() == ""


@pytest.mark.parametrize("name", ALL)
def test_two_calls_in_one_reply(name: str) -> None:
    family = OFFICIAL[name]
    if family.style in ("llama3", "harmony"):
        pytest.skip("one call per reply in this family's format")
    _, _, calls = parse(family, family.call + "\n" + family.call, 3)
    assert [c["function"]["index"] for c in calls] == [0, 1]


@pytest.mark.parametrize("sizes", [0, 1, 4])
@pytest.mark.parametrize("name", ALL)
def test_text_before_a_call_stays_content(name: str, sizes: int) -> None:
    family = OFFICIAL[name]
    if family.style in ("llama3", "harmony"):
        pytest.skip("a call is the whole reply in this family's format")
    content, _, calls = parse(family, "Let me check. " + family.call, sizes)
    assert content.strip() == "Let me check."
    assert len(calls) == 1


@pytest.mark.parametrize("sizes", [0, 1, 3])
@pytest.mark.parametrize("name", [n for n in ALL if OFFICIAL[n].style != "harmony"])
def test_call_to_a_tool_not_offered_comes_back_as_text(name: str, sizes: int) -> None:
    reply = OFFICIAL[name].call.replace("get_weather", "delete_files")
    content, _, calls = parse(OFFICIAL[name], reply, sizes)
    assert calls == []
    assert content == reply


@pytest.mark.parametrize("sizes", [0, 1, 3])
@pytest.mark.parametrize("name", [n for n in ALL if OFFICIAL[n].style != "harmony"])
def test_cut_off_call_comes_back_as_text(name: str, sizes: int) -> None:
    reply = OFFICIAL[name].call
    reply = reply[: reply.index("Paris") + 2]
    content, _, calls = parse(OFFICIAL[name], reply, sizes)
    assert calls == []
    assert content == reply


def thinking_reply(family: Official, prompt: str) -> str:
    """ "Use the tool." as the family's thinking, then its call; the open tag only where the prompt did not
    already open the block."""
    fmt = model_format(family.template)
    opened = prompt.rstrip().endswith(fmt.open_tag)
    return ("" if opened else fmt.open_tag + "\n") + "Use the tool.\n" + fmt.close_tag + "\n" + family.call


def thinking_prompt(family: Official) -> str:
    """The prompt as the runtime renders it with thinking on."""
    variables = template_variables(model_format(family.template), Think(True, "medium"))
    return template_of(family).render(ASK, tools=[WEATHER], extra=variables).text


THINKERS = sorted(
    n for n in ALL if model_format(OFFICIAL[n].template).thinking == "tags" and n not in SANDBOX_REFUSED
)


@pytest.mark.parametrize("sizes", [0, 1, 3])
@pytest.mark.parametrize("name", THINKERS)
def test_thinking_then_a_call(name: str, sizes: int) -> None:
    family = OFFICIAL[name]
    prompt = thinking_prompt(family)
    content, thinking, calls = parse(family, thinking_reply(family, prompt), sizes, prompt)
    assert thinking == "Use the tool."
    assert [c["function"]["arguments"] for c in calls] == [ARGS]
    assert content.strip() == ""


@pytest.mark.parametrize("name", [n for n in ALL if OFFICIAL[n].thinking and n not in SANDBOX_REFUSED])
def test_thinking_as_the_template_renders_it(name: str) -> None:
    family = OFFICIAL[name]
    content, thinking, calls = parse(family, family.thinking, 2, thinking_prompt(family))
    assert thinking == "Use the tool."
    assert [c["function"]["arguments"] for c in calls] == [ARGS]


def test_kimi_thinking_then_a_call_without_the_template() -> None:
    # the Kimi K2 Thinking template does not render here yet (see SANDBOX_REFUSED); its reply format does
    family = OFFICIAL["kimi-k2-thinking"]
    content, thinking, calls = parse(family, family.thinking, 2)
    assert thinking == "Use the tool."
    assert [c["function"]["arguments"] for c in calls] == [ARGS]


@pytest.mark.parametrize(
    "text,value",
    [
        ('{city:<|"|>Paris<|"|>,days:3}', {"city": "Paris", "days": 3}),
        ('{q:<|"|>a, b: {c}<|"|>,n:[1,2],o:{x:true}}', {"q": "a, b: {c}", "n": [1, 2], "o": {"x": True}}),
    ],
)
def test_gemma4_argument_syntax(text: str, value: Any) -> None:
    assert gemma_value(text) == value


def test_glm_values_are_typed_by_the_schema() -> None:
    reply = OFFICIAL["glm-4.7-flash"].call.replace("Paris", "1984")
    _, _, [call] = parse(OFFICIAL["glm-4.7-flash"], reply)
    assert call["function"]["arguments"] == {"city": "1984", "days": 3}


def test_minimax_m3_nested_arguments() -> None:
    t = "]<]minimax[>["
    reply = (
        f'{t}<tool_call>\n{t}<invoke name="get_weather">{t}<city>Paris{t}</city>{t}<opts>{t}<units>metric{t}'
        f"</units>{t}<hours>{t}<item>6{t}</item>{t}<item>12{t}</item>{t}</hours>{t}</opts>{t}</invoke>\n{t}</tool_call>"
    )
    _, _, [call] = parse(OFFICIAL["minimax-m3"], reply, 4)
    assert call["function"]["arguments"] == {"city": "Paris", "opts": {"units": "metric", "hours": [6, 12]}}


# ---- through a real `localrt serve`, with the official clients ----------------------------------------
# one model per template, all in one server; the prompts of some official templates are long in the tiny
# byte-level vocabulary, hence the larger context
SERVED = [n for n in ALL if n not in SANDBOX_REFUSED]
# one template per call syntax in the default run (the first by name); every template in the slow one
_FIRST_OF_STYLE = {OFFICIAL[n].style: n for n in reversed(SERVED)}
ROUND_TRIPS = [
    n if n in _FIRST_OF_STYLE.values() else pytest.param(n, marks=pytest.mark.slow) for n in SERVED
]
# one template per thinking syntax (and per prompt that opens the block or not)
THINKING_SERVED = [
    "glm-4.6",
    "glm-4.7-flash",
    "seed-oss",
    "minimax-m3",
    "command-r7b",
    "cohere2-moe",
    "apertus",
    "gemma-4",
    "apriel-1.6",
    "ministral-3",
    "hy3",
]
OPTIONS = {"temperature": 0, "num_predict": 600, "num_thread": 1, "num_ctx": 8192}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalrtServer]:
    root = tmp_path_factory.mktemp("official")
    store = Store(root / "models")
    for name in SERVED:
        family = OFFICIAL[name].family()
        path = write_tiny_llama(
            root / f"{name}.gguf",
            chat_template=family.template,
            extra_specials=family.specials,
            context_length=16384,
        )
        import_gguf(store, f"{name}:tiny", path)
    srv = LocalrtServer(store.root, root / "serve.log")
    yield srv
    srv.stop()
    assert "Traceback" not in (root / "serve.log").read_text(errors="replace")


def grammar(name: str) -> str:
    return forced(OFFICIAL[name].call, OFFICIAL[name].family())


def thinks(name: str) -> bool:
    """Thinking off for the bare call: many of these prompts open a thinking block, and a reply that
    never closes it is all thinking (thinking then a call is tested on its own)."""
    return model_format(OFFICIAL[name].template).can_think


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("name", ROUND_TRIPS)
def test_ollama_chat_returns_the_call(server: LocalrtServer, name: str, stream: bool) -> None:
    client = ollama.Client(host=server.url)
    options = {**OPTIONS, "grammar": grammar(name)}
    think = False if thinks(name) else None
    kwargs: dict[str, Any] = dict(messages=ASK, tools=[WEATHER], options=options, think=think)
    if stream:
        parts = list(client.chat(f"{name}:tiny", **kwargs, stream=True))
    else:
        parts = [client.chat(f"{name}:tiny", **kwargs)]
    found = [c for p in parts for c in p.message.tool_calls or []]
    assert [c.function.name for c in found] == ["get_weather"]
    assert found[0].function.arguments == ARGS
    assert "".join(p.message.content or "" for p in parts).strip() == ""


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("name", ROUND_TRIPS)
def test_openai_chat_returns_the_call(server: LocalrtServer, name: str, stream: bool) -> None:
    oai = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    extra = {**{k: v for k, v in OPTIONS.items() if k != "num_predict"}, "grammar": grammar(name)}
    kwargs: dict[str, Any] = dict(
        model=f"{name}:tiny", messages=ASK, tools=[WEATHER], max_tokens=600, extra_body=extra
    )
    if thinks(name):
        kwargs["reasoning_effort"] = "none"
    if not stream:
        choice = oai.chat.completions.create(**kwargs).choices[0]
        assert choice.finish_reason == "tool_calls"
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
        content = choice.message.content or ""
    else:
        chunks = [c for c in oai.chat.completions.create(**kwargs, stream=True) if c.choices]
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
        deltas = [t for c in chunks for t in c.choices[0].delta.tool_calls or []]
        calls = [(d.function.name, d.function.arguments) for d in deltas if d.function and d.function.name]
        content = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert [n for n, _ in calls] == ["get_weather"]
    assert json.loads(calls[0][1]) == ARGS
    assert content.strip() == ""


@pytest.mark.parametrize("name", THINKING_SERVED)
def test_thinking_then_a_call_through_the_server(server: LocalrtServer, name: str) -> None:
    family = OFFICIAL[name]
    reply = thinking_reply(family, thinking_prompt(family))
    options = {**OPTIONS, "grammar": forced(reply, family.family())}
    client = ollama.Client(host=server.url)
    parts = list(
        client.chat(f"{name}:tiny", messages=ASK, tools=[WEATHER], options=options, think=True, stream=True)
    )
    assert "".join(p.message.thinking or "" for p in parts) == "Use the tool."
    found = [c for p in parts for c in p.message.tool_calls or []]
    assert [c.function.arguments for c in found] == [ARGS]
    oai = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    extra = {**{k: v for k, v in OPTIONS.items() if k != "num_predict"}, "grammar": options["grammar"]}
    message = (
        oai.chat.completions.create(
            model=f"{name}:tiny",
            messages=ASK,
            tools=[WEATHER],
            max_tokens=600,
            reasoning_effort="high",
            extra_body=extra,
        )
        .choices[0]
        .message
    )
    assert message.model_extra["reasoning_content"] == "Use the tool."
    assert [json.loads(c.function.arguments) for c in message.tool_calls or []] == [ARGS]


@pytest.mark.parametrize("think", [Think(True, "medium"), Think(True, "low"), Think(False)])
def test_hunyuan_reasoning_effort_is_one_its_template_accepts(think: Think) -> None:
    family = OFFICIAL["hy3"]
    variables = template_variables(model_format(family.template), think)
    prompt = template_of(family).render(ASK, extra=variables).text  # the template raises on other values
    closed = prompt.endswith("<think:opensource></think:opensource>")
    assert closed is (think.enabled is False)


CITY = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather for a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"], "description": "The city"}},
            "required": ["city"],
        },
    },
}


@pytest.mark.parametrize("name", sorted(n for s, n in _FIRST_OF_STYLE.items() if s in FAMILY_STYLES))
def test_tool_choice_required_writes_a_call_the_family_reads(server: LocalrtServer, name: str) -> None:
    # no forced reply: the random model writes, the grammar makes it a call between the family's markers
    oai = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    extra = {k: v for k, v in OPTIONS.items() if k != "num_predict"}
    kwargs: dict[str, Any] = {"reasoning_effort": "none"} if thinks(name) else {}
    choice = oai.chat.completions.create(
        model=f"{name}:tiny",
        messages=ASK,
        tools=[CITY],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=300,
        extra_body=extra,
        **kwargs,
    ).choices[0]
    assert choice.finish_reason == "tool_calls"
    [call] = choice.message.tool_calls or []
    assert json.loads(call.function.arguments)["city"] in ("Paris", "Rome")
