"""The chat app's pieces that need no terminal: the SQLite conversation store, settings validation
(the same checks as the API's), and the server client's error mapping. Textual is not needed here."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from localrt.client import ServerUnreachable
from localrt.client import _error_from
from localrt.client import server_address
from localrt.errors import BackendUnavailable
from localrt.errors import LocalrtError
from localrt.errors import ModelNotFound
from localrt.errors import OptionError
from localrt.runtime.options import Options
from localrt.runtime.options import validate_option
from localrt.tui.conversations import SCHEMA_VERSION
from localrt.tui.conversations import ConversationStore
from localrt.tui.conversations import Message
from localrt.tui.conversations import Settings
from localrt.tui.conversations import default_path
from localrt.tui.conversations import make_title
from localrt.tui.conversations import slug
from localrt.tui.conversations import to_markdown
from localrt.tui.settings import parse_fields
from localrt.tui.settings import summary

T0 = 1_700_000_000.0


class Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


@pytest.fixture
def db(tmp_path: Path) -> ConversationStore:
    store = ConversationStore(tmp_path / "chat.db", clock=Clock())
    yield store
    store.close()


def test_schema_is_versioned_and_reopening_keeps_data(tmp_path: Path) -> None:
    path = tmp_path / "chat.db"
    first = ConversationStore(path)
    assert first.schema_version == SCHEMA_VERSION
    conv = first.create(
        "Hello there", "smollm2:135m", Settings(system="Be brief.", options={"temperature": 0.0})
    )
    first.add_message(conv.id, Message("user", "Hello there"))
    first.close()
    again = ConversationStore(path)  # migrations do not run twice
    loaded = again.load(conv.id)
    assert loaded.model == "smollm2:135m"
    assert loaded.settings.system == "Be brief."
    assert loaded.settings.options == {"temperature": 0.0}
    assert [m.content for m in loaded.messages] == ["Hello there"]
    again.close()


def test_a_newer_schema_is_refused_clearly(tmp_path: Path) -> None:
    path = tmp_path / "chat.db"
    raw = sqlite3.connect(path)
    raw.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    raw.close()
    with pytest.raises(LocalrtError, match="newer localrt"):
        ConversationStore(path)


def test_messages_round_trip_with_stats_and_partial_answers(db: ConversationStore) -> None:
    conv = db.create("q", "m:latest")
    db.add_message(conv.id, Message("user", "q"))
    reply = Message("assistant", "partial", model="m:latest", complete=False)
    db.add_message(conv.id, reply)
    reply.content, reply.complete, reply.done_reason = "partial and more", True, "cancel"
    reply.stats = {"ttft_s": 0.25, "tokens_per_s": 40.0}
    db.update_message(reply)
    [q, a] = db.load(conv.id).messages
    assert (q.role, a.role) == ("user", "assistant")
    assert a.content == "partial and more"
    assert a.complete
    assert a.done_reason == "cancel"
    assert a.stats == {"ttft_s": 0.25, "tokens_per_s": 40.0}
    assert a.model == "m:latest"


def test_rename_model_settings_delete_and_order(db: ConversationStore) -> None:
    a = db.create("first", "a:latest")
    b = db.create("second", "b:latest")
    assert [c.title for c in db.conversations()] == ["second", "first"]  # most recent first
    db.rename(a.id, "  renamed  ")
    db.set_model(a.id, "c:latest")
    db.set_settings(a.id, Settings(options={"top_k": 5}, json_output=True))
    loaded = db.load(a.id)
    assert (loaded.title, loaded.model, loaded.settings.options, loaded.settings.json_output) == (
        "renamed",
        "c:latest",
        {"top_k": 5},
        True,
    )
    assert db.conversations()[0].id == a.id  # touched last
    db.add_message(b.id, Message("user", "x"))
    db.delete(b.id)
    assert [c.id for c in db.conversations()] == [a.id]
    left = db.db.execute("SELECT COUNT(*) FROM messages WHERE conversation_id = ?", (b.id,)).fetchone()[0]
    assert left == 0  # messages go with their conversation
    with pytest.raises(LocalrtError):
        db.load(b.id)


def test_a_failed_write_rolls_back(db: ConversationStore) -> None:
    conv = db.create("t", None)
    with pytest.raises(sqlite3.IntegrityError):
        db.add_message(conv.id + 100, Message("user", "orphan"))  # foreign key: no such conversation
    assert db.load(conv.id).messages == []
    assert db.db.execute("SELECT COUNT(*) FROM messages").fetchone()[0] == 0
    assert not db.db.in_transaction


def test_default_path_honours_localrt_data(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCALRT_DATA", str(tmp_path / "data"))
    assert default_path() == tmp_path / "data" / "chat.db"
    monkeypatch.delenv("LOCALRT_DATA")
    assert default_path().name == "chat.db"
    assert "localrt" in str(default_path())


def test_markdown_export() -> None:
    from localrt.tui.conversations import Conversation

    conv = Conversation(
        1,
        "Capitals",
        "smollm2:135m",
        Settings(system="Be brief.", options={"temperature": 0.0}),
        messages=[
            Message("user", "Capital of France?"),
            Message("assistant", "Paris.", model="smollm2:135m"),
            Message("user", "And Spain?"),
            Message("assistant", "Mad", model="smollm2:135m", done_reason="cancel"),
        ],
    )
    text = to_markdown(conv)
    assert text.startswith("# Capitals\n")
    assert "- model: `smollm2:135m`" in text
    assert "- temperature: `0.0`" in text
    assert "## System\n\nBe brief." in text
    assert "## You\n\nCapital of France?" in text
    assert "## smollm2:135m\n\nParis." in text
    assert "## smollm2:135m (stopped)\n\nMad" in text


def test_titles_and_slugs() -> None:
    assert make_title("  What   is\nthe capital? ") == "What is the capital?"
    assert len(make_title("x" * 200)) == 48
    assert make_title("x" * 200).endswith("…")
    assert slug("What is the capital of France?") == "what-is-the-capital-of-france"
    assert slug("???") == "conversation"


# ---- settings: validated exactly as request options are ------------------------------------------
def test_settings_fields_parse_like_set_parameter() -> None:
    options, errors = parse_fields(
        {
            "temperature": "0",
            "top_p": "0.5",
            "top_k": "20",
            "num_ctx": "2048",
            "num_predict": "64",
            "seed": "",
            "draft_model": "",
            "backend": "llama.cpp",
            "speculative": None,
        }
    )
    assert errors == {}
    assert options == {
        "temperature": 0.0,
        "top_p": 0.5,
        "top_k": 20,
        "num_ctx": 2048,
        "num_predict": 64,
        "backend": "llama.cpp",
    }
    Options.merge(options)  # what the runtime will do with them
    assert (
        summary(options, True) == "backend=llama.cpp · num_ctx=2048 · num_predict=64 · temperature=0 · "
        "top_k=20 · top_p=0.5 · json"
    )


@pytest.mark.parametrize(
    ("field", "text"),
    [
        ("temperature", "hot"),
        ("temperature", "-1"),
        ("top_p", "1.5"),
        ("top_k", "2.5"),
        ("num_ctx", "0"),
        ("backend", "tpu"),
        ("speculative", "sometimes"),
    ],
)
def test_bad_settings_fail_with_the_api_message(field: str, text: str) -> None:
    options, errors = parse_fields({field: text})
    assert field in errors
    assert not options
    # the very message the API returns for the same value in `options`
    from localrt.runtime.options import parse_option_value

    with pytest.raises(OptionError) as api:
        validate_option(field, parse_option_value(field, text))
    assert errors[field] == str(api.value)


# ---- server client error mapping ---------------------------------------------------------------
def test_server_errors_map_to_the_same_exceptions() -> None:
    assert isinstance(_error_from(404, b'{"error": "model \'x\' not found"}'), ModelNotFound)
    assert isinstance(_error_from(501, b'{"error": "backend mlx is not available"}'), BackendUnavailable)
    e = _error_from(400, b'{"error": {"message": "bad option"}}')  # the OpenAI shape, just in case
    assert str(e) == "bad option"
    assert str(_error_from(500, b"<html>")) == "the server answered 500"
    assert issubclass(ServerUnreachable, LocalrtError)


def test_server_address_follows_localrt_host(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCALRT_HOST", "0.0.0.0:12345")
    assert server_address() == ("http://127.0.0.1:12345", "0.0.0.0:12345")
    monkeypatch.setenv("LOCALRT_HOST", "[::1]:8080")
    assert server_address()[0] == "http://[::1]:8080"


def test_the_stylesheet_ships_with_the_package() -> None:
    """tui/app.tcss is data: without a package-data entry a wheel install would lack it."""
    import sys

    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover
        import tomli as tomllib

    root = Path(__file__).resolve().parents[1]
    config = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert "*.tcss" in config.get("package-data", {}).get("localrt.tui", [])
    assert (root / "tui" / "app.tcss").is_file()


def test_a_version_1_database_gains_the_thinking_column(tmp_path: Path) -> None:
    import sqlite3

    from localrt.tui.conversations import MIGRATIONS

    path = tmp_path / "old.db"
    raw = sqlite3.connect(path)
    for statement in MIGRATIONS[1]:
        raw.execute(statement)
    raw.execute(
        "INSERT INTO conversations(title, model, settings, created_at, updated_at) VALUES ('t', 'm', '{}', 1, 1)"
    )
    raw.execute(
        "INSERT INTO messages(conversation_id, role, content, created_at) VALUES (1, 'assistant', 'Hi', 1)"
    )
    raw.execute("PRAGMA user_version = 1")
    raw.commit()
    raw.close()
    db = ConversationStore(path)
    assert db.schema_version == SCHEMA_VERSION
    [old] = db.load(1).messages
    assert old.content == "Hi"
    assert old.thinking == ""
    reply = Message("assistant", "Answer", thinking="Thought first.")
    db.add_message(1, reply)
    assert db.load(1).messages[-1].thinking == "Thought first."


def test_a_version_2_database_gains_the_tool_columns(tmp_path: Path) -> None:
    from localrt.tui.conversations import MIGRATIONS

    path = tmp_path / "old.db"
    raw = sqlite3.connect(path)
    for statement in MIGRATIONS[1] + MIGRATIONS[2]:
        raw.execute(statement)
    raw.execute(
        "INSERT INTO conversations(title, model, settings, created_at, updated_at) VALUES ('t', 'm', '{}', 1, 1)"
    )
    raw.execute(
        "INSERT INTO messages(conversation_id, role, content, created_at) VALUES (1, 'user', 'Hi', 1)"
    )
    raw.execute("PRAGMA user_version = 2")
    raw.commit()
    raw.close()
    db = ConversationStore(path)
    assert db.schema_version == SCHEMA_VERSION
    [old] = db.load(1).messages
    assert (old.tool_calls, old.tool_name, old.tool_call_id) == (None, None, None)
    db.close()


def test_tool_calls_and_results_round_trip(db: ConversationStore) -> None:
    """A turn that called a tool: the calls with the assistant's step, each result as a tool message,
    both back in the next request's `messages` as the loop sent them."""
    conv = db.create("Edit", "m", Settings(tools=False, max_steps=3))
    call = {"id": "call_1", "function": {"name": "edit_file", "arguments": {"path": "a.txt"}}}
    db.add_message(conv.id, Message("user", "Edit a.txt"))
    db.add_message(conv.id, Message("assistant", "", model="m", tool_calls=[call]))
    db.add_message(
        conv.id,
        Message("tool", "edited a.txt", done_reason="ok", tool_name="edit_file", tool_call_id="call_1"),
    )
    db.add_message(conv.id, Message("assistant", "Done.", model="m"))
    loaded = db.load(conv.id)
    assert loaded.settings.tools is False
    assert loaded.settings.max_steps == 3
    assert loaded.chat_messages() == [
        {"role": "user", "content": "Edit a.txt"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "edited a.txt", "tool_name": "edit_file", "tool_call_id": "call_1"},
        {"role": "assistant", "content": "Done."},
    ]
    exported = to_markdown(loaded)
    assert "Tool call `edit_file`:" in exported
    assert "<details><summary>Result of edit_file (ok)</summary>" in exported
    assert Settings.from_json(Settings().to_json()) == Settings()  # the defaults are not written out
