"""MCP servers in the tool loop, all real: `mcp-server-time` and `mcp-server-git` from PyPI over stdio, and
a server built with the `mcp` SDK (tests/servers/mcp_server.py) over stdio and streamable HTTP on
127.0.0.1. Their tools listed, calls made, a server that does not start (a notice), one that dies in the
middle of a call (an error result; the other servers and the chat go on), the config file's format,
`localrt mcp list`, and `localrt run --tools` against a real `localrt serve` with SmolLM2.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from localrt.agent.approvals import Approvals
from localrt.agent.loop import AgentLoop
from localrt.agent.loop import ToolFinished
from localrt.agent.mcp import McpHub
from localrt.agent.mcp import ServerSpec
from localrt.agent.mcp import load_config
from localrt.agent.mcp import parse_entry
from localrt.agent.toolbox import Toolbox
from localrt.agent.tools import Limits
from localrt.errors import LocalrtError
from tests.conftest import async_test
from tests.servers.serve import LocalrtServer
from tests.tool_loop_fixtures import MODEL
from tests.tool_loop_fixtures import ROOT
from tests.tool_loop_fixtures import McpHttpServer
from tests.tool_loop_fixtures import mcp_entry
from tests.tool_loop_fixtures import scratch_repo
from tests.tool_loop_fixtures import serve_tool_model
from tests.tool_loop_fixtures import write_mcp_config

TOKEN = "s3cret-token"


@pytest.fixture(autouse=True)
def private_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No user's ~/.config/localrt/mcp.json is read; the servers' logs go to the test's data dir."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.setenv("LOCALRT_DATA", str(tmp_path / "data"))


@pytest.fixture(scope="module")
def http_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[McpHttpServer]:
    server = McpHttpServer(tmp_path_factory.mktemp("mcp-http") / "server.log", token=TOKEN)
    yield server
    server.stop()


def spec(name: str, entry: dict[str, Any]) -> ServerSpec:
    return parse_entry(name, entry)


# ---- the config file ----------------------------------------------------------------------------
def test_the_config_file_format(tmp_path: Path) -> None:
    path = write_mcp_config(
        tmp_path / "mcp.json",
        {
            "time": {"command": "uvx", "args": ["mcp-server-time"], "env": {"TZ": "UTC"}},
            "docs": {"url": "https://example.com/mcp", "headers": {"Authorization": "Bearer x"}},
            "typed": {"type": "http", "url": "http://127.0.0.1:9/mcp"},
            "old": {"type": "sse", "url": "http://127.0.0.1:9/sse"},
            "neither": {"args": ["x"]},
            "bad args": {"command": "x"},
            "argsbad": {"command": "x", "args": "--flag"},
        },
    )
    specs, where = load_config(path)
    assert where == path
    by_name = {s.name: s for s in specs}
    assert (by_name["time"].transport, by_name["time"].shown, by_name["time"].env) == (
        "stdio",
        "uvx mcp-server-time",
        {"TZ": "UTC"},
    )
    assert (by_name["docs"].transport, by_name["docs"].headers) == ("http", {"Authorization": "Bearer x"})
    assert by_name["typed"].problem == ""
    assert "SSE transport is not supported" in by_name["old"].problem
    assert "either" in by_name["neither"].problem
    assert "server name" in by_name["bad args"].problem
    assert "args must be a list of strings" in by_name["argsbad"].problem


def test_config_errors(tmp_path: Path) -> None:
    with pytest.raises(LocalrtError, match="MCP config file not found"):
        load_config(tmp_path / "missing.json")
    (tmp_path / "broken.json").write_text("{not json")
    with pytest.raises(LocalrtError, match="not valid JSON"):
        load_config(tmp_path / "broken.json")
    (tmp_path / "other.json").write_text('{"servers": {}}')
    with pytest.raises(LocalrtError, match='no "mcpServers" object'):
        load_config(tmp_path / "other.json")
    # the default file (platformdirs' config dir) may be absent: no servers, no error
    assert load_config(None)[0] == []


def test_a_broken_default_config_is_a_notice(tmp_path: Path) -> None:
    default = tmp_path / "config" / "localrt" / "mcp.json"
    default.parent.mkdir(parents=True)
    default.write_text("{")
    box = Toolbox.standard(tmp_path)
    assert box.hub is None
    assert [line.split(":")[0] for line in box.failures()] == [f"the MCP config {default} is not valid JSON"]
    assert box.get("read_file") is not None  # the built-in tools still work


# ---- real servers over stdio and HTTP -----------------------------------------------------------
@async_test
async def test_time_server_over_stdio() -> None:
    hub = McpHub([spec("time", mcp_entry("time"))])
    await hub.start()
    try:
        [server] = hub.servers
        assert server.status == "ready (2 tools)"
        names = [t.name for t in hub.tools()]
        assert names == ["time__get_current_time", "time__convert_time"]
        tool = hub.tools()[0]
        assert tool.source == "time"
        assert tool.parameters["required"] == ["timezone"]
        call = await tool.prepare({"timezone": "Asia/Tokyo"})
        result = await call.run()  # type: ignore[union-attr]
    finally:
        await hub.close()
    assert not result.error
    assert json.loads(result.content)["timezone"] == "Asia/Tokyo"


@async_test
async def test_git_server_over_stdio_on_a_scratch_repository(tmp_path: Path) -> None:
    repo = scratch_repo(tmp_path / "repo")
    hub = McpHub([spec("git", mcp_entry("git", repo=repo))])
    await hub.start()
    try:
        names = {t.name for t in hub.tools()}
        assert {"git__git_status", "git__git_log", "git__git_diff_unstaged"} <= names
        status = await hub.servers[0].call("git_status", {"repo_path": str(repo)})
        log = await hub.servers[0].call("git_log", {"repo_path": str(repo)})
        outside = await hub.servers[0].call("git_status", {"repo_path": str(tmp_path)})
    finally:
        await hub.close()
    assert not status.error
    assert "modified:   README.md" in status.content or "README.md" in status.content
    assert "first commit" in log.content
    assert outside.error  # the server's own --repository confinement, reported as an error result


@async_test
async def test_sdk_server_over_streamable_http_with_headers(http_server: McpHttpServer) -> None:
    good = spec("web", {"url": http_server.url, "headers": {"Authorization": f"Bearer {TOKEN}"}})
    bad = spec("nokey", {"url": http_server.url})
    hub = McpHub([good, bad])
    await hub.start()
    try:
        web, nokey = hub.servers
        assert web.status == "ready (3 tools)"
        assert [t.name for t in web.tools] == ["web__echo", "web__big", "web__die"]
        result = await web.call("echo", {"text": "over http"})
        assert nokey.state == "failed"
        assert nokey.error.endswith("(HTTP 401 Unauthorized)")
    finally:
        await hub.close()
    assert result.content == "echo: over http"


@async_test
async def test_a_server_that_does_not_start_is_a_notice_and_the_others_run(tmp_path: Path) -> None:
    hub = McpHub(
        [spec("nope", {"command": "no-such-mcp-server-here"}), spec("time", mcp_entry("time"))],
        log_dir=tmp_path / "logs",
    )
    await hub.start()
    try:
        assert hub.failures() == ["MCP server nope: failed: command not found: no-such-mcp-server-here"]
        assert [t.name for t in hub.tools()] == ["time__get_current_time", "time__convert_time"]
        result = await hub.servers[0].call("anything", {})
    finally:
        await hub.close()
    assert result.error
    assert "is not running" in result.content


@async_test
async def test_a_server_that_exits_at_start_says_why(tmp_path: Path) -> None:
    crash = spec(
        "crash",
        {
            "command": sys.executable,
            "args": ["-c", "import sys; print('no config here', file=sys.stderr); sys.exit(2)"],
        },
    )
    hub = McpHub([crash], log_dir=tmp_path / "logs")
    await hub.start(timeout=60)
    await hub.close()
    [server] = hub.servers
    assert server.state == "failed"
    assert server.error.endswith("(no config here)")  # the last line it wrote on stderr


@pytest.mark.parametrize("transport", ["stdio", "http"])
@async_test
async def test_a_server_that_dies_mid_call_gives_an_error_result(
    transport: str, http_server: McpHttpServer, tmp_path: Path
) -> None:
    if transport == "stdio":
        entry = mcp_entry("sdk")
    else:  # a server of its own: this one dies
        own = McpHttpServer(tmp_path / "dying.log", token=TOKEN)
        entry = {"url": own.url, "headers": {"Authorization": f"Bearer {TOKEN}"}}
    hub = McpHub([spec("dies", entry), spec("time", mcp_entry("time"))])
    await hub.start()
    try:
        dies, time_server = hub.servers
        assert dies.state == "ready"
        result = await dies.call("die", {})
        assert result.error
        assert "stopped during the call" in result.content or "failed the call" in result.content
        again = await dies.call("echo", {"text": "still there?"})
        other = await time_server.call("get_current_time", {"timezone": "UTC"})
    finally:
        await hub.close()
        if transport == "http":
            own.stop()
    assert again.error  # the dead server's calls are error results, not hangs or exceptions
    assert dies.state == "failed"
    assert not other.error  # the other server goes on


@async_test
async def test_a_ten_megabyte_result_is_capped_before_the_model(tmp_path: Path) -> None:
    hub = McpHub([spec("sdk", mcp_entry("sdk"))])
    await hub.start()
    try:
        raw = await hub.servers[0].call("big", {"megabytes": 10})
        box = Toolbox([], hub)
        loop = AgentLoop(None, MODEL, box, Approvals(approve_all=True), limits=Limits(result_chars=5000))  # type: ignore[arg-type]
        messages: list[dict[str, Any]] = []
        finished = [
            e
            async for e in loop._call(
                messages, {"id": "c1", "function": {"name": "sdk__big", "arguments": {"megabytes": 10}}}
            )
            if isinstance(e, ToolFinished)
        ]
    finally:
        await hub.close()
    assert len(raw.content) == 10 * 1024 * 1024
    [done] = finished
    assert len(done.result.content) < 5200
    assert done.result.content.endswith(
        f"[... {10 * 1024 * 1024 - 5000} more characters cut: the result was {10 * 1024 * 1024} characters]"
    )
    assert messages[-1]["content"] == done.result.content


# ---- the CLI -------------------------------------------------------------------------------------
def localrt(
    *args: str, env: dict[str, str], cwd: Path, timeout: float = 900
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "localrt", *args],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )


def run_tools(
    model: str, config: Path, choice: str, prompt: str, *, env: dict[str, str], cwd: Path, yes: bool = True
) -> subprocess.CompletedProcess[str]:
    """`localrt run MODEL --tools --mcp CONFIG [--yes] --tool-choice CHOICE PROMPT`."""
    approve = ["--yes"] if yes else []
    return localrt(
        "run",
        model,
        "--tools",
        "--mcp",
        str(config),
        *approve,
        "--tool-choice",
        choice,
        prompt,
        env=env,
        cwd=cwd,
    )


def cli_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    return {
        **os.environ,
        "XDG_CONFIG_HOME": str(tmp_path / "config"),
        "LOCALRT_DATA": str(tmp_path / "data"),
        "PYTHONPATH": str(ROOT),
        **extra,
    }


def test_mcp_list(tmp_path: Path, http_server: McpHttpServer) -> None:
    repo = scratch_repo(tmp_path / "repo")
    config = write_mcp_config(
        tmp_path / "mcp.json",
        {
            "time": mcp_entry("time"),
            "git": mcp_entry("git", repo=repo),
            "web": {"url": http_server.url, "headers": {"Authorization": f"Bearer {TOKEN}"}},
            "nope": {"command": "no-such-mcp-server-here"},
        },
    )
    done = localrt("mcp", "list", "--mcp", str(config), env=cli_env(tmp_path), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == f"MCP servers in {config}:"
    assert (
        f"time: {sys.executable} -m mcp_server_time --local-timezone Europe/Paris (stdio) - ready (2 tools)"
        in lines
    )
    assert "  time__get_current_time  Get current time in a specific timezone" in lines
    assert any(line.startswith("git: ") and line.endswith("(stdio) - ready (12 tools)") for line in lines)
    assert any(line.startswith("  git__git_status ") for line in lines)
    assert f"web: {http_server.url} (http) - ready (3 tools)" in lines
    assert (
        "nope: no-such-mcp-server-here (stdio) - failed: command not found: no-such-mcp-server-here" in lines
    )


def test_mcp_list_reads_the_default_config(tmp_path: Path) -> None:
    env = cli_env(tmp_path)
    done = localrt("mcp", "list", env=env, cwd=tmp_path)
    assert done.stdout == f"No MCP servers configured ({tmp_path / 'config' / 'localrt' / 'mcp.json'}).\n"
    write_mcp_config(tmp_path / "config" / "localrt" / "mcp.json", {"time": mcp_entry("time")})
    done = localrt("mcp", "list", env=env, cwd=tmp_path)
    assert "time: " in done.stdout
    missing = localrt("mcp", "list", "--mcp", str(tmp_path / "nothing.json"), env=env, cwd=tmp_path)
    assert missing.returncode == 1
    assert missing.stderr == f"Error: MCP config file not found: {tmp_path / 'nothing.json'}\n"


@pytest.fixture(scope="module")
def tool_server(smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalrtServer]:
    yield from serve_tool_model(smollm2_gguf, tmp_path_factory)


# What only the server's answer holds. SmolLM2 writes the git tool's `repo_path` itself (the runtime forces
# the tool, not its arguments) and never writes the repository's path: mcp-server-git's own refusal of the
# path it wrote is the result then (its successful answers are in the pilot test and the tests above). The
# prompt names no path: a greedy model copying the test's temporary path can run past num_predict inside it.
@pytest.mark.parametrize(
    ("server", "choice", "prompt", "expected"),
    [
        (
            "time",
            "time__get_current_time",
            "What time is it in Europe/Paris?",
            ('"timezone": "Europe/Paris"',),
        ),
        (
            "git",
            "git__git_status",
            "What is the git status of the repository?",
            ("Repository status:", "is outside the allowed repository"),
        ),
        ("web", "web__echo", "Echo the word banana.", ("echo: ",)),
    ],
)
def test_run_tools_calls_a_real_mcp_server(
    server: str,
    choice: str,
    prompt: str,
    expected: tuple[str, ...],
    tool_server: LocalrtServer,
    http_server: McpHttpServer,
    tmp_path: Path,
) -> None:
    repo = scratch_repo(tmp_path / "repo")
    entries = {
        "time": mcp_entry("time"),
        "git": mcp_entry("git", repo=repo),
        "web": {"url": http_server.url, "headers": {"Authorization": f"Bearer {TOKEN}"}},
    }
    config = write_mcp_config(tmp_path / "mcp.json", {server: entries[server]})
    env = cli_env(tmp_path, LOCALRT_HOST=tool_server.url.removeprefix("http://"))
    done = run_tools(MODEL, config, choice, prompt, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    err = done.stderr
    assert f"→ {choice}: " in err
    assert f"← {choice}" in err  # the call ran: its result follows
    result = err.split(f"← {choice}", 1)[1]
    assert any(text in result for text in expected), err
    assert "→" not in done.stdout  # calls and results on stderr, the answer alone on stdout


def test_run_tools_says_when_the_token_limit_cut_the_reply(
    tool_server: LocalrtServer, tmp_path: Path
) -> None:
    """A forced call the token limit cuts off is dropped by the server (never shown as its markup); the
    terminal says why nothing came, rather than printing nothing at all."""
    config = write_mcp_config(tmp_path / "mcp.json", {"time": mcp_entry("time")})
    env = cli_env(tmp_path, LOCALRT_HOST=tool_server.url.removeprefix("http://"))
    (tmp_path / "Modelfile").write_text(f"FROM {MODEL}\nPARAMETER num_predict 4\n")
    made = localrt("create", "clipped", "-f", str(tmp_path / "Modelfile"), env=env, cwd=tmp_path)
    assert made.returncode == 0, made.stderr
    done = run_tools(
        "clipped", config, "time__get_current_time", "What time is it in Europe/Paris?", env=env, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr
    assert "→" not in done.stderr  # the call was cut off: nothing ran
    assert "localrt: the reply stopped at the token limit" in done.stderr


def test_run_tools_without_a_terminal_denies_and_says_so(tool_server: LocalrtServer, tmp_path: Path) -> None:
    config = write_mcp_config(tmp_path / "mcp.json", {"time": mcp_entry("time")})
    env = cli_env(tmp_path, LOCALRT_HOST=tool_server.url.removeprefix("http://"))
    done = run_tools(
        MODEL,
        config,
        "time__get_current_time",
        "What time is it in Europe/Paris?",
        env=env,
        cwd=tmp_path,
        yes=False,
    )
    assert done.returncode == 0, done.stderr
    assert "← time__get_current_time (denied):" in done.stderr
    assert "there is no terminal to ask on (run with --yes" in done.stderr


def test_run_tools_option_errors(tmp_path: Path) -> None:
    env = cli_env(tmp_path)
    done = localrt("run", MODEL, "--yes", "hi", env=env, cwd=tmp_path)
    assert done.returncode == 1
    assert done.stderr == "Error: --yes approves tool calls: use it with --tools\n"
