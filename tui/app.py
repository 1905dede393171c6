"""`localrt chat [NAME]`: a Textual chat over the runtime API or a running `localrt serve`.

Layout: a sidebar (installed models, saved conversations), the conversation (streamed Markdown),
a multi-line input, a status bar with the engine's live numbers, and the key footer. Every action
has a key, a command-palette entry and a line in the help screen (all built from ACTIONS).
Errors from the runtime or server become notifications; the app itself never dies on them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable
from collections.abc import Iterable
from dataclasses import dataclass
from dataclasses import field
from pathlib import Path
from typing import Any

from rich.text import Text
from textual import on
from textual.app import App
from textual.app import ComposeResult
from textual.app import SystemCommand
from textual.binding import Binding
from textual.containers import Horizontal
from textual.containers import Vertical
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.screen import Screen
from textual.widgets import Footer
from textual.widgets import Header
from textual.widgets import Label
from textual.widgets import ListView
from textual.widgets import Markdown
from textual.widgets import Static
from textual.worker import Worker

from localrt.agent.approvals import ApprovalRequest
from localrt.agent.approvals import Approvals
from localrt.agent.approvals import Decision
from localrt.agent.loop import STOPPED
from localrt.agent.loop import AgentLoop
from localrt.agent.loop import Finished
from localrt.agent.loop import StepDone
from localrt.agent.loop import TextDelta
from localrt.agent.loop import ToolFinished
from localrt.agent.loop import ToolStarted
from localrt.agent.loop import call_parts
from localrt.agent.loop import tools_refused
from localrt.agent.toolbox import Toolbox
from localrt.client import Client
from localrt.client import ModelRow
from localrt.client import connect
from localrt.errors import LocalrtError
from localrt.format import human_size
from localrt.tui.conversations import Conversation
from localrt.tui.conversations import ConversationStore
from localrt.tui.conversations import Message
from localrt.tui.conversations import Settings
from localrt.tui.conversations import slug
from localrt.tui.conversations import to_markdown
from localrt.tui.screens import ApprovalScreen
from localrt.tui.screens import ConfirmScreen
from localrt.tui.screens import HelpScreen
from localrt.tui.screens import ModelInfoScreen
from localrt.tui.screens import ModelPickerScreen
from localrt.tui.screens import PromptScreen
from localrt.tui.screens import PullScreen
from localrt.tui.screens import SettingsScreen
from localrt.tui.screens import ToolsScreen
from localrt.tui.settings import summary
from localrt.tui.widgets import ChatInput
from localrt.tui.widgets import ConversationItem
from localrt.tui.widgets import MessageView
from localrt.tui.widgets import ModelItem
from localrt.tui.widgets import StatusBar
from localrt.tui.widgets import ToolCallView
from localrt.tui.widgets import ToolsLine


@dataclass(frozen=True)
class Action:
    """One user action: its key, the `action_*` name, and how the footer, palette and help name it."""

    key: str
    action: str
    title: str
    description: str
    short: str = ""  # footer label; empty: not shown in the footer


# the bindings, the command palette and the help screen are all built from this table
ACTIONS: list[Action] = [
    Action("ctrl+n", "new_conversation", "New conversation", "Start a new conversation", "New"),
    Action("ctrl+o", "switch_model", "Switch model", "Pick the model for this conversation", "Model"),
    Action(
        "f4",
        "settings",
        "Conversation settings",
        "System prompt, temperature, top_p, top_k, context length, backend, speculative, JSON output",
        "Settings",
    ),
    Action(
        "ctrl+t",
        "toggle_think",
        "Toggle thinking",
        "Thinking for this conversation: the model's default, on, off (for models that think)",
    ),
    Action(
        "f6",
        "tools",
        "Tools",
        "Tools on or off, each tool and MCP server, approving every call, the step limit",
        "Tools",
    ),
    Action("escape", "stop", "Stop answer", "Stop the current answer and keep what was generated", "Stop"),
    Action("f2", "rename", "Rename conversation", "Give this conversation a new title"),
    Action("f7", "export", "Export conversation", "Write this conversation to a Markdown file"),
    Action("f8", "delete_conversation", "Delete conversation", "Delete this conversation and its messages"),
    Action("f5", "pull", "Pull model", "Download a model by name, with progress", "Pull"),
    Action("f3", "model_info", "Model info", "Architecture, size, quantization, context, backend in use"),
    Action("f9", "delete_model", "Delete model", "Remove a model from the store"),
    Action("ctrl+b", "toggle_sidebar", "Toggle sidebar", "Show or hide the models and conversations"),
    Action("f1", "help", "Help", "Show the keyboard shortcuts", "Help"),
    Action("ctrl+q", "quit", "Quit", "Leave localrt chat"),  # Textual's own binding
]
ACTION_NAMES = frozenset(a.action for a in ACTIONS)
INPUT_KEYS = [
    ("Enter", "Send the message"),
    ("Shift+Enter, Ctrl+J", "New line in the message"),
    ("Ctrl+P", "Command palette (every action)"),
    ("Tab, Shift+Tab", "Move between the sidebar, the conversation and the input"),
]
WELCOME_KEYS = [
    ("Enter", "send"),
    ("Ctrl+J", "new line"),
    ("Esc", "stop an answer"),
    ("Ctrl+O", "switch model"),
    ("F4", "settings"),
    ("F1", "help"),
    ("Ctrl+P", "every command"),
]
SAVE_EVERY = 0.5  # seconds between saves of a streaming answer, so a kill loses at most this much


def key_label(key: str) -> str:
    """ctrl+n -> Ctrl+N, f4 -> F4, escape -> Esc."""
    if key == "escape":
        return "Esc"

    def part(p: str) -> str:
        return p.upper() if len(p) == 1 or (p[0] == "f" and p[1:].isdigit()) else p.title()

    return "+".join(part(p) for p in key.split("+"))


def human_ago(then: float, now: float) -> str:
    seconds = max(0, int(now - then))
    for unit, span in (("y", 31536000), ("mo", 2592000), ("w", 604800), ("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= span:
            return f"{seconds // span}{unit} ago"
    return "just now"


@dataclass
class Turn:
    """One answer in the making: the assistant message being streamed (None between a step that called
    tools and the next request's first text), its view, and what this turn has saved so far."""

    model: str
    view: MessageView | None = None
    stream: Any = None
    reply: Message | None = None
    final: Any = None  # the current request's final chunk
    started: float = 0.0
    last_save: float = 0.0
    steps: int = 0
    tools: list[dict[str, Any]] | None = None  # what the requests offered (counted in the context)
    saved: list[Message] = field(default_factory=list)  # steps with calls, and the tool messages
    tool_views: list[ToolCallView] = field(default_factory=list)


class ChatApp(App[int]):
    """The chat app. `client` defaults to `connect()` (server if one answers, else in-process)."""

    CSS_PATH = Path(__file__).with_name("app.tcss")  # absolute: subclasses may live elsewhere (tests)
    TITLE = "localrt chat"
    # priority bindings: the focused TextArea binds many keys itself (F6, F7, ctrl+...); Esc is left
    # to dialogs and the palette, which close on it (check_action mutes the rest while a dialog is open)
    BINDINGS = [
        Binding(a.key, a.action, a.short or a.title, show=bool(a.short), priority=a.key != "escape")
        for a in ACTIONS
        if a.action != "quit"
    ]

    def __init__(
        self,
        model: str | None = None,
        *,
        client: Client | None = None,
        store: ConversationStore | None = None,
        db_path: Path | str | None = None,
        clock: Callable[[], float] = time.time,
        export_dir: Path | None = None,
        toolbox: Toolbox | None = None,
        mcp_config: Path | str | None = None,
        approve_all: bool = False,
        tool_choice: str | None = None,
    ) -> None:
        super().__init__()
        self.client: Client = client if client is not None else connect()
        # the built-in tools work in the directory the app started in; MCP servers start on mount
        self.toolbox = toolbox if toolbox is not None else Toolbox.standard(Path.cwd(), mcp_config=mcp_config)
        self.approvals = Approvals(ask=self._approve, approve_all=approve_all)
        self.tools_off: dict[str, str | None] = {}  # model -> why it takes no tools (None: it does)
        self.tool_choice = tool_choice  # the first request of each answer (`--tool-choice`)
        self.clock = clock
        self.db = store if store is not None else ConversationStore(db_path, clock=clock)
        self.initial_model = model
        self.export_dir = export_dir
        self.models: list[ModelRow] = []
        self.conversation = Conversation(None, "New conversation", model)
        self.answer_worker: Worker[None] | None = None
        self.busy = False  # an answer is streaming (or loading)
        self._ctx_warned: int | None = None  # conversation id already warned about its context

    def notify(
        self,
        message: str,
        *,
        title: str = "",
        severity: Any = "information",
        timeout: float | None = None,
        markup: bool = False,
    ) -> None:
        # plain text by default: error messages carry brackets ("[Errno 111]") that are not markup
        super().notify(message, title=title, severity=severity, timeout=timeout, markup=markup)

    # ---- layout ----------------------------------------------------------------------------
    def compose(self) -> ComposeResult:
        yield Header(show_clock=False, icon="≡")
        with Horizontal(id="body"):
            with Vertical(id="sidebar"):
                yield Label("Models", classes="sidebar-title")
                yield ListView(id="models")
                yield Label("Conversations", classes="sidebar-title")
                yield ListView(id="conversations")
            with Vertical(id="main"):
                yield VerticalScroll(id="messages")
                yield ToolsLine("", id="tools-line", markup=False)
                yield ChatInput(id="input")
        yield StatusBar(id="status")
        yield Footer()

    @property
    def status(self) -> StatusBar:
        return self.query_one(StatusBar)

    @property
    def messages_pane(self) -> VerticalScroll:
        return self.query_one("#messages", VerticalScroll)

    @property
    def chat_input(self) -> ChatInput:
        return self.query_one(ChatInput)

    async def on_mount(self) -> None:
        self.status.stats.where = self.client.where
        self.run_worker(self._start_tools(), group="tools", exit_on_error=False)
        await self.refresh_models()
        await self.refresh_conversations()
        if self.initial_model:
            self.set_model(self.initial_model, announce=False)
            if self.conversation.model and not self.is_installed(self.conversation.model):
                self.notify(
                    f"model '{self.conversation.model}' not found, try pulling it first (F5)",
                    title="Model missing",
                    severity="error",
                    timeout=10,
                )
        elif self.models:
            self.set_model(self.models[0].name, announce=False)
        else:
            self.notify(
                "No models installed yet: press F5 to pull one (e.g. smollm2:135m).",
                title="No models",
                severity="warning",
                timeout=10,
            )
        await self.show_conversation()
        self.chat_input.focus()

    async def on_unmount(self) -> None:
        # let a cancelled answer save what it has, then unload models / close the HTTP client
        worker = self.answer_worker
        if worker is not None:
            with contextlib.suppress(Exception):  # WorkerCancelled / WorkerFailed / TimeoutError
                await asyncio.wait_for(worker.wait(), 5)
        with contextlib.suppress(Exception):
            await self.toolbox.close()
        with contextlib.suppress(Exception):
            await self.client.close()
        with contextlib.suppress(Exception):
            self.db.close()

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        # the main screen's shortcuts do nothing while a dialog is open
        if isinstance(self.screen, ModalScreen) and action in ACTION_NAMES and action != "quit":
            return False
        return True

    # ---- models ----------------------------------------------------------------------------
    def is_installed(self, name: str) -> bool:
        return any(m.name == name for m in self.models)

    async def refresh_models(self) -> None:
        try:
            self.models = await self.client.list_models()
        except LocalrtError as e:
            self.notify(str(e), title="Cannot list models", severity="error", timeout=10)
            self.models = []
        view = self.query_one("#models", ListView)
        await view.clear()
        await view.extend(ModelItem(m.name, human_size(m.size)) for m in self.models)
        self._highlight_model()

    def _highlight_model(self) -> None:
        view = self.query_one("#models", ListView)
        names = [m.name for m in self.models]
        for item in view.query(ModelItem):
            item.set_class(item.model_name == self.conversation.model, "-current")
        if self.conversation.model in names:
            view.index = names.index(self.conversation.model)

    def set_model(self, name: str, *, announce: bool = True) -> None:
        from localrt.store.names import parse_name

        try:
            name = parse_name(name).display
        except LocalrtError as e:
            self.notify(str(e), title="Invalid model name", severity="error")
            return
        conv = self.conversation
        changed = conv.model != name
        conv.model = name
        if changed and conv.id is not None:
            self.db.set_model(conv.id, name)
        self._model_changed()
        if announce and changed:
            self.notify(f"This conversation now uses {name}.", title="Model")

    def _model_changed(self) -> None:
        stats = self.status.stats
        stats.ctx_used = stats.ctx_len = None
        stats.ttft = stats.tokens_per_s = None
        stats.draft_count = stats.draft_accepted = 0
        self.status.refresh_stats()
        self._update_titles()
        self._highlight_model()
        if self.conversation.model and self.is_installed(self.conversation.model):
            self.run_worker(self._update_context_length(), group="ctx", exclusive=True, exit_on_error=False)
            self.run_worker(self._check_tools(), group="tools-check", exclusive=True, exit_on_error=False)
        self.refresh_tools_line()

    # ---- tools -----------------------------------------------------------------------------
    async def _start_tools(self) -> None:
        """Start the MCP servers; one that fails is a notice (and a state in the tools panel)."""
        self.refresh_tools_line()
        await self.toolbox.start()
        for line in self.toolbox.failures():
            self.notify(line, title="MCP", severity="warning", timeout=10)
        self.refresh_tools_line()

    async def _check_tools(self, model: str | None = None) -> None:
        """Whether `model` (the current conversation's by default) takes tools; one line says why not."""
        model = self.conversation.model or "" if model is None else model
        if model in self.tools_off:
            return
        self.tools_off[model] = await tools_refused(self.client, model)
        self.refresh_tools_line()

    def refresh_tools_line(self) -> None:
        """`⚙ tools: 7 built-in, time (2) · asks first · F6`, or why there are none."""
        with contextlib.suppress(Exception):  # before mount, or while closing
            line = self.query_one(ToolsLine)
            conv = self.conversation
            off = self.tools_off.get(conv.model or "")
            if not conv.settings.tools:
                text = "⚙ tools off for this conversation · F6"
            elif off:
                text = f"⚙ {off}"
            else:
                parts = [
                    f"{len(self.toolbox.builtin) - len(self.toolbox.disabled & {t.name for t in self.toolbox.builtin})} built-in"
                ]
                for server in self.toolbox.hub.servers if self.toolbox.hub is not None else []:
                    parts.append(
                        f"{server.name} ({len(server.tools)})"
                        if server.state == "ready"
                        else f"{server.name} ({server.state})"
                    )
                asks = "approves all" if self.approvals.approve_all else "asks first"
                text = f"⚙ tools: {', '.join(parts)} · {asks} · F6"
            line.update(text)
            line.set_class(bool(off) or not conv.settings.tools, "-off")

    async def _update_context_length(self) -> None:
        conv = self.conversation
        if not conv.model:
            return
        with contextlib.suppress(LocalrtError):
            options = conv.settings.options or None
            self.status.stats.ctx_len = await self.client.context_length(conv.model, options)
            self.status.refresh_stats()

    def _update_titles(self) -> None:
        conv = self.conversation
        extra = summary(conv.settings.options, conv.settings.json_output)
        self.sub_title = " · ".join(p for p in (conv.title, conv.model or "no model", extra) if p)

    # ---- conversations ---------------------------------------------------------------------
    async def refresh_conversations(self) -> None:
        view = self.query_one("#conversations", ListView)
        now = self.clock()
        await view.clear()
        convs = self.db.conversations()
        await view.extend(ConversationItem(c.id or 0, c.title, human_ago(c.updated_at, now)) for c in convs)
        ids = [c.id for c in convs]
        if self.conversation.id in ids:
            view.index = ids.index(self.conversation.id)

    async def show_conversation(self) -> None:
        pane = self.messages_pane
        await pane.remove_children()
        conv = self.conversation
        if not conv.messages:
            welcome = Text()
            welcome.append("localrt chat", style="bold")
            welcome.append(f"\n\nModel: {conv.model or 'none (F5 pulls one)'} · {self.client.where}\n\n")
            for key, what in WELCOME_KEYS:
                welcome.append(f"{key:<12}", style="bold")
                welcome.append(f"{what}\n")
            await pane.mount(Static(welcome, id="welcome"))
        else:
            await pane.mount_all(self._views(conv.messages))
        pane.scroll_end(animate=False)
        self._update_titles()
        self._restore_stats()

    def _views(self, messages: list[Message]) -> list[Any]:
        """A saved conversation's widgets: each turn, and each tool call as a block with its result."""
        out: list[Any] = []
        waiting: list[ToolCallView] = []
        for m in messages:
            if m.role == "tool":
                block = next((b for b in waiting if m.tool_call_id and b.call_id == m.tool_call_id), None)
                block = block or next((b for b in waiting if b.tool_name == m.tool_name), None)
                if block is None:
                    block = ToolCallView(m.tool_name or "tool", m.tool_name or "tool", "")
                    out.append(block)
                else:
                    waiting.remove(block)
                block.saved_result = (m.content, m.done_reason or "ok")
                continue
            if m.content or m.thinking or not m.tool_calls:
                out.append(self._message_view(m))
            for call in m.tool_calls or []:
                call_id, name, args = call_parts(call)
                shown = json.dumps(args, ensure_ascii=False)
                block = ToolCallView(
                    name,
                    f"{name} {shown if len(shown) <= 80 else shown[:77] + '...'}",
                    json.dumps(args, ensure_ascii=False, indent=2),
                    call_id=call_id,
                    state="stopped",
                )
                out.append(block)
                waiting.append(block)
        return out

    def _message_view(self, m: Message) -> MessageView:
        note = (
            ""
            if m.complete and m.done_reason not in ("cancel", "error")
            else "stopped"
            if m.done_reason == "cancel"
            else "interrupted"
            if not m.complete
            else "error"
        )
        author = (m.model or "assistant") if m.role == "assistant" else None
        return MessageView(m.role, m.content, author=author, note=note, thinking=m.thinking)

    def _restore_stats(self) -> None:
        """A reopened conversation shows the numbers of its last answer."""
        stats = self.status.stats
        last = next(
            (m for m in reversed(self.conversation.messages) if m.role == "assistant" and m.stats), None
        )
        s = last.stats if last and last.stats else {}
        stats.ttft, stats.tokens_per_s = s.get("ttft_s"), s.get("tokens_per_s")
        stats.draft_count, stats.draft_accepted = s.get("draft_count", 0), s.get("draft_accepted_count", 0)
        stats.ctx_used, stats.ctx_exact = s.get("context_tokens"), bool(s.get("context_exact", True))
        self.status.refresh_stats()

    async def open_conversation(self, conversation_id: int) -> None:
        if self.busy:
            self.notify("An answer is streaming: Esc stops it first.", severity="warning")
            return
        try:
            conv = self.db.load(conversation_id)
        except LocalrtError as e:
            self.notify(str(e), severity="error")
            return
        self.conversation = conv
        self._model_changed()
        await self.show_conversation()  # after: it shows the numbers of the last answer again
        ids = [item.conversation_id for item in self.query(ConversationItem)]
        if conv.id in ids:
            self.query_one("#conversations", ListView).index = ids.index(conv.id)
        if conv.model and not self.is_installed(conv.model):
            self.notify(
                f"model '{conv.model}' not found, try pulling it first (F5)",
                title="Model missing",
                severity="warning",
                timeout=8,
            )

    # ---- sending and streaming -------------------------------------------------------------
    @on(ChatInput.Submitted)
    async def _submitted(self, event: ChatInput.Submitted) -> None:
        await self.send(event.text)

    async def send(self, text: str) -> None:
        text = text.strip()
        if not text:
            return
        if self.busy:
            self.notify("An answer is still streaming: Esc stops it.", severity="warning")
            return
        conv = self.conversation
        if not conv.model:
            self.notify(
                "No model selected: Ctrl+O picks one, F5 pulls one.", title="No model", severity="error"
            )
            return
        self.chat_input.clear()
        if conv.id is None:
            saved = self.db.create(text, conv.model, conv.settings)
            conv.id, conv.title, conv.created_at = saved.id, saved.title, saved.created_at
            await self.refresh_conversations()
            self._update_titles()
        question = Message("user", text)
        self._announce_images(text)  # image paths in the text are attached
        self.db.add_message(conv.id, question)  # committed before the model runs: a kill cannot lose it
        conv.messages.append(question)
        pane = self.messages_pane
        with contextlib.suppress(Exception):
            await pane.query("#welcome").remove()
        await pane.mount(self._message_view(question))
        self.busy = True
        self.answer_worker = self.run_worker(
            self._answer(conv, question), name="answer", group="answer", exit_on_error=False
        )

    def _announce_images(self, text: str) -> None:
        from localrt.runtime.images import images_in_prompt

        for path in images_in_prompt(text)[1]:
            self.notify(f"Added image '{path}'", title="Image")

    async def _answer(self, conv: Conversation, question: Message) -> None:
        model = conv.model or ""
        stats, bar = self.status.stats, self.status
        stats.state, stats.ttft, stats.pieces, stats.first_token_at = "loading", None, 0, None
        stats.draft_count = stats.draft_accepted = 0
        bar.refresh_stats()
        turn = Turn(model)
        await self._next_reply(turn)
        error, stopped = None, False
        try:
            await self._run_loop(conv, turn)
        except asyncio.CancelledError:
            stopped = True  # Esc (or quitting): keep what was generated
        except LocalrtError as e:
            error = str(e)
        except Exception as e:  # a bug must not take the app down: say what happened
            error = f"internal error: {type(e).__name__}: {e}"
        # save first: when the app is closing, the UI below may already be gone
        self._save_reply(conv, question, turn, stopped)
        self.busy = False
        with contextlib.suppress(Exception):  # when quitting, the widget may be gone already
            if turn.stream is not None:
                await asyncio.wait_for(turn.stream.stop(), 2)
        if self.is_running:  # else the app is closing around us; the answer is saved already
            await self._finish_answer(conv, question, turn, error, stopped)

    async def _next_reply(self, turn: Turn) -> None:
        """A new assistant message and its view, streamed into from here on (one per request)."""
        turn.view = MessageView("assistant", author=turn.model, note="thinking…")
        await self.messages_pane.mount(turn.view)
        self.messages_pane.scroll_end(animate=False)
        turn.stream = Markdown.get_stream(turn.view.markdown)
        turn.reply = Message("assistant", "", model=turn.model, complete=False)
        turn.final = None

    def tool_loop(self, conv: Conversation) -> AgentLoop:
        """The loop for this conversation: its tools when they are on and the model takes them."""
        use = conv.settings.tools and not self.tools_off.get(conv.model or "")
        return AgentLoop(
            self.client,
            conv.model or "",
            self.toolbox if use else Toolbox(),
            self.approvals,
            max_steps=conv.settings.max_steps,
            tool_choice=self.tool_choice if use else None,
            options=dict(conv.settings.options) or None,
            format="json" if conv.settings.json_output else None,
            think=conv.settings.think,
        )

    async def _run_loop(self, conv: Conversation, turn: Turn) -> None:
        """Stream the answer (thinking into its block, then the text), each tool call as a block, and save
        every step as it ends; a request after tool results goes into a new assistant message."""
        messages = conv.chat_messages()
        # known before the first request: the check started with the conversation may not have answered yet
        await self._check_tools(conv.model or "")
        loop = self.tool_loop(conv)
        turn.tools = loop.toolbox.schemas() or None
        turn.started = time.monotonic()
        events = loop.run(messages)
        async with contextlib.aclosing(events):  # type: ignore[type-var]
            async for event in events:
                if isinstance(event, TextDelta):
                    await self._delta(conv, turn, event)
                elif isinstance(event, StepDone):
                    await self._step_done(conv, turn, event)
                elif isinstance(event, ToolStarted):
                    await self._tool_started(turn, event)
                elif isinstance(event, ToolFinished):
                    self._tool_finished(conv, turn, event)
                elif isinstance(event, Finished) and event.reason == "max_steps":
                    self.notify(
                        f"Stopped after {event.steps} requests (the step limit; F6 changes it).",
                        title="Tools",
                        severity="warning",
                    )

    async def _delta(self, conv: Conversation, turn: Turn, event: TextDelta) -> None:
        stats, bar = self.status.stats, self.status
        now = time.monotonic()
        if turn.reply is None or turn.view is None:
            await self._next_reply(turn)  # the answer after tool results: a message of its own
        view, reply = turn.view, turn.reply
        assert view is not None and reply is not None
        if stats.first_token_at is None:
            stats.first_token_at, stats.ttft, stats.state = now, now - turn.started, "answering"
        view.set_note("")
        stats.pieces += 1
        if event.thinking:
            reply.thinking += event.thinking
            view.add_thinking(event.thinking)
        if event.content:
            if not reply.content:
                view.end_thinking()
            reply.content += event.content
            await turn.stream.write(event.content)
        self._follow()
        if reply.id is None and conv.id is not None:
            self.db.add_message(conv.id, reply)
            turn.last_save = now
        elif now - turn.last_save >= SAVE_EVERY:
            self.db.update_message(reply)
            turn.last_save = now
        bar.refresh_stats()

    async def _step_done(self, conv: Conversation, turn: Turn, event: StepDone) -> None:
        """One request answered: its final chunk is kept; a step that called tools is saved whole now."""
        if turn.reply is None or turn.view is None:
            await self._next_reply(turn)
        assert turn.view is not None and turn.reply is not None
        turn.final = event.final
        turn.steps += 1
        calls = event.message.get("tool_calls")
        if not calls:
            return
        reply = turn.reply
        reply.tool_calls = list(calls)
        self._close_reply(turn, stopped=False)
        if conv.id is not None:
            if reply.id is None:
                self.db.add_message(conv.id, reply)
            else:
                self.db.update_message(reply)
        conv.messages.append(reply)
        turn.saved.append(reply)
        with contextlib.suppress(LocalrtError):  # the meter between requests
            await self._count_context(conv, turn.tools)
            self.status.refresh_stats()
        if not reply.content and not reply.thinking:
            turn.view.display = False  # the calls below say what this request did
        else:
            turn.view.set_note("")
        if turn.stream is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(turn.stream.stop(), 2)
        # the next request's text (after the results) goes into a new message, made when it comes
        turn.view = turn.reply = turn.stream = None

    async def _tool_started(self, turn: Turn, event: ToolStarted) -> None:
        shown = (
            json.dumps(event.arguments, ensure_ascii=False, indent=2) if event.arguments else "(no arguments)"
        )
        block = ToolCallView(event.name, event.summary, shown, call_id=event.call_id)
        turn.tool_views.append(block)
        await self.messages_pane.mount(block)
        self._follow()

    def _tool_finished(self, conv: Conversation, turn: Turn, event: ToolFinished) -> None:
        block = next(
            (b for b in reversed(turn.tool_views) if b.tool_name == event.name and not b.result), None
        )
        if block is not None:
            block.set_result(event.result.content, event.status)
        message = Message(
            "tool",
            event.result.content,
            done_reason=event.status,
            tool_name=event.name,
            tool_call_id=event.call_id or None,
        )
        if conv.id is not None:
            self.db.add_message(conv.id, message)
        conv.messages.append(message)
        turn.saved.append(message)
        self._follow()

    async def _approve(self, request: ApprovalRequest) -> Decision:
        """The approval modal, over whatever is on screen; the tool call's block says it is waiting."""
        for block in self.query(ToolCallView):
            if block.state == "running" and not block.result:
                block.set_state("waiting for approval")
        decision = await self.push_screen(ApprovalScreen(request), wait_for_dismiss=True)
        for block in self.query(ToolCallView):
            if block.state == "waiting for approval":
                block.set_state("running" if decision is not Decision.DENY else "denied")
        return decision if isinstance(decision, Decision) else Decision.DENY

    def _close_reply(self, turn: Turn, stopped: bool) -> None:
        """The current reply's ending: numbers from its final chunk (or the live rate), its done_reason."""
        stats = self.status.stats
        reply, final = turn.reply, turn.final
        assert reply is not None
        m = final.metrics if final is not None else None
        reply.complete = True
        reply.done_reason = "cancel" if stopped else (final.done_reason if final else "error")
        reply.stats = {"ttft_s": stats.ttft}
        if m is not None and m.eval_ns:
            reply.stats.update(
                tokens_per_s=m.eval_count / m.eval_ns * 1e9,
                eval_count=m.eval_count,
                prompt_eval_count=m.prompt_eval_count,
            )
        elif stats.live_rate() is not None:
            reply.stats["tokens_per_s"] = stats.live_rate()
        if m is not None and m.draft_count:
            reply.stats.update(draft_count=m.draft_count, draft_accepted_count=m.draft_accepted_count)

    def _answer_open_calls(self, conv: Conversation, turn: Turn) -> None:
        """Every call this turn saved gets its tool message, as the loop gave the model: a call stopped
        before its result is answered `stopped`, so the next request is a valid conversation."""
        answered = [m.tool_call_id for m in turn.saved if m.role == "tool"]
        calls = [call_parts(c) for m in turn.saved if m.role == "assistant" for c in m.tool_calls or []]
        for i, (call_id, name, _) in enumerate(calls):
            if (call_id and call_id in answered) or (not call_id and i < len(answered)):
                continue
            message = Message(
                "tool", STOPPED, done_reason="stopped", tool_name=name, tool_call_id=call_id or None
            )
            if conv.id is not None:
                self.db.add_message(conv.id, message)
            conv.messages.append(message)
            turn.saved.append(message)

    def _save_reply(self, conv: Conversation, question: Message, turn: Turn, stopped: bool) -> None:
        self._answer_open_calls(conv, turn)
        reply = turn.reply
        if reply is not None and (reply.content or reply.thinking):
            self._close_reply(turn, stopped)
            if reply.id is None:
                if conv.id is not None:
                    self.db.add_message(conv.id, reply)
            else:
                self.db.update_message(reply)
            conv.messages.append(reply)
            return
        if reply is not None and reply.id is not None:
            self.db.delete_message(reply.id)
        if turn.saved:  # tools ran: the turn stays, only the empty last message goes
            return
        # nothing came back: take the question out of the history and give it back to the input
        if question.id is not None:
            self.db.delete_message(question.id)
        with contextlib.suppress(ValueError):
            conv.messages.remove(question)
        if not conv.messages and conv.id is not None:  # created by this send: leave no empty entry
            self.db.delete(conv.id)
            conv.id = None

    def _follow(self) -> None:
        """Keep the newest text in view, unless the user scrolled up to read."""
        pane = self.messages_pane
        if pane.max_scroll_y - pane.scroll_y <= 3:
            pane.scroll_end(animate=False)

    async def _finish_answer(
        self, conv: Conversation, question: Message, turn: Turn, error: str | None, stopped: bool
    ) -> None:
        stats, bar = self.status.stats, self.status
        view, reply = turn.view, turn.reply
        stats.state = ""
        last = (
            reply
            if reply is not None and reply.stats
            else next((m for m in reversed(turn.saved) if m.stats), None)
        )
        s = last.stats if last is not None and last.stats else {}
        stats.tokens_per_s = s.get("tokens_per_s")
        stats.draft_count, stats.draft_accepted = s.get("draft_count", 0), s.get("draft_accepted_count", 0)
        bar.refresh_stats()
        for block in turn.tool_views:  # stopped before their results: say so
            if not block.result and block.state in ("running", "waiting for approval"):
                block.set_state("stopped")
        if error:
            self.notify(error, title="Error", severity="error", timeout=10)
        if reply is None or view is None or (not reply.content and not reply.thinking):
            if turn.saved:  # tools ran, then nothing more: only the empty message goes
                if view is not None:
                    await view.remove()
            elif not conv.messages:  # the question was the first: back to the welcome text
                await self.refresh_conversations()
                await self.show_conversation()
            elif view is not None:
                await view.remove()
                views = list(self.messages_pane.query(MessageView))
                if views and views[-1].role == "user":
                    await views[-1].remove()
            if not turn.saved and not self.chat_input.text:
                self.chat_input.text = question.content
            if stopped:
                said = (
                    "Stopped; the tool calls so far are kept."
                    if turn.saved
                    else "Stopped before the answer began."
                )
                self.notify(said, severity="information")
            if conv is self.conversation and not error and turn.saved:
                await self._update_context(conv, turn.saved[-1], turn.tools)
            return
        view.set_note(
            "stopped"
            if stopped
            else "error"
            if error
            else "cut at the length limit"
            if reply.done_reason == "length"
            else ""
        )
        if stopped:
            self.notify("Answer stopped; what was generated is kept.", severity="information", timeout=3)
        if conv is self.conversation and not error:
            await self._update_context(conv, reply, turn.tools)

    async def _count_context(self, conv: Conversation, tools: list[dict[str, Any]] | None) -> None:
        """The context meter: the conversation's tokens, the tools' descriptions included (as text: an
        estimate, shown with a ~, since the template renders them its own way)."""
        stats = self.status.stats
        messages = conv.chat_messages()
        if tools:
            messages = [{"role": "system", "content": json.dumps(tools)}, *messages]
        used, exact = await self.client.count_tokens(
            conv.model or "", messages, conv.settings.options or None
        )
        stats.ctx_used, stats.ctx_exact = used, exact and not tools

    async def _update_context(
        self, conv: Conversation, reply: Message, tools: list[dict[str, Any]] | None = None
    ) -> None:
        """Tokens in context after this answer versus the context length; warn before it overflows."""
        stats, bar = self.status.stats, self.status
        options = conv.settings.options or None
        try:
            stats.ctx_len = await self.client.context_length(conv.model or "", options)
            await self._count_context(conv, tools)
        except LocalrtError:
            return
        if reply.stats is not None and reply.id is not None:
            reply.stats.update(context_tokens=stats.ctx_used, context_exact=stats.ctx_exact)
            self.db.update_message(reply)
        bar.refresh_stats()
        if stats.near_overflow and self._ctx_warned != conv.id:
            self._ctx_warned = conv.id
            self.notify(
                f"This conversation fills {stats.ctx_share:.0%} of the context "
                f"({stats.ctx_used}/{stats.ctx_len} tokens): the next answers may not fit. "
                "Ctrl+N starts a new conversation; F4 raises the context length.",
                title="Context almost full",
                severity="warning",
                timeout=12,
            )

    # ---- sidebar events --------------------------------------------------------------------
    @on(ListView.Selected, "#models")
    def _model_selected(self, event: ListView.Selected) -> None:
        if isinstance(event.item, ModelItem):
            self.switch_model(event.item.model_name)

    @on(ListView.Selected, "#conversations")
    async def _conversation_selected(self, event: ListView.Selected) -> None:
        if isinstance(event.item, ConversationItem):
            await self.open_conversation(event.item.conversation_id)

    def switch_model(self, name: str) -> None:
        if self.busy:
            self.notify("An answer is streaming: Esc stops it first.", severity="warning")
            return
        self.set_model(name)

    # ---- actions ---------------------------------------------------------------------------
    def action_stop(self) -> None:
        if self.answer_worker is not None and self.busy:
            self.answer_worker.cancel()

    async def action_new_conversation(self) -> None:
        if self.busy:
            self.notify("An answer is streaming: Esc stops it first.", severity="warning")
            return
        self.conversation = Conversation(None, "New conversation", self.conversation.model)
        self._model_changed()
        await self.show_conversation()
        await self.refresh_conversations()
        self.chat_input.focus()

    def action_switch_model(self) -> None:
        names = [m.name for m in self.models]

        def chosen(name: str | None) -> None:
            if name:
                self.switch_model(name)

        self.push_screen(ModelPickerScreen(names, self.conversation.model), chosen)

    def action_settings(self) -> None:
        conv = self.conversation

        def saved(settings: Settings | None) -> None:
            if settings is None:
                return
            conv.settings = settings
            if conv.id is not None:
                self.db.set_settings(conv.id, settings)
            self._model_changed()
            self.notify("Settings saved for this conversation.", title="Settings")

        self.push_screen(SettingsScreen(conv.settings, conv.model), saved)

    def action_tools(self) -> None:
        conv = self.conversation

        def closed(_: Any) -> None:
            if conv.id is not None:
                self.db.set_settings(conv.id, conv.settings)
            self.refresh_tools_line()

        self.push_screen(
            ToolsScreen(self.toolbox, self.approvals, conv.settings, self.tools_off.get(conv.model or "")),
            closed,
        )

    def action_toggle_think(self) -> None:
        """The model's default -> on -> off -> the default; saved with the conversation."""
        conv = self.conversation
        following = {None: True, True: False, False: None}[conv.settings.think]
        conv.settings.think = following
        if conv.id is not None:
            self.db.set_settings(conv.id, conv.settings)
        state = {None: "the model's default", True: "on", False: "off"}[following]
        self.notify(f"Thinking: {state} for this conversation.", title="Thinking")

    def action_rename(self) -> None:
        conv = self.conversation

        async def renamed(title: str | None) -> None:
            if not title or not title.strip():
                return
            if conv.id is None:
                saved = self.db.create(title, conv.model, conv.settings)
                conv.id, conv.title = saved.id, saved.title
            else:
                self.db.rename(conv.id, title)
                conv.title = self.db.load(conv.id).title
            self._update_titles()
            await self.refresh_conversations()

        self.push_screen(PromptScreen("Rename conversation", conv.title), renamed)

    def action_export(self) -> None:
        conv = self.conversation
        if not conv.messages:
            self.notify("Nothing to export yet.", severity="warning")
            return
        default = (self.export_dir or Path.cwd()) / f"{slug(conv.title)}.md"

        def chosen(path: str | None) -> None:
            if not path:
                return
            target = Path(path).expanduser()
            try:
                target.write_text(to_markdown(conv), encoding="utf-8")
            except OSError as e:
                self.notify(
                    f"cannot write {target}: {e.strerror or e}", title="Export failed", severity="error"
                )
                return
            self.notify(f"Exported to {target}", title="Export")

        self.push_screen(PromptScreen("Export to Markdown file", str(default)), chosen)

    def action_delete_conversation(self) -> None:
        conv = self.conversation
        if self.busy:
            self.notify("An answer is streaming: Esc stops it first.", severity="warning")
            return

        async def confirmed(yes: bool | None) -> None:
            if not yes:
                return
            if conv.id is not None:
                self.db.delete(conv.id)
            self.notify(f"Deleted “{conv.title}”.", title="Conversation")
            await self.action_new_conversation()

        self.push_screen(ConfirmScreen(f"Delete the conversation “{conv.title}”?"), confirmed)

    def action_pull(self, name: str = "") -> None:
        async def pulled(name: str | None) -> None:
            if not name:
                return
            await self.refresh_models()
            self.notify(f"Pulled {name}.", title="Pull")
            from localrt.store.names import parse_name

            with contextlib.suppress(LocalrtError):
                name = parse_name(name).display
            current = self.conversation.model
            if (not current or not self.is_installed(current)) and self.is_installed(name):
                self.set_model(name)
            else:
                self._highlight_model()

        self.push_screen(PullScreen(self.client, name), pulled)

    def _target_model(self) -> str | None:
        """The model an action applies to: the highlighted sidebar row when focused, else the current one."""
        view = self.query_one("#models", ListView)
        if view.has_focus and isinstance(view.highlighted_child, ModelItem):
            return view.highlighted_child.model_name
        return self.conversation.model

    def action_model_info(self) -> None:
        name = self._target_model()
        if not name:
            self.notify("No model selected.", severity="warning")
            return
        self.run_worker(self._show_info(name), group="info", exclusive=True, exit_on_error=False)

    async def _show_info(self, name: str) -> None:
        try:
            info = await self.client.show(name, self.conversation.settings.options or None)
        except LocalrtError as e:
            self.notify(str(e), title="Model info", severity="error", timeout=8)
            return
        await self.push_screen(ModelInfoScreen(info))

    def action_delete_model(self) -> None:
        name = self._target_model()
        if not name:
            self.notify("No model selected.", severity="warning")
            return

        async def confirmed(yes: bool | None) -> None:
            if not yes:
                return
            try:
                await self.client.delete(name)
            except LocalrtError as e:
                self.notify(str(e), title="Delete failed", severity="error")
                return
            self.notify(f"Deleted model {name}.", title="Model")
            await self.refresh_models()

        self.push_screen(ConfirmScreen(f"Delete the model {name} from the store?"), confirmed)

    def action_toggle_sidebar(self) -> None:
        sidebar = self.query_one("#sidebar")
        sidebar.display = not sidebar.display

    def action_help(self) -> None:
        rows = [(key_label(a.key), a.title) for a in ACTIONS]
        self.push_screen(HelpScreen([*INPUT_KEYS, *rows]))

    # ---- command palette -------------------------------------------------------------------
    def get_system_commands(self, screen: Screen[Any]) -> Iterable[SystemCommand]:
        for a in ACTIONS:
            if a.action == "quit":
                continue  # Textual's own "Quit" entry comes with super() below
            yield SystemCommand(
                f"{a.title} ({key_label(a.key)})", a.description, getattr(self, f"action_{a.action}")
            )
        for m in self.models:
            yield SystemCommand(
                f"Use model {m.name}",
                f"Switch this conversation to {m.name}",
                lambda name=m.name: self.switch_model(name),
            )
        for c in self.db.conversations()[:30]:
            yield SystemCommand(
                f"Open conversation: {c.title}",
                "Reopen a saved conversation",
                lambda cid=c.id: self.run_worker(self.open_conversation(cid or 0), exit_on_error=False),
            )
        yield from super().get_system_commands(screen)
