"""A remote model is a proxy, against llama.cpp's own llama-server as the upstream (built by
`tests/fixtures_hf.py::llama_cpp_tools()`, as the oracle tests build it).

The upstream serves SmolLM2 under Qwen3.5's chat template, whose generation prompt opens a thinking block
(so llama-server's `--reasoning-format deepseek` answers in `reasoning_content`) and whose tool calls
llama-server parses and streams; its `/slots` shows the sampling parameters each request ran with. A
`localrt serve` holds the remote model; the official `openai` and `ollama` clients drive both.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import ollama
import openai
import pytest

from localrt.store.remote import create_remote
from localrt.store.store import Store
from tests.servers.llama_server import running_llama_server
from tests.servers.serve import LocalrtServer

TEMPLATE = Path(__file__).with_name("templates") / "Qwen3.5-4B.jinja"
THREADS = os.environ.get("LOCALRT_TEST_THREADS", "1")
UPSTREAM_MODEL = "smollm2"
PARIS = [{"role": "user", "content": "What is the capital of France?"}]
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
# One call made before, and the next one begun in the template's own call format: llama-server continues
# a last assistant turn, so the tiny model only has to finish the call as the first one went, which
# llama-server then parses and streams as a tool call. In OpenAI's shape, then in Ollama's.
BEGUN = {"role": "assistant", "content": "<tool_call>\n<function=get_weather>\n<parameter=city>\n"}
ASKED = {"role": "user", "content": "What is the weather in Paris?"}
CALL_BEGUN = [
    {"role": "user", "content": "What is the weather in Berlin?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Berlin"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    {"role": "assistant", "content": "It is sunny in Berlin."},
    ASKED,
    BEGUN,
]
CALL_BEGUN_OLLAMA = [
    CALL_BEGUN[0],
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Berlin"}}}],
    },
    {"role": "tool", "content": "sunny", "tool_name": "get_weather"},
    *CALL_BEGUN[3:],
]


@pytest.fixture(scope="module")
def upstream(smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    args = [
        *("-m", str(smollm2_gguf), "-c", "4096", "-np", "1", "-t", THREADS, "--alias", UPSTREAM_MODEL),
        *("--jinja", "--chat-template-file", str(TEMPLATE), "--reasoning-format", "deepseek"),
    ]
    log = tmp_path_factory.mktemp("llama-server") / "log"
    with running_llama_server(args, log, limit=900) as url:
        yield url


@pytest.fixture(scope="module")
def front(upstream: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalrtServer]:
    root = tmp_path_factory.mktemp("front")
    store = Store(root / "models")
    create_remote(store, "far", [upstream + "/v1"], model=UPSTREAM_MODEL)
    server = LocalrtServer(store.root, root / "serve.log")
    yield server
    server.stop()
    assert "Traceback" not in server.log_path.read_text(errors="replace")


def oai(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=600)


def slot_params(upstream: str) -> dict[str, Any]:
    """The sampling parameters of the upstream's one slot, as its last request set them."""
    [slot] = httpx.get(upstream + "/slots", timeout=30).json()
    return slot["params"]


def streamed(client: openai.OpenAI, model: str, messages: list[dict[str, Any]], **fields: Any) -> list[Any]:
    stream = client.chat.completions.create(
        model=model, messages=messages, stream=True, stream_options={"include_usage": True}, **fields
    )
    return list(stream)


def reasoning_of(chunks: list[Any]) -> str:
    return "".join(
        (c.choices[0].delta.model_extra or {}).get("reasoning_content") or "" for c in chunks if c.choices
    )


def test_a_chat_reaches_the_upstream_with_the_sampling_parameters_it_sent(
    upstream: str, front: LocalrtServer
) -> None:
    """A chat that sets no sampling field runs with the upstream's own defaults through localrt, by the
    OpenAI route (forwarded as written) and by Ollama's (translated once), as when sent directly."""
    streamed(oai(upstream), UPSTREAM_MODEL, PARIS, max_tokens=4)
    direct = slot_params(upstream)
    streamed(oai(front.url), "far", PARIS, max_tokens=4)
    forwarded = slot_params(upstream)
    ollama.Client(host=front.url, timeout=600).chat("far", messages=PARIS, options={"num_predict": 4})
    translated = slot_params(upstream)
    assert forwarded == direct
    assert translated == direct
    # the upstream's defaults, not the ones localrt uses for its own models (0.8, 0.9, top_k 40, 0.0)
    assert (direct["top_p"], direct["min_p"]) == pytest.approx((0.95, 0.05))


