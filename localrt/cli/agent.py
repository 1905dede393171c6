"""`localrt run MODEL --tools`: the chat app's tool loop for scripts and the terminal, and `localrt mcp list`.

Each call and its result go to stderr, the answer to stdout, so `localrt run m --tools "..." > out.txt`
keeps only the answer. A call that writes or runs asks on the terminal (allow once, for this run,
deny); without a terminal it is denied and the model is told so, unless `--yes` approves every call.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path
from typing import TYPE_CHECKING
from typing import Any
from typing import TextIO

from localrt.agent.approvals import ApprovalRequest
from localrt.agent.approvals import Approvals
from localrt.agent.approvals import Decision
from localrt.agent.loop import DEFAULT_MAX_STEPS
from localrt.agent.loop import AgentLoop
from localrt.agent.loop import Finished
from localrt.agent.loop import StepDone
from localrt.agent.loop import TextDelta
from localrt.agent.loop import ToolFinished
from localrt.agent.loop import ToolStarted
from localrt.agent.loop import tools_refused
from localrt.agent.toolbox import Toolbox
from localrt.cli.common import Subparsers
from localrt.cli.common import add_tool_options
from localrt.errors import LocalrtError

if TYPE_CHECKING:
    from localrt.cli.repl import Session

SHOWN_LINES = 40  # of a tool result on stderr (the model gets the whole capped result)
SHOWN_CHARS = 4000


def add_tool_arguments(p: argparse.ArgumentParser) -> None:
    """`run --tools [--mcp FILE] [--yes] [--tool-choice auto|required|none|NAME]`."""
    p.add_argument(
        "--tools", action="store_true", help="let the model use the built-in tools and MCP servers"
    )
    add_tool_options(p)


def wants_tools(args: argparse.Namespace) -> bool:
    """--tools, or an option that only means something with tools (--mcp, --tool-choice)."""
    on = bool(
        getattr(args, "tools", False) or getattr(args, "mcp", None) or getattr(args, "tool_choice", None)
    )
    if getattr(args, "yes", False) and not on:
        raise LocalrtError("--yes approves tool calls: use it with --tools")
    return on


def clipped(text: str) -> str:
    """A tool result as stderr shows it: the first lines, and how much more there was."""
    lines = text.splitlines()
    shown = "\n".join(lines[:SHOWN_LINES])[:SHOWN_CHARS]
    rest = len(text) - len(shown)
    return shown + (f"\n… ({rest} more characters)" if rest > 0 else "")


def indent(text: str, prefix: str = "  ") -> str:
    return "".join(prefix + line + "\n" for line in text.splitlines()) if text else ""


class ToolSession:
    """The tools of one `localrt run`: the toolbox (built-in tools in the working directory, the MCP
    servers), the approvals, and the loop's events written to the terminal."""

    def __init__(self, session: Session, args: argparse.Namespace, stdin: TextIO | None = None) -> None:
        self.session = session
        self.stdin = stdin or sys.stdin
        self.toolbox = Toolbox.standard(Path.cwd(), mcp_config=getattr(args, "mcp", None))
        can_ask = self.stdin.isatty()
        self.approvals = Approvals(ask=self._ask if can_ask else None, approve_all=bool(args.yes))
        self.tool_choice: str | None = getattr(args, "tool_choice", None)
        self.max_steps = DEFAULT_MAX_STEPS
        self.off: str | None = None  # why the model gets no tools

    @property
    def err(self) -> TextIO:
        return self.session.err

    def start(self) -> None:
        """Start the MCP servers (a failure is a notice) and check that the model takes tools."""

        async def go() -> str | None:
            await self.toolbox.start()
            return await tools_refused(self.session.client, self.session.model)

        self.off, interrupted = self.session.run(go)
        if interrupted:
            raise KeyboardInterrupt
        for line in self.toolbox.failures():
            self.err.write(f"localrt: {line}\n")
        if self.off:
            self.err.write(f"localrt: {self.off}\n")
        self.err.flush()

    def close(self) -> None:
        self.session.run(self.toolbox.close)

    async def _ask(self, request: ApprovalRequest) -> Decision:
        self.err.write(f"Allow {request.tool} ({request.summary})? [y] once, [a] for this run, [n] deny: ")
        self.err.flush()
        try:
            answer = await self._readline()
        except (EOFError, OSError):
            answer = ""
        choice = answer.strip().lower()[:1]
        return {"y": Decision.ONCE, "a": Decision.SESSION}.get(choice, Decision.DENY)

    async def _readline(self) -> str:
        """A line from the terminal, waited for on the event loop: Ctrl-C (a cancel) leaves no reader
        behind to eat the next line typed."""
        loop = asyncio.get_running_loop()
        got: asyncio.Future[str] = loop.create_future()
        fd = self.stdin.fileno()

        def readable() -> None:
            if not got.done():
                got.set_result(self.stdin.readline())

        try:
            loop.add_reader(fd, readable)
        except (NotImplementedError, ValueError, OSError):
            return await asyncio.to_thread(self.stdin.readline)
        try:
            return await got
        finally:
            loop.remove_reader(fd)

    def loop(self) -> AgentLoop:
        s = self.session
        toolbox = self.toolbox if not self.off else Toolbox()
        return AgentLoop(
            s.client,
            s.model,
            toolbox,
            self.approvals,
            max_steps=self.max_steps,
            tool_choice=self.tool_choice if not self.off else None,
            options=s.options,
            format=s.format,
            think=s.think,
            keep_alive=s.keep_alive,
        )

    def ask(self, text: str, images: list[str] | None = None) -> bool:
        """One user turn through the loop; the history keeps every call and result. False when stopped."""
        s = self.session
        loop = self.loop()  # a bad --tool-choice is an error before the model is asked
        start = len(s.messages)
        s.messages.append({"role": "user", "content": text, **({"images": images} if images else {})})
        msgs = ([{"role": "system", "content": s.system}] if s.system else []) + s.messages
        head = len(msgs) - len(s.messages)
        answered: list[str] = []

        async def go() -> None:
            async for event in loop.run(msgs):
                self.show(event, answered)

        try:
            _, interrupted = s.run(go)
        finally:
            s.messages[:] = msgs[head:]  # every step, call and result, also when stopped half way
        if answered and not answered[-1].endswith("\n"):
            s.out.write("\n")
        s.out.flush()
        if len(s.messages) == start + 1 and not answered:  # nothing came back: forget the question
            s.messages.pop()
        return not interrupted

    def show(self, event: Any, answered: list[str]) -> None:
        s = self.session
        if isinstance(event, TextDelta):
            if event.content:
                s.out.write(event.content)
                s.out.flush()
                answered.append(event.content)
        elif isinstance(event, ToolStarted):
            if answered and not answered[-1].endswith("\n"):
                s.out.write("\n")
                answered.append("\n")
            self.err.write(f"→ {event.name}: {event.summary}\n")
            if event.detail_kind in ("diff", "command") and event.detail:
                self.err.write(indent(event.detail.rstrip("\n")))
        elif isinstance(event, ToolFinished):
            label = event.name if event.status == "ok" else f"{event.name} ({event.status})"
            self.err.write(f"← {label}:\n{indent(clipped(event.result.content))}")
        elif isinstance(event, StepDone):
            m = getattr(event.final, "metrics", None)
            if s.verbose and m is not None:
                from localrt.cli.repl import timing_lines

                self.err.write("\n".join(timing_lines(m)) + "\n")
        elif isinstance(event, Finished) and event.reason == "max_steps":
            self.err.write(f"localrt: stopped after {event.steps} steps (the step limit; /set maxsteps N)\n")
        elif isinstance(event, Finished) and event.reason == "length":
            # a tool call the limit cut off is dropped by the server: without this line nothing would show
            self.err.write(
                "localrt: the reply stopped at the token limit, before it was complete "
                "(/set parameter num_predict N)\n"
            )
        self.err.flush()


