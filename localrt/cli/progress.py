"""Pull progress on the terminal: one rich bar per layer, like `ollama pull`; plain lines when piped.

Piped, the status lines go to stdout, so stderr carries nothing but a final error line.
"""

from __future__ import annotations

from types import TracebackType
from typing import Any

from rich.console import Console
from rich.progress import BarColumn
from rich.progress import DownloadColumn
from rich.progress import Progress
from rich.progress import TextColumn
from rich.progress import TimeRemainingColumn
from rich.progress import TransferSpeedColumn


def byte_bars(console: Console, transient: bool) -> Progress:
    """Bars over byte counts: description, bar, bytes done of total, speed, time left."""
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        console=console,
        transient=transient,
    )


class PullProgress:
    """A context manager whose `update(event)` takes `localrt.store.pull.Progress` events."""

    def __init__(self, console: Console | None = None) -> None:
        self.console = console or Console(stderr=True)
        self.live = self.console.is_terminal
        self.bars = byte_bars(self.console, transient=False)
        self.tasks: dict[str, Any] = {}
        self.last_status: str | None = None

    def __enter__(self) -> PullProgress:
        if self.live:
            self.bars.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self.live:
            self.bars.stop()

    def update(self, event: Any) -> None:
        digest, total = getattr(event, "digest", None), getattr(event, "total", None)
        if digest and total:
            completed = getattr(event, "completed", 0) or 0
            if digest not in self.tasks:
                self.tasks[digest] = self.bars.add_task(event.status, total=total)
                if not self.live:
                    print(f"{event.status} ({total} bytes)", flush=True)
            self.bars.update(self.tasks[digest], completed=completed, total=total)
            return
        if event.status != self.last_status:
            self.last_status = event.status
            if self.live:
                self.bars.console.print(event.status)
            else:
                print(event.status, flush=True)


class ByteProgress:
    """One rich bar over a byte count (`localrt verify`'s hashing), on stderr while it is a terminal;
    piped, it draws nothing. `update(done, total)` takes the counts as the work reports them."""

    def __init__(self, description: str, console: Console | None = None) -> None:
        self.console = console or Console(stderr=True)
        self.live = self.console.is_terminal
        self.bar = byte_bars(self.console, transient=True)
        self.task = self.bar.add_task(description, total=None)

    def __enter__(self) -> ByteProgress:
        if self.live:
            self.bar.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self.live:
            self.bar.stop()

    def update(self, done: int, total: int) -> None:
        self.bar.update(self.task, completed=done, total=total)
