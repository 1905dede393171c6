"""`run_shell`: one command in the working directory, with a time limit and an output cap.

The command runs in a session of its own, so a timeout (or Esc) stops it and every child it started,
not just the shell. Output (stdout and stderr together, as a terminal shows them) is read as it comes;
past the cap it is counted, not kept, so a command that prints gigabytes costs no memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
from collections.abc import Mapping
from typing import Any

from localrt.agent.tools import Limits
from localrt.agent.tools import Prepared
from localrt.agent.tools import Tool
from localrt.agent.tools import ToolResult
from localrt.agent.tools import int_arg
from localrt.agent.tools import schema
from localrt.agent.tools import string_arg
from localrt.agent.tools.files import Root

KILL_GRACE = 2.0  # seconds between SIGTERM and SIGKILL to the command's process group


def _stop_group(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


async def _stop(proc: asyncio.subprocess.Process) -> None:
    """SIGTERM to the whole group, then SIGKILL to what is left."""
    _stop_group(proc.pid, signal.SIGTERM)
    try:
        await asyncio.wait_for(proc.wait(), KILL_GRACE)
    except asyncio.TimeoutError:
        pass
    _stop_group(proc.pid, signal.SIGKILL)
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(proc.wait(), KILL_GRACE)


async def run_command(command: str, cwd: str, timeout: float, cap: int) -> ToolResult:
    """Run `command` with the user's shell rules (bash where there is one), at most `timeout` seconds."""
    shell = shutil.which("bash") or "/bin/sh"
    proc = await asyncio.create_subprocess_exec(
        shell,
        "-c",
        command,
        cwd=cwd,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        start_new_session=True,
    )
    kept = bytearray()
    dropped = 0

    async def drain() -> None:
        nonlocal dropped
        assert proc.stdout is not None
        while block := await proc.stdout.read(65536):
            room = cap - len(kept)
            kept.extend(block[: max(room, 0)])
            dropped += max(len(block) - max(room, 0), 0)
        await proc.wait()

    timed_out = False
    try:
        await asyncio.wait_for(drain(), timeout)
    except asyncio.TimeoutError:
        timed_out = True
        await _stop(proc)
    except asyncio.CancelledError:  # the user stopped the answer: stop the command too
        await _stop(proc)
        raise
    out = kept.decode("utf-8", errors="replace")
    if dropped:
        out += f"\n[... {dropped} more bytes of output cut]"
    if out and not out.endswith("\n"):
        out += "\n"
    if timed_out:
        return ToolResult.failed(
            f"{out}[timed out after {timeout:g}s: the command and its children were stopped]"
        )
    code = proc.returncode
    status = f"[exit code {code}]" if code is not None and code >= 0 else f"[killed by signal {-(code or 0)}]"
    return ToolResult(out + status, error=code != 0)


def run_shell(root: Root, limits: Limits) -> Tool:
    async def prepare(arguments: Mapping[str, Any]) -> Prepared | ToolResult:
        command = string_arg(arguments, "command")
        if not command.strip():
            return ToolResult.failed("the command is empty")
        asked = int_arg(arguments, "timeout")
        timeout = limits.shell_timeout if not asked or asked <= 0 else min(float(asked), limits.shell_timeout)

        async def run() -> ToolResult:
            return await run_command(command, str(root.path), timeout, limits.result_chars)

        return Prepared(f"$ {command}", run, detail=command, detail_kind="command")

    return Tool(
        "run_shell",
        "Run a shell command in the working directory and return its output (stdout and stderr) and "
        f"exit code. It is stopped after `timeout` seconds (at most {limits.shell_timeout:g}). The user "
        "approves each command first.",
        schema(
            {
                "command": {"type": "string", "description": "the command line, as typed in bash"},
                "timeout": {"type": "integer", "description": "seconds before it is stopped"},
            },
            ["command"],
        ),
        "run",
        prepare,
    )
