"""The file tools, rooted in the working directory: read a file, list a directory, search files (a glob
and a text), write a file and edit one (an exact string replaced), the last two shown as a diff first.

Every path goes through `Root.resolve`: relative to the root, normalised, symlinks followed, and
refused unless the real path is the root or below it. So `../x`, `/etc/passwd` and a symlink that
points out of the root are refused alike, whatever the model writes.
"""

from __future__ import annotations

import asyncio
import difflib
import os
import re
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from localrt.agent.tools import Limits
from localrt.agent.tools import Prepared
from localrt.agent.tools import Tool
from localrt.agent.tools import ToolResult
from localrt.agent.tools import int_arg
from localrt.agent.tools import schema
from localrt.agent.tools import string_arg

SKIPPED_DIRS = frozenset({".git", ".hg", ".svn", "__pycache__", "node_modules", ".venv"})
SEARCH_FILE_BYTES = 2 * 1024 * 1024  # search_files reads no more of one file
EDIT_FILE_BYTES = 10 * 1024 * 1024  # write_file and edit_file change text files up to this size
LINE_CHARS = 240  # a matching line is cut here in search results


class OutsideRoot(ValueError):
    """A path the model gave resolves outside the working directory."""


class Root:
    """The working directory the file tools are confined to."""

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path).resolve()

    def resolve(self, given: str) -> Path:
        """The real path for `given`, or OutsideRoot when it leaves the root (by `..`, by being absolute
        elsewhere, or through a symlink)."""
        if not given.strip() or "\x00" in given:
            raise ValueError("the path is empty" if not given.strip() else "the path holds a NUL byte")
        candidate = Path(given)
        if not candidate.is_absolute():
            candidate = self.path / candidate
        real = candidate.resolve()  # symlinks followed, `..` applied
        if real == self.path or self.path in real.parents:
            return real
        plain = Path(os.path.normpath(candidate))  # `..` applied, symlinks not followed
        if plain == self.path or self.path in plain.parents:
            raise OutsideRoot(
                f"{given!r} leads outside the working directory {self.path} through a symlink: refused"
            )
        raise OutsideRoot(
            f"{given!r} is outside the working directory {self.path}: file tools stay inside it"
        )

    def shown(self, path: Path) -> str:
        """`path` as the model and the user read it: relative to the root."""
        return "." if path == self.path else path.relative_to(self.path).as_posix()


def _is_binary(data: bytes) -> bool:
    return b"\x00" in data[:8192]


