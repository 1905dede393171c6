"""The chat app's own widgets: the message input, a message, the status bar, sidebar rows."""

from __future__ import annotations

import time
from dataclasses import dataclass

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.events import Key
from textual.message import Message
from textual.widgets import Collapsible
from textual.widgets import Label
from textual.widgets import ListItem
from textual.widgets import Markdown
from textual.widgets import Static
from textual.widgets import TextArea

CONTEXT_WARNING = 0.8  # warn when this share of the context is used: the next turns may not fit


class ChatInput(TextArea):
    """A multi-line input: Enter sends, Shift+Enter or Ctrl+J starts a new line."""

    BINDINGS = [
        Binding("ctrl+j", "newline", "New line", show=False),
        Binding("shift+enter", "newline", "New line", show=False),
    ]

    @dataclass
    class Submitted(Message):
        chat_input: ChatInput
        text: str

    def __init__(self, **kwargs: object) -> None:
        super().__init__(
            soft_wrap=True,
            show_line_numbers=False,
            tab_behavior="focus",
            placeholder="Ask anything · Enter sends · Ctrl+J new line · F1 help",
            compact=True,
            **kwargs,
        )  # type: ignore[arg-type]

    async def _on_key(self, event: Key) -> None:
        # runs before TextArea's own handler (which would insert a newline); prevent_default stops it
        if event.key == "enter":
            event.stop()
            event.prevent_default()
            self.post_message(self.Submitted(self, self.text))

    def action_newline(self) -> None:
        self.insert("\n")


class MessageView(Vertical):
    """One turn: a one-line header (who, and a note such as "stopped"), the model's thinking in a
    collapsible block (shown only when there is some), then the Markdown content."""

    def __init__(
        self,
        role: str,
        content: str = "",
        *,
        author: str | None = None,
        note: str = "",
        thinking: str = "",
    ) -> None:
        super().__init__(classes=f"message -{role}")
        self.role = role
        self.author = author or ("You" if role == "user" else role.title())
        self.note = note
        self.initial = content
        self.thinking = thinking

    def compose(self) -> ComposeResult:
        yield Label(self._title(), classes="message-title", markup=False)
        block = Collapsible(
            Static(self.thinking, classes="thinking-text", markup=False),
            title="Thinking",
            collapsed=True,
            classes="thinking",
        )
        block.display = bool(self.thinking)
        yield block
        yield Markdown(self.initial, classes="message-body")

    @property
    def thinking_block(self) -> Collapsible:
        return self.query_one(".thinking", Collapsible)

    def add_thinking(self, text: str) -> None:
        """Live while it streams: the block opens and grows; `end_thinking` folds it when the answer starts."""
        self.thinking += text
        block = self.thinking_block
        if not block.display:
            block.display = True
            block.collapsed = False
        self.query_one(".thinking-text", Static).update(self.thinking)

    def end_thinking(self) -> None:
        if self.thinking:
            self.thinking_block.collapsed = True

    def _title(self) -> str:
        return f"{self.author} · {self.note}" if self.note else self.author

    @property
    def markdown(self) -> Markdown:
        return self.query_one(Markdown)

    def set_note(self, note: str) -> None:
        self.note = note
        self.query_one(".message-title", Label).update(self._title())


class ToolCallView(Collapsible):
    """One tool call as a collapsible block: the call (name and arguments) in the title and the body, then
    its result; the title carries the state (waiting for approval, running, ok, denied, error)."""

    SHOWN_LINES = 60  # of a result in the block (the model gets the whole capped result)
    SHOWN_CHARS = 6000

    def __init__(
        self, name: str, summary: str, arguments: str, *, call_id: str = "", state: str = "running"
    ) -> None:
        self.tool_name, self.summary, self.call_id = name, summary, call_id
        self.state = state
        self.result = ""
        self.saved_result: tuple[str, str] | None = None  # a reopened conversation's, shown once mounted
        super().__init__(
            Static(arguments, classes="tool-arguments", markup=False),
            Static("", classes="tool-result", markup=False),
            title=self._heading(),
            collapsed=False,
            classes="tool-call",
        )

    def on_mount(self) -> None:
        if self.saved_result is not None:
            self.set_result(*self.saved_result)

    def _heading(self) -> str:
        return f"⚙ {self.summary} · {self.state}"

    def set_state(self, state: str) -> None:
        self.state = state
        self.title = self._heading()

    def set_result(self, content: str, state: str) -> None:
        """The result arrived: shown (its first lines), the block folded when the result is long."""
        self.result = content
        lines = content.splitlines()
        shown = "\n".join(lines[: self.SHOWN_LINES])[: self.SHOWN_CHARS]
        if len(shown) < len(content):
            shown += f"\n… ({len(content) - len(shown)} more characters)"
        self.query_one(".tool-result", Static).update(shown)
        self.set_state(state)
        self.set_class(state not in ("ok",), "-failed")
        if len(lines) > 12:
            self.collapsed = True


