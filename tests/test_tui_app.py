"""`localrt chat` driven with Textual's Pilot (`App.run_test`), on the real SmolLM2 model.

Covers: a streamed answer, Esc, switching models, saving and reopening, pulling from a local
registry with visible progress, every error case as a notification while the app lives on, the
settings dialog's validation, the context warning, the palette and help, a running `localrt serve`.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import socket
import time
from collections.abc import AsyncIterator
from collections.abc import Callable
from collections.abc import Iterator
from collections.abc import Mapping
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("textual")

from textual.widgets import Checkbox  # noqa: E402
from textual.widgets import Input  # noqa: E402
from textual.widgets import ListView  # noqa: E402
from textual.widgets import OptionList  # noqa: E402
from textual.widgets import ProgressBar  # noqa: E402
from textual.widgets import Select  # noqa: E402
from textual.widgets import TextArea  # noqa: E402

from localrt.client import InProcessClient  # noqa: E402
from localrt.client import ModelDetails  # noqa: E402
from localrt.client import ModelInfo  # noqa: E402
from localrt.client import ModelRow  # noqa: E402
from localrt.client import ServerClient  # noqa: E402
from localrt.client import connect  # noqa: E402
from localrt.runtime.answers import Chunk  # noqa: E402
from localrt.runtime.answers import Metrics  # noqa: E402
from localrt.store.importer import import_gguf  # noqa: E402
from localrt.store.names import parse_name  # noqa: E402
from localrt.store.pull import Progress  # noqa: E402
from localrt.store.store import Store  # noqa: E402
from localrt.tui.app import ACTIONS  # noqa: E402
from localrt.tui.app import INPUT_KEYS  # noqa: E402
from localrt.tui.app import ChatApp  # noqa: E402
from localrt.tui.app import key_label  # noqa: E402
from localrt.tui.conversations import ConversationStore  # noqa: E402
from localrt.tui.conversations import Settings  # noqa: E402
from localrt.tui.screens import ConfirmScreen  # noqa: E402
from localrt.tui.screens import HelpScreen  # noqa: E402
from localrt.tui.screens import ModelInfoScreen  # noqa: E402
from localrt.tui.screens import ModelPickerScreen  # noqa: E402
from localrt.tui.screens import PromptScreen  # noqa: E402
from localrt.tui.screens import PullScreen  # noqa: E402
from localrt.tui.screens import SettingsScreen  # noqa: E402
from localrt.tui.widgets import ChatInput  # noqa: E402
from localrt.tui.widgets import MessageView  # noqa: E402
from tests.conftest import async_test  # noqa: E402

THREADS = int(os.environ.get("LOCALRT_TEST_THREADS", "1"))
# greedy, short and a plain system prompt: SmolLM2-135M's own default system prompt makes it ramble
PARAMS = {"temperature": 0, "num_ctx": 1024, "num_thread": THREADS, "num_batch": 256, "num_predict": 32}
SYSTEM = "You are a helpful assistant."
FRANCE = "What is the capital of France?"
MODEL = "smollm2:135m"
TWIN = "twin:latest"  # the same weights under a second name, to switch between
BROKEN = "broken-template:latest"
T0 = 1_700_000_000.0

needs_llama = pytest.mark.skipif(
    importlib.util.find_spec("llama_cpp") is None,
    reason="llama-cpp-python is not installed (pip install 'localrt[llama]')",
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(autouse=True)
def no_default_server(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Nothing listens on LOCALRT_HOST, the chat database lives in this test's tmp dir, and no user's MCP
    config (~/.config/localrt/mcp.json) is read."""
    monkeypatch.setenv("LOCALRT_HOST", f"127.0.0.1:{free_port()}")
    monkeypatch.setenv("LOCALRT_DATA", str(tmp_path / "data"))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.delenv("NO_COLOR", raising=False)


@pytest.fixture(scope="module")
def model_root(tmp_path_factory: pytest.TempPathFactory, smollm2_gguf: Path) -> Path:
    """One store for the module (importing 98 MB once): SmolLM2, a twin, and one with a broken template."""
    root = tmp_path_factory.mktemp("tui-models")
    store = Store(root)
    import_gguf(store, MODEL, smollm2_gguf, system=SYSTEM, params=PARAMS)
    store.copy(parse_name(MODEL), parse_name(TWIN))
    import_gguf(
        store,
        BROKEN,
        smollm2_gguf,
        system=SYSTEM,
        params=PARAMS,
        template="{% for m in messages %}{{ m.content }",
    )  # unclosed: jinja cannot compile it
    return root


