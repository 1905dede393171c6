"""Snapshots (pytest-textual-snapshot) of the chat app's main screens at 80x24 and 120x40.

Deterministic by construction: a scripted client (fixed model names and sizes, no model output),
a seeded conversation database and a fixed clock. The SVGs live in tests/snapshots/test_tui_snapshots/;
after an intended change, review and refresh them with `pytest tests/test_tui_snapshots.py --snapshot-update`.
"""

from __future__ import annotations

from collections.abc import Awaitable
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("textual")
pytest_textual_snapshot = pytest.importorskip("pytest_textual_snapshot")

from localrt.tui.app import ChatApp  # noqa: E402
from localrt.tui.conversations import ConversationStore  # noqa: E402
from localrt.tui.conversations import Message  # noqa: E402
from localrt.tui.conversations import Settings  # noqa: E402
from localrt.tui.screens import ModelInfoScreen  # noqa: E402
from tests.test_tui_app import MODEL  # noqa: E402
from tests.test_tui_app import T0  # noqa: E402
from tests.test_tui_app import FakeClient  # noqa: E402

SIZES = [(80, 24), (120, 40)]
NOW = T0 + 2 * 3600  # "2h ago" in the sidebar, whatever the real date
CODE_ANSWER = """Here is one way:

```python
def add(a: int, b: int) -> int:
    \"\"\"Return the sum of a and b.\"\"\"
    return a + b
```

Call it as `add(2, 3)`, which returns **5**."""


class SnapshotDir(pytest_textual_snapshot.SVGImageExtension):  # type: ignore[name-defined,misc]
    """Keep this project's snapshots in tests/snapshots/<test module>/ (syrupy's default is __snapshots__)."""

    @classmethod
    def dirname(cls, *, test_location: Any) -> str:
        return str(Path(test_location.filepath).parent / "snapshots" / test_location.basename)


@pytest.fixture(autouse=True)
def no_user_config(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The tools line shows the built-in tools only: no user's MCP config is read."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))


@pytest.fixture
def snapshot_dir(monkeypatch: pytest.MonkeyPatch) -> None:
    # the plugin's fixture reads this module-level name when it is set up, so patch it before that
    monkeypatch.setattr(pytest_textual_snapshot, "SVGImageExtension", SnapshotDir)


@pytest.fixture
def snap_compare(snapshot_dir: None, snap_compare: Callable[..., bool]) -> Callable[..., bool]:
    return snap_compare


def seeded_app(tmp_path: Path, *, warn: bool = False) -> ChatApp:
    clock = iter(range(10_000))
    db = ConversationStore(tmp_path / "chat.db", clock=lambda: T0 + next(clock))
    one = db.create("What is the capital of France?", MODEL)
    db.add_message(one.id, Message("user", "What is the capital of France?"))
    db.add_message(
        one.id,
        Message(
            "assistant",
            "The capital of France is Paris.",
            model=MODEL,
            stats={"ttft_s": 0.21, "tokens_per_s": 42.5, "context_tokens": 45},
        ),
    )
    two = db.create(
        "Write a Python function that adds two numbers.",
        MODEL,
        Settings(system="You are a concise coding assistant.", options={"temperature": 0.0}),
    )
    db.add_message(two.id, Message("user", "Write a Python function that adds two numbers."))
    db.add_message(
        two.id,
        Message(
            "assistant",
            CODE_ANSWER,
            model=MODEL,
            stats={
                "ttft_s": 0.18,
                "tokens_per_s": 38.2,
                "context_tokens": 870 if warn else 96,
                "draft_count": 40,
                "draft_accepted_count": 29,
            },
        ),
    )
    return ChatApp(MODEL, client=FakeClient(), store=db, clock=lambda: NOW)


async def settle(pilot: Any) -> None:
    """Wait for the background bits (the context length in the status bar, Markdown layout)."""
    app: ChatApp = pilot.app
    for _ in range(200):
        if app.status.stats.ctx_len is not None and not any(w.is_running for w in app.workers):
            break
        await pilot.pause(0.01)
    for widget in [*app.query("Input, TextArea"), *app.screen.query("Input, TextArea")]:
        widget.cursor_blink = False  # type: ignore[attr-defined]  # else a slow run may catch the cursor off
    await pilot.wait_for_scheduled_animations()
    await pilot.pause()
    await pilot.pause()


async def open_latest(pilot: Any) -> None:
    app: ChatApp = pilot.app
    await app.open_conversation(app.db.conversations()[0].id or 0)
    await settle(pilot)


def then_press(key: str, screen: type | None = None) -> Callable[[Any], Awaitable[None]]:
    async def run(pilot: Any) -> None:
        await settle(pilot)
        await pilot.press(key)
        for _ in range(100):  # some dialogs open after an await (model info)
            if screen is None or isinstance(pilot.app.screen, screen):
                break
            await pilot.pause(0.02)
        await settle(pilot)

    return run


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_welcome(snap_compare: Callable[..., bool], tmp_path: Path, size: tuple[int, int]) -> None:
    app = ChatApp(MODEL, client=FakeClient(), db_path=tmp_path / "chat.db", clock=lambda: NOW)
    assert snap_compare(app, terminal_size=size, run_before=settle)


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_conversation(snap_compare: Callable[..., bool], tmp_path: Path, size: tuple[int, int]) -> None:
    assert snap_compare(seeded_app(tmp_path), terminal_size=size, run_before=open_latest)


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_help(snap_compare: Callable[..., bool], tmp_path: Path, size: tuple[int, int]) -> None:
    assert snap_compare(seeded_app(tmp_path), terminal_size=size, run_before=then_press("f1"))


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_settings(snap_compare: Callable[..., bool], tmp_path: Path, size: tuple[int, int]) -> None:
    async def run(pilot: Any) -> None:
        await open_latest(pilot)
        await then_press("f4")(pilot)

    assert snap_compare(seeded_app(tmp_path), terminal_size=size, run_before=run)


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_pull(snap_compare: Callable[..., bool], tmp_path: Path, size: tuple[int, int]) -> None:
    assert snap_compare(seeded_app(tmp_path), terminal_size=size, run_before=then_press("f5"))


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_model_info(snap_compare: Callable[..., bool], tmp_path: Path, size: tuple[int, int]) -> None:
    assert snap_compare(
        seeded_app(tmp_path), terminal_size=size, run_before=then_press("f3", ModelInfoScreen)
    )


def test_context_warning_80x24(snap_compare: Callable[..., bool], tmp_path: Path) -> None:
    assert snap_compare(seeded_app(tmp_path, warn=True), terminal_size=(80, 24), run_before=open_latest)


def test_no_color_80x24(
    snap_compare: Callable[..., bool], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NO_COLOR", "1")
    assert snap_compare(seeded_app(tmp_path), terminal_size=(80, 24), run_before=open_latest)
