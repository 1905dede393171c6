"""The chat app's tool loop, driven with Textual's Pilot and in a real terminal (tmux): the approval modal
with the diff, tool calls as blocks with their results, the tools panel (built-in tools and MCP servers,
each switchable, each server's state), a model without tools, saved conversations that keep the tool
messages, and the README's screenshot of a tool call (docs/tui-tools.svg).

The model is SmolLM2 under the Qwen2.5 template behind a real `localrt serve`; real MCP servers from PyPI
(`mcp-server-time`, `mcp-server-git`) and the SDK-built test server over streamable HTTP. The first call of
an answer is made exact by a grammar where the model is too small to write the arguments.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("textual")

from textual.widgets import Switch  # noqa: E402

from localrt.agent.toolbox import Toolbox  # noqa: E402
from localrt.agent.toolbox import builtin_tools  # noqa: E402
from localrt.tui.conversations import ConversationStore  # noqa: E402
from localrt.tui.screens import ApprovalScreen  # noqa: E402
from localrt.tui.screens import ToolsScreen  # noqa: E402
from localrt.tui.widgets import ToolCallView  # noqa: E402
from localrt.tui.widgets import ToolsLine  # noqa: E402
from tests.conftest import async_test  # noqa: E402
from tests.servers.serve import LocalrtServer  # noqa: E402
from tests.test_tui_app import FakeClient  # noqa: E402
from tests.test_tui_app import RecordingApp  # noqa: E402
from tests.test_tui_app import ask  # noqa: E402
from tests.test_tui_app import until  # noqa: E402
from tests.tool_loop_fixtures import MODEL  # noqa: E402
from tests.tool_loop_fixtures import ROOT  # noqa: E402
from tests.tool_loop_fixtures import ForcedFirstCall  # noqa: E402
from tests.tool_loop_fixtures import McpHttpServer  # noqa: E402
from tests.tool_loop_fixtures import mcp_entry  # noqa: E402
from tests.tool_loop_fixtures import scratch_repo  # noqa: E402
from tests.tool_loop_fixtures import serve_tool_model  # noqa: E402
from tests.tool_loop_fixtures import write_mcp_config  # noqa: E402

SCREENSHOT = ROOT / "docs" / "tui-tools.svg"
TOKEN = "tui-token"
EDIT = ("edit_file", {"path": "notes.txt", "old_string": "apples", "new_string": "cherries"})


@pytest.fixture(autouse=True)
def private_dirs(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("LOCALRT_DATA", str(tmp_path / "data"))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.delenv("NO_COLOR", raising=False)


@pytest.fixture(scope="module")
def tool_server(smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalrtServer]:
    yield from serve_tool_model(smollm2_gguf, tmp_path_factory)


@pytest.fixture(scope="module")
def http_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[McpHttpServer]:
    server = McpHttpServer(tmp_path_factory.mktemp("mcp-http") / "server.log", token=TOKEN)
    yield server
    server.stop()


@pytest.fixture
def work(tmp_path: Path) -> Path:
    root = tmp_path / "work"
    root.mkdir()
    (root / "notes.txt").write_text("apples\npears\n")
    return root


def servers(tmp_path: Path, http_server: McpHttpServer, repo: Path, **extra: Any) -> Path:
    return write_mcp_config(
        tmp_path / "mcp.json",
        {
            "time": mcp_entry("time"),
            "git": mcp_entry("git", repo=repo),
            "web": {"url": http_server.url, "headers": {"Authorization": f"Bearer {TOKEN}"}},
            **extra,
        },
    )


def only(toolbox: Toolbox, *names: str) -> Toolbox:
    """Every tool but `names` switched off, as the panel does (a short prompt for a small model)."""
    for tool in toolbox.all():
        toolbox.set_enabled(tool.name, tool.name in names)
    return toolbox


async def started(pilot: Any, app: RecordingApp) -> None:
    hub = app.toolbox.hub
    if hub is not None:
        await until(
            pilot, lambda: all(s.state not in ("off", "starting") for s in hub.servers), 90, "the servers"
        )


# ---- without a model -------------------------------------------------------------------------------
@async_test
async def test_tools_panel_lists_every_tool_and_server(
    tmp_path: Path, work: Path, http_server: McpHttpServer
) -> None:
    config = servers(
        tmp_path, http_server, scratch_repo(tmp_path / "repo"), nope={"command": "no-such-mcp-server"}
    )
    app = RecordingApp(
        MODEL,
        client=FakeClient(),
        db_path=tmp_path / "chat.db",
        toolbox=Toolbox.standard(work, mcp_config=config),
    )
    async with app.run_test(size=(110, 40)) as pilot:
        await started(pilot, app)
        await pilot.pause()
        assert ("warning", "MCP: MCP server nope: failed: command not found: no-such-mcp-server") in app.noted
        line = str(app.query_one(ToolsLine).render())
        assert line == "⚙ tools: 7 built-in, time (2), git (12), web (3), nope (failed) · asks first · F6"
        await pilot.press("f6")
        assert isinstance(app.screen, ToolsScreen)
        panel = app.screen
        labels = [str(w.render()) for w in panel.query("Label")]
        assert "time (stdio): ready (2 tools)" in labels
        assert "git (stdio): ready (12 tools)" in labels
        assert "web (http): ready (3 tools)" in labels
        assert "nope (stdio): failed: command not found: no-such-mcp-server" in labels
        assert "run_shell · runs: asks first" in labels
        assert "web__echo · asks first" in labels
        # one tool off, then the tools of this conversation off
        switch_id = next(k for k, v in panel.switch_names.items() if v == "web__echo")
        panel.query_one(f"#{switch_id}", Switch).toggle()
        await pilot.pause()
        assert app.toolbox.get("web__echo") is None
        panel.query_one("#tools-on", Switch).toggle()
        await pilot.pause()
        await pilot.press("escape")
        await pilot.pause()
        assert str(app.query_one(ToolsLine).render()) == "⚙ tools off for this conversation · F6"
        await ask(pilot, app, "Hello?")
        assert app.client.requests[-1]["tools"] is None  # type: ignore[attr-defined]
        saved = ConversationStore(tmp_path / "chat.db").load(app.conversation.id or 0)
        assert saved.settings.tools is False


@async_test
async def test_a_model_without_tools_gets_one_line_and_no_tools(tmp_path: Path, work: Path) -> None:
    class NoTools(FakeClient):
        async def details(self, model: str) -> Any:
            details = await super().details(model)
            details.capabilities = ["completion"]
            return details

    client = NoTools()
    app = RecordingApp(
        MODEL, client=client, db_path=tmp_path / "chat.db", toolbox=Toolbox(builtin_tools(work))
    )
    async with app.run_test(size=(100, 30)) as pilot:
        await until(pilot, lambda: MODEL in app.tools_off, 10, "the capability check")
        assert str(app.query_one(ToolsLine).render()) == (
            f"⚙ {MODEL} does not support tools (its chat template shows none): tools are off"
        )
        await ask(pilot, app, "Hello?")
        assert client.requests[-1]["tools"] is None
        assert app.conversation.messages[-1].content == "Hello there."


# ---- with the real model ---------------------------------------------------------------------------
def tool_app(tool_server: LocalrtServer, tmp_path: Path, toolbox: Toolbox, calls: list[Any]) -> RecordingApp:
    app = RecordingApp(
        MODEL,
        client=ForcedFirstCall(tool_server.url, calls),
        db_path=tmp_path / "chat.db",
        toolbox=toolbox,
    )
    app.conversation.settings.max_steps = 2  # the forced call, then the model's answer to its result
    return app


async def approve_when_asked(pilot: Any, app: RecordingApp, key: str) -> tuple[ApprovalScreen, str]:
    """Wait for the approval modal, answer it with `key`; (the modal, the screen as it was shown)."""
    await until(pilot, lambda: isinstance(app.screen, ApprovalScreen), 300, "the approval")
    screen = app.screen
    assert isinstance(screen, ApprovalScreen)
    await pilot.pause(0.2)
    shown = app.export_screenshot().replace("&#160;", " ")
    await pilot.press(key)
    return screen, shown


@async_test
async def test_an_edit_approved_in_the_modal(tool_server: LocalrtServer, tmp_path: Path, work: Path) -> None:
    app = tool_app(tool_server, tmp_path, only(Toolbox(builtin_tools(work)), "edit_file"), [EDIT])
    async with app.run_test(size=(110, 34)) as pilot:
        app.chat_input.insert("In notes.txt, replace apples with cherries.")
        await pilot.press("enter")
        modal, shown = await approve_when_asked(pilot, app, "y")
        assert modal.request.detail_kind == "diff"
        assert "Allow edit_file?" in shown
        assert "-apples" in shown  # the diff, on screen before anything changed
        assert "+cherries" in shown
        worker = app.answer_worker
        assert worker is not None
        await until(pilot, lambda: worker.is_finished, 300, "the answer")
        await pilot.pause(0.3)
        assert (work / "notes.txt").read_text() == "cherries\npears\n"
        [block] = app.query(ToolCallView)
        assert block.state == "ok"
        assert block.result == "edited notes.txt (2 lines)"
        assert block.title == "⚙ edit notes.txt · ok"
        assert not app.errors()
        if os.environ.get("LOCALRT_UPDATE_SCREENSHOT"):
            SCREENSHOT.write_text(app.export_screenshot(title="localrt chat: a tool call"), encoding="utf-8")
        conv_id = app.conversation.id or 0
    # saved with the call and its result; reopened, the call is a block again
    saved = ConversationStore(tmp_path / "chat.db").load(conv_id).messages
    assert [m.role for m in saved] == ["user", "assistant", "tool", "assistant"]
    assert saved[1].tool_calls is not None
    assert saved[1].tool_calls[0]["function"]["name"] == "edit_file"
    assert (saved[2].tool_name, saved[2].done_reason, saved[2].content) == (
        "edit_file",
        "ok",
        "edited notes.txt (2 lines)",
    )
    assert saved[2].tool_call_id == saved[1].tool_calls[0]["id"]
    reopened = RecordingApp(MODEL, client=FakeClient(), db_path=tmp_path / "chat.db", toolbox=Toolbox())
    async with reopened.run_test(size=(110, 34)) as pilot:
        await reopened.open_conversation(conv_id)
        await pilot.pause()
        [block] = reopened.query(ToolCallView)
        assert block.result == "edited notes.txt (2 lines)"
        history = reopened.conversation.chat_messages()  # what the next request sends
        assert [m["role"] for m in history] == ["user", "assistant", "tool", "assistant"]
        assert history[1]["tool_calls"] == saved[1].tool_calls
        assert history[2]["tool_name"] == "edit_file"


@async_test
async def test_an_edit_denied_in_the_modal(tool_server: LocalrtServer, tmp_path: Path, work: Path) -> None:
    app = tool_app(tool_server, tmp_path, only(Toolbox(builtin_tools(work)), "edit_file"), [EDIT])
    async with app.run_test(size=(110, 34)) as pilot:
        app.chat_input.insert("In notes.txt, replace apples with cherries.")
        await pilot.press("enter")
        await approve_when_asked(pilot, app, "n")
        worker = app.answer_worker
        assert worker is not None
        await until(pilot, lambda: worker.is_finished, 300, "the answer")
        await pilot.pause(0.3)
        assert (work / "notes.txt").read_text() == "apples\npears\n"
        [block] = app.query(ToolCallView)
        assert block.state == "denied"
        second = app.client.requests[1]["messages"]  # type: ignore[attr-defined]
        assert second[-1]["role"] == "tool"
        assert second[-1]["content"].startswith("The user denied this call")


@async_test
async def test_escape_stops_a_running_command(tool_server: LocalrtServer, tmp_path: Path, work: Path) -> None:
    command = "echo started; sleep 600 & echo $! > child.pid; wait"
    app = tool_app(
        tool_server,
        tmp_path,
        only(Toolbox(builtin_tools(work)), "run_shell"),
        [("run_shell", {"command": command})],
    )
    app.approvals.approve_all = True
    async with app.run_test(size=(110, 34)) as pilot:
        app.chat_input.insert("Run it.")
        await pilot.press("enter")
        await until(pilot, lambda: (work / "child.pid").exists(), 300, "the command to start")
        await pilot.pause(0.2)
        await pilot.press("escape")
        worker = app.answer_worker
        assert worker is not None
        await until(pilot, lambda: worker.is_finished, 30, "the stop")
        await pilot.pause(0.2)
        [block] = app.query(ToolCallView)
        assert block.state == "stopped"
        assert not app.busy
        child = int((work / "child.pid").read_text())
        stat = Path(f"/proc/{child}/stat")
        assert not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] == "Z"  # stopped too
        conv_id = app.conversation.id or 0
    saved = ConversationStore(tmp_path / "chat.db").load(conv_id).messages
    assert [m.role for m in saved] == ["user", "assistant", "tool"]
    assert (saved[2].done_reason, saved[2].tool_call_id) == ("stopped", saved[1].tool_calls[0]["id"])  # type: ignore[index]
    # the next request answers the call with the stop, so the conversation can go on
    history = app.conversation.chat_messages()
    assert history[-1]["role"] == "tool"
    assert history[-1]["content"] == "The user stopped this call before it finished."


@async_test
async def test_mcp_servers_in_the_chat(
    tool_server: LocalrtServer, http_server: McpHttpServer, tmp_path: Path, work: Path
) -> None:
    repo = scratch_repo(tmp_path / "repo")
    config = servers(tmp_path, http_server, repo)
    calls = [
        ("time__get_current_time", {"timezone": "Asia/Tokyo"}),
        ("git__git_status", {"repo_path": str(repo)}),
        ("web__echo", {"text": "from the chat"}),
    ]
    toolbox = Toolbox.standard(work, mcp_config=config)
    app = tool_app(tool_server, tmp_path, toolbox, calls)
    app.approvals.approve_all = True
    async with app.run_test(size=(110, 40)) as pilot:
        await started(pilot, app)
        expected = {
            "time__get_current_time": '"timezone": "Asia/Tokyo"',
            "git__git_status": "modified:   README.md",
            "web__echo": "echo: from the chat",
        }
        for name, _ in calls:
            only(toolbox, name)  # a short prompt: this turn's tool alone
            await ask(pilot, app, f"Use {name}.", timeout=600)
            block = list(app.query(ToolCallView))[-1]
            assert block.tool_name == name, (app.noted, app.conversation.messages[-4:])
            assert block.state == "ok", block.result
            assert expected[name] in block.result
        assert not app.errors()


# ---- in a real terminal ------------------------------------------------------------------------------
def test_mcp_tools_in_a_real_terminal(
    tool_server: LocalrtServer, http_server: McpHttpServer, tmp_path: Path, work: Path
) -> None:
    tmux = shutil.which("tmux")
    if tmux is None:
        pytest.skip("tmux is not installed; CI installs it with `apt-get install -y tmux`")
    config = servers(tmp_path, http_server, scratch_repo(tmp_path / "repo"))
    env = {
        **os.environ,
        "LOCALRT_HOST": tool_server.url.removeprefix("http://"),
        "LOCALRT_DATA": str(tmp_path / "data"),
        "XDG_CONFIG_HOME": str(tmp_path / "config"),
        "PYTHONPATH": str(ROOT),
        "TERM": "xterm-256color",
    }
    sock = str(tmp_path / "tmux.sock")

    def run(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return subprocess.run([tmux, "-S", sock, *args], capture_output=True, text=True, check=check, env=env)

    def screen() -> str:
        return run("capture-pane", "-p", "-t", "chat").stdout

    def wait_for(text: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            shown = screen()
            if text in shown:
                return shown
            time.sleep(0.3)
        raise AssertionError(f"{text!r} never appeared; the pane shows:\n{screen()}")

    argv = [
        sys.executable,
        "-m",
        "localrt",
        "chat",
        MODEL,
        "--mcp",
        str(config),
        "--tool-choice",
        "time__get_current_time",
    ]
    command = " ".join(shlex.quote(a) for a in argv)
    run(
        "new-session",
        "-d",
        "-s",
        "chat",
        "-x",
        "120",
        "-y",
        "40",
        f"cd {shlex.quote(str(work))} && {command}; echo EXITED-$?; sleep 30",
    )
    try:
        wait_for("7 built-in, time (2), git (12), web (3)", 120)  # every server started: the tools line
        run("send-keys", "-t", "chat", "-l", "What time is it in Europe/Paris?")
        run("send-keys", "-t", "chat", "Enter")
        shown = wait_for("Allow time__get_current_time?", 600)  # the approval modal, in the terminal
        assert "MCP server time" in shown
        run("send-keys", "-t", "chat", "y")
        # the forced reply may hold more calls than the first: each asks in a modal of its own, denied
        deadline, quiet = time.monotonic() + 600, 0
        while quiet < 3:
            assert time.monotonic() < deadline, screen()
            time.sleep(1)
            shown = screen()
            if "Allow time__get_current_time?" in shown:
                run("send-keys", "-t", "chat", "n")
                quiet = 0
            else:
                quiet = quiet + 1 if "answering" not in shown and "TTFT" in shown else 0
        assert "⚙ time get_current_time" in shown
        run("send-keys", "-t", "chat", "F6")
        shown = wait_for("Tools · Esc closes", 30)
        assert "time (stdio): ready (2 tools)" in shown
        assert "git (stdio): ready (12 tools)" in shown  # web's rows are further down the panel's list
        run("send-keys", "-t", "chat", "Escape")
        run("send-keys", "-t", "chat", "C-q")
        wait_for("EXITED-0", 60)
    finally:
        run("kill-server", check=False)
    [conv] = ConversationStore(tmp_path / "data" / "chat.db").conversations()
    roles = [m.role for m in ConversationStore(tmp_path / "data" / "chat.db").load(conv.id or 0).messages]
    assert roles[:3] == ["user", "assistant", "tool"]
    messages = ConversationStore(tmp_path / "data" / "chat.db").load(conv.id or 0).messages
    assert '"datetime":' in messages[2].content  # the MCP server's answer, approved with y


def test_the_tools_screenshot() -> None:
    """docs/tui-tools.svg: the approved edit above (LOCALRT_UPDATE_SCREENSHOT=1 retakes it)."""
    text = SCREENSHOT.read_text(encoding="utf-8")
    assert text.lstrip().startswith("<svg")
    assert "edit&#160;notes.txt&#160;·&#160;ok" in text or "edit notes.txt · ok" in text
    assert "edited&#160;notes.txt" in text or "edited notes.txt" in text
