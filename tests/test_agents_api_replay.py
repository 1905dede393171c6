"""The first requests of the real coding agents (tests/agents/, recorded from the npm binaries), replayed
against a real `localrt serve`: each is answered on its route (Claude Code: /v1/messages?beta=true,
Codex: /v1/responses, opencode: /v1/chat/completions), and the prompt the runtime renders from it holds
every tool and every system / developer block the agent sent.

The model is a random-weight tiny Llama with the official Qwen3 chat template from llama.cpp's
models/templates/ as its TEMPLATE (it renders tools, as the agents' models must), a context big
enough for Claude Code's prompt, and a one-token answer, so a replay costs one prompt evaluation.
"""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from localrt.api import anthropic as anthropic_route
from localrt.api import responses as responses_route
from localrt.runtime.front import Runtime
from localrt.store.importer import import_gguf
from localrt.store.store import Store
from tests import families
from tests.agent_templates import official_template
from tests.conftest import async_test
from tests.gguf_factory import write_tiny_llama
from tests.servers.serve import LocalrtServer

AGENTS = Path(__file__).parent / "agents"
MODEL = "agent-tools:tiny"
CONTEXT = 131072  # the tiny vocabulary spells most words letter by letter: Claude Code's prompt is long
BODIES = sorted(AGENTS.glob("*.json"))
DROPPED_HEADERS = {"content-length", "host", "accept-encoding", "authorization", "x-api-key"}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("agents-replay")
    family = families.FAMILIES["qwen3"]
    gguf = write_tiny_llama(
        root / "tiny.gguf",
        chat_template=family.template,
        extra_specials=family.specials,
        context_length=CONTEXT,
    )
    store = Store(root / "models")
    import_gguf(
        store, MODEL, gguf, template=official_template("Qwen-Qwen3-0.6B.jinja"), params={"num_ctx": CONTEXT}
    )
    return root / "models"


@pytest.fixture(scope="module")
def server(models: Path) -> Iterator[LocalrtServer]:
    srv = LocalrtServer(models, models.parent / "serve.log", env={"LOCALRT_KEEP_ALIVE": "10m"})
    yield srv
    assert srv.stop() in (0, -signal.SIGTERM)
    log = srv.log_path.read_text(errors="replace")
    assert "Traceback" not in log, log[-4000:]


def requests_of(path: Path) -> list[dict[str, Any]]:
    return json.loads(path.read_text())["requests"]


def replayed(request: dict[str, Any], num_ctx: int | None = None) -> dict[str, Any]:
    """The agent's body with this test's model, a one-token answer and, if given, a smaller context."""
    body = {**request["body"], "model": MODEL}
    if request["path"].startswith("/v1/responses"):
        body["max_output_tokens"] = 1
    else:
        body["max_tokens"] = 1
    if num_ctx is not None:
        body["options"] = {"num_ctx": num_ctx}
    return body


def send(server: LocalrtServer, request: dict[str, Any], num_ctx: int | None = None) -> tuple[int, list[str]]:
    """(status, SSE lines or the JSON body) of the replayed request, sent with the agent's own headers."""
    headers = {k: v for k, v in request["headers"].items() if k.lower() not in DROPPED_HEADERS}
    body = replayed(request, num_ctx)
    with httpx.stream("POST", server.url + request["path"], json=body, headers=headers, timeout=1800) as r:
        return r.status_code, [line for line in r.iter_lines() if line]


SMALL_CONTEXT = 1024  # smaller than every recorded prompt


@pytest.mark.parametrize("recorded", BODIES, ids=lambda p: p.stem)
def test_first_request_passes_every_check_before_evaluation(server: LocalrtServer, recorded: Path) -> None:
    """Fast form: the body is parsed, translated, checked against the model's capabilities and rendered;
    then, in a context smaller than its prompt, the one refusal left is the context's, which names the
    prompt's length (the next test lets the model answer it, and takes minutes on a small CPU)."""
    for request in requests_of(recorded):
        status, lines = send(server, request, SMALL_CONTEXT)
        message = json.loads(lines[0])["error"]
        message = message if isinstance(message, str) else message["message"]
        assert status == 400
        assert f"{SMALL_CONTEXT}" in message
        assert any(words in message for words in ("does not fit the context", "prompt is too long"))


@pytest.mark.slow
@pytest.mark.parametrize("recorded", BODIES, ids=lambda p: p.stem)
def test_first_request_is_answered(server: LocalrtServer, recorded: Path) -> None:
    for request in requests_of(recorded):
        status, lines = send(server, request)
        assert status == 200, lines[:3]
        assert [line for line in lines if line.startswith("event: error")] == []


# ---- the rendered prompt ------------------------------------------------------------------------------
def texts_of(blocks: Any) -> list[str]:
    """The texts of a system prompt / message content: a string, or text parts of a list."""
    if isinstance(blocks, str):
        return [blocks]
    return [b["text"] for b in blocks if isinstance(b, dict) and b.get("type") in ("text", "input_text")]


def expected_in_prompt(request: dict[str, Any]) -> tuple[list[str], list[str]]:
    """(tool names as the model is shown them, system and developer texts) of one agent request. A
    deferred tool is not shown: no first request references one."""
    body = request["body"]
    names, texts = [], []
    for tool in body.get("tools") or []:
        if tool.get("defer_loading") is True:
            continue
        if tool.get("type") == "namespace":
            names += [f"{tool['name']}.{member['name']}" for member in tool["tools"]]
        elif tool.get("type") == "function" and "function" in tool:
            names.append(tool["function"]["name"])
        elif tool.get("type") in (None, "custom", "function"):
            names.append(tool["name"])
    texts += texts_of(body.get("system") or [])
    for message in body.get("messages") or body.get("input") or []:
        if message.get("role") in ("system", "developer"):
            texts += texts_of(message["content"])
    return names, [t.strip() for t in texts if t.strip()]


def chat_of(request: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The runtime's messages and tools for a replayed body, through the route's own translation."""
    body = replayed(request)
    if request["path"].startswith("/v1/messages"):
        call, _, _ = anthropic_route.chat_call(body)
        return call.messages, call.tools
    if request["path"].startswith("/v1/responses"):
        call = responses_route.chat_call(body, []).call
        return call.messages, call.tools
    return body["messages"], [t for t in body.get("tools") or [] if t.get("type") == "function"] or None


@pytest.mark.parametrize("recorded", BODIES, ids=lambda p: p.stem)
@async_test
async def test_rendered_prompt_holds_every_tool_and_system_block(models: Path, recorded: Path) -> None:
    runtime = Runtime(Store(models))
    try:
        for request in requests_of(recorded):
            messages, tools = chat_of(request)
            text, _ = await runtime.render(MODEL, messages, tools=tools)
            names, system = expected_in_prompt(request)
            assert len(names) == len(tools or [])  # every tool the agent sent is offered
            assert [n for n in names if f'"name": "{n}"' not in text] == []
            assert [t[:60] for t in system if t not in text] == []
    finally:
        await runtime.close()


def test_every_agent_has_a_recorded_body() -> None:
    agents = {json.loads(p.read_text())["agent"] for p in BODIES}
    assert len(agents) == 3
