"""The chat app as a person meets it: in a real terminal (tmux), killed mid-answer, and the README's
screenshot. All on the real SmolLM2 model.

tmux: CI installs it (`apt-get install -y tmux`); where it cannot be installed the tmux test skips
and says so. The README screenshot (docs/tui.svg) is regenerated with
`LOCALRT_UPDATE_SCREENSHOT=1 python -m pytest tests/test_tui_terminal.py -k screenshot`.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("textual")
if importlib.util.find_spec("llama_cpp") is None:
    pytest.skip("llama-cpp-python is not installed (pip install 'localrt[llama]')", allow_module_level=True)

from localrt.store.importer import import_gguf  # noqa: E402
from localrt.store.store import Store  # noqa: E402
from localrt.tui.conversations import ConversationStore  # noqa: E402
from tests.test_tui_app import FRANCE  # noqa: E402
from tests.test_tui_app import MODEL  # noqa: E402
from tests.test_tui_app import PARAMS  # noqa: E402
from tests.test_tui_app import SYSTEM  # noqa: E402
from tests.test_tui_app import FakeClient  # noqa: E402
from tests.test_tui_app import free_port  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SCREENSHOT = ROOT / "docs" / "tui.svg"


@pytest.fixture
def env(tmp_path: Path, smollm2_gguf: Path) -> dict[str, str]:
    """A store with SmolLM2 (greedy, short answers), a private chat DB and no server on LOCALRT_HOST."""
    import_gguf(Store(tmp_path / "models"), MODEL, smollm2_gguf, system=SYSTEM, params=PARAMS)
    return {
        **os.environ,
        "LOCALRT_MODELS": str(tmp_path / "models"),
        "LOCALRT_DATA": str(tmp_path / "data"),
        "LOCALRT_HOST": f"127.0.0.1:{free_port()}",
        "TERM": "xterm-256color",
    }


def chat_argv() -> list[str]:
    """`localrt chat NAME`, as a user starts it."""
    return [sys.executable, "-m", "localrt", "chat", MODEL]


def test_localrt_chat_in_a_real_terminal(env: dict[str, str], tmp_path: Path) -> None:
    tmux = shutil.which("tmux")
    if tmux is None:
        pytest.skip("tmux is not installed; CI installs it with `apt-get install -y tmux`")
    sock = str(tmp_path / "tmux.sock")  # a private tmux server: nothing of the user's is touched

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
            time.sleep(0.2)
        raise AssertionError(f"{text!r} never appeared; the pane shows:\n{screen()}")

    command = " ".join(shlex.quote(a) for a in chat_argv())
    run(
        "new-session",
        "-d",
        "-s",
        "chat",
        "-x",
        "100",
        "-y",
        "30",
        f"cd {shlex.quote(str(ROOT))} && {command}; echo EXITED-$?; sleep 30",
    )
    try:
        wait_for("Ask anything", 60)  # the input's placeholder: the app is up
        run("send-keys", "-t", "chat", "-l", FRANCE)
        run("send-keys", "-t", "chat", "Enter")
        shown = wait_for("Paris", 120)
        assert "smollm2:135m" in shown
        assert "TTFT" in shown
        assert "tok/s" in shown
        run("send-keys", "-t", "chat", "C-q")
        wait_for("EXITED-0", 30)  # quits cleanly, exit status 0
    finally:
        run("kill-server", check=False)
    [conv] = ConversationStore(Path(env["LOCALRT_DATA"]) / "chat.db").conversations()
    assert conv.title == FRANCE


KILL_SCRIPT = """
import asyncio, sys
from pathlib import Path
from localrt.store.store import Store
from localrt.tui.app import ChatApp
from localrt.client import InProcessClient
from localrt.tui.conversations import Settings

async def wait(pilot, condition):
    while not condition():
        await pilot.pause(0.05)

