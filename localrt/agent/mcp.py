"""MCP servers, through the official `mcp` SDK: stdio servers (a command) and streamable-HTTP servers (a
URL), read from the config file Claude Desktop, Cursor and LM Studio use:

    {"mcpServers": {"time": {"command": "uvx", "args": ["mcp-server-time"], "env": {...}},
                    "docs": {"url": "https://example.com/mcp", "headers": {"Authorization": "..."}}}}

at `~/.config/localrt/mcp.json` (platformdirs' user config dir) or `--mcp FILE`. Each server's tools
join the built-in ones as `server__tool`. A server that fails to start, or dies later, is a state
shown to the user (`failed: why`), never an exception out of the chat: its calls become error results.

Each connection lives in a task of its own, from start to close, because the SDK's transports are
anyio task groups that must be entered and left by the same task; calls from the loop's task wait on
the call and on that task together, so a server that dies mid-call ends the call at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
from collections.abc import Mapping
from contextlib import AsyncExitStack
from dataclasses import dataclass
from dataclasses import field
from pathlib import Path
from typing import Any
from typing import TextIO

from localrt import config
from localrt.agent.tools import Limits
from localrt.agent.tools import Prepared
from localrt.agent.tools import Tool
from localrt.agent.tools import ToolResult
from localrt.errors import LocalrtError

START_TIMEOUT = 30.0  # seconds for a server to start, answer `initialize` and list its tools
CLOSE_TIMEOUT = 5.0
PING_TIMEOUT = 5.0  # after a failed call: a server that does not answer a ping is taken as dead
MAX_TOOL_PAGES = 20  # tools/list pages read from one server
SSE_EVENT_BYTES = 32 * 1024 * 1024  # one streamed HTTP answer; a bigger one is an error result
NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,40}$")
SEPARATOR = "__"


@dataclass
class ServerSpec:
    """One `mcpServers` entry. `problem` says why it cannot start (a config mistake), "" when it can."""

    name: str
    command: str | None = None
    args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    cwd: str | None = None
    url: str | None = None
    headers: dict[str, str] = field(default_factory=dict)
    problem: str = ""

    @property
    def transport(self) -> str:
        return "stdio" if self.command else "http"

    @property
    def shown(self) -> str:
        """The server as `mcp list` prints it: its command line or its URL."""
        if self.command:
            return " ".join([self.command, *self.args])
        return self.url or ""


def _strings(value: Any, what: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{what} must be a list of strings")
    return list(value)


def _string_map(value: Any, what: str) -> dict[str, str]:
    if not isinstance(value, Mapping) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    ):
        raise ValueError(f"{what} must be an object of strings")
    return dict(value)


def parse_entry(name: str, entry: Any) -> ServerSpec:
    """One server's entry; a mistake in it becomes the spec's `problem`, so the other servers still start."""
    spec = ServerSpec(name)
    try:
        if not NAME_RE.match(name):
            raise ValueError("a server name is 1 to 40 letters, digits, '_' or '-'")
        if not isinstance(entry, Mapping):
            raise ValueError("an entry must be an object")
        kind = entry.get("type") or entry.get("transport")
        if kind == "sse":
            raise ValueError("the old SSE transport is not supported: use a streamable-HTTP URL")
        command, url = entry.get("command"), entry.get("url") or entry.get("serverUrl")
        if isinstance(command, str) and command and not url:
            spec.command = command
            spec.args = _strings(entry.get("args", []), "args")
            spec.env = _string_map(entry.get("env", {}), "env")
            cwd = entry.get("cwd")
            spec.cwd = cwd if isinstance(cwd, str) and cwd else None
        elif isinstance(url, str) and url and not command:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"url must be http:// or https://, not {url!r}")
            spec.url = url
            spec.headers = _string_map(entry.get("headers", {}), "headers")
        else:
            raise ValueError('give either "command" (a stdio server) or "url" (streamable HTTP)')
    except ValueError as e:
        spec.problem = f"config: {e}"
    return spec


def load_config(path: Path | str | None = None) -> tuple[list[ServerSpec], Path]:
    """The servers in `path` (`--mcp FILE`: it must exist) or the default file (none when missing)."""
    explicit = path is not None
    where = Path(path).expanduser() if path is not None else config.mcp_config_path()
    if not where.is_file():
        if explicit:
            raise LocalrtError(f"MCP config file not found: {where}")
        return [], where
    try:
        raw = json.loads(where.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as e:
        raise LocalrtError(f"cannot read the MCP config {where}: {e}") from None
    except ValueError as e:
        raise LocalrtError(f"the MCP config {where} is not valid JSON: {e}") from None
    servers = raw.get("mcpServers") if isinstance(raw, Mapping) else None
    if not isinstance(servers, Mapping):
        raise LocalrtError(f'the MCP config {where} has no "mcpServers" object')
    return [parse_entry(name, entry) for name, entry in servers.items()], where


def tool_name(server: str, tool: str) -> str:
    """`server__tool`, in the characters every chat template and API takes for a function name."""
    return f"{server}{SEPARATOR}{re.sub(r'[^A-Za-z0-9_-]', '_', tool)}"[:64]


def result_of(result: Any) -> ToolResult:
    """An MCP `CallToolResult` as the text the model reads: text blocks as they are, other blocks named."""
    parts: list[str] = []
    for block in getattr(result, "content", None) or []:
        kind = getattr(block, "type", "")
        if kind == "text":
            parts.append(block.text)
        elif kind in ("image", "audio"):
            size = len(getattr(block, "data", "") or "") * 3 // 4
            parts.append(f"[{kind} {getattr(block, 'mime_type', '')}, {size} bytes: not shown to the model]")
        elif kind == "resource":
            res = block.resource
            text = getattr(res, "text", None)
            parts.append(text if isinstance(text, str) else f"[resource {res.uri}: binary, not shown]")
        elif kind == "resource_link":
            parts.append(f"[resource {block.uri}]")
    structured = getattr(result, "structured_content", None)
    if not parts and structured is not None:
        parts.append(json.dumps(structured, ensure_ascii=False))
    return ToolResult(
        "\n".join(parts) or "(the tool returned nothing)", error=bool(getattr(result, "is_error", False))
    )


def describe(error: BaseException) -> str:
    """One line for what went wrong, from the first real error inside anyio's exception groups."""
    while getattr(error, "exceptions", None):  # an exception group: its first error says what happened
        error = error.exceptions[0]  # type: ignore[attr-defined]
    if isinstance(error, FileNotFoundError):
        return f"command not found: {error.filename or error}"
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0]}" if text else type(error).__name__


