"""The apps people point at Ollama, against a real `localrt serve` on 127.0.0.1, each doing its real job:
LiteLLM (its `ollama_chat/` and `openai/` providers), LlamaIndex's Ollama LLM and embeddings, the Vercel AI
SDK (its Ollama provider and `@ai-sdk/openai-compatible`, a Node script run with the machine's Node) and
aider (one message that edits a file in a scratch git repository).

LiteLLM and LlamaIndex are pinned in the test extras; the AI SDK and aider are installed by .ci/run at the
versions in tests/clients_fixtures.py (skipped where they are not installed). The real SmolLM2-135M
answers, greedy; assertions check properties, not exact texts. Tool calls are forced as each client
lets its users force them (a JSON schema through LiteLLM's Ollama provider, `tool_choice` elsewhere).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from localrt.store.catalog import load_catalog
from localrt.store.importer import import_gguf
from localrt.store.store import Store
from tests.agent_templates import CHATML_JSON_TOOLS
from tests.agent_templates import official_template
from tests.agents_fixtures import GrammarProxy
from tests.clients_fixtures import CALL_SCHEMA
from tests.clients_fixtures import WEATHER_TOOL
from tests.clients_fixtures import node_modules
from tests.clients_fixtures import venv_bin
from tests.servers.serve import LocalrtServer

MODEL = "smollm2:135m"
TOOLS_MODEL = "smollm2-tools:135m"
# the same file under ChatML with tools as JSON and no call markers: a reply that is a call's JSON is a call
JSON_TOOLS_MODEL = "smollm2-json-tools:135m"
QUESTION = "What is the capital of France?"
AI_SDK_SCRIPT = Path(__file__).parent / "clients" / "ai_sdk.cjs"


@pytest.fixture(scope="module")
def server(smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalrtServer]:
    root = tmp_path_factory.mktemp("client-apps")
    system = load_catalog().find(MODEL).system
    import_gguf(Store(root / "models"), MODEL, smollm2_gguf, system=system)
    # the official Qwen2.5 template (ChatML, as SmolLM2's own, with tools and `<tool_call>` blocks)
    template = official_template("Qwen-Qwen2.5-7B-Instruct.jinja")
    import_gguf(Store(root / "models"), TOOLS_MODEL, smollm2_gguf, system=system, template=template)
    import_gguf(
        Store(root / "models"), JSON_TOOLS_MODEL, smollm2_gguf, system=system, template=CHATML_JSON_TOOLS
    )
    srv = LocalrtServer(root / "models", root / "serve.log", env={"LOCALRT_KEEP_ALIVE": "10m"})
    yield srv
    assert srv.stop() in (0, -signal.SIGTERM)
    log = srv.log_path.read_text(errors="replace")
    assert "Traceback" not in log, log[-4000:]


# ---- LiteLLM ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def litellm() -> Any:
    # the model price list comes from the package, not from GitHub (no network here)
    os.environ["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"
    import litellm

    litellm.telemetry = False
    return litellm


def litellm_models(server: LocalrtServer) -> list[tuple[str, dict[str, Any]]]:
    """Each LiteLLM provider a user points at localrt, with its base URL."""
    return [
        (f"ollama_chat/{MODEL}", {"api_base": server.url}),
        (f"openai/{MODEL}", {"api_base": server.url + "/v1", "api_key": "unused"}),
    ]


@pytest.mark.parametrize("provider", [0, 1], ids=["ollama_chat", "openai"])
def test_litellm_completion_and_stream(litellm: Any, server: LocalrtServer, provider: int) -> None:
    model, where = litellm_models(server)[provider]
    messages = [{"role": "user", "content": QUESTION}]
    r = litellm.completion(model=model, messages=messages, temperature=0, max_tokens=24, **where)
    assert "Paris" in r.choices[0].message.content
    assert r.usage.completion_tokens > 0
    pieces = litellm.completion(
        model=model, messages=messages, temperature=0, max_tokens=24, stream=True, **where
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in pieces)
    assert text == r.choices[0].message.content


@pytest.mark.parametrize("provider", [0, 1], ids=["ollama_chat", "openai"])
def test_litellm_tool_call_round_trip(litellm: Any, server: LocalrtServer, provider: int) -> None:
    model, where = litellm_models(server)[provider]
    messages: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]
    # LiteLLM's Ollama provider drops tool_choice (Ollama ignores it): its users force a call by schema,
    # which a template without call markers reads back as a call
    if model.startswith("ollama_chat/"):
        model = model.replace(MODEL, JSON_TOOLS_MODEL)
        schema = {"type": "json_schema", "json_schema": {"name": "call", "schema": CALL_SCHEMA}}
        force: dict[str, Any] = {"response_format": schema}
    else:
        model, force = model.replace(MODEL, TOOLS_MODEL), {"tool_choice": "required"}
    r = litellm.completion(
        model=model, messages=messages, tools=[WEATHER_TOOL], temperature=0, max_tokens=64, **force, **where
    )
    call = r.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather"
    assert isinstance(json.loads(call.function.arguments)["city"], str)
    messages += [
        r.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": "21C", "sky": "clear"}'},
    ]
    follow = litellm.completion(
        model=model, messages=messages, tools=[WEATHER_TOOL], temperature=0, max_tokens=24, **where
    )
    assert follow.choices[0].message.content or follow.choices[0].message.tool_calls


@pytest.mark.parametrize("provider", [0, 1], ids=["ollama", "openai"])
def test_litellm_embeddings(litellm: Any, server: LocalrtServer, provider: int) -> None:
    model, where = litellm_models(server)[provider]
    model = model.replace("ollama_chat/", "ollama/")
    r = litellm.embedding(model=model, input=["The cat sat on the mat.", "Stock markets fell."], **where)
    assert len(r.data) == 2
    assert len(r.data[0]["embedding"]) == 576
    assert r.data[0]["embedding"] != r.data[1]["embedding"]


# ---- LlamaIndex ------------------------------------------------------------------------------------
def test_llamaindex_complete_chat_and_stream(server: LocalrtServer) -> None:
    from llama_index.core.llms import ChatMessage
    from llama_index.llms.ollama import Ollama

    llm = Ollama(
        model=MODEL,
        base_url=server.url,
        temperature=0,
        context_window=2048,
        request_timeout=300,
        additional_kwargs={"num_predict": 24},
    )
    completed = llm.complete(QUESTION)
    assert "Paris" in completed.text
    streamed = list(llm.stream_complete(QUESTION))
    assert len(streamed) > 1
    assert streamed[-1].text == completed.text  # each piece carries the text so far
    said = llm.chat([ChatMessage(role="user", content=QUESTION)])
    assert "Paris" in said.message.content
    pieces = [r.delta for r in llm.stream_chat([ChatMessage(role="user", content=QUESTION)])]
    assert "".join(p or "" for p in pieces) == said.message.content


def test_llamaindex_embeddings(server: LocalrtServer) -> None:
    from llama_index.embeddings.ollama import OllamaEmbedding

    embedder = OllamaEmbedding(model_name=MODEL, base_url=server.url)
    one = embedder.get_text_embedding("The cat sat on the mat.")
    both = embedder.get_text_embedding_batch(["The cat sat on the mat.", "Stock markets fell."])
    assert len(one) == 576
    assert both[0] == pytest.approx(one, abs=1e-4)
    assert embedder.get_query_embedding("Where did the cat sit?") != one


# ---- the Vercel AI SDK -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ai_sdk(server: LocalrtServer) -> dict[str, Any]:
    """What the AI SDK script reports for each provider (it runs every job once)."""
    modules = node_modules()
    if modules is None:
        pytest.skip("the AI SDK is not installed (.ci/run installs it; see tests/clients_fixtures.py)")
    env = {**os.environ, "NODE_PATH": str(modules)}
    done = subprocess.run(
        ["node", str(AI_SDK_SCRIPT), server.url, MODEL, TOOLS_MODEL],
        env=env,
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


PROVIDERS = ["ollama", "openai-compatible"]


@pytest.mark.parametrize("provider", PROVIDERS)
def test_ai_sdk_generate_and_stream_text(ai_sdk: dict[str, Any], provider: str) -> None:
    report = ai_sdk[provider]
    assert "Paris" in report["generate"]["text"]
    assert report["stream"]["text"] == report["generate"]["text"]
    assert report["stream"]["chunks"] > 1


@pytest.mark.parametrize("provider", PROVIDERS)
def test_ai_sdk_max_output_tokens_stops_at_64(ai_sdk: dict[str, Any], provider: str) -> None:
    limited = ai_sdk[provider]["limited"]
    assert limited["outputTokens"] == 64
    assert limited["finishReason"] == "length"


@pytest.mark.parametrize("provider", PROVIDERS)
def test_ai_sdk_tool_choice_required_returns_a_call(ai_sdk: dict[str, Any], provider: str) -> None:
    tool = ai_sdk[provider]["tool"]
    assert [c["toolName"] for c in tool["toolCalls"]][:1] == ["get_weather"]
    assert isinstance(tool["toolCalls"][0]["input"]["city"], str)
    assert tool["outputTokens"] <= 64
    assert "<tool_call>" not in tool["text"]


@pytest.mark.parametrize("provider", PROVIDERS)
def test_ai_sdk_embed(ai_sdk: dict[str, Any], provider: str) -> None:
    embedded = ai_sdk[provider]["embed"]
    assert embedded["dimensions"] == 576
    assert embedded["tokens"] > 0


# ---- aider -----------------------------------------------------------------------------------------
# aider's "whole" edit format: the file's name, then its new content in a fence. SmolLM2 is forced to
# write exactly this (a grammar added by a proxy, as the agents' tests force their replies), so the
# test shows aider's request accepted, its reply parsed and the edit applied, not the model's skill.
AIDER_REPLY = 'hello.py\n```python\ndef greet():\n    return "Hello from localrt"\n```\n'
# non-interactive, offline: no update check, no analytics, no release notes, no browser, no commits
AIDER_FLAGS = [
    "--yes-always",
    "--no-check-update",
    "--analytics-disable",
    "--no-show-release-notes",
    "--no-show-model-warnings",
    "--no-check-model-accepts-settings",
    "--no-auto-commits",
    "--no-dirty-commits",
    "--no-gitignore",
    "--no-pretty",
    "--no-fancy-input",
    "--no-detect-urls",
    "--no-suggest-shell-commands",
    "--no-notifications",
    "--no-browser",
    "--map-tokens",
    "0",
    "--edit-format",
    "whole",
]


def test_aider_edits_a_file(server: LocalrtServer, tmp_path: Path) -> None:
    aider = venv_bin("aider", "aider")
    if aider is None:
        pytest.skip("aider is not installed (.ci/run installs it; see tests/clients_fixtures.py)")
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "hello.py").write_text("def greet():\n    return 'hi'\n")
    for cmd in (
        ["init", "-q"],
        ["config", "user.name", "t"],
        ["config", "user.email", "t@t"],
        ["add", "hello.py"],
        ["commit", "-qm", "start"],
    ):
        subprocess.run(["git", *cmd], cwd=repo, check=True)
    proxy = GrammarProxy(server.url)
    proxy.replies["plain"] = AIDER_REPLY
    home = tmp_path / "home"
    # aider fetches model prices from GitHub unless a fresh copy is cached: a minimal one is
    (home / ".aider" / "caches").mkdir(parents=True)
    (home / ".aider" / "caches" / "model_prices_and_context_window.json").write_text('{"sample_spec": {}}')
    env = {
        **os.environ,
        "HOME": str(home),
        "OLLAMA_API_BASE": proxy.url,
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",
    }
    try:
        done = subprocess.run(
            [
                str(aider),
                "--model",
                f"ollama_chat/{MODEL}",
                *AIDER_FLAGS,
                "--message",
                "Make greet say hello.",
                "hello.py",
            ],
            cwd=repo,
            env=env,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=540,
        )
    finally:
        proxy.close()
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert (repo / "hello.py").read_text() == 'def greet():\n    return "Hello from localrt"\n'
    chats = [body for path, body in proxy.seen if path == "/api/chat"]
    assert chats  # aider spoke Ollama's /api/chat
    assert "Make greet say hello." in json.dumps(chats[-1]["messages"])
