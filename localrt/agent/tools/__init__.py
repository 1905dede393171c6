"""What a tool is, for the loop: a name, a JSON schema, what it does to the world, and how a call is
prepared (checked, and shown for approval) before it runs.

A call runs in two parts so that what the user approves is what runs: `prepare(arguments)` checks the
arguments and computes the change (a write's diff, a shell command) without touching anything, and
`Prepared.run()` applies exactly that. A bad argument is an error result the model reads, never an
exception out of the loop.
"""

from __future__ import annotations

from collections.abc import Awaitable
from collections.abc import Callable
from collections.abc import Mapping
from dataclasses import dataclass
from dataclasses import field
from typing import Any
from typing import Literal

# read: runs without asking; write: changes files; run: runs a command, reaches the network or an MCP server
Effect = Literal["read", "write", "run"]


@dataclass(frozen=True)
class Limits:
    """The bounds every built-in tool keeps: how long a command may run and how much text comes back."""

    shell_timeout: float = 120.0  # seconds, unless the call asks for less
    result_chars: int = 32_000  # what one tool result may hand the model; the rest is cut and counted
    read_bytes: int = 256 * 1024  # what read_file reads of one file
    fetch_bytes: int = 2 * 1024 * 1024  # what fetch_url downloads
    fetch_timeout: float = 20.0
    mcp_timeout: float = 120.0  # one MCP tool call
    list_entries: int = 500  # list_directory and search_files stop here


@dataclass
class ToolResult:
    """What goes back to the model as the tool message; `error` marks a failure the model should read."""

    content: str
    error: bool = False

    @classmethod
    def failed(cls, message: str) -> ToolResult:
        return cls(message, error=True)


@dataclass
class Prepared:
    """A checked call, ready to run: `summary` is one line (the call as a person reads it), `detail` what
    an approval shows (a unified diff, the command, the arguments), `detail_kind` how to show it."""

    summary: str
    run: Callable[[], Awaitable[ToolResult]]
    detail: str = ""
    detail_kind: Literal["diff", "command", "arguments", ""] = ""


@dataclass
class Tool:
    """One tool the model may call. `source` is "built-in" or the MCP server's name."""

    name: str
    description: str
    parameters: dict[str, Any]
    effect: Effect
    prepare: Callable[[Mapping[str, Any]], Awaitable[Prepared | ToolResult]]
    source: str = "built-in"
    annotations: dict[str, Any] = field(default_factory=dict)

    def schema(self) -> dict[str, Any]:
        """The tool as `/api/chat` takes it (OpenAI's function shape)."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }


def cap_text(text: str, limit: int) -> str:
    """`text` cut to `limit` characters, saying how much was left out (the model must know it is partial)."""
    if len(text) <= limit:
        return text
    cut = len(text) - limit
    return f"{text[:limit]}\n[... {cut} more characters cut: the result was {len(text)} characters]"


def schema(properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    """A JSON schema of an object with these properties."""
    return {"type": "object", "properties": properties, "required": required}


def string_arg(arguments: Mapping[str, Any], name: str, *, default: str | None = None) -> str:
    """A string argument, or ValueError naming it (the loop turns it into an error result)."""
    value = arguments.get(name, default)
    if value is None:
        raise ValueError(f"missing argument {name!r}")
    if not isinstance(value, str):
        raise ValueError(f"argument {name!r} must be a string, got {type(value).__name__}")
    return value


def int_arg(arguments: Mapping[str, Any], name: str, default: int | None = None) -> int | None:
    value = arguments.get(name, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(f"argument {name!r} must be a number")
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"argument {name!r} must be a number, got {value!r}") from None
