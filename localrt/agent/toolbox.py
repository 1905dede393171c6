"""What the model is offered: the built-in tools and the MCP servers' tools, each one switchable."""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from localrt.agent.mcp import McpHub
from localrt.agent.tools import Limits
from localrt.agent.tools import Tool
from localrt.agent.tools.files import Root
from localrt.agent.tools.files import edit_file
from localrt.agent.tools.files import list_directory
from localrt.agent.tools.files import read_file
from localrt.agent.tools.files import search_files
from localrt.agent.tools.files import write_file
from localrt.agent.tools.shell import run_shell
from localrt.agent.tools.web import fetch_url
from localrt.errors import LocalrtError

BUILTIN: list[Callable[[Root, Limits], Tool]] = [
    read_file,
    list_directory,
    search_files,
    write_file,
    edit_file,
    run_shell,
]
BUILTIN_NAMES = [
    "read_file",
    "list_directory",
    "search_files",
    "write_file",
    "edit_file",
    "run_shell",
    "fetch_url",
]


def builtin_tools(root: Path | str, limits: Limits | None = None) -> list[Tool]:
    """The built-in tools, their files rooted in `root` (the working directory)."""
    limits = limits or Limits()
    where = Root(root)
    return [make(where, limits) for make in BUILTIN] + [fetch_url(limits)]


class Toolbox:
    """The built-in tools and the hub's MCP tools; `disabled` holds the names switched off."""

    def __init__(self, builtin: Iterable[Tool] = (), hub: McpHub | None = None) -> None:
        self.builtin = list(builtin)
        self.hub = hub
        self.disabled: set[str] = set()
        self.notices: list[str] = []  # what went wrong before any server started (a broken config)

    @classmethod
    def standard(
        cls, root: Path | str, *, mcp_config: Path | str | None = None, limits: Limits | None = None
    ) -> Toolbox:
        """The built-in tools in `root`, and the servers of the MCP config (not started yet). A config named
        here that is missing or broken is an error; the default one is a notice, and no servers."""
        try:
            hub = McpHub.from_config(mcp_config, limits)
        except LocalrtError as e:
            if mcp_config is not None:
                raise
            box = cls(builtin_tools(root, limits), None)
            box.notices.append(str(e))
            return box
        return cls(builtin_tools(root, limits), hub)

    def failures(self) -> list[str]:
        """The notices, and one line per MCP server that did not start."""
        return self.notices + (self.hub.failures() if self.hub is not None else [])

    def all(self) -> list[Tool]:
        return self.builtin + (self.hub.tools() if self.hub is not None else [])

    def enabled(self) -> list[Tool]:
        return [tool for tool in self.all() if tool.name not in self.disabled]

    def find(self, name: str) -> Tool | None:
        return next((tool for tool in self.all() if tool.name == name), None)

    def get(self, name: str) -> Tool | None:
        """An enabled tool by name."""
        tool = self.find(name)
        return tool if tool is not None and tool.name not in self.disabled else None

    def set_enabled(self, name: str, on: bool) -> None:
        if on:
            self.disabled.discard(name)
        else:
            self.disabled.add(name)

    def schemas(self) -> list[dict[str, Any]]:
        return [tool.schema() for tool in self.enabled()]

    async def start(self) -> None:
        if self.hub is not None:
            await self.hub.start()

    async def close(self) -> None:
        if self.hub is not None:
            await self.hub.close()
