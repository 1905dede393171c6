"""The real coding agents (Claude Code, Codex CLI, opencode; versions in tests/agents_fixtures.PINS),
run non-interactively through `localrt launch` against a real `localrt serve`.

The model is tiny with the official Qwen3 template; a grammar forces each reply (tests/agents_fixtures.py
explains the proxy that adds it): a first turn answers in text, and a tool loop has the model call
the agent's own file-read or shell tool, the agent run it and send its output back, and the model
answer. The note's secret word exists only in the file, so seeing it in the next request proves the
agent ran the tool with the model's arguments.

They run in the default suite (about two minutes on 2 cores): the model is tiny, so each agent's first
request (a system prompt and tool list of 8,000 to 20,000 tokens) costs seconds, and the tests share one
server, so a later run evaluates only what the prefix cache does not hold.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from localrt.store.importer import import_gguf
from localrt.store.store import Store
from tests.agents_fixtures import DEFAULT_PREFIX
from tests.agents_fixtures import GrammarProxy
from tests.agents_fixtures import agents_bin
from tests.agents_fixtures import npm_specs
from tests.agents_fixtures import official_template
from tests.agents_fixtures import qwen3_call
from tests.agents_fixtures import turn_of
from tests.agents_fixtures import write_agent_model
from tests.conftest import free_port
from tests.servers.serve import LocalrtServer

BIN = agents_bin()
if BIN is None:
    pytest.skip(
        "the coding agents are not installed: npm install --prefix "
        f"{DEFAULT_PREFIX} {' '.join(npm_specs())} (or name their bin folder in LOCALRT_AGENT_PATH)",
        allow_module_level=True,
    )

pytestmark = pytest.mark.timeout(1800)

MODEL = "agent:tiny"
HELLO = "Hello from localrt."
TITLE = "Greeting"
SECRET = "pineapple"
ANSWER = "I have read the note."
ASK = "Read note.txt and tell me the secret word."


@dataclass
class Stack:
    server: LocalrtServer
    proxy: GrammarProxy
    models: Path
    root: Path


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    root = tmp_path_factory.mktemp("agents-e2e")
    gguf = write_agent_model(
        root / "agent.gguf", context_length=65536, template=official_template("Qwen-Qwen3-0.6B.jinja")
    )
    import_gguf(Store(root / "models"), MODEL, gguf)
    # one sequence: its whole KV cache stays with the agent's prompt, which the next turn reuses
    server = LocalrtServer(root / "models", root / "serve.log", env={"LOCALRT_NUM_PARALLEL": "1"})
    proxy = GrammarProxy(server.url)
    yield Stack(server, proxy, root / "models", root)
    proxy.close()
    server.stop()
    assert "Traceback" not in server.log_path.read_text(errors="replace")


def run_agent(stack: Stack, tmp: Path, agent: str, *agent_args: str) -> subprocess.CompletedProcess[str]:
    """`localrt launch AGENT agent:tiny -- ARGS` in `tmp/work`, the agent's home and config in `tmp`."""
    home = tmp / "home"
    (home / ".codex").mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LOCALRT_", "ANTHROPIC_", "OPENAI_"))}
    env.update(
        {
            "HOME": str(home),
            "PWD": str(tmp / "work"),  # opencode takes its project folder from PWD, not the process's cwd
            "XDG_CONFIG_HOME": str(home / ".config"),
            "XDG_DATA_HOME": str(home / ".local" / "share"),
            "XDG_CACHE_HOME": str(home / ".cache"),
            "XDG_STATE_HOME": str(home / ".local" / "state"),
            "CODEX_HOME": str(home / ".codex"),
            "LOCALRT_HOST": stack.proxy.url,
            "LOCALRT_MODELS": str(stack.models),
            "LOCALRT_DATA": str(tmp / "data"),
            "LOCALRT_AGENT_PATH": str(BIN),
            # opencode installs its plugin package into its config folder on every start: a registry
            # on a closed loopback port keeps the test on this machine (the install fails quietly)
            "npm_config_registry": f"http://127.0.0.1:{free_port()}/",
        }
    )
    return subprocess.run(
        [sys.executable, "-m", "localrt", "launch", agent, MODEL, "--", *agent_args],
        env=env,
        cwd=tmp / "work",
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=1500,
    )


def prompt_args(agent: str, prompt: str) -> list[str]:
    """Each agent's non-interactive one-prompt form."""
    return {
        "claude": ["-p", prompt],
        "codex": ["exec", "--skip-git-repo-check", prompt],
        "opencode": ["run", prompt],
    }[agent]


def read_call(agent: str, note: Path) -> str:
    """The model's call of the agent's own file-read (or shell) tool, with that tool's argument names."""
    return {
        "claude": qwen3_call("Read", {"file_path": str(note)}),
        "codex": qwen3_call("exec_command", {"cmd": f"cat {note.name}"}),
        "opencode": qwen3_call("read", {"filePath": str(note)}),
    }[agent]


@pytest.fixture
def work(tmp_path: Path) -> Path:
    (tmp_path / "work").mkdir()
    return tmp_path / "work"


AGENTS = ("claude", "codex", "opencode")


@pytest.mark.parametrize("agent", AGENTS)
def test_first_turn(stack: Stack, work: Path, agent: str) -> None:
    stack.proxy.replies = {"tools": HELLO, "plain": TITLE}
    stack.proxy.seen.clear()
    r = run_agent(stack, work.parent, agent, *prompt_args(agent, "Say hello."))
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-2000:])
    assert HELLO in r.stdout
    turns = [turn_of(path, body) for path, body in stack.proxy.seen]
    assert "tools" in turns  # the agent's own request, with its tools, reached the model


@pytest.mark.parametrize("agent", AGENTS)
def test_tool_loop(stack: Stack, work: Path, agent: str) -> None:
    note = work / "note.txt"
    note.write_text(f"The secret word is {SECRET}.\n")
    stack.proxy.replies = {"tools": read_call(agent, note), "result": ANSWER, "plain": TITLE}
    stack.proxy.seen.clear()
    r = run_agent(stack, work.parent, agent, *prompt_args(agent, ASK))
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-2000:])
    assert ANSWER in r.stdout
    turns = [turn_of(path, body) for path, body in stack.proxy.seen]
    assert "tools" in turns
    assert "result" in turns
    assert turns.index("tools") < turns.index("result")
    result_request = stack.proxy.seen[turns.index("result")][1]
    assert SECRET in json.dumps(result_request)  # the tool ran on the model's arguments, its output went back
