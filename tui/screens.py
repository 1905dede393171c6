"""Dialogs: help, settings, tools, a tool call's approval, pull, model info, model picker, a one-line
prompt and a confirmation."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING
from typing import Any

from rich.syntax import Syntax
from rich.table import Table
from rich.text import Text
from textual import on
from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Grid
from textual.containers import Horizontal
from textual.containers import Vertical
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Button
from textual.widgets import Checkbox
from textual.widgets import DataTable
from textual.widgets import Input
from textual.widgets import Label
from textual.widgets import OptionList
from textual.widgets import ProgressBar
from textual.widgets import Select
from textual.widgets import Static
from textual.widgets import Switch
from textual.widgets import TextArea
from textual.widgets.option_list import Option

from localrt.agent.approvals import ApprovalRequest
from localrt.agent.approvals import Approvals
from localrt.agent.approvals import Decision
from localrt.errors import LocalrtError
from localrt.format import human_size
from localrt.tui.conversations import Settings
from localrt.tui.settings import CHOICE_FIELDS
from localrt.tui.settings import TEXT_FIELDS
from localrt.tui.settings import field_text
from localrt.tui.settings import parse_fields

if TYPE_CHECKING:
    from localrt.agent.toolbox import Toolbox
    from localrt.client import Client
    from localrt.client import ModelInfo


class Dialog(ModalScreen[Any]):
    """A modal with Esc to close; subclasses compose into a `.dialog` container."""

    BINDINGS = [Binding("escape", "close", "Close")]

    def action_close(self) -> None:
        self.dismiss(None)


class HelpScreen(Dialog):
    """Every shortcut, built from the app's action table so it cannot drift from the bindings."""

    def __init__(self, rows: Sequence[tuple[str, str]]) -> None:
        super().__init__()
        self.rows = list(rows)

    def compose(self) -> ComposeResult:
        table = Table.grid(padding=(0, 2))
        table.add_column(style="bold", no_wrap=True)
        table.add_column()
        for key, what in self.rows:
            table.add_row(key, what)
        with Vertical(classes="dialog", id="help"):
            yield Label("Keyboard shortcuts · Esc closes", classes="dialog-title")
            with VerticalScroll(id="help-keys"):
                yield Static(table)
            yield Label("Ctrl+P opens the command palette: every action is there too.", classes="dim")


class PromptScreen(Dialog):
    """One line of text (rename, export path); Enter accepts, Esc cancels. Returns the text or None."""

    def __init__(self, title: str, value: str = "", placeholder: str = "") -> None:
        super().__init__()
        self.title_text, self.value, self.placeholder = title, value, placeholder

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog", id="prompt"):
            yield Label(self.title_text, classes="dialog-title")
            yield Input(self.value, placeholder=self.placeholder, id="prompt-input")
            with Horizontal(classes="buttons"):
                yield Button("OK", id="ok", variant="primary")
                yield Button("Cancel", id="cancel")

    @on(Input.Submitted)
    @on(Button.Pressed, "#ok")
    def _ok(self) -> None:
        self.dismiss(self.query_one(Input).value)

    @on(Button.Pressed, "#cancel")
    def _cancel(self) -> None:
        self.dismiss(None)


class ConfirmScreen(Dialog):
    """Yes / No; returns True only on Yes."""

    BINDINGS = [Binding("y", "yes", "Yes"), Binding("n", "close", "No")]

    def __init__(self, question: str) -> None:
        super().__init__()
        self.question = question

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog", id="confirm"):
            yield Label(self.question, classes="dialog-title")
            with Horizontal(classes="buttons"):
                yield Button("Yes (y)", id="yes", variant="error")
                yield Button("No (n)", id="no")

    def action_yes(self) -> None:
        self.dismiss(True)

    @on(Button.Pressed, "#yes")
    def _yes(self) -> None:
        self.dismiss(True)

    @on(Button.Pressed, "#no")
    def _no(self) -> None:
        self.dismiss(False)