class ToolsLine(Static):
    """One line above the input: which tools the model has, or why it has none."""


class ModelItem(ListItem):
    def __init__(self, name: str, size: str) -> None:
        super().__init__(Label(name, markup=False), Label(size, classes="dim"), classes="model-item")
        self.model_name = name


class ConversationItem(ListItem):
    def __init__(self, conversation_id: int, title: str, when: str) -> None:
        super().__init__(Label(title, markup=False), Label(when, classes="dim"), classes="conversation-item")
        self.conversation_id = conversation_id


@dataclass
class Stats:
    """The live numbers the status bar shows; None means not known yet."""

    where: str = ""
    state: str = ""  # "", "loading", "answering"
    ttft: float | None = None  # seconds
    tokens_per_s: float | None = None
    ctx_used: int | None = None
    ctx_exact: bool = True
    ctx_len: int | None = None
    draft_count: int = 0
    draft_accepted: int = 0
    pieces: int = 0  # streamed pieces of the answer so far (about one token each)
    first_token_at: float | None = None

    @property
    def ctx_share(self) -> float | None:
        if self.ctx_used is None or not self.ctx_len:
            return None
        return self.ctx_used / self.ctx_len

    @property
    def near_overflow(self) -> bool:
        share = self.ctx_share
        return share is not None and share >= CONTEXT_WARNING

    def live_rate(self, now: float | None = None) -> float | None:
        if self.first_token_at is None or self.pieces < 2:
            return None
        elapsed = (now or time.monotonic()) - self.first_token_at
        return (self.pieces - 1) / elapsed if elapsed > 0 else None


def meter(share: float, cells: int = 5) -> str:
    """The context's fill as a bar of `cells` (▰ used, ▱ free)."""
    used = min(cells, max(0, round(share * cells)))
    return "▰" * used + "▱" * (cells - used)


class StatusBar(Static):
    """TTFT, tokens/s, tokens in context / context length, speculative acceptance; warns near overflow."""

    def __init__(self, **kwargs: object) -> None:
        super().__init__("", **kwargs)  # type: ignore[arg-type]
        self.stats = Stats()

    def refresh_stats(self) -> None:
        self.set_class(self.stats.near_overflow, "-warning")
        self.update(self.line())

    def line(self) -> Text:
        s = self.stats
        parts: list[str] = []
        if s.state == "loading":
            parts.append("loading…")
        elif s.state == "answering":
            parts.append("answering… (Esc stops)")
        parts.append(f"TTFT {s.ttft:.2f}s" if s.ttft is not None else "TTFT –")
        rate = s.live_rate() if s.state == "answering" else s.tokens_per_s
        parts.append(f"{rate:.1f} tok/s" if rate is not None else "– tok/s")
        context = ""
        if s.ctx_len:
            used = "–" if s.ctx_used is None else f"{'' if s.ctx_exact else '~'}{s.ctx_used}"
            share = s.ctx_share
            context = f"ctx {used}/{s.ctx_len}" + (
                f" {meter(share)} {share:.0%}" if share is not None else ""
            )
        if s.draft_count:
            parts.append(f"spec {s.draft_accepted / s.draft_count:.0%} ({s.draft_accepted}/{s.draft_count})")
        if not s.near_overflow:
            if context:
                parts.insert(3 if s.state else 2, context)  # after TTFT and tok/s
            parts.append(s.where)
            return Text(" · ".join(parts), no_wrap=True, overflow="ellipsis")
        # near overflow the warning leads, with the numbers it is about, so it shows even at 80 columns
        full = (s.ctx_share or 0) >= 0.98
        advice = "the next turn will not fit" if full else "Ctrl+N new chat, F4 more context"
        text = Text(f"⚠ {context} full: {advice}", style="bold", no_wrap=True, overflow="ellipsis")
        text.append(" │ " + " · ".join(parts))
        return text
