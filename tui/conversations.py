"""Saved conversations: one SQLite file (stdlib sqlite3) under the user data dir.

Every write is its own short transaction, committed before the app moves on, so killing the app
mid-answer loses nothing that came before (the answer itself is saved as it streams, marked
incomplete until it ends). The schema is versioned with `PRAGMA user_version`; migrations run
in order inside one transaction.
"""

from __future__ import annotations

import contextlib
import json
import re
import sqlite3
import time
from collections.abc import Callable
from collections.abc import Iterator
from dataclasses import dataclass
from dataclasses import field
from pathlib import Path
from typing import Any

from localrt import config
from localrt.agent.loop import DEFAULT_MAX_STEPS
from localrt.errors import LocalrtError

SCHEMA_VERSION = 3
MIGRATIONS: dict[int, list[str]] = {
    1: [
        """CREATE TABLE conversations (
            id INTEGER PRIMARY KEY,
            title TEXT NOT NULL,
            model TEXT,
            settings TEXT NOT NULL DEFAULT '{}',
            created_at REAL NOT NULL,
            updated_at REAL NOT NULL)""",
        """CREATE TABLE messages (
            id INTEGER PRIMARY KEY,
            conversation_id INTEGER NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
            role TEXT NOT NULL,
            content TEXT NOT NULL,
            model TEXT,
            created_at REAL NOT NULL,
            complete INTEGER NOT NULL DEFAULT 1,
            done_reason TEXT,
            stats TEXT)""",
        "CREATE INDEX messages_by_conversation ON messages(conversation_id, id)",
    ],
    # a reasoning model's thinking, kept beside the answer it led to
    2: ["ALTER TABLE messages ADD COLUMN thinking TEXT NOT NULL DEFAULT ''"],
    # the tool loop: an assistant turn's calls (JSON), and a tool message's tool and the call it answers
    3: [
        "ALTER TABLE messages ADD COLUMN tool_calls TEXT",
        "ALTER TABLE messages ADD COLUMN tool_name TEXT",
        "ALTER TABLE messages ADD COLUMN tool_call_id TEXT",
    ],
}
TITLE_LENGTH = 48


def default_path() -> Path:
    """`chat.db` in the data dir (`LOCALRT_DATA`, else the platformdirs user data dir)."""
    return config.data_dir() / "chat.db"


@dataclass
class Settings:
    """Per-conversation settings: the system prompt, request options (validated), JSON output, thinking
    (None: the model's default; True / False: on / off), tools on or off and the tool loop's step limit."""

    system: str = ""
    options: dict[str, Any] = field(default_factory=dict)
    json_output: bool = False
    think: bool | None = None
    tools: bool = True
    max_steps: int = DEFAULT_MAX_STEPS

    def to_json(self) -> str:
        raw: dict[str, Any] = {"system": self.system, "options": self.options, "json": self.json_output}
        if self.think is not None:
            raw["think"] = self.think
        if not self.tools:
            raw["tools"] = False
        if self.max_steps != DEFAULT_MAX_STEPS:
            raw["max_steps"] = self.max_steps
        return json.dumps(raw, sort_keys=True)

    @classmethod
    def from_json(cls, text: str | None) -> Settings:
        try:
            raw = json.loads(text or "{}")
        except ValueError:
            raw = {}
        return cls(
            system=str(raw.get("system") or ""),
            options=dict(raw.get("options") or {}),
            json_output=bool(raw.get("json")),
            think=raw.get("think") if isinstance(raw.get("think"), bool) else None,
            tools=raw.get("tools") is not False,
            max_steps=steps
            if isinstance(steps := raw.get("max_steps"), int) and steps >= 1
            else DEFAULT_MAX_STEPS,
        )


@dataclass
class Message:
    role: str  # system | user | assistant | tool
    content: str
    model: str | None = None  # the model that wrote an assistant message
    created_at: float = 0.0
    complete: bool = True  # False while streaming, and after a kill mid-answer
    done_reason: str | None = None  # stop | length | cancel | error
    stats: dict[str, Any] | None = None  # ttft_s, tokens_per_s, eval_count, ...
    id: int | None = None
    thinking: str = ""  # what a reasoning model thought before this answer
    tool_calls: list[dict[str, Any]] | None = None  # an assistant turn's calls, in Ollama's shape
    tool_name: str | None = None  # a tool message: the tool that ran (done_reason: ok, denied, ...)
    tool_call_id: str | None = None  # a tool message: the call it answers

    def chat_message(self) -> dict[str, Any] | None:
        """This message in a request's `messages`, None when it adds nothing (an empty answer)."""
        if self.role == "tool":
            out: dict[str, Any] = {"role": "tool", "content": self.content, "tool_name": self.tool_name or ""}
            if self.tool_call_id:
                out["tool_call_id"] = self.tool_call_id
            return out
        if not self.content and not self.tool_calls:
            return None
        turn = attach_images(self.role, self.content)
        if self.thinking:
            turn["thinking"] = self.thinking
        if self.tool_calls:
            turn["tool_calls"] = self.tool_calls
        return turn