class ModelPickerScreen(Dialog):
    """Pick one of the installed models; returns its name or None."""

    def __init__(self, models: Sequence[str], current: str | None) -> None:
        super().__init__()
        self.models, self.current = list(models), current

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog", id="picker"):
            yield Label("Switch model", classes="dialog-title")
            if not self.models:
                yield Label("No models installed: F5 pulls one.", classes="dim")
            options = [Option(f"{'● ' if m == self.current else '  '}{m}", id=m) for m in self.models]
            yield OptionList(*options, id="picker-list")

    def on_mount(self) -> None:
        if self.current in self.models:
            self.query_one(OptionList).highlighted = self.models.index(self.current)

    @on(OptionList.OptionSelected)
    def _picked(self, event: OptionList.OptionSelected) -> None:
        self.dismiss(event.option.id)


class SettingsScreen(Dialog):
    """Per-conversation settings; Save validates like the API and stays open on an error."""

    BINDINGS = [Binding("ctrl+s", "save", "Save")]

    def __init__(self, settings: Settings, model: str | None) -> None:
        super().__init__()
        self.settings, self.model = settings, model

    def compose(self) -> ComposeResult:
        opts = self.settings.options
        with Vertical(classes="dialog", id="settings"):
            title = f"Conversation settings · {self.model}" if self.model else "Conversation settings"
            yield Label(title, classes="dialog-title", markup=False)
            with VerticalScroll(id="settings-form"):
                yield Label("System prompt", classes="field-label")
                yield TextArea(self.settings.system, id="system", soft_wrap=True, compact=True)
                with Grid(id="settings-grid"):
                    for name, label, placeholder in TEXT_FIELDS:
                        yield Label(label, classes="field-label")
                        yield Input(field_text(opts, name), placeholder=placeholder, id=name, compact=True)
                    for name, (label, choices) in CHOICE_FIELDS.items():
                        yield Label(label, classes="field-label")
                        yield Select(
                            [(c, c) for c in choices],
                            value=opts.get(name, Select.NULL),
                            prompt="model default",
                            id=name,
                            compact=True,
                        )
                    yield Label("JSON output", classes="field-label")
                    yield Switch(self.settings.json_output, id="json")
            yield Static("", id="settings-error")
            with Horizontal(classes="buttons"):
                yield Button("Save (Ctrl+S)", id="save", variant="primary")
                yield Button("Cancel", id="cancel")

    def values(self) -> dict[str, str | None]:
        out: dict[str, str | None] = {}
        for name, _, _ in TEXT_FIELDS:
            out[name] = self.query_one(f"#{name}", Input).value
        for name in CHOICE_FIELDS:
            value = self.query_one(f"#{name}", Select).value
            out[name] = None if value is Select.NULL else str(value)
        return out

    def action_save(self) -> None:
        options, errors = parse_fields(self.values())
        for widget in self.query("Input, Select"):
            widget.set_class(widget.id in errors, "-invalid")
        if errors:
            message = "; ".join(errors.values())
            self.query_one("#settings-error", Static).update(message)
            self.app.notify(message, title="Invalid setting", severity="error")
            return
        system = self.query_one("#system", TextArea).text.strip()
        self.dismiss(
            Settings(
                system=system,
                options=options,
                json_output=self.query_one("#json", Switch).value,
                think=self.settings.think,  # toggled with its own key, kept as it is here
                tools=self.settings.tools,  # the tools dialog's
                max_steps=self.settings.max_steps,
            )
        )

    @on(Button.Pressed, "#save")
    def _save(self) -> None:
        self.action_save()

    @on(Button.Pressed, "#cancel")
    def _cancel(self) -> None:
        self.dismiss(None)