def test_greedy_the_same_text_through_localrt_as_directly(upstream: str, front: LocalrtServer) -> None:
    direct = (
        oai(upstream)
        .chat.completions.create(model=UPSTREAM_MODEL, messages=PARIS, temperature=0, max_tokens=16)
        .choices[0]
        .message
    )
    ours = (
        ollama.Client(host=front.url, timeout=600)
        .chat("far", messages=PARIS, options={"temperature": 0, "num_predict": 16})
        .message
    )
    forwarded = oai(front.url).chat.completions.create(
        model="far", messages=PARIS, temperature=0, max_tokens=16
    )
    assert ours.thinking == direct.model_extra["reasoning_content"]
    assert ours.content == direct.content
    assert (
        forwarded.choices[0].message.model_extra["reasoning_content"]
        == direct.model_extra["reasoning_content"]
    )


def test_a_streamed_tool_call_arrives_as_deltas_with_its_id(upstream: str, front: LocalrtServer) -> None:
    chunks = streamed(oai(front.url), "far", CALL_BEGUN, tools=[WEATHER_TOOL], temperature=0, max_tokens=24)
    deltas = [call for c in chunks if c.choices for call in c.choices[0].delta.tool_calls or []]
    assert len(deltas) >= 2  # the call as it is made: its name first, its arguments in pieces
    assert deltas[0].id
    assert deltas[0].function.name == "get_weather"
    assert all(d.index == 0 for d in deltas)
    assert json.loads("".join(d.function.arguments or "" for d in deltas)) == {"city": "Paris"}
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    # translated for an Ollama client, the call keeps the upstream's id
    body = {"model": "far", "messages": CALL_BEGUN_OLLAMA, "tools": [WEATHER_TOOL], "stream": False}
    body["options"] = {"temperature": 0, "num_predict": 24}
    [call] = httpx.post(front.url + "/api/chat", json=body, timeout=600).json()["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert call["function"]["arguments"] == {"city": "Paris"}
    assert len(call["id"]) == len(deltas[0].id)


def test_reasoning_content_arrives(front: LocalrtServer) -> None:
    chunks = streamed(oai(front.url), "far", PARIS, temperature=0, max_tokens=8)
    assert (
        sum(
            bool((c.choices[0].delta.model_extra or {}).get("reasoning_content")) for c in chunks if c.choices
        )
        > 1
    )
    assert reasoning_of(chunks)
    parts = list(
        ollama.Client(host=front.url, timeout=600).chat(
            "far", messages=PARIS, options={"temperature": 0, "num_predict": 8}, stream=True
        )
    )
    assert sum(bool(p.message.thinking) for p in parts) > 1  # streamed as it comes
    assert "".join(p.message.thinking or "" for p in parts) == reasoning_of(chunks)


def test_a_forwarded_answer_is_counted_in_metrics(front: LocalrtServer) -> None:
    """localrt reads the usage off the forwarded bytes (where the client asked for it) for /metrics."""

    def generated() -> int:
        text = httpx.get(front.url + "/metrics", timeout=30).text
        return int(
            next(
                line for line in text.splitlines() if line.startswith("localrt_generated_tokens_total ")
            ).split()[1]
        )

    before = generated()
    chunks = streamed(oai(front.url), "far", PARIS, temperature=0, max_tokens=4)
    assert chunks[-1].usage.completion_tokens == 4
    assert generated() - before == 4
    whole = oai(front.url).chat.completions.create(model="far", messages=PARIS, temperature=0, max_tokens=3)
    assert whole.usage.completion_tokens == 3
    assert generated() - before == 7