@dataclass
class Conversation:
    id: int | None
    title: str
    model: str | None
    settings: Settings = field(default_factory=Settings)
    created_at: float = 0.0
    updated_at: float = 0.0
    messages: list[Message] = field(default_factory=list)

    def chat_messages(self) -> list[dict[str, Any]]:
        """The request's `messages`: the system prompt (if set), then every turn so far (with the thinking
        that led to an answer). Image files a user message names are attached (read again each turn, so
        the store keeps only the text)."""
        out: list[dict[str, Any]] = (
            [{"role": "system", "content": self.settings.system}] if self.settings.system else []
        )
        for m in self.messages:
            turn = m.chat_message()
            if turn is not None:
                out.append(turn)
        return out


def attach_images(role: str, content: str) -> dict[str, Any]:
    """A chat message; a user's text naming image files (typed, or dropped in) carries them as images."""
    if role != "user":
        return {"role": role, "content": content}
    from localrt.runtime.images import images_in_prompt
    from localrt.runtime.images import read_image_file

    text, paths = images_in_prompt(content)
    if not paths:
        return {"role": role, "content": content}
    return {"role": role, "content": text, "images": [read_image_file(p) for p in paths]}


def make_title(text: str) -> str:
    line = " ".join(text.split())
    return line if len(line) <= TITLE_LENGTH else line[: TITLE_LENGTH - 1].rstrip() + "…"


class ConversationStore:
    def __init__(self, path: Path | str | None = None, *, clock: Callable[[], float] = time.time) -> None:
        self.path = Path(path) if path is not None else default_path()
        self.clock = clock
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # autocommit mode: transactions are explicit (BEGIN IMMEDIATE .. COMMIT), DDL included
        self.db = sqlite3.connect(self.path, isolation_level=None, timeout=10)
        self.db.row_factory = sqlite3.Row
        self.db.execute("PRAGMA journal_mode=WAL")  # a crash mid-write leaves the last commit intact
        self.db.execute("PRAGMA foreign_keys=ON")
        try:
            self._migrate()
        except BaseException:
            self.db.close()
            raise

    @contextlib.contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        self.db.execute("BEGIN IMMEDIATE")
        try:
            yield self.db
        except BaseException:
            self.db.execute("ROLLBACK")
            raise
        self.db.execute("COMMIT")

    def _migrate(self) -> None:
        with self._tx() as db:
            version = db.execute("PRAGMA user_version").fetchone()[0]
            if version > SCHEMA_VERSION:
                raise LocalrtError(
                    f"{self.path} was written by a newer localrt (schema {version}, "
                    f"this one knows {SCHEMA_VERSION})"
                )
            for v in range(version + 1, SCHEMA_VERSION + 1):
                for statement in MIGRATIONS[v]:
                    db.execute(statement)
                db.execute(f"PRAGMA user_version = {v}")

    @property
    def schema_version(self) -> int:
        return int(self.db.execute("PRAGMA user_version").fetchone()[0])

    def close(self) -> None:
        self.db.close()

    # ---- conversations ---------------------------------------------------------------------
    def create(self, title: str, model: str | None, settings: Settings | None = None) -> Conversation:
        now = self.clock()
        settings = settings or Settings()
        with self._tx() as db:
            cur = db.execute(
                "INSERT INTO conversations(title, model, settings, created_at, updated_at) "
                "VALUES (?, ?, ?, ?, ?)",
                (make_title(title), model, settings.to_json(), now, now),
            )
        return Conversation(cur.lastrowid, make_title(title), model, settings, now, now)

    def conversations(self) -> list[Conversation]:
        rows = self.db.execute("SELECT * FROM conversations ORDER BY updated_at DESC, id DESC").fetchall()
        return [self._conversation(r) for r in rows]

    def load(self, conversation_id: int) -> Conversation:
        row = self.db.execute("SELECT * FROM conversations WHERE id = ?", (conversation_id,)).fetchone()
        if row is None:
            raise LocalrtError(f"conversation {conversation_id} does not exist")
        conv = self._conversation(row)
        conv.messages = [
            self._message(m)
            for m in self.db.execute(
                "SELECT * FROM messages WHERE conversation_id = ? ORDER BY id", (conversation_id,)
            )
        ]
        return conv

    def rename(self, conversation_id: int, title: str) -> None:
        self._update_conversation(conversation_id, title=make_title(title) or "Untitled")

    def set_model(self, conversation_id: int, model: str | None) -> None:
        self._update_conversation(conversation_id, model=model)

    def set_settings(self, conversation_id: int, settings: Settings) -> None:
        self._update_conversation(conversation_id, settings=settings.to_json())

    def delete(self, conversation_id: int) -> None:
        with self._tx() as db:
            db.execute("DELETE FROM conversations WHERE id = ?", (conversation_id,))  # messages cascade

    def _update_conversation(self, conversation_id: int, **values: Any) -> None:
        cols = ", ".join(f"{k} = ?" for k in values)
        with self._tx() as db:
            db.execute(
                f"UPDATE conversations SET {cols}, updated_at = ? WHERE id = ?",
                (*values.values(), self.clock(), conversation_id),
            )

    # ---- messages --------------------------------------------------------------------------
    def add_message(self, conversation_id: int, message: Message) -> int:
        message.created_at = message.created_at or self.clock()
        with self._tx() as db:
            cur = db.execute(
                "INSERT INTO messages(conversation_id, role, content, model, created_at, complete, done_reason, "
                "stats, thinking, tool_calls, tool_name, tool_call_id) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    conversation_id,
                    message.role,
                    message.content,
                    message.model,
                    message.created_at,
                    int(message.complete),
                    message.done_reason,
                    _dump(message.stats),
                    message.thinking,
                    _dump_calls(message.tool_calls),
                    message.tool_name,
                    message.tool_call_id,
                ),
            )
            db.execute(
                "UPDATE conversations SET updated_at = ? WHERE id = ?", (self.clock(), conversation_id)
            )
        message.id = cur.lastrowid
        return message.id

    def update_message(self, message: Message) -> None:
        assert message.id is not None
        with self._tx() as db:
            db.execute(
                "UPDATE messages SET content = ?, complete = ?, done_reason = ?, stats = ?, thinking = ?, "
                "tool_calls = ? WHERE id = ?",
                (
                    message.content,
                    int(message.complete),
                    message.done_reason,
                    _dump(message.stats),
                    message.thinking,
                    _dump_calls(message.tool_calls),
                    message.id,
                ),
            )

    def delete_message(self, message_id: int) -> None:
        with self._tx() as db:
            db.execute("DELETE FROM messages WHERE id = ?", (message_id,))

    # ---- rows ------------------------------------------------------------------------------
    @staticmethod
    def _conversation(row: sqlite3.Row) -> Conversation:
        return Conversation(
            row["id"],
            row["title"],
            row["model"],
            Settings.from_json(row["settings"]),
            row["created_at"],
            row["updated_at"],
        )

    @staticmethod
    def _message(row: sqlite3.Row) -> Message:
        stats = json.loads(row["stats"]) if row["stats"] else None
        return Message(
            row["role"],
            row["content"],
            row["model"],
            row["created_at"],
            bool(row["complete"]),
            row["done_reason"],
            stats,
            row["id"],
            row["thinking"] or "",
            json.loads(row["tool_calls"]) if row["tool_calls"] else None,
            row["tool_name"],
            row["tool_call_id"],
        )