class PullScreen(Dialog):
    """Pull a model by name with a progress bar: the same `pull` as the CLI, through the client."""

    def __init__(self, client: Client, name: str = "") -> None:
        super().__init__()
        self.client, self.initial = client, name
        self.pulling = False
        self.events_seen = 0  # progress events received (the tests watch this)

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog", id="pull"):
            yield Label("Pull a model", classes="dialog-title")
            yield Input(
                self.initial, placeholder="name, e.g. smollm2:135m or host/ns/model:tag", id="pull-name"
            )
            yield Checkbox("Allow http registries (--insecure)", id="insecure")
            yield Label("", id="pull-status")
            # hidden until sizes are known: an indeterminate bar animates (and snapshots would differ)
            yield ProgressBar(total=None, show_eta=False, id="pull-bar").set_styles("display: none;")
            with Horizontal(classes="buttons"):
                yield Button("Pull", id="pull-start", variant="primary")
                yield Button("Close", id="close")

    @on(Input.Submitted, "#pull-name")
    @on(Button.Pressed, "#pull-start")
    def start(self) -> None:
        name = self.query_one("#pull-name", Input).value.strip()
        if self.pulling:
            return
        if not name:
            self.app.notify("Type a model name to pull.", severity="warning")
            return
        self.pulling = True
        self.query_one("#pull-start", Button).disabled = True
        self._pull(name, self.query_one("#insecure", Checkbox).value)

    @work(exclusive=True, group="pull", exit_on_error=False)
    async def _pull(self, name: str, insecure: bool) -> None:
        status = self.query_one("#pull-status", Label)
        bar = self.query_one("#pull-bar", ProgressBar)
        status.update(f"pulling {name}…")
        try:
            async for event in self.client.pull(name, insecure=insecure):
                self.events_seen += 1
                if event.total:
                    bar.display = True
                    bar.update(total=event.total, progress=event.completed or 0)
                    label = f"{event.status} · {human_size(event.completed or 0)} / {human_size(event.total)}"
                else:
                    label = event.status
                status.update(label)
        except LocalrtError as e:
            status.update(f"failed: {e}")
            self.app.notify(str(e), title="Pull failed", severity="error", timeout=10)
            return
        except Exception as e:  # a bug must not take the app down: say what happened
            status.update(f"failed: {type(e).__name__}: {e}")
            self.app.notify(f"{type(e).__name__}: {e}", title="Pull failed", severity="error", timeout=10)
            return
        finally:
            self.pulling = False
            if self.is_attached:
                self.query_one("#pull-start", Button).disabled = False
        status.update(f"pulled {name}")
        self.dismiss(name)

    @on(Button.Pressed, "#close")
    def _close(self) -> None:
        self.dismiss(None)


class ModelInfoScreen(Dialog):
    """Architecture, size, quantization, context and the backend in use."""

    def __init__(self, info: ModelInfo) -> None:
        super().__init__()
        self.info = info

    def compose(self) -> ComposeResult:
        i = self.info
        rows = [
            ("architecture", i.architecture),
            ("parameters", i.parameters),
            ("quantization", i.quantization),
            ("size", human_size(i.size)),
            ("context length", str(i.context_length or "unknown")),
            ("loaded context", str(i.loaded_context) if i.loaded_context else "–"),
            ("backend", i.backend),
        ]
        with Vertical(classes="dialog", id="info"):
            yield Label(i.name, classes="dialog-title")
            table: DataTable[str] = DataTable(show_cursor=False, show_header=False, id="info-table")
            table.add_columns("key", "value")
            for key, value in rows:
                table.add_row(key, value)
            yield table
            yield Button("Close", id="close", variant="primary")

    @on(Button.Pressed, "#close")
    def _close(self) -> None:
        self.dismiss(None)


EFFECTS = {"read": "read-only", "write": "changes files: asks first", "run": "runs: asks first"}


class ApprovalScreen(Dialog):
    """A tool call that writes or runs, shown as it will run (the diff, the command, the arguments):
    allow once, allow this tool for the session, or deny. Esc denies. Returns a `Decision`."""

    BINDINGS = [
        Binding("y", "once", "Allow once"),
        Binding("a", "session", "Allow for this session"),
        Binding("n", "close", "Deny"),
    ]

    def __init__(self, request: ApprovalRequest) -> None:
        super().__init__()
        self.request = request

    def compose(self) -> ComposeResult:
        r = self.request
        where = "built-in tool" if r.source == "built-in" else f"MCP server {r.source}"
        if r.detail_kind == "diff":
            body: Any = Syntax(r.detail, "diff", theme="ansi_dark", word_wrap=True)
        elif r.detail_kind == "command":
            body = Syntax(r.detail, "bash", theme="ansi_dark", word_wrap=True)
        else:
            body = Text(r.detail)
        with Vertical(classes="dialog", id="approval"):
            yield Label(f"Allow {r.tool}?", classes="dialog-title", markup=False)
            yield Label(f"{where} · {EFFECTS.get(r.effect, r.effect)}", classes="dim", markup=False)
            yield Label(r.summary, id="approval-summary", markup=False)
            with VerticalScroll(id="approval-detail"):
                yield Static(body, id="approval-body")
            with Horizontal(classes="buttons"):
                yield Button("Allow once (y)", id="once", variant="primary")
                yield Button("For this session (a)", id="session")
                yield Button("Deny (n)", id="deny", variant="error")

    def action_close(self) -> None:
        self.dismiss(Decision.DENY)

    def action_once(self) -> None:
        self.dismiss(Decision.ONCE)

    def action_session(self) -> None:
        self.dismiss(Decision.SESSION)

    @on(Button.Pressed, "#once")
    def _once(self) -> None:
        self.action_once()

    @on(Button.Pressed, "#session")
    def _session(self) -> None:
        self.action_session()

    @on(Button.Pressed, "#deny")
    def _deny(self) -> None:
        self.action_close()


