"""How sizes, durations, times and tables read on the terminal, as Ollama prints them.

One module for the CLI and the chat app, so `localrt list` and the sidebar never disagree. It imports
nothing of localrt: every layer may use it.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from typing import TextIO


def human_size(n: float) -> str:
    """Decimal units as `ollama list` prints them: "98 MB", "4.7 GB", "512 KB"."""
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            break
        n /= 1000
    return f"{n:.1f} {unit}" if n < 10 and n != int(n) else f"{int(n)} {unit}"


_SPANS = (
    ("year", 31536000),
    ("month", 2592000),
    ("week", 604800),
    ("day", 86400),
    ("hour", 3600),
    ("minute", 60),
    ("second", 1),
)


def _count(n: int, unit: str) -> str:
    return f"{n} {unit}{'s' if n != 1 else ''}"


def human_ago(then: float, now: float | None = None) -> str:
    """`ollama list`'s MODIFIED column: "3 days ago"."""
    seconds = max(0, int((now or time.time()) - then))
    for unit, span in _SPANS:
        if seconds >= span:
            return f"{_count(seconds // span, unit)} ago"
    return "Less than a second ago"


def human_until(expires_at: float | None, now: float | None = None) -> str:
    """`ollama ps`'s UNTIL column: "4 minutes from now", "Forever" (None) or "Stopping..."."""
    if expires_at is None:
        return "Forever"
    left = expires_at - (now or time.time())
    if left > 10 * 365 * 86400:
        return "Forever"
    for unit, span in (("hour", 3600), ("minute", 60), ("second", 1)):
        if left >= span and left > 1:
            return f"{_count(int(left // span), unit)} from now"
    return "Stopping..."


def go_duration(ns: int) -> str:
    """Go's time.Duration.String(), which Ollama's timing lines use (1.234s, 56.7ms, 890µs)."""
    if ns < 1000:
        return f"{ns}ns"
    if ns < 1_000_000:
        return _trim(f"{ns / 1e3:.3f}") + "µs"
    if ns < 1_000_000_000:
        return _trim(f"{ns / 1e6:.6f}") + "ms"
    seconds = ns / 1e9
    if seconds < 60:
        return _trim(f"{seconds:.9f}") + "s"
    minutes, rest = divmod(seconds, 60)
    if minutes < 60:
        return f"{int(minutes)}m" + _trim(f"{rest:.9f}") + "s"
    hours, minutes = divmod(int(minutes), 60)
    return f"{hours}h{minutes}m" + _trim(f"{rest:.9f}") + "s"


def _trim(number: str) -> str:
    return number.rstrip("0").rstrip(".") if "." in number else number


def print_table(rows: Sequence[Sequence[str]], out: TextIO | None = None) -> None:
    """Columns padded to their widest cell, four spaces apart, as Ollama's tables."""
    out = out or sys.stdout
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        out.write("    ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() + "\n")


def format_bytes(n: int) -> str:
    """Sizes in messages, one decimal as Ollama's pull errors print them: 98362432 -> "98.4 MB"."""
    value, unit = float(n), "B"
    for unit in ("B", "KB", "MB", "GB", "TB", "PB"):  # noqa: B007 - the unit reached is the answer
        if value < 1000 or unit == "PB":
            break
        value /= 1000
    return f"{n} B" if unit == "B" else f"{value:.1f} {unit}"