class McpServer:
    """One configured server: its state (`off`, `starting`, `ready`, `failed`), its tools and its calls."""

    def __init__(self, spec: ServerSpec, limits: Limits | None = None, log_dir: Path | None = None) -> None:
        self.spec = spec
        self.limits = limits or Limits()
        self.log_dir = log_dir
        self.state = "off"
        self.error = ""
        self.tools: list[Tool] = []
        self._session: Any = None
        self._task: asyncio.Task[None] | None = None
        self._ready = asyncio.Event()
        self._stop = asyncio.Event()
        self._log: TextIO | None = None
        self._http_error = ""  # the last HTTP error answer (a 401 says more than the SDK's message)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def status(self) -> str:
        """One line: `ready (2 tools)`, `starting`, `failed: why`."""
        if self.state == "ready":
            return f"ready ({len(self.tools)} tool{'s' if len(self.tools) != 1 else ''})"
        return f"failed: {self.error}" if self.state == "failed" else self.state

    async def start(self, timeout: float = START_TIMEOUT) -> None:
        """Start the server and list its tools; a failure is this server's state, never raised."""
        if self.spec.problem:
            self.state, self.error = "failed", self.spec.problem
            return
        self.state, self.error = "starting", ""
        self._ready.clear()
        self._stop.clear()
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"localrt-mcp-{self.name}")
        ready = asyncio.ensure_future(self._ready.wait())
        try:
            await asyncio.wait({self._task, ready}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            ready.cancel()
        if self.state == "starting":  # neither ready nor failed in time
            await self.close()
            self.state, self.error = "failed", f"did not start within {timeout:g}s"

    async def _connect(self, stack: AsyncExitStack) -> Any:
        from mcp import ClientSession

        if self.spec.command:
            from mcp.client.stdio import StdioServerParameters
            from mcp.client.stdio import stdio_client

            params = StdioServerParameters(
                command=self.spec.command, args=self.spec.args, env=self.spec.env or None, cwd=self.spec.cwd
            )
            read, write = await stack.enter_async_context(stdio_client(params, errlog=self._errlog()))
        else:
            import httpx2  # the SDK's HTTP client: headers go on it (the SDK's documented way)
            from mcp.client.streamable_http import streamable_http_client

            async def seen(response: Any) -> None:
                if response.status_code >= 400:
                    self._http_error = f"HTTP {response.status_code} {response.reason_phrase}".strip()

            http = await stack.enter_async_context(
                httpx2.AsyncClient(
                    headers=self.spec.headers,
                    timeout=httpx2.Timeout(30.0, read=300.0),
                    event_hooks={"response": [seen]},
                )
            )
            assert self.spec.url is not None
            read, write = await stack.enter_async_context(
                streamable_http_client(self.spec.url, http_client=http, max_sse_event_size=SSE_EVENT_BYTES)
            )
        return await stack.enter_async_context(ClientSession(read, write))

    def _errlog(self) -> TextIO:
        """Where a stdio server's stderr goes: a log file per server, read back for the failure line."""
        if self.log_dir is None:
            self._log = open(os.devnull, "w")  # noqa: SIM115 (closed in _run's finally)
        else:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            self._log = open(self.log_dir / f"{self.name}.log", "a", encoding="utf-8")  # noqa: SIM115
        return self._log

    def _last_log_line(self) -> str:
        if self.log_dir is None:
            return ""
        with contextlib.suppress(OSError):
            lines = (self.log_dir / f"{self.name}.log").read_text(errors="replace").strip().splitlines()
            return lines[-1].strip()[:200] if lines else ""
        return ""

    async def _list_tools(self, session: Any) -> list[Tool]:
        from mcp.types import PaginatedRequestParams

        tools, cursor = [], None
        for _ in range(MAX_TOOL_PAGES):
            page = await session.list_tools(params=PaginatedRequestParams(cursor=cursor) if cursor else None)
            tools.extend(self._tool(t) for t in page.tools)
            cursor = page.next_cursor
            if not cursor:
                break
        return tools

    def _tool(self, listed: Any) -> Tool:
        real = listed.name

        async def prepare(arguments: Mapping[str, Any]) -> Prepared:
            args = dict(arguments)

            async def run() -> ToolResult:
                return await self.call(real, args)

            shown = json.dumps(args, ensure_ascii=False)
            return Prepared(
                f"{self.name} {real} {shown if len(shown) <= 80 else shown[:77] + '...'}",
                run,
                detail=json.dumps(args, ensure_ascii=False, indent=2),
                detail_kind="arguments",
            )

        annotations = getattr(listed, "annotations", None)
        return Tool(
            tool_name(self.name, real),
            listed.description or f"{real} from the MCP server {self.name}",
            dict(listed.input_schema or {"type": "object", "properties": {}}),
            "run",
            prepare,
            source=self.name,
            annotations=annotations.model_dump(exclude_none=True) if annotations is not None else {},
        )

    async def _run(self) -> None:
        try:
            async with AsyncExitStack() as stack:
                session = await self._connect(stack)
                await session.initialize()
                self.tools = await self._list_tools(session)
                self._session, self.state = session, "ready"
                self._ready.set()
                await self._stop.wait()
        except BaseException as e:  # anyio cancels the transport's scope when the server goes away
            if not self._stop.is_set():
                line = self._http_error or self._last_log_line()
                self.state, self.error = "failed", describe(e) + (f" ({line})" if line else "")
            if isinstance(e, (KeyboardInterrupt, SystemExit)):
                raise
        finally:
            self._session = None
            if self.state == "ready":
                self.state = "off"
            if self._log is not None:
                self._log.close()
                self._log = None

    async def call(self, tool: str, arguments: dict[str, Any]) -> ToolResult:
        """Call one of this server's tools; every failure (the server gone, a timeout) is an error result."""
        session, task = self._session, self._task
        if self.state != "ready" or session is None or task is None:
            return ToolResult.failed(f"the MCP server {self.name!r} is not running ({self.status})")
        timeout = self.limits.mcp_timeout
        call = asyncio.ensure_future(session.call_tool(tool, arguments, read_timeout_seconds=timeout))
        try:
            await asyncio.wait({call, task}, timeout=timeout + 5, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not call.done():
                call.cancel()
        if not call.done():
            if task.done():
                return ToolResult.failed(
                    f"the MCP server {self.name!r} stopped during the call: {self.status}"
                )
            return ToolResult.failed(f"the MCP server {self.name!r} did not answer within {timeout:g}s")
        try:
            return result_of(call.result())
        except asyncio.CancelledError:
            return self._gone("the call was cut off")
        except Exception as e:
            if task.done() or not await self._answers(session):
                return self._gone(describe(e))
            return ToolResult.failed(f"the MCP server {self.name!r} failed the call: {describe(e)}")

    async def _answers(self, session: Any) -> bool:
        """Whether the server still answers a ping (after a call failed: a dead one is marked so)."""
        try:
            await asyncio.wait_for(session.send_ping(), PING_TIMEOUT)
        except Exception:
            return False
        return True

    def _gone(self, why: str) -> ToolResult:
        """The server died during a call: it is `failed` from now on, and its connection is let go."""
        self.state, self.error = "failed", f"stopped during a call ({why})"
        self._stop.set()
        return ToolResult.failed(f"the MCP server {self.name!r} stopped during the call: {why}")

    async def close(self) -> None:
        self._stop.set()
        task = self._task
        if task is not None and not task.done():
            try:
                await asyncio.wait_for(asyncio.shield(task), CLOSE_TIMEOUT)
            except (asyncio.TimeoutError, asyncio.CancelledError):
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
        if self.state in ("ready", "starting"):
            self.state = "off"


class McpHub:
    """Every configured server, started together; `tools()` are the ready servers' tools."""

    def __init__(
        self, specs: list[ServerSpec], limits: Limits | None = None, log_dir: Path | None = None
    ) -> None:
        self.servers = [McpServer(spec, limits, log_dir) for spec in specs]

    @classmethod
    def from_config(cls, path: Path | str | None = None, limits: Limits | None = None) -> McpHub:
        specs, _ = load_config(path)
        return cls(specs, limits, config.data_dir() / "mcp-logs")

    async def start(self, timeout: float = START_TIMEOUT) -> None:
        await asyncio.gather(*(server.start(timeout) for server in self.servers))

    def tools(self) -> list[Tool]:
        return [tool for server in self.servers if server.state == "ready" for tool in server.tools]

    def failures(self) -> list[str]:
        """One notice per server that did not start: `MCP server time: failed: why`."""
        return [f"MCP server {s.name}: {s.status}" for s in self.servers if s.state == "failed"]

    async def close(self) -> None:
        await asyncio.gather(*(server.close() for server in self.servers), return_exceptions=True)