def _dump(stats: dict[str, Any] | None) -> str | None:
    return json.dumps(stats, sort_keys=True) if stats else None


def _dump_calls(calls: list[dict[str, Any]] | None) -> str | None:
    return json.dumps(calls, ensure_ascii=False) if calls else None


# ---- export -----------------------------------------------------------------------------------
def to_markdown(conv: Conversation) -> str:
    """A conversation as a Markdown document: title, model and settings, then each turn."""
    out = [f"# {conv.title}", ""]
    if conv.model:
        out.append(f"- model: `{conv.model}`")
    for key, value in sorted(conv.settings.options.items()):
        out.append(f"- {key}: `{value}`")
    if conv.settings.json_output:
        out.append("- format: `json`")
    if conv.settings.think is not None:
        out.append(f"- think: `{'on' if conv.settings.think else 'off'}`")
    if len(out) > 2:
        out.append("")
    if conv.settings.system:
        out += ["## System", "", conv.settings.system, ""]
    for m in conv.messages:
        if m.role == "tool":
            out += [
                f"<details><summary>Result of {m.tool_name} ({m.done_reason or 'ok'})</summary>",
                "",
                "```",
                m.content.rstrip(),
                "```",
                "",
                "</details>",
                "",
            ]
            continue
        who = {"user": "You", "assistant": m.model or "Assistant"}.get(m.role, m.role.title())
        note = "" if m.complete and m.done_reason != "cancel" else " (stopped)"
        out += [f"## {who}{note}", ""]
        if m.thinking:
            out += ["<details><summary>Thinking</summary>", "", m.thinking.rstrip(), "", "</details>", ""]
        if m.content:
            out += [m.content.rstrip(), ""]
        for call in m.tool_calls or []:
            fn = call.get("function") or {}
            args = json.dumps(fn.get("arguments") or {}, ensure_ascii=False, indent=2)
            out += [f"Tool call `{fn.get('name', '')}`:", "", "```json", args, "```", ""]
    return "\n".join(out).rstrip() + "\n"


def slug(text: str) -> str:
    s = re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")
    return s[:40].rstrip("-") or "conversation"
