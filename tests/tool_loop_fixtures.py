"""What the tool-loop tests share: SmolLM2 with a tool-capable template behind a real `localrt serve`, a
client that makes the model's first call exact, and MCP config files naming real servers.

SmolLM2-135M is too small to choose a tool and write its arguments: the runtime's `tool_choice` forces
the call but the model still picks the arguments (a path, a timezone), so where a test needs exact
arguments the first request of each answer carries a GBNF grammar that is the call, in the template's
own `<tool_call>` format (`ForcedFirstCall`). Everything after that is the model's own.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from collections.abc import Iterator
from collections.abc import Mapping
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest

from localrt.client import ServerClient
from localrt.runtime.answers import Chunk
from localrt.store.importer import import_gguf
from localrt.store.store import Store
from tests.agent_templates import official_template
from tests.servers.serve import LocalrtServer
from tests.servers.serve import free_port

MODEL = "smollm2:135m"
THREADS = int(os.environ.get("LOCALRT_TEST_THREADS", "1"))
# greedy and short: a step is bounded by num_predict (room for one forced call), whatever the model makes of it
PARAMS = {"temperature": 0, "num_ctx": 4096, "num_predict": 128, "num_thread": THREADS}
SYSTEM = "You are a helpful assistant."
ROOT = Path(__file__).resolve().parents[1]


def tool_model_store(root: Path, smollm2_gguf: Path) -> Path:
    """A store with SmolLM2 under the official Qwen2.5 template (ChatML, as SmolLM2's own, plus tools in
    `<tool_call>` blocks): a model must support tools to be sent them."""
    import_gguf(
        Store(root),
        MODEL,
        smollm2_gguf,
        system=SYSTEM,
        template=official_template("Qwen-Qwen2.5-7B-Instruct.jinja"),
        params=PARAMS,
    )
    return root


def serve_tool_model(smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalrtServer]:
    """A real `localrt serve` on 127.0.0.1 with the tool-capable SmolLM2 (a module fixture's body)."""
    root = tmp_path_factory.mktemp("tool-loop")
    tool_model_store(root / "models", smollm2_gguf)
    srv = LocalrtServer(root / "models", root / "serve.log", env={"LOCALRT_KEEP_ALIVE": "10m"})
    yield srv
    assert srv.stop() in (0, -signal.SIGTERM)
    log = srv.log_path.read_text(errors="replace")
    assert "Traceback" not in log, log[-4000:]


def call_grammar(name: str, arguments: Mapping[str, Any]) -> str:
    """GBNF whose one sentence is this call in the Qwen2.5 template's format."""
    call = json.dumps({"name": name, "arguments": dict(arguments)})
    return f"root ::= {json.dumps(f'<tool_call>{chr(10)}{call}{chr(10)}</tool_call>')}"


class ForcedFirstCall(ServerClient):
    """The real HTTP client. The first request of each answer (its last message is the user's) carries a
    grammar that makes the model write the next call of `calls`; every request is recorded."""

    def __init__(self, url: str, calls: Sequence[tuple[str, Mapping[str, Any]]] = ()) -> None:
        super().__init__(url)
        self.calls = list(calls)
        self.requests: list[dict[str, Any]] = []

    def chat(
        self,
        model: str,
        messages: Sequence[Mapping[str, Any]],
        *,
        options: Mapping[str, Any] | None = None,
        **kw: Any,
    ) -> AsyncIterator[Chunk]:
        options = dict(options or {})
        if messages and messages[-1].get("role") == "user" and self.calls:
            name, arguments = self.calls.pop(0)
            options["grammar"] = call_grammar(name, arguments)
            options["num_predict"] = 512  # the grammar ends the reply: room for a long path
        self.requests.append(
            {"messages": [dict(m) for m in messages], "tools": kw.get("tools"), "options": options}
        )
        return super().chat(model, messages, options=options, **kw)


def mcp_entry(kind: str, **extra: Any) -> dict[str, Any]:
    """A config entry for a real server: `time` and `git` from PyPI, `sdk` the test server over stdio."""
    modules = {
        "time": ["-m", "mcp_server_time", "--local-timezone", "Europe/Paris"],
        "sdk": ["-m", "tests.servers.mcp_server", "stdio"],
    }
    if kind == "git":
        return {
            "command": sys.executable,
            "args": ["-m", "mcp_server_git", "--repository", str(extra["repo"])],
        }
    return {"command": sys.executable, "args": modules[kind], **({"cwd": str(ROOT)} if kind == "sdk" else {})}


def write_mcp_config(path: Path, servers: Mapping[str, Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"mcpServers": dict(servers)}, indent=2))
    return path


def scratch_repo(path: Path) -> Path:
    """A git repository with one commit and one uncommitted change, for mcp-server-git."""
    path.mkdir(parents=True)
    env = {
        **os.environ,
        "GIT_AUTHOR_NAME": "t",
        "GIT_AUTHOR_EMAIL": "t@x",
        "GIT_COMMITTER_NAME": "t",
        "GIT_COMMITTER_EMAIL": "t@x",
    }

    def git(*args: str) -> None:
        subprocess.run(["git", *args], cwd=path, check=True, capture_output=True, env=env)

    git("init", "-q", "-b", "main")
    (path / "README.md").write_text("scratch\n")
    git("add", "README.md")
    git("commit", "-q", "-m", "first commit")
    (path / "README.md").write_text("scratch, changed\n")
    return path


class McpHttpServer:
    """The SDK-built test server over streamable HTTP on 127.0.0.1, as a subprocess (`token`: the Bearer
    token it wants)."""

    def __init__(self, log: Path, token: str | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/mcp"
        env = {**os.environ, **({"MCP_TEST_TOKEN": token} if token else {})}
        self.log = open(log, "ab")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.servers.mcp_server", "http", str(self.port)],
            cwd=ROOT,
            env=env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the MCP test server exited: {log.read_text(errors='replace')}")
            try:
                httpx.get(f"http://127.0.0.1:{self.port}/", timeout=1)
                return
            except httpx.HTTPError:
                time.sleep(0.2)
        raise RuntimeError("the MCP test server did not come up")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