# ---- localrt mcp list -----------------------------------------------------------------------------
def add_mcp(sub: Subparsers) -> argparse.ArgumentParser:
    p = sub.add_parser("mcp", help="MCP servers for the tool loop")
    verbs = p.add_subparsers(dest="mcp_command", metavar="COMMAND")
    listing = verbs.add_parser("list", help="start each configured server and list its tools")
    listing.add_argument("--mcp", default=None, metavar="FILE", help="the config file to read")
    listing.set_defaults(func=cmd_mcp_list)
    p.set_defaults(func=lambda args: p.print_help() or 0)
    return p


def cmd_mcp_list(args: argparse.Namespace) -> int:
    from localrt import config
    from localrt.agent.mcp import McpHub
    from localrt.agent.mcp import load_config

    specs, where = load_config(args.mcp)
    if not specs:
        print(f"No MCP servers configured ({where}).")
        return 0
    hub = McpHub(specs, log_dir=config.data_dir() / "mcp-logs")

    lines: list[str] = []

    async def go() -> None:
        try:
            await hub.start()
            lines.extend(server_lines(hub))  # while they run: closed, a server is `off`
        finally:
            await hub.close()

    asyncio.run(go())
    print(f"MCP servers in {where}:")
    print("\n".join(lines))
    return 0


def server_lines(hub: Any) -> list[str]:
    """`name: command (stdio) - ready (2 tools)`, then each tool and the first line of its description."""
    out = []
    for server in hub.servers:
        if server.spec.problem:
            out.append(f"{server.name}: {server.status}")
            continue
        out.append(f"{server.name}: {server.spec.shown} ({server.spec.transport}) - {server.status}")
        width = max((len(t.name) for t in server.tools), default=0)
        for tool in server.tools:
            first = (tool.description or "").strip().splitlines()
            out.append(f"  {tool.name:<{width}}  {first[0] if first else ''}".rstrip())
    return out
