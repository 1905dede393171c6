"""A real `localrt serve` on 127.0.0.1 driven by the official `ollama` and `openai` Python packages.

One server for the module (the model loads once); greedy decoding with short `num_predict` keeps it
fast. The real SmolLM2-135M-Instruct answers; assertions check properties, not exact texts.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import ollama
import openai
import pytest

from localrt.store.catalog import load_catalog
from localrt.store.importer import import_gguf
from localrt.store.store import Store
from tests.agent_templates import CHATML_JSON_TOOLS
from tests.clients_fixtures import CALL_SCHEMA
from tests.clients_fixtures import WEATHER_TOOL
from tests.servers.registry import Registry
from tests.servers.serve import LocalrtServer

MODEL = "smollm2:135m"
TOOLS_MODEL = "smollm2-tools:135m"
GREEDY = {"temperature": 0, "num_predict": 24, "num_ctx": 2048}
CITY_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
    "required": ["city", "country"],
}


@pytest.fixture(scope="module")
def server(smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalrtServer]:
    root = tmp_path_factory.mktemp("api-clients")
    # the catalog's system prompt, as `localrt pull smollm2:135m` would store it
    import_gguf(Store(root / "models"), MODEL, smollm2_gguf, system=load_catalog().find(MODEL).system)
    # SmolLM2's own template shows no tools (tools for it are a 400): the tool tests use the same file
    # under ChatML that shows tools as JSON (SmolLM2's calls are bare JSON)
    import_gguf(
        Store(root / "models"),
        TOOLS_MODEL,
        smollm2_gguf,
        system=load_catalog().find(MODEL).system,
        template=CHATML_JSON_TOOLS,
    )
    srv = LocalrtServer(root / "models", root / "serve.log", env={"LOCALRT_KEEP_ALIVE": "10m"})
    yield srv
    assert srv.stop() in (0, -signal.SIGTERM)  # uvicorn re-raises SIGTERM after a graceful shutdown
    assert "Traceback" not in srv.log_path.read_text(errors="replace")


@pytest.fixture(scope="module")
def client(server: LocalrtServer) -> ollama.Client:
    return ollama.Client(host=server.url)


@pytest.fixture(scope="module")
def oai(server: LocalrtServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


# ---- Ollama client ----------------------------------------------------------------------------
def test_list_and_show(client: ollama.Client) -> None:
    [model] = [m for m in client.list().models if m.model == MODEL]
    assert model.details.family == "llama"
    assert model.details.quantization_level == "Q4_1"
    assert model.size > 90_000_000
    info = client.show(MODEL)
    assert info.modelinfo["general.architecture"] == "llama"
    assert info.modelinfo["llama.context_length"] == 8192
    assert "<|im_start|>" in info.template
    assert "FROM " in info.modelfile


def test_generate_not_streamed(client: ollama.Client) -> None:
    started = time.perf_counter_ns()
    r = client.generate(MODEL, "What is the capital of France?", options=GREEDY)
    waited = time.perf_counter_ns() - started
    assert r.done
    assert r.done_reason in ("stop", "length")
    assert "Paris" in r.response
    assert r.eval_count > 0
    assert r.prompt_eval_count > 0
    # the durations are measured in nanoseconds: their parts fit in the total, which fits in the time
    # this client waited for the answer (a figure in other units, or a part counted twice, would not)
    assert r.prompt_eval_duration + r.eval_duration <= r.total_duration
    assert r.load_duration + r.prompt_eval_duration <= r.total_duration
    assert r.total_duration <= waited
    assert r.context
    assert len(r.context) > r.prompt_eval_count


def test_generate_streamed_matches_not_streamed(client: ollama.Client) -> None:
    # keep_alive 0 unloads after each answer, so both runs evaluate the prompt from a cold cache:
    # llama.cpp's floats depend on batch shapes, and a reused prefix can flip a near-tie in greedy.
    whole = client.generate(MODEL, "Name three colors.", options=GREEDY, keep_alive=0).response
    assert MODEL not in [m.model for m in client.ps().models]
    chunks = list(client.generate(MODEL, "Name three colors.", options=GREEDY, stream=True, keep_alive=0))
    assert len(chunks) > 2
    assert chunks[-1].done
    assert not any(c.done for c in chunks[:-1])
    assert "".join(c.response for c in chunks) == whole


def test_chat_streamed_and_not(client: ollama.Client) -> None:
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    r = client.chat(MODEL, messages=messages, options=GREEDY)
    assert r.message.role == "assistant"
    assert "Paris" in r.message.content
    parts = list(client.chat(MODEL, messages=messages, options=GREEDY, stream=True))
    assert "".join(p.message.content for p in parts) == r.message.content
    final = parts[-1]
    assert final.done
    assert final.eval_count == r.eval_count


def test_chat_json_schema_output_validates(client: ollama.Client) -> None:
    r = client.chat(
        MODEL,
        messages=[{"role": "user", "content": "Where is the Eiffel Tower? Answer in JSON."}],
        format=CITY_SCHEMA,
        options={**GREEDY, "num_predict": 64},
    )
    jsonschema.validate(json.loads(r.message.content), CITY_SCHEMA)


def test_tool_call_round_trip(client: ollama.Client) -> None:
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = client.chat(
        TOOLS_MODEL,
        messages=messages,
        tools=[WEATHER_TOOL],
        format=CALL_SCHEMA,
        options={**GREEDY, "num_predict": 64},
    )
    assert r.message.tool_calls, r.message
    call = r.message.tool_calls[0]
    assert call.function.name == "get_weather"
    assert isinstance(call.function.arguments["city"], str)

    # the answer to the call goes back in: the template renders the tool's result into the prompt (a
    # longer result makes a longer prompt, counted whole from a cold cache) and the model replies
    def follow_up(result: str) -> ollama.ChatResponse:
        history = [*messages, r.message, {"role": "tool", "content": result, "tool_name": "get_weather"}]
        options = {**GREEDY, "num_predict": 4}
        return client.chat(TOOLS_MODEL, messages=history, tools=[WEATHER_TOOL], options=options, keep_alive=0)

    short = follow_up('{"temperature": "21C", "sky": "clear"}')
    long = follow_up(json.dumps({"temperature": "21C", "sky": "clear", "note": "calm " * 40}))
    assert short.done_reason in ("stop", "length")
    assert short.eval_count > 0
    assert long.prompt_eval_count - short.prompt_eval_count >= 40


def test_logprobs(client: ollama.Client) -> None:
    r = client.generate(
        MODEL, "The sky is", options={**GREEDY, "num_predict": 4}, logprobs=True, top_logprobs=3
    )
    assert r.logprobs
    assert len(r.logprobs) == r.eval_count
    first = r.logprobs[0]
    assert len(first.top_logprobs) == 3
    assert first.logprob == pytest.approx(max(t.logprob for t in first.top_logprobs), abs=1e-4)  # greedy


def test_embed(client: ollama.Client) -> None:
    r = client.embed(MODEL, ["The cat sat on the mat.", "Stock markets fell sharply today."])
    assert len(r.embeddings) == 2
    assert len(r.embeddings[0]) == 576
    legacy = client.embeddings(MODEL, "The cat sat on the mat.")
    assert legacy.embedding == pytest.approx(r.embeddings[0], abs=1e-4)


def test_embed_dimensions(client: ollama.Client) -> None:
    whole = client.embed(MODEL, "The cat sat on the mat.").embeddings[0]
    short = client.embed(MODEL, "The cat sat on the mat.", dimensions=64).embeddings[0]
    assert len(short) == 64
    assert sum(v * v for v in short) == pytest.approx(1.0, abs=1e-5)
    norm = sum(v * v for v in whole[:64]) ** 0.5
    assert short == pytest.approx([v / norm for v in whole[:64]], abs=1e-5)


def test_ps_shows_the_loaded_model(client: ollama.Client) -> None:
    client.generate(MODEL, "Hi", options={**GREEDY, "num_predict": 1})
    [row] = [m for m in client.ps().models if m.model == MODEL]
    assert row.size > 0
    assert row.context_length == GREEDY["num_ctx"]


def test_copy_and_delete(client: ollama.Client) -> None:
    client.copy(MODEL, "me/smol-copy")
    assert "me/smol-copy:latest" in [m.model for m in client.list().models]
    client.delete("me/smol-copy")
    assert "me/smol-copy:latest" not in [m.model for m in client.list().models]
    with pytest.raises(ollama.ResponseError) as err:
        client.delete("me/smol-copy")
    assert err.value.status_code == 404


def test_create_from_uploaded_blob(client: ollama.Client, smollm2_gguf: Path) -> None:
    digest = client.create_blob(smollm2_gguf)
    statuses = [
        p.status
        for p in client.create(
            "me/smol-created",
            files={"model.gguf": digest},
            system="You are terse.",
            parameters={"temperature": 0.1},
            stream=True,
        )
    ]
    assert statuses[-1] == "success"
    info = client.show("me/smol-created")
    assert 'SYSTEM """You are terse."""' in info.modelfile
    assert "temperature" in info.parameters
    client.delete("me/smol-created")


def test_pull_with_progress(client: ollama.Client, tmp_path: Path) -> None:
    from tests.gguf_factory import write_tiny_llama

    tiny = write_tiny_llama(tmp_path / "tiny.gguf")
    with Registry() as registry:
        registry.add_model("library/tiny", "1", tiny)
        name = f"{registry.address}/library/tiny:1"
        events = list(client.pull(name, insecure=True, stream=True))
    statuses = [e.status for e in events]
    assert statuses[0] == "pulling manifest"
    assert statuses[-1] == "success"
    layer = [e for e in events if e.digest and e.total]
    assert layer
    assert layer[-1].completed == layer[-1].total
    assert name in [m.model for m in client.list().models]
    client.delete(name)


def test_errors_and_server_stays_up(client: ollama.Client, server: LocalrtServer) -> None:
    with pytest.raises(ollama.ResponseError) as err:
        client.chat("nosuch:model", messages=[{"role": "user", "content": "hi"}])
    assert err.value.status_code == 404
    with pytest.raises(ollama.ResponseError) as err:
        client.generate(MODEL, "hi", options={"temperature": "hot"})
    assert err.value.status_code == 400
    assert "temperature" in str(err.value)
    with pytest.raises(ollama.ResponseError) as err:
        client.generate(MODEL, "hi", options={"no_such_option": 1})
    assert err.value.status_code == 400
    too_long = {"model": MODEL, "prompt": "word " * 3000, "options": {"num_ctx": 512, "num_predict": 2}}
    r = httpx.post(
        server.url + "/api/generate", json={**too_long, "truncate": False, "stream": False}, timeout=120
    )
    assert r.status_code == 400
    assert "does not fit the context length of 512 tokens" in r.json()["error"]
    # truncate (the default): the prompt keeps its start and its newest tokens, and is answered
    r = httpx.post(server.url + "/api/generate", json={**too_long, "stream": False}, timeout=120)
    assert r.status_code == 200
    assert r.json()["done"] is True
    assert client.generate(MODEL, "Hi", options={**GREEDY, "num_predict": 2}).done


def test_disconnect_cancels_generation(server: LocalrtServer) -> None:
    """A client that goes away mid-stream frees the model: the next request is served at once."""
    body = {
        "model": MODEL,
        "prompt": "Count from one to ten thousand, one number per line.",
        "options": {"temperature": 0, "num_predict": 6000, "num_ctx": 8192},
    }
    with httpx.stream("POST", server.url + "/api/generate", json=body, timeout=60) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i >= 3:
                break
    done = threading.Event()
    result: dict = {}

    def follow_up() -> None:
        result.update(
            httpx.post(
                server.url + "/api/generate",
                json={
                    "model": MODEL,
                    "prompt": "Hi",
                    "stream": False,
                    "options": {**GREEDY, "num_predict": 2},
                },
                timeout=120,
            ).json()
        )
        done.set()

    threading.Thread(target=follow_up, daemon=True).start()
    # a liveness bound, not a speed target: 6000 tokens would take minutes on this machine
    assert done.wait(60), "the cancelled generation still holds the model"
    assert result.get("done") is True


def test_metrics_and_tokenize(server: LocalrtServer) -> None:
    body = {"model": MODEL, "prompt": "Hi", "stream": False, "options": {**GREEDY, "num_predict": 2}}
    assert httpx.post(server.url + "/api/generate", json=body, timeout=120).status_code == 200
    toks = httpx.post(server.url + "/api/tokenize", json={"model": MODEL, "text": "Hello world"}).json()[
        "tokens"
    ]
    assert toks
    assert all(isinstance(t, int) for t in toks)
    text = httpx.post(server.url + "/api/detokenize", json={"model": MODEL, "tokens": toks}).json()["text"]
    assert text.strip() == "Hello world"
    metrics = httpx.get(server.url + "/metrics").text
    assert 'localrt_requests_total{route="/api/generate",status="200"}' in metrics
    assert "localrt_time_to_first_token_seconds_bucket" in metrics
    # the gauge counts what /api/ps lists (the tool tests may have loaded the ChatML copy too)
    loaded = len(httpx.get(server.url + "/api/ps").json()["models"])
    assert f"localrt_loaded_models {loaded}\n" in metrics


# ---- top-level sampling fields and tool_choice (localrt's addition to Ollama's API) ----------------
def post(server: LocalrtServer, route: str, **body: object) -> httpx.Response:
    return httpx.post(server.url + route, json={"model": MODEL, "stream": False, **body}, timeout=300)


@pytest.mark.parametrize("field", ["max_tokens", "max_output_tokens"])
@pytest.mark.parametrize("route", ["/api/generate", "/api/chat"])
def test_top_level_token_limit_is_honoured(server: LocalrtServer, route: str, field: str) -> None:
    ask = (
        {"prompt": "Count from 1 to 100."}
        if route == "/api/generate"
        else {"messages": [{"role": "user", "content": "Count from 1 to 100."}]}
    )
    r = post(server, route, **ask, temperature=0, **{field: 7})
    assert r.status_code == 200, r.text
    assert r.json()["eval_count"] == 7
    assert r.json()["done_reason"] == "length"


def test_options_win_over_top_level_fields(server: LocalrtServer) -> None:
    r = post(server, "/api/generate", prompt="Count from 1 to 100.", max_tokens=9, options={"num_predict": 4})
    assert r.json()["eval_count"] == 4
    # a null option is not set: the top-level value applies
    r = post(
        server, "/api/generate", prompt="Count from 1 to 100.", max_tokens=5, options={"num_predict": None}
    )
    assert r.json()["eval_count"] == 5


def test_top_level_sampling_fields_are_honoured(server: LocalrtServer) -> None:
    prompt = "Write a short poem about the sea."
    greedy = post(server, "/api/generate", prompt=prompt, options={"temperature": 0, "num_predict": 16})
    top_level = post(server, "/api/generate", prompt=prompt, temperature=0, max_tokens=16)
    assert top_level.json()["response"] == greedy.json()["response"]
    hot = {"prompt": prompt, "temperature": 1.5, "top_p": 1.0, "top_k": 0, "max_tokens": 16}
    first, again = post(server, "/api/generate", **hot, seed=7), post(server, "/api/generate", **hot, seed=7)
    other = post(server, "/api/generate", **hot, seed=8)
    assert first.json()["response"] == again.json()["response"]
    assert first.json()["response"] != other.json()["response"]
    assert first.json()["response"] != greedy.json()["response"]
    stopped = post(
        server, "/api/generate", prompt="Count from 1 to 10: 1, 2,", temperature=0, stop=" 5", max_tokens=24
    )
    assert stopped.json()["done_reason"] == "stop"
    assert " 5" not in stopped.json()["response"]


def test_a_bad_top_level_field_is_a_400_naming_it(server: LocalrtServer) -> None:
    r = post(server, "/api/chat", messages=[{"role": "user", "content": "Hi"}], temperature="hot")
    assert r.status_code == 400
    assert "temperature" in r.json()["error"]


@pytest.mark.parametrize(
    "choice",
    [
        "required",
        {"type": "function", "name": "get_weather"},
        {"type": "function", "function": {"name": "get_weather"}},
    ],
)
def test_tool_choice_on_api_chat_forces_a_call(server: LocalrtServer, choice: object) -> None:
    r = httpx.post(
        server.url + "/api/chat",
        json={
            "model": TOOLS_MODEL,
            "messages": [{"role": "user", "content": "Hello there!"}],
            "tools": [WEATHER_TOOL],
            "tool_choice": choice,
            "stream": False,
            "options": {**GREEDY, "num_predict": 64},
        },
        timeout=300,
    )
    assert r.status_code == 200, r.text
    calls = r.json()["message"].get("tool_calls") or []
    assert [c["function"]["name"] for c in calls][:1] == ["get_weather"]


def test_tool_choice_none_on_api_chat_hides_the_tools(server: LocalrtServer) -> None:
    body = {"model": TOOLS_MODEL, "messages": [{"role": "user", "content": "Hi"}], "tools": [WEATHER_TOOL]}
    r = post(
        server,
        "/api/chat",
        **body,
        tool_choice="none",
        options={**GREEDY, "num_predict": 48},
        format=CALL_SCHEMA,
    )
    assert r.status_code == 200, r.text
    assert not r.json()["message"].get("tool_calls")  # the call-shaped JSON stays text: no tools were offered


def test_tool_choice_without_tools_is_a_400(server: LocalrtServer) -> None:
    for route, ask in (
        ("/api/generate", {"prompt": "Hi"}),
        ("/api/chat", {"messages": [{"role": "user", "content": "Hi"}]}),
    ):
        r = post(server, route, **ask, tool_choice="required")
        assert r.status_code == 400, route
        assert "tool_choice" in r.json()["error"]
    r = post(server, "/api/chat", messages=[], tool_choice={"type": "web_search_preview"})
    assert r.status_code == 400
    assert "tool_choice" in r.json()["error"]


# ---- OpenAI client ----------------------------------------------------------------------------
def test_openai_models(oai: openai.OpenAI) -> None:
    assert MODEL in [m.id for m in oai.models.list().data]
    assert oai.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        oai.models.retrieve("nosuch")


def test_openai_chat(oai: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    r = oai.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=24)
    assert "Paris" in r.choices[0].message.content
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.completion_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    stream = oai.chat.completions.create(
        model=MODEL,
        messages=messages,
        temperature=0,
        max_tokens=24,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == r.choices[0].message.content
    assert chunks[-1].usage
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    # the same prompt again: all of it but the last token comes from the KV cache
    assert chunks[-1].usage.prompt_tokens == r.usage.prompt_tokens
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == r.usage.prompt_tokens - 1


def test_openai_completions_and_embeddings(oai: openai.OpenAI) -> None:
    r = oai.completions.create(model=MODEL, prompt="The capital of France is", temperature=0, max_tokens=8)
    assert r.choices[0].text
    assert r.usage.completion_tokens > 0
    e = oai.embeddings.create(model=MODEL, input=["hello", "world"])
    assert len(e.data) == 2
    assert len(e.data[0].embedding) == 576


def test_openai_json_schema_and_tools(oai: openai.OpenAI) -> None:
    r = oai.chat.completions.create(
        model=TOOLS_MODEL,
        messages=[{"role": "user", "content": "Where is the Eiffel Tower?"}],
        temperature=0,
        max_tokens=64,
        response_format={"type": "json_schema", "json_schema": {"name": "place", "schema": CITY_SCHEMA}},
    )
    jsonschema.validate(json.loads(r.choices[0].message.content), CITY_SCHEMA)
    call = oai.chat.completions.create(
        model=TOOLS_MODEL,
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        temperature=0,
        max_tokens=64,
        tools=[WEATHER_TOOL],
        response_format={"type": "json_schema", "json_schema": {"name": "call", "schema": CALL_SCHEMA}},
    )
    choice = call.choices[0]
    assert choice.finish_reason == "tool_calls"
    tool_call = choice.message.tool_calls[0]
    assert tool_call.function.name == "get_weather"
    assert "city" in json.loads(tool_call.function.arguments)

    def follow_up(result: str) -> Any:
        return oai.chat.completions.create(
            model=TOOLS_MODEL,
            temperature=0,
            max_tokens=4,
            tools=[WEATHER_TOOL],
            messages=[
                {"role": "user", "content": "What is the weather in Paris?"},
                choice.message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": tool_call.id, "content": result},
            ],
        )

    # the result reaches the prompt (usage counts the whole prompt, a cached prefix included)
    short = follow_up('{"temperature": "21C"}')
    long = follow_up(json.dumps({"temperature": "21C", "note": "calm " * 40}))
    assert short.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert long.usage.prompt_tokens - short.usage.prompt_tokens >= 40


def test_openai_logprobs_and_errors(oai: openai.OpenAI) -> None:
    r = oai.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hi"}],
        temperature=0,
        max_tokens=3,
        logprobs=True,
        top_logprobs=2,
    )
    content = r.choices[0].logprobs.content
    assert content
    assert len(content[0].top_logprobs) == 2
    with pytest.raises(openai.NotFoundError) as err:
        oai.chat.completions.create(model="nosuch", messages=[{"role": "user", "content": "Hi"}])
    assert err.value.body["type"] == "not_found_error"
    with pytest.raises(openai.BadRequestError):
        oai.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], temperature="hot"
        )


# ---- thinking on a model that cannot think; capabilities; null options ---------------
def test_think_true_on_smollm2_is_a_400_naming_the_model(client: ollama.Client) -> None:
    for call in (
        lambda: client.chat(MODEL, messages=[{"role": "user", "content": "Hi"}], think=True, options=GREEDY),
        lambda: client.generate(MODEL, "Hi", think="high", options=GREEDY),
    ):
        with pytest.raises(ollama.ResponseError) as e:
            call()
        assert e.value.status_code == 400
        assert e.value.error == f'"{MODEL}" does not support thinking'


@pytest.mark.parametrize("think", [False, None])
def test_think_false_and_absent_work_on_smollm2(client: ollama.Client, think: bool | None) -> None:
    r = client.chat(MODEL, messages=[{"role": "user", "content": "Hi"}], think=think, options=GREEDY)
    assert r.message.content
    assert not r.message.thinking


def test_show_capabilities_of_smollm2(client: ollama.Client) -> None:
    # SmolLM2's template renders no tools, so only completion
    assert client.show(MODEL).capabilities == ["completion"]


def test_bad_think_value_is_a_400(server: LocalrtServer) -> None:
    r = httpx.post(
        server.url + "/api/chat", json={"model": MODEL, "messages": [], "think": "very"}, timeout=30
    )
    assert r.status_code == 400
    assert "think" in r.json()["error"]


def test_null_options_mean_not_set(server: LocalrtServer) -> None:
    options = {"mirostat": None, "num_ctx": None, "temperature": None, "stop": None, "num_predict": 4}
    r = httpx.post(
        server.url + "/api/generate",
        json={"model": MODEL, "prompt": "Hi", "stream": False, "options": options, "system": None},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    assert r.json()["done"] is True


def test_openai_reasoning_effort(oai: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Hi"}]
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=MODEL, messages=messages, reasoning_effort="low", max_tokens=4)
    assert "does not support thinking" in str(e.value)
    r = oai.chat.completions.create(model=MODEL, messages=messages, reasoning_effort="none", max_tokens=4)
    assert r.choices[0].message.content


def test_openai_num_ctx_in_extra_body(oai: openai.OpenAI, client: ollama.Client) -> None:
    messages = [{"role": "user", "content": "Hi"}]
    r = oai.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=4, extra_body={"num_ctx": 1536}
    )
    assert r.choices[0].message.content is not None
    [loaded] = [m for m in client.ps().models if m.model == MODEL]
    assert loaded.context_length == 1536
    client.chat(MODEL, messages=[{"role": "user", "content": "Hi"}], options=GREEDY)  # back to the others'


# ---- LangChain's Ollama integration ------------------------------------------------------------
def test_langchain_chat_ollama_invoke_and_stream(server: LocalrtServer) -> None:
    from langchain_ollama import ChatOllama

    llm = ChatOllama(model=MODEL, base_url=server.url, temperature=0, num_predict=16, num_ctx=2048)
    answer = llm.invoke("What is the capital of France?")
    assert "Paris" in answer.content
    pieces = [chunk.content for chunk in llm.stream("What is the capital of France?")]
    assert len(pieces) > 1
    assert "".join(pieces) == answer.content


def test_langchain_chat_ollama_tools(server: LocalrtServer) -> None:
    from langchain_core.tools import tool
    from langchain_ollama import ChatOllama

    @tool
    def get_weather(city: str) -> str:
        """Get the current weather for a city."""
        return "21C"

    # the schema makes SmolLM2 answer with a call, which the server parses into tool_calls
    llm = ChatOllama(
        model=TOOLS_MODEL,
        base_url=server.url,
        temperature=0,
        num_predict=64,
        num_ctx=2048,
        format=CALL_SCHEMA,
    ).bind_tools([get_weather])
    message = llm.invoke("What is the weather in Paris?")
    assert [c["name"] for c in message.tool_calls] == ["get_weather"]
    assert isinstance(message.tool_calls[0]["args"]["city"], str)


def test_langchain_ollama_embeddings(server: LocalrtServer) -> None:
    from langchain_ollama import OllamaEmbeddings

    # sends "options": {"mirostat": null, ...}: null means not set
    vector = OllamaEmbeddings(model=MODEL, base_url=server.url).embed_query("Hello world")
    assert len(vector) == 576
    assert any(v != 0 for v in vector)