async def main():
    app = ChatApp(sys.argv[1], client=InProcessClient(Store(sys.argv[2])), db_path=sys.argv[3])
    async with app.run_test(size=(100, 30)) as pilot:
        app.conversation.settings = Settings(options={"num_predict": 900})
        for text in (sys.argv[4], "Write a very long story about a dragon."):
            before = app.answer_worker
            app.chat_input.focus()
            app.chat_input.insert(text)
            await pilot.press("enter")
            await wait(pilot, lambda: app.answer_worker is not before)
            if before is None:
                await wait(pilot, lambda: app.answer_worker.is_finished)
                print("FIRST ANSWER DONE", flush=True)
        await wait(pilot, lambda: app.status.stats.pieces >= 8)
        print("STREAMING", flush=True)
        await asyncio.sleep(3600)

asyncio.run(main())
"""


def test_killing_the_app_mid_answer_loses_no_earlier_message(env: dict[str, str], tmp_path: Path) -> None:
    db = tmp_path / "data" / "chat.db"
    proc = subprocess.Popen(
        [sys.executable, "-c", KILL_SCRIPT, MODEL, env["LOCALRT_MODELS"], str(db), FRANCE],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 180
        assert proc.stdout is not None
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if line.startswith("STREAMING"):
                break
        assert lines, "no line came back"
        assert lines[-1].startswith("STREAMING"), "".join(lines)
        time.sleep(0.8)  # past one periodic save of the streaming answer
    finally:
        proc.send_signal(signal.SIGKILL)  # no cleanup of any kind runs
        proc.wait()

    store = ConversationStore(db)
    [conv] = store.conversations()
    first_q, first_a, second_q, partial = store.load(conv.id or 0).messages
    assert (first_q.content, first_q.role) == (FRANCE, "user")
    assert "Paris" in first_a.content
    assert first_a.complete
    assert first_a.done_reason == "stop"
    assert second_q.content == "Write a very long story about a dragon."
    assert partial.role == "assistant"
    assert not partial.complete
    assert len(partial.content) > 10
    store.close()

    # reopened, the cut answer is shown as interrupted and the conversation can go on
    from localrt.tui.app import ChatApp
    from localrt.tui.widgets import MessageView

    async def reopen() -> None:
        app = ChatApp(MODEL, client=FakeClient(), db_path=db)
        async with app.run_test(size=(100, 30)) as pilot:
            await app.open_conversation(conv.id or 0)
            await pilot.pause()
            views = list(app.query(MessageView))
            assert len(views) == 4
            assert views[-1].note == "interrupted"

    asyncio.run(reopen())


def test_readme_screenshot(smollm2_gguf: Path, tmp_path: Path) -> None:
    """docs/tui.svg is a real conversation with SmolLM2; set LOCALRT_UPDATE_SCREENSHOT=1 to retake it."""
    if os.environ.get("LOCALRT_UPDATE_SCREENSHOT"):
        from localrt.client import InProcessClient
        from localrt.tui.app import ChatApp
        from tests.test_tui_app import ask

        store = Store(tmp_path / "models")
        import_gguf(store, MODEL, smollm2_gguf, system=SYSTEM, params={**PARAMS, "num_predict": 80})

        async def take() -> None:
            app = ChatApp(MODEL, client=InProcessClient(store), db_path=tmp_path / "chat.db")
            async with app.run_test(size=(110, 34)) as pilot:
                await ask(pilot, app, FRANCE)
                await ask(pilot, app, "Write a Python function that reverses a string.")
                await pilot.pause(0.5)
                SCREENSHOT.parent.mkdir(exist_ok=True)
                SCREENSHOT.write_text(app.export_screenshot(title="localrt chat"), encoding="utf-8")

        asyncio.run(take())
    text = SCREENSHOT.read_text(encoding="utf-8")
    assert text.lstrip().startswith("<svg")
    assert "Paris" in text
    assert "smollm2:135m" in text