class ToolsScreen(Dialog):
    """The tools panel: tools on or off for this conversation, approve-all, the step limit, then every
    built-in tool and every MCP server (its state, its tools), each tool with its own switch. Changes
    apply at once; closing returns True so the app saves the conversation's part."""

    def __init__(
        self, toolbox: Toolbox, approvals: Approvals, settings: Settings, off_reason: str | None = None
    ) -> None:
        super().__init__()
        self.toolbox, self.approvals, self.settings, self.off_reason = (
            toolbox,
            approvals,
            settings,
            off_reason,
        )
        self.switch_names: dict[str, str] = {}  # switch id -> tool name

    def _tool_row(self, name: str, text: str) -> ComposeResult:
        switch_id = f"tool-{len(self.switch_names)}"
        self.switch_names[switch_id] = name
        yield Switch(name not in self.toolbox.disabled, id=switch_id, classes="tool-switch")
        yield Label(text, markup=False)

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog", id="tools"):
            yield Label("Tools · Esc closes", classes="dialog-title")
            if self.off_reason:
                yield Label(f"⚠ {self.off_reason}", id="tools-off", markup=False)
            with VerticalScroll(id="tools-list"), Grid(id="tools-grid"):
                yield Switch(self.settings.tools, id="tools-on")
                yield Label("Tools in this conversation")
                yield Switch(self.approvals.approve_all, id="approve-all")
                yield Label("Approve every call without asking (as --yes)")
                yield Input(str(self.settings.max_steps), id="max-steps", type="integer", compact=True)
                yield Label("Max steps: requests to the model per answer")
                yield Static("")
                yield Label("Built-in", classes="tools-section")
                for tool in self.toolbox.builtin:
                    yield from self._tool_row(tool.name, f"{tool.name} · {EFFECTS[tool.effect]}")
                hub = self.toolbox.hub
                yield Static("")
                yield Label("MCP servers", classes="tools-section")
                if hub is None or not hub.servers:
                    yield Static("")
                    yield Label("none configured (~/.config/localrt/mcp.json)", classes="dim")
                for server in hub.servers if hub is not None else []:
                    yield Static("")
                    yield Label(
                        f"{server.name} ({server.spec.transport}): {server.status}",
                        classes="tools-server",
                        markup=False,
                    )
                    for tool in server.tools:
                        yield from self._tool_row(tool.name, f"{tool.name} · asks first")
            with Horizontal(classes="buttons"):
                yield Button("Close", id="close", variant="primary")

    def action_close(self) -> None:
        self.dismiss(True)

    @on(Button.Pressed, "#close")
    def _close(self) -> None:
        self.dismiss(True)

    @on(Switch.Changed)
    def _switched(self, event: Switch.Changed) -> None:
        switch_id = event.switch.id or ""
        if switch_id == "tools-on":
            self.settings.tools = event.value
        elif switch_id == "approve-all":
            self.approvals.approve_all = event.value
        elif switch_id in self.switch_names:
            self.toolbox.set_enabled(self.switch_names[switch_id], event.value)

    @on(Input.Changed, "#max-steps")
    def _steps(self, event: Input.Changed) -> None:
        value = event.value.strip()
        valid = value.isdigit() and int(value) >= 1
        event.input.set_class(not valid, "-invalid")
        if valid:
            self.settings.max_steps = int(value)