def _read_text(path: Path, limit: int) -> tuple[str, int]:
    """(the text of the first `limit` bytes, the file's size); ValueError for a binary file."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        data = f.read(limit)
    if _is_binary(data):
        raise ValueError(f"{path.name} is a binary file ({size} bytes): not shown")
    return data.decode("utf-8", errors="replace"), size


# ---- read_file -----------------------------------------------------------------------------------
def read_file(root: Root, limits: Limits) -> Tool:
    async def prepare(arguments: Mapping[str, Any]) -> Prepared | ToolResult:
        path = root.resolve(string_arg(arguments, "path"))
        offset = int_arg(arguments, "offset") or 1
        count = int_arg(arguments, "limit")

        async def run() -> ToolResult:
            if path.is_dir():
                return ToolResult.failed(f"{root.shown(path)} is a directory: use list_directory")
            text, size = await asyncio.to_thread(_read_text, path, limits.read_bytes)
            lines = text.splitlines(keepends=True)
            chosen = lines[max(offset, 1) - 1 :]
            if count is not None:
                chosen = chosen[: max(count, 0)]
            out = "".join(chosen)
            if size > limits.read_bytes:
                out += f"\n[... the file is {size} bytes; only the first {limits.read_bytes} were read]"
            return ToolResult(out)

        return Prepared(f"read {root.shown(path)}", run)

    return Tool(
        "read_file",
        "Read a text file in the working directory. `offset` (first line, from 1) and `limit` (lines) "
        "read a part of a long file.",
        schema(
            {
                "path": {"type": "string", "description": "the file, relative to the working directory"},
                "offset": {"type": "integer", "description": "the first line to read (1-based)"},
                "limit": {"type": "integer", "description": "how many lines to read"},
            },
            ["path"],
        ),
        "read",
        prepare,
    )


# ---- list_directory ------------------------------------------------------------------------------
def list_directory(root: Root, limits: Limits) -> Tool:
    async def prepare(arguments: Mapping[str, Any]) -> Prepared | ToolResult:
        path = root.resolve(string_arg(arguments, "path", default="."))

        def listing() -> ToolResult:
            if not path.is_dir():
                return ToolResult.failed(f"{root.shown(path)} is not a directory")
            rows = []
            for entry in sorted(os.scandir(path), key=lambda e: e.name):
                if entry.is_symlink():
                    rows.append(f"{entry.name}@")
                elif entry.is_dir():
                    rows.append(f"{entry.name}/")
                else:
                    rows.append(f"{entry.name}  ({entry.stat().st_size} bytes)")
            more = len(rows) - limits.list_entries
            out = "\n".join(rows[: limits.list_entries]) or "(empty)"
            return ToolResult(out + (f"\n[... {more} more entries]" if more > 0 else ""))

        async def run() -> ToolResult:
            return await asyncio.to_thread(listing)

        return Prepared(f"list {root.shown(path)}", run)

    return Tool(
        "list_directory",
        "List the files and directories in a directory of the working directory (directories end in /).",
        schema(
            {"path": {"type": "string", "description": "the directory; default: the working directory"}}, []
        ),
        "read",
        prepare,
    )


# ---- search_files --------------------------------------------------------------------------------
def glob_regex(pattern: str) -> re.Pattern[str]:
    """A glob as a regex over paths relative to the search root: `*` and `?` stay within one path part,
    `**/` crosses any number of directories; a pattern without `/` matches file names anywhere."""
    if "/" not in pattern:
        pattern = "**/" + pattern
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pattern[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pattern[i] == "?":
            out, i = out + "[^/]", i + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return re.compile(out + r"\Z")


def _walk(base: Path) -> list[Path]:
    """The files under `base`, sorted, without following symlinks or entering version-control dirs."""
    found = []
    for top, dirs, files in os.walk(base, followlinks=False):
        dirs[:] = sorted(d for d in dirs if d not in SKIPPED_DIRS)
        found.extend(Path(top) / name for name in sorted(files))
    return found


def _search(root: Root, base: Path, glob: re.Pattern[str], text: re.Pattern[str] | None, cap: int) -> str:
    rows: list[str] = []
    more = 0
    for path in _walk(base):
        if path.is_symlink():
            continue
        rel = path.relative_to(base).as_posix()
        if not glob.match(rel):
            continue
        if text is None:
            if len(rows) < cap:
                rows.append(root.shown(path))
            else:
                more += 1
            continue
        try:
            content, _ = _read_text(path, SEARCH_FILE_BYTES)
        except (OSError, ValueError):
            continue
        for number, line in enumerate(content.splitlines(), 1):
            if text.search(line):
                if len(rows) < cap:
                    rows.append(f"{root.shown(path)}:{number}: {line.strip()[:LINE_CHARS]}")
                else:
                    more += 1
    if not rows:
        return "no matches"
    return "\n".join(rows) + (f"\n[... {more} more matches]" if more else "")


def search_files(root: Root, limits: Limits) -> Tool:
    async def prepare(arguments: Mapping[str, Any]) -> Prepared | ToolResult:
        pattern = string_arg(arguments, "pattern", default="*")
        base = root.resolve(string_arg(arguments, "path", default="."))
        raw = arguments.get("text")
        try:
            text = re.compile(raw) if isinstance(raw, str) and raw else None
        except re.error as e:
            raise ValueError(f"text is not a valid regular expression: {e}") from None

        async def run() -> ToolResult:
            if not base.is_dir():
                return ToolResult.failed(f"{root.shown(base)} is not a directory")
            found = await asyncio.to_thread(
                _search, root, base, glob_regex(pattern), text, limits.list_entries
            )
            return ToolResult(found)

        what = f" for /{raw}/" if text is not None else ""
        return Prepared(f"search {pattern}{what} in {root.shown(base)}", run)

    return Tool(
        "search_files",
        "Find files in the working directory by a glob (`*.py`, `src/**/*.md`) and, with `text`, the "
        "lines that match a regular expression (`path:line: text`).",
        schema(
            {
                "pattern": {"type": "string", "description": "a glob; default: every file"},
                "text": {"type": "string", "description": "a regular expression the lines must match"},
                "path": {"type": "string", "description": "the directory to search; default: all"},
            },
            [],
        ),
        "read",
        prepare,
    )


# ---- write_file and edit_file --------------------------------------------------------------------
def unified_diff(shown: str, before: str, after: str) -> str:
    lines = difflib.unified_diff(
        before.splitlines(keepends=True), after.splitlines(keepends=True), f"a/{shown}", f"b/{shown}"
    )
    return "".join(
        line if line.endswith("\n") else line + "\n\\ No newline at end of file\n" for line in lines
    )


def _current(path: Path) -> str | None:
    """The text of a file about to be changed, None when it does not exist yet."""
    if not path.exists():
        return None
    if path.is_dir():
        raise ValueError(f"{path.name} is a directory")
    if path.stat().st_size > EDIT_FILE_BYTES:
        raise ValueError(f"{path.name} is larger than {EDIT_FILE_BYTES} bytes: not changed by the tools")
    data = path.read_bytes()
    if _is_binary(data):
        raise ValueError(f"{path.name} is a binary file: not changed by the tools")
    return data.decode("utf-8")


def _write(path: Path, before: str | None, after: str) -> None:
    """Write `after` if the file still holds `before` (what the diff was made from): atomically, by a
    temporary file renamed over it, keeping its mode."""
    if _current(path) != before:
        raise ValueError(f"{path.name} changed since the diff was made: not written")
    path.parent.mkdir(parents=True, exist_ok=True)
    mode = path.stat().st_mode & 0o7777 if before is not None else None
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as f:
            f.write(after)
        if mode is not None:
            os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _change(root: Root, path: Path, before: str | None, after: str, doing: str, done: str) -> Prepared:
    shown = root.shown(path)

    async def run() -> ToolResult:
        try:
            await asyncio.to_thread(_write, path, before, after)
        except ValueError as e:
            return ToolResult.failed(str(e))
        lines = after.count("\n") + (0 if after.endswith("\n") or not after else 1)
        return ToolResult(f"{done} {shown} ({lines} lines)")

    diff = unified_diff(shown, before or "", after) or "(no change)\n"
    return Prepared(f"{doing} {shown}", run, detail=diff, detail_kind="diff")


def write_file(root: Root, limits: Limits) -> Tool:
    async def prepare(arguments: Mapping[str, Any]) -> Prepared | ToolResult:
        path = root.resolve(string_arg(arguments, "path"))
        content = string_arg(arguments, "content")
        before = await asyncio.to_thread(_current, path)
        if before is None:
            return _change(root, path, before, content, "create", "created")
        return _change(root, path, before, content, "write", "wrote")

    return Tool(
        "write_file",
        "Write a whole text file in the working directory (created, or replaced). The user sees the "
        "diff and approves it first.",
        schema(
            {
                "path": {"type": "string", "description": "the file, relative to the working directory"},
                "content": {"type": "string", "description": "the file's whole new text"},
            },
            ["path", "content"],
        ),
        "write",
        prepare,
    )


def edit_file(root: Root, limits: Limits) -> Tool:
    async def prepare(arguments: Mapping[str, Any]) -> Prepared | ToolResult:
        path = root.resolve(string_arg(arguments, "path"))
        old = string_arg(arguments, "old_string")
        new = string_arg(arguments, "new_string")
        every = arguments.get("replace_all") is True
        before = await asyncio.to_thread(_current, path)
        shown = root.shown(path)
        if before is None:
            return ToolResult.failed(f"{shown} does not exist (write_file creates a file)")
        if not old:
            return ToolResult.failed("old_string is empty: give the exact text to replace")
        if old == new:
            return ToolResult.failed("old_string and new_string are the same: nothing to change")
        count = before.count(old)
        if count == 0:
            return ToolResult.failed(f"old_string was not found in {shown}: it must match the file exactly")
        if count > 1 and not every:
            return ToolResult.failed(
                f"old_string occurs {count} times in {shown}: give more context to pick one, "
                "or set replace_all"
            )
        return _change(root, path, before, before.replace(old, new), "edit", "edited")

    return Tool(
        "edit_file",
        "Replace an exact string in a text file of the working directory with another. `old_string` "
        "must occur once (or set `replace_all`). The user sees the diff and approves it first.",
        schema(
            {
                "path": {"type": "string", "description": "the file, relative to the working directory"},
                "old_string": {"type": "string", "description": "the exact text to replace"},
                "new_string": {"type": "string", "description": "the text to put in its place"},
                "replace_all": {"type": "boolean", "description": "replace every occurrence"},
            },
            ["path", "old_string", "new_string"],
        ),
        "write",
        prepare,
    )