class RecordingApp(ChatApp):
    """The real app, remembering every notification (Textual drops them when they expire)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.noted: list[tuple[str, str]] = []

    def notify(
        self,
        message: str,
        *,
        title: str = "",
        severity: Any = "information",
        timeout: float | None = None,
        markup: bool = False,
    ) -> None:
        self.noted.append((severity, f"{title}: {message}" if title else message))
        super().notify(message, title=title, severity=severity, timeout=timeout, markup=markup)

    def errors(self) -> list[str]:
        return [m for s, m in self.noted if s == "error"]


def make_app(root: Path | None, tmp_path: Path, model: str | None = MODEL, **kwargs: Any) -> RecordingApp:
    kwargs.setdefault("client", InProcessClient(Store(root)) if root is not None else FakeClient())
    return RecordingApp(model, db_path=tmp_path / "chat.db", export_dir=tmp_path, **kwargs)


async def until(pilot: Any, condition: Callable[[], bool], timeout: float = 120.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what or condition}")
        await pilot.pause(0.05)


async def ask(pilot: Any, app: ChatApp, text: str, timeout: float = 120.0, *, type_it: bool = False) -> None:
    """Enter a message (typed key by key, or pasted: typing costs ~70 ms a key), press Enter, and wait
    until the answer (or its error) is fully handled."""
    before = app.answer_worker
    app.chat_input.focus()
    if type_it:
        await pilot.press(*text)
    else:
        app.chat_input.insert(text)
    await pilot.press("enter")
    await until(pilot, lambda: app.answer_worker is not before, 10, "the answer to start")
    worker = app.answer_worker
    assert worker is not None
    await until(pilot, lambda: worker.is_finished, timeout, "the answer to finish")
    await pilot.pause()


class FakeClient:
    """A scripted model host for the tests that need no model: fixed names, sizes and answers."""

    kind = "runtime"
    where = "in-process"

    def __init__(
        self,
        models: Sequence[str] = (MODEL, TWIN),
        answer: Sequence[str] = ("Hello", " there", "."),
    ):
        self.models = list(models)
        self.answer = list(answer)
        self.requests: list[dict[str, Any]] = []

    async def chat(
        self,
        model: str,
        messages: Sequence[Mapping[str, Any]],
        *,
        options: Mapping[str, Any] | None = None,
        format: str | None = None,
        think: bool | None = None,
        keep_alive: str | float | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        tool_choice: Any = None,
    ) -> AsyncIterator[Chunk]:
        self.requests.append(
            {
                "model": model,
                "messages": list(messages),
                "options": options,
                "format": format,
                "think": think,
                "tools": tools,
            }
        )
        for piece in self.answer:
            await asyncio.sleep(0)
            yield Chunk(model=model, content=piece)
        yield Chunk(
            model=model,
            done=True,
            done_reason="stop",
            metrics=Metrics(total_ns=10**9, eval_count=42, eval_ns=10**9, prompt_eval_count=20),
        )

    async def list_models(self) -> list[ModelRow]:
        return [ModelRow(name, 98_363_392 + i, T0) for i, name in enumerate(self.models)]

    async def show(self, model: str, options: Mapping[str, Any] | None = None) -> ModelInfo:
        return ModelInfo(model, "llama", "134.52M", "Q4_1", 8192, 98_363_392, "llama.cpp (not loaded)")

    async def details(self, model: str) -> ModelDetails:
        return ModelDetails("llama", "135M", 8192, 576, "Q4_1", capabilities=["completion", "tools"])

    async def pull(self, model: str, *, insecure: bool = False) -> AsyncIterator[Progress]:
        yield Progress("pulling manifest")

    async def delete(self, model: str) -> None:
        self.models.remove(model)

    async def context_length(self, model: str, options: Mapping[str, Any] | None = None) -> int | None:
        return 1024

    async def count_tokens(
        self, model: str, messages: Sequence[Mapping[str, Any]], options: Mapping[str, Any] | None = None
    ) -> tuple[int, bool]:
        return 20 * len(messages), True

    async def close(self) -> None:
        pass


# ---- the core: a streamed answer, Esc, switching, reopening --------------------------------------
@needs_llama
@async_test
async def test_send_a_message_and_receive_a_streamed_answer(model_root: Path, tmp_path: Path) -> None:
    app = make_app(model_root, tmp_path)
    async with app.run_test(size=(100, 30)) as pilot:
        await ask(pilot, app, FRANCE, type_it=True)
        question, answer = app.conversation.messages
        assert question.content == FRANCE
        assert "Paris" in answer.content
        assert answer.done_reason == "stop"
        assert answer.model == MODEL
        stats = app.status.stats
        assert stats.pieces > 1  # it arrived token by token, not at once
        assert stats.ttft is not None
        assert stats.ttft > 0
        assert stats.tokens_per_s
        assert stats.tokens_per_s > 0
        assert stats.ctx_len == 1024
        assert stats.ctx_exact
        assert 20 < (stats.ctx_used or 0) < 200
        line = str(app.status.line())
        assert "TTFT" in line
        assert "tok/s" in line
        assert f"ctx {stats.ctx_used}/1024" in line
        views = list(app.query(MessageView))
        assert [v.role for v in views] == ["user", "assistant"]
        assert "Paris" in views[-1].markdown.source
        assert not app.errors()
        saved = ConversationStore(tmp_path / "chat.db").load(app.conversation.id or 0)
        assert [m.content for m in saved.messages] == [question.content, answer.content]
        assert saved.messages[1].stats
        assert saved.messages[1].stats["tokens_per_s"] > 0


@needs_llama
@async_test
async def test_escape_stops_the_answer_and_keeps_what_was_generated(model_root: Path, tmp_path: Path) -> None:
    app = make_app(model_root, tmp_path)
    async with app.run_test(size=(100, 30)) as pilot:
        app.conversation.settings = Settings(options={"num_predict": 900})
        app.chat_input.focus()
        app.chat_input.insert("Write a very long story about a dragon.")
        await pilot.press("enter")
        await until(pilot, lambda: app.status.stats.pieces >= 5, 120, "the answer to start streaming")
        await pilot.press("escape")
        worker = app.answer_worker
        assert worker is not None
        await until(pilot, lambda: worker.is_finished, 15, "the stop")
        answer = app.conversation.messages[-1]
        assert answer.role == "assistant"
        assert answer.done_reason == "cancel"
        assert len(answer.content) > 10
        assert app.query(MessageView).last().note == "stopped"
        saved = ConversationStore(tmp_path / "chat.db").load(app.conversation.id or 0).messages[-1]
        assert saved.content == answer.content
        assert saved.done_reason == "cancel"
        assert saved.complete
        assert not app.busy
        assert not app.errors()
        # the model is free again: the next question is answered, with the stopped turn in its history
        await ask(pilot, app, FRANCE)
        assert len(app.conversation.messages) == 4
        assert app.conversation.messages[-1].content


@needs_llama
@async_test
async def test_quitting_mid_answer_keeps_the_partial_answer(model_root: Path, tmp_path: Path) -> None:
    app = make_app(model_root, tmp_path)
    async with app.run_test(size=(100, 30)) as pilot:
        app.conversation.settings = Settings(options={"num_predict": 900})
        app.chat_input.focus()
        app.chat_input.insert("Write a very long story about a dragon.")
        await pilot.press("enter")
        await until(pilot, lambda: app.status.stats.pieces >= 5, 120, "the answer to start streaming")
        await pilot.press("ctrl+q")
    conv_id = app.conversation.id or 0
    question, answer = ConversationStore(tmp_path / "chat.db").load(conv_id).messages
    assert question.role == "user"
    assert answer.role == "assistant"
    assert answer.complete
    assert answer.done_reason == "cancel"
    assert len(answer.content) > 10


@needs_llama
@async_test
async def test_switching_models(model_root: Path, tmp_path: Path) -> None:
    client = InProcessClient(Store(model_root))
    app = make_app(model_root, tmp_path, client=client)
    async with app.run_test(size=(100, 30)) as pilot:
        assert app.conversation.model == MODEL
        await pilot.press("ctrl+o")
        assert isinstance(app.screen, ModelPickerScreen)
        options = app.screen.query_one(OptionList)
        ids = [options.get_option_at_index(i).id for i in range(options.option_count)]
        options.highlighted = ids.index(TWIN)
        await pilot.press("enter")
        await pilot.pause()
        assert app.conversation.model == TWIN
        assert app.sub_title.endswith(TWIN)
        await ask(pilot, app, FRANCE)
        assert "Paris" in app.conversation.messages[-1].content
        assert app.conversation.messages[-1].model == TWIN
        assert TWIN in [row.name for row in client.runtime.ps()]  # the runtime really loaded the twin
        assert ConversationStore(tmp_path / "chat.db").load(app.conversation.id or 0).model == TWIN
        # and back, from the sidebar
        models = app.query_one("#models", ListView)
        models.focus()
        models.index = [m.name for m in app.models].index(MODEL)
        await pilot.press("enter")
        assert app.conversation.model == MODEL
        assert ConversationStore(tmp_path / "chat.db").load(app.conversation.id or 0).model == MODEL
        assert any("now uses smollm2:135m" in m for _, m in app.noted)


@needs_llama
def test_saving_and_reopening_a_conversation(model_root: Path, tmp_path: Path) -> None:
    async def first_session() -> int:
        app = make_app(model_root, tmp_path, model=TWIN)
        async with app.run_test(size=(100, 30)) as pilot:
            await pilot.press("f4")
            screen = app.screen
            assert isinstance(screen, SettingsScreen)
            screen.query_one("#system", TextArea).text = "Answer in one short sentence."
            screen.query_one("#temperature", Input).focus()
            await pilot.press("0")
            screen.query_one("#num_predict", Input).focus()
            await pilot.press("2", "4")
            await pilot.press("ctrl+s")
            await pilot.pause()
            assert not isinstance(app.screen, SettingsScreen)
            assert app.conversation.settings.options == {"temperature": 0.0, "num_predict": 24}
            await ask(pilot, app, FRANCE)
            assert "Paris" in app.conversation.messages[-1].content
            return app.conversation.id or 0

    async def second_session(conv_id: int) -> None:
        app = make_app(model_root, tmp_path, model=MODEL)
        async with app.run_test(size=(100, 30)) as pilot:
            assert app.conversation.id is None
            assert not app.conversation.messages
            sidebar = app.query_one("#conversations", ListView)
            assert len(sidebar.children) == 1
            sidebar.focus()
            sidebar.index = 0
            await pilot.press("enter")
            await pilot.pause()
            conv = app.conversation
            assert conv.id == conv_id
            assert conv.model == TWIN
            assert conv.settings.system == "Answer in one short sentence."
            assert conv.settings.options == {"temperature": 0.0, "num_predict": 24}
            assert [m.role for m in conv.messages] == ["user", "assistant"]
            assert [v.role for v in app.query(MessageView)] == ["user", "assistant"]
            assert "Paris" in app.query(MessageView).last().markdown.source
            assert app.status.stats.ttft is not None  # the last answer's numbers are shown again
            await ask(pilot, app, "And of Italy?")
            assert len(conv.messages) == 4
            assert len(ConversationStore(tmp_path / "chat.db").load(conv_id).messages) == 4

    conv_id = asyncio.run(first_session())
    asyncio.run(second_session(conv_id))


# ---- model management ----------------------------------------------------------------------------
@needs_llama
@async_test
async def test_pulling_a_model_shows_progress(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("gguf")
    from tests.gguf_factory import write_tiny_llama
    from tests.servers.registry import Registry

    monkeypatch.setenv("LOCALRT_MODELS", str(tmp_path / "models"))
    gguf = write_tiny_llama(tmp_path / "tiny.gguf", n_embd=256, n_ff=512)  # a few MB: many progress events
    with Registry() as registry:
        registry.add_model("library/tiny", "latest", gguf)
        # a link slow enough (about 1 s for the file) that the pull's progress, a few events a second,
        # shows the bar part-filled
        registry.delay = 0.01
        name = f"{registry.address}/library/tiny:latest"

        app = make_app(tmp_path / "models", tmp_path, model=None)
        async with app.run_test(size=(100, 30)) as pilot:
            assert app.models == []
            assert any("No models" in m for _, m in app.noted)
            await pilot.press("f5")
            screen = app.screen
            assert isinstance(screen, PullScreen)
            screen.query_one("#pull-name", Input).value = name
            # first without --insecure: a plain-http registry is refused, shown in the dialog
            screen.query_one("#pull-name", Input).focus()
            await pilot.press("enter")
            await until(pilot, lambda: not screen.pulling and bool(app.errors()), 30, "the refusal")
            assert isinstance(app.screen, PullScreen)
            assert app.is_running
            await pilot.click("#insecure")
            assert screen.query_one("#insecure", Checkbox).value
            bar = screen.query_one("#pull-bar", ProgressBar)
            seen: list[tuple[float, float]] = []
            # every value the bar takes, recorded as it is set: the UI loop's pace does not matter
            screen.watch(bar, "progress", lambda done: seen.append((done, bar.total or 0)), init=False)
            await pilot.click("#pull-start")
            await until(pilot, lambda: not isinstance(app.screen, PullScreen), 120, "the pull to finish")
            assert any(0 < done < total for done, total in seen), seen  # visible partial progress
            assert screen.events_seen > 5
            await until(pilot, lambda: app.conversation.model == name, 10, "the pulled model to be chosen")
            assert app.is_installed(name)
            listed = [item.model_name for item in app.query("#models ModelItem")]  # type: ignore[attr-defined]
            assert name in listed
            assert Store(tmp_path / "models").exists(parse_name(name))


@needs_llama
@async_test
async def test_model_info_and_delete(model_root: Path, tmp_path: Path) -> None:
    spare = "spare:latest"
    Store(model_root).copy(parse_name(MODEL), parse_name(spare))

    app = make_app(model_root, tmp_path)
    async with app.run_test(size=(100, 30)) as pilot:
        await pilot.press("f3")
        await until(pilot, lambda: isinstance(app.screen, ModelInfoScreen), 20, "the info dialog")
        info = app.screen.info  # type: ignore[attr-defined]
        assert (info.name, info.architecture, info.quantization, info.context_length) == (
            MODEL,
            "llama",
            "Q4_1",
            8192,
        )
        assert info.backend == "llama.cpp (not loaded)"
        assert info.size > 90_000_000
        await pilot.press("escape")
        models = app.query_one("#models", ListView)
        models.focus()
        models.index = [m.name for m in app.models].index(spare)
        await pilot.press("f9")
        assert isinstance(app.screen, ConfirmScreen)
        await pilot.press("y")
        await until(pilot, lambda: not app.is_installed(spare), 10, "the delete")
        assert not Store(model_root).exists(parse_name(spare))
        assert Store(model_root).exists(parse_name(MODEL))  # the shared blob stays for the others


# ---- errors: notifications, and the app lives on ---------------------------------------------------
@needs_llama
@async_test
async def test_error_model_missing(model_root: Path, tmp_path: Path) -> None:
    app = make_app(model_root, tmp_path, model="nosuchmodel")
    async with app.run_test(size=(100, 30)) as pilot:
        assert any("model 'nosuchmodel:latest' not found" in m for m in app.errors())
        await ask(pilot, app, "Hello?")
        assert any("not found" in m and "Error" in m for m in app.errors())
        assert app.is_running
        assert not app.busy
        assert app.chat_input.text == "Hello?"  # the message is given back, not lost
        assert app.conversation.messages == []
        assert ConversationStore(tmp_path / "chat.db").conversations() == []  # no empty entry left


@needs_llama
@async_test
async def test_error_backend_not_installed(model_root: Path, tmp_path: Path, without_mlx: None) -> None:
    app = make_app(model_root, tmp_path)
    async with app.run_test(size=(100, 30)) as pilot:
        await pilot.press("f4")
        app.screen.query_one("#backend", Select).value = "mlx"
        await pilot.press("ctrl+s")
        await pilot.pause()
        assert app.conversation.settings.options == {"backend": "mlx"}
        await ask(pilot, app, FRANCE)
        assert any("backend mlx is not available" in m for m in app.errors()), app.errors()
        assert app.is_running
        assert app.chat_input.text == FRANCE
        # the app recovers: back to the default backend, the same question is answered
        await pilot.press("f4")
        app.screen.query_one("#backend", Select).value = Select.NULL
        await pilot.press("ctrl+s")
        app.chat_input.clear()
        await ask(pilot, app, FRANCE)
        assert "Paris" in app.conversation.messages[-1].content


@async_test
async def test_error_server_unreachable(tmp_path: Path) -> None:
    dead = ServerClient(f"http://127.0.0.1:{free_port()}", connect_timeout=2)
    app = make_app(None, tmp_path, client=dead)
    async with app.run_test(size=(100, 30)) as pilot:
        assert any("cannot reach the localrt server" in m for m in app.errors())  # listing models
        await ask(pilot, app, "Hello?")
        assert sum("cannot reach the localrt server" in m for m in app.errors()) == 2
        await pilot.press("f5")
        app.screen.query_one("#pull-name", Input).value = MODEL
        await pilot.click("#pull-start")
        await until(pilot, lambda: sum("cannot reach" in m for m in app.errors()) == 3, 20, "the pull error")
        assert app.is_running
        assert app.chat_input.text == "Hello?"


@needs_llama
@async_test
async def test_error_template(model_root: Path, tmp_path: Path) -> None:
    app = make_app(model_root, tmp_path, model=BROKEN)
    async with app.run_test(size=(100, 30)) as pilot:
        await ask(pilot, app, FRANCE)
        assert any("chat template is invalid" in m for m in app.errors()), app.errors()
        assert app.is_running
        assert not app.busy
        app.chat_input.clear()
        app.switch_model(MODEL)  # another model still works
        await ask(pilot, app, FRANCE)
        assert "Paris" in app.conversation.messages[-1].content


# ---- live numbers, settings, palette, help -------------------------------------------------------
@needs_llama
@async_test
async def test_warning_before_the_context_overflows(model_root: Path, tmp_path: Path) -> None:
    app = make_app(model_root, tmp_path)
    async with app.run_test(size=(100, 30)) as pilot:
        # a 40-token context: the prompt (~27 tokens) and a short answer nearly fill it
        app.conversation.settings = Settings(options={"num_ctx": 40, "num_predict": 8})
        await ask(pilot, app, FRANCE)
        stats = app.status.stats
        assert stats.ctx_len == 40, stats
        assert stats.ctx_used is not None, stats
        assert 32 <= stats.ctx_used <= 40, stats
        assert stats.near_overflow
        assert app.status.has_class("-warning")
        assert str(app.status.line()).startswith(f"⚠ ctx {stats.ctx_used}/40")
        assert any("Context almost full" in m for s, m in app.noted if s == "warning")


@needs_llama
@async_test
async def test_speculative_acceptance_in_the_status_bar(model_root: Path, tmp_path: Path) -> None:
    app = make_app(model_root, tmp_path)
    async with app.run_test(size=(100, 30)) as pilot:
        app.conversation.settings = Settings(options={"speculative": "lookup"})  # prompt-lookup drafts
        await ask(pilot, app, "Repeat exactly: the cat sat on the mat, the cat sat on the mat.")
        stats = app.status.stats
        assert stats.draft_count > 0, stats
        assert 0 <= stats.draft_accepted <= stats.draft_count, stats
        assert f"({stats.draft_accepted}/{stats.draft_count})" in str(app.status.line())
        saved = ConversationStore(tmp_path / "chat.db").load(app.conversation.id or 0).messages[-1]
        assert saved.stats
        assert saved.stats["draft_count"] == stats.draft_count


@async_test
async def test_settings_are_validated_like_the_api(tmp_path: Path) -> None:
    app = make_app(None, tmp_path)
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("f4")
        screen = app.screen
        assert isinstance(screen, SettingsScreen)
        screen.query_one("#temperature", Input).value = "hot"
        screen.query_one("#top_p", Input).value = "1.5"
        await pilot.press("ctrl+s")
        assert app.screen is screen  # stays open on an error
        assert any("option 'temperature' must be a number" in m for m in app.errors())
        assert any("option 'top_p' is out of range" in m for m in app.errors())
        assert screen.query_one("#temperature", Input).has_class("-invalid")
        screen.query_one("#temperature", Input).value = "0.2"
        screen.query_one("#top_p", Input).value = "0.5"
        screen.query_one("#speculative", Select).value = "lookup"
        screen.query_one("#json").value = True  # type: ignore[attr-defined]
        await pilot.press("ctrl+s")
        await pilot.pause()
        assert app.screen is not screen
        settings = app.conversation.settings
        assert settings.options == {"temperature": 0.2, "top_p": 0.5, "speculative": "lookup"}
        assert settings.json_output
        await ask(pilot, app, "Hi")  # and the request carries them
        request = app.client.requests[-1]  # type: ignore[attr-defined]
        assert request["options"] == settings.options
        assert request["format"] == "json"


@async_test
async def test_multiline_input_and_the_status_bar_numbers(tmp_path: Path) -> None:
    app = make_app(None, tmp_path)
    async with app.run_test(size=(80, 24)) as pilot:
        app.chat_input.focus()
        await pilot.press("l", "i", "n", "e", "1", "ctrl+j", "l", "i", "n", "e", "2")
        assert app.chat_input.text == "line1\nline2"
        before = app.answer_worker
        await pilot.press("enter")
        await until(pilot, lambda: app.answer_worker is not before and app.answer_worker.is_finished, 10)
        assert app.conversation.messages[0].content == "line1\nline2"
        assert app.conversation.messages[1].content == "Hello there."
        stats = app.status.stats
        assert stats.tokens_per_s == pytest.approx(42.0)
        # the two messages (20 tokens each to this client) and the tools this model is offered, counted as
        # one more message of their descriptions: an estimate, shown with a ~
        assert stats.ctx_used == 60
        assert stats.ctx_len == 1024
        assert "42.0 tok/s" in str(app.status.line())
        assert "ctx ~60/1024" in str(app.status.line())
        assert "6%" in str(app.status.line())
        # speculative numbers appear when the engine reports drafts
        stats.draft_count, stats.draft_accepted = 50, 35
        assert "spec 70% (35/50)" in str(app.status.line())


@async_test
async def test_every_action_is_in_the_palette_and_the_help(tmp_path: Path) -> None:
    app = make_app(None, tmp_path)
    async with app.run_test(size=(80, 24)) as pilot:
        titles = [c.title for c in app.get_system_commands(app.screen)]
        for action in ACTIONS:
            assert any(t.startswith(action.title) for t in titles), action.title
            assert callable(getattr(app, f"action_{action.action}"))
        assert f"Use model {TWIN}" in titles
        bound = {b.action for b in app.BINDINGS}  # type: ignore[union-attr]
        assert bound | {"quit"} == {a.action for a in ACTIONS}
        # the palette runs them
        await pilot.press("ctrl+p")
        await pilot.pause()
        await pilot.press(*"Pull model")
        await pilot.pause(0.5)
        await pilot.press("enter")
        await until(pilot, lambda: isinstance(app.screen, PullScreen), 10, "the pull dialog")
        await pilot.press("escape")
        # the help screen lists every shortcut
        await pilot.press("f1")
        assert isinstance(app.screen, HelpScreen)
        keys = [key for key, _ in app.screen.rows]
        assert keys == [k for k, _ in INPUT_KEYS] + [key_label(a.key) for a in ACTIONS]
        assert "Esc" in keys
        assert "Ctrl+N" in keys
        assert "F5" in keys
        await pilot.press("escape")
        assert not isinstance(app.screen, HelpScreen)


@async_test
async def test_rename_export_and_delete_a_conversation(tmp_path: Path) -> None:
    app = make_app(None, tmp_path)
    async with app.run_test(size=(80, 24)) as pilot:
        await ask(pilot, app, "Hi")
        conv_id = app.conversation.id
        await pilot.press("f2")
        assert isinstance(app.screen, PromptScreen)
        app.screen.query_one(Input).value = "Greetings"
        await pilot.press("enter")
        await pilot.pause()
        assert ConversationStore(tmp_path / "chat.db").load(conv_id or 0).title == "Greetings"
        assert "Greetings" in app.sub_title
        await pilot.press("f7")
        assert isinstance(app.screen, PromptScreen), app.noted
        assert app.screen.query_one(Input).value == str(tmp_path / "greetings.md")
        await pilot.press("enter")
        await pilot.pause()
        text = (tmp_path / "greetings.md").read_text()
        assert text.startswith("# Greetings")
        assert "## You\n\nHi" in text
        assert "Hello there." in text
        await pilot.press("f8")
        assert isinstance(app.screen, ConfirmScreen)
        await pilot.press("y")
        await pilot.pause()
        assert ConversationStore(tmp_path / "chat.db").conversations() == []
        assert app.conversation.id is None
        assert not list(app.query(MessageView))
        await pilot.press("ctrl+n")  # new conversation keeps the model
        assert app.conversation.model == MODEL


@async_test
async def test_no_color_and_80x24(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import re

    monkeypatch.setenv("NO_COLOR", "1")

    app = make_app(None, tmp_path)
    assert app.no_color
    async with app.run_test(size=(80, 24)) as pilot:
        await ask(pilot, app, "Hi")
        for selector in ("#sidebar", "#messages", "ChatInput", "StatusBar", "Footer"):
            region = app.query_one(selector).region
            assert region.width > 0
            assert region.height > 0
            assert region.right <= 80
            assert region.bottom <= 24
        assert app.query_one(ChatInput).region.height >= 3
        svg = app.export_screenshot()
    # every colour drawn is a grey (the window-button dots and default ink belong to the SVG frame)
    colours = set(re.findall(r"#([0-9a-f]{6})\b", svg.lower())) - {"ff5f57", "febc2e", "28c840", "c5c8c6"}
    coloured = [c for c in colours if not c[0:2] == c[2:4] == c[4:6]]
    assert colours, svg[:2000]
    assert not coloured, coloured


# ---- a running `localrt serve` ----------------------------------------------------------------
@needs_llama
@async_test
async def test_through_a_running_server(
    model_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("fastapi")
    from tests.servers.serve import LocalrtServer

    server = LocalrtServer(model_root, tmp_path / "serve.log")
    try:
        monkeypatch.setenv("LOCALRT_HOST", f"127.0.0.1:{server.port}")
        client = connect()
        assert isinstance(client, ServerClient)  # auto-detected

        app = make_app(model_root, tmp_path, client=client)
        async with app.run_test(size=(100, 30)) as pilot:
            assert app.is_installed(MODEL)
            assert app.is_installed(TWIN)
            await ask(pilot, app, FRANCE)
            assert "Paris" in app.conversation.messages[-1].content, app.errors()
            stats = app.status.stats
            assert stats.ctx_len == 1024
            assert stats.ctx_used
            # counted by the server through the model's template, as in process: exact, no "~"
            assert stats.ctx_exact
            assert "~" not in str(app.status.line())
            await pilot.press("f3")
            await until(pilot, lambda: isinstance(app.screen, ModelInfoScreen), 20, "the info dialog")
            assert app.screen.info.backend == "llama.cpp"  # type: ignore[attr-defined]
            await pilot.press("escape")
            server.stop()  # the server goes away under the app
            app.chat_input.clear()
            await ask(pilot, app, "Are you there?")
            assert any("cannot reach the localrt server" in m for m in app.errors()), app.errors()
            assert app.is_running
            assert app.chat_input.text == "Are you there?"
    finally:
        server.stop()


# ---- thinking ------------------------------------------------------------------------------------
# A real `localrt serve` with a tiny Qwen3-format GGUF (tests/families.py) whose reply is forced token by
# token by a grammar: whether the app shows thinking is then the runtime's rule (a hybrid template thinks
# unless told not to; `think: false` drops what the model thinks anyway), not a stand-in's.
THINKING_MODEL = "qwen3:tiny"
THOUGHT, ANSWER = "The user asks about Paris weather.", "It is sunny."


@pytest.fixture(scope="module")
def thinking_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    pytest.importorskip("llama_cpp")
    from tests import families
    from tests.servers.serve import LocalrtServer

    root = tmp_path_factory.mktemp("tui-thinking")
    qwen3 = families.FAMILIES["qwen3"]
    import_gguf(Store(root / "models"), THINKING_MODEL, qwen3.write(root / "qwen3.gguf"))
    server = LocalrtServer(root / "models", root / "serve.log")
    server.forced = {  # type: ignore[attr-defined]
        "temperature": 0,
        "num_thread": 1,
        "grammar": families.forced(f"<think>\n{THOUGHT}\n</think>\n\n{ANSWER}", qwen3),
    }
    yield server
    server.stop()


def thinking_app(server: Any, tmp_path: Path) -> RecordingApp:
    return make_app(None, tmp_path, model=THINKING_MODEL, client=ServerClient(server.url))


def test_thinking_shows_in_a_collapsible_block_and_is_saved(thinking_server: Any, tmp_path: Path) -> None:
    async def first() -> int:
        app = thinking_app(thinking_server, tmp_path)
        async with app.run_test(size=(100, 30)) as pilot:
            app.conversation.settings = Settings(options=thinking_server.forced)
            await ask(pilot, app, "What is the weather in Paris?")
            reply = app.conversation.messages[-1]
            assert reply.thinking == THOUGHT
            assert reply.content == ANSWER
            view = app.query(MessageView).last()
            assert view.thinking_block.display
            assert view.thinking_block.collapsed  # folded once the answer began
            assert "Paris weather" not in view.markdown.source  # thinking stays out of the answer
            return app.conversation.id or 0

    async def second(conv_id: int) -> None:
        app = thinking_app(thinking_server, tmp_path)
        async with app.run_test(size=(100, 30)) as pilot:
            await app.open_conversation(conv_id)
            await pilot.pause()
            assert app.conversation.messages[-1].thinking == THOUGHT
            view = app.query(MessageView).last()
            assert view.thinking_block.display
            assert view.thinking == THOUGHT
            user_view = app.query(MessageView).first()
            assert not user_view.thinking_block.display

    asyncio.run(second(asyncio.run(first())))


def test_think_toggle_is_per_conversation_and_saved(thinking_server: Any, tmp_path: Path) -> None:
    async def scenario() -> None:
        app = thinking_app(thinking_server, tmp_path)
        async with app.run_test(size=(100, 30)) as pilot:
            app.conversation.settings = Settings(options=thinking_server.forced)
            await ask(pilot, app, "Hi")
            assert app.conversation.settings.think is None  # the model's default: a hybrid template thinks
            assert app.conversation.messages[-1].thinking == THOUGHT
            await pilot.press("ctrl+t")
            assert app.conversation.settings.think is True
            await ask(pilot, app, "Again")
            assert app.conversation.messages[-1].thinking == THOUGHT
            await pilot.press("ctrl+t")
            assert app.conversation.settings.think is False
            await ask(pilot, app, "Once more")
            assert app.conversation.messages[-1].thinking == ""  # the runtime drops it
            assert app.conversation.messages[-1].content == ANSWER
            saved = ConversationStore(tmp_path / "chat.db").load(app.conversation.id or 0)
            assert saved.settings.think is False
            assert any("Thinking: off" in m for _, m in app.noted)

    asyncio.run(scenario())
