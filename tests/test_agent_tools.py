"""The built-in tools of the tool loop, run for real in a scratch working directory: files rooted in it
(escapes by `..`, absolute paths and symlinks refused), write and edit shown as a diff and applied only
as shown, the shell's timeout and output cap, fetch_url against a real HTTP server on 127.0.0.1, and
results capped before they reach the model."""

from __future__ import annotations

import asyncio
import http.server
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from localrt.agent.approvals import NO_ONE_TO_ASK
from localrt.agent.approvals import ApprovalRequest
from localrt.agent.approvals import Approvals
from localrt.agent.approvals import Decision
from localrt.agent.toolbox import Toolbox
from localrt.agent.toolbox import builtin_tools
from localrt.agent.tools import Limits
from localrt.agent.tools import Prepared
from localrt.agent.tools import ToolResult
from localrt.agent.tools import cap_text
from localrt.agent.tools.files import OutsideRoot
from localrt.agent.tools.files import Root
from localrt.agent.tools.files import glob_regex


@pytest.fixture
def work(tmp_path: Path) -> Path:
    """A working directory with a file, a subdirectory, and a secret file beside it (outside)."""
    root = tmp_path / "work"
    (root / "src").mkdir(parents=True)
    (root / "notes.txt").write_text("apples\npears\nplums\n")
    (root / "src" / "main.py").write_text("def main():\n    return 'apple pie'\n")
    (tmp_path / "secret.txt").write_text("the secret\n")
    return root


def box(root: Path, **limits: Any) -> Toolbox:
    return Toolbox(builtin_tools(root, Limits(**limits)))


async def prepared(toolbox: Toolbox, name: str, **arguments: Any) -> Prepared | ToolResult:
    tool = toolbox.get(name)
    assert tool is not None
    return await tool.prepare(arguments)


async def run(toolbox: Toolbox, name: str, **arguments: Any) -> ToolResult:
    call = await prepared(toolbox, name, **arguments)
    return call if isinstance(call, ToolResult) else await call.run()


# ---- the root -------------------------------------------------------------------------------------
@pytest.mark.parametrize("escape", ["../secret.txt", "src/../../secret.txt", "SECRET_ABSOLUTE"])
def test_paths_outside_the_working_directory_are_refused(work: Path, escape: str) -> None:
    given = str(work.parent / "secret.txt") if escape == "SECRET_ABSOLUTE" else escape
    with pytest.raises(OutsideRoot, match="outside the working directory"):
        Root(work).resolve(given)


def test_a_symlink_that_leaves_the_root_is_refused(work: Path) -> None:
    (work / "link.txt").symlink_to(work.parent / "secret.txt")
    (work / "linkdir").symlink_to(work.parent)
    root = Root(work)
    with pytest.raises(OutsideRoot, match="through a symlink"):
        root.resolve("link.txt")
    with pytest.raises(OutsideRoot, match="through a symlink"):
        root.resolve("linkdir/secret.txt")


def test_paths_inside_the_root_resolve(work: Path) -> None:
    root = Root(work)
    (work / "inner.txt").symlink_to(work / "notes.txt")  # a symlink that stays inside is fine
    assert root.resolve("src/../notes.txt") == (work / "notes.txt").resolve()
    assert root.resolve(str(work / "src" / "main.py")) == (work / "src" / "main.py").resolve()
    assert root.resolve("inner.txt") == (work / "notes.txt").resolve()
    assert root.resolve("new/file.txt") == work.resolve() / "new" / "file.txt"


@pytest.mark.parametrize("tool", ["read_file", "write_file", "edit_file", "list_directory"])
def test_every_file_tool_refuses_an_escape(work: Path, tool: str) -> None:
    toolbox = box(work)
    args = {"path": "../secret.txt", "content": "x", "old_string": "the", "new_string": "a"}
    if tool == "list_directory":
        args["path"] = ".."
    with pytest.raises(OutsideRoot):
        asyncio.run(prepared(toolbox, tool, **args))
    assert (work.parent / "secret.txt").read_text() == "the secret\n"


# ---- reading and searching ------------------------------------------------------------------------
def test_read_list_and_search(work: Path) -> None:
    toolbox = box(work)
    assert asyncio.run(run(toolbox, "read_file", path="notes.txt")).content == "apples\npears\nplums\n"
    assert asyncio.run(run(toolbox, "read_file", path="notes.txt", offset=2, limit=1)).content == "pears\n"
    listing = asyncio.run(run(toolbox, "list_directory")).content.splitlines()
    assert listing == ["notes.txt  (19 bytes)", "src/"]
    found = asyncio.run(run(toolbox, "search_files", pattern="*.py")).content
    assert found == "src/main.py"
    lines = asyncio.run(run(toolbox, "search_files", text="appl")).content.splitlines()
    assert lines == ["notes.txt:1: apples", "src/main.py:2: return 'apple pie'"]
    with pytest.raises(ValueError, match="not a valid regular expression"):  # the loop's error result
        asyncio.run(run(toolbox, "search_files", text="("))


def test_search_does_not_follow_a_symlink_out(work: Path) -> None:
    (work / "out").symlink_to(work.parent)
    found = asyncio.run(run(box(work), "search_files", text="secret")).content
    assert found == "no matches"


@pytest.mark.parametrize(
    ("pattern", "path", "matches"),
    [
        ("*.py", "a/b/c.py", True),
        ("src/*.py", "src/a.py", True),
        ("src/*.py", "src/x/a.py", False),
        ("src/**/*.py", "src/x/y/a.py", True),
        ("src/**/*.py", "src/a.py", True),
        ("**/*.md", "README.md", True),
        ("*.txt", "notes.txt.bak", False),
    ],
)
def test_glob(pattern: str, path: str, matches: bool) -> None:
    assert bool(glob_regex(pattern).match(path)) is matches


def test_a_large_file_is_read_up_to_the_limit(work: Path) -> None:
    (work / "big.txt").write_text("y" * (10 * 1024 * 1024))
    result = asyncio.run(run(box(work), "read_file", path="big.txt"))
    assert len(result.content) < 300 * 1024
    assert "only the first 262144 were read" in result.content


# ---- writing and editing --------------------------------------------------------------------------
def test_edit_is_a_diff_first_and_applied_as_shown(work: Path) -> None:
    toolbox = box(work)
    call = asyncio.run(
        prepared(toolbox, "edit_file", path="notes.txt", old_string="pears", new_string="figs")
    )
    assert isinstance(call, Prepared)
    assert call.detail_kind == "diff"
    assert "-pears\n+figs\n" in call.detail
    assert call.detail.startswith("--- a/notes.txt\n+++ b/notes.txt\n")
    assert (work / "notes.txt").read_text() == "apples\npears\nplums\n"  # nothing changed before run()
    result = asyncio.run(call.run())
    assert not result.error
    assert (work / "notes.txt").read_text() == "apples\nfigs\nplums\n"


def test_a_file_changed_after_the_diff_is_not_written(work: Path) -> None:
    call = asyncio.run(
        prepared(box(work), "edit_file", path="notes.txt", old_string="pears", new_string="figs")
    )
    assert isinstance(call, Prepared)
    (work / "notes.txt").write_text("apples\npears\nplums\nkiwis\n")
    result = asyncio.run(call.run())
    assert result.error
    assert "changed since the diff" in result.content
    assert (work / "notes.txt").read_text() == "apples\npears\nplums\nkiwis\n"


@pytest.mark.parametrize(
    ("old", "new", "why"),
    [
        ("kiwis", "x", "not found"),
        ("p", "q", "occurs 4 times"),
        ("pears", "pears", "the same"),
        ("", "x", "empty"),
    ],
)
def test_edit_refuses_what_is_not_one_exact_match(work: Path, old: str, new: str, why: str) -> None:
    result = asyncio.run(prepared(box(work), "edit_file", path="notes.txt", old_string=old, new_string=new))
    assert isinstance(result, ToolResult)
    assert result.error
    assert why in result.content


def test_replace_all_and_write_a_new_file(work: Path) -> None:
    toolbox = box(work)
    asyncio.run(run(toolbox, "edit_file", path="notes.txt", old_string="p", new_string="P", replace_all=True))
    assert (work / "notes.txt").read_text() == "aPPles\nPears\nPlums\n"
    call = asyncio.run(prepared(toolbox, "write_file", path="docs/new.md", content="# New\n"))
    assert isinstance(call, Prepared)
    assert call.summary == "create docs/new.md"
    assert "+# New\n" in call.detail
    asyncio.run(call.run())
    assert (work / "docs" / "new.md").read_text() == "# New\n"


def test_write_keeps_the_file_mode(work: Path) -> None:
    script = work / "run.sh"
    script.write_text("echo hi\n")
    script.chmod(0o755)
    asyncio.run(run(box(work), "write_file", path="run.sh", content="echo bye\n"))
    assert script.stat().st_mode & 0o777 == 0o755


# ---- the shell --------------------------------------------------------------------------------------
def test_shell_runs_in_the_working_directory(work: Path) -> None:
    result = asyncio.run(run(box(work), "run_shell", command="pwd; ls; exit 3"))
    assert result.content.splitlines() == [str(work.resolve()), "notes.txt", "src", "[exit code 3]"]
    assert result.error


def running(pid: int) -> bool:
    """The process exists and is not a zombie (which a container's init may never reap)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_shell_timeout_stops_the_command_and_its_children(work: Path) -> None:
    # the child writes its pid, then both would sleep for 10 minutes: the timeout must end them
    command = "sleep 600 & echo $! > child.pid; sleep 600"
    result = asyncio.run(run(box(work, shell_timeout=2), "run_shell", command=command))
    assert result.error
    assert "timed out after 2s" in result.content
    child = int((work / "child.pid").read_text())
    assert not running(child)  # no sleeping child is left behind


def test_shell_asks_for_less_time_but_never_more(work: Path) -> None:
    toolbox = box(work, shell_timeout=2)
    result = asyncio.run(run(toolbox, "run_shell", command="sleep 600", timeout=3600))
    assert "timed out after 2s" in result.content
    result = asyncio.run(run(toolbox, "run_shell", command="sleep 600", timeout=1))
    assert "timed out after 1s" in result.content


def test_shell_output_is_capped_and_counted(work: Path) -> None:
    result = asyncio.run(
        run(box(work, result_chars=1000), "run_shell", command="head -c 10485760 /dev/zero | tr '\\0' x")
    )
    assert result.content.startswith("x" * 1000 + "\n[... 10484760 more bytes of output cut]")
    assert result.content.endswith("[exit code 0]")


def test_a_result_is_capped_before_the_model_gets_it() -> None:
    text = "z" * (10 * 1024 * 1024)
    capped = cap_text(text, 32_000)
    assert len(capped) < 32_200
    assert capped.endswith(
        f"[... {len(text) - 32_000} more characters cut: the result was {len(text)} characters]"
    )


# ---- fetch_url --------------------------------------------------------------------------------------
class _Pages(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        if self.path == "/page":
            body = b"<html><head><style>p{}</style><script>x=1</script></head><body><h1>Title</h1><p>Some text.</p></body></html>"
            kind = "text/html; charset=utf-8"
        elif self.path == "/big":
            body, kind = b"w" * (3 * 1024 * 1024), "text/plain"
        else:
            self.send_response(404)
            self.end_headers()
            return
        self.send_response(200)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def pages() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Pages)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_fetch_url_reads_the_text_of_a_page(work: Path, pages: str) -> None:
    result = asyncio.run(run(box(work), "fetch_url", url=f"{pages}/page"))
    assert result.content.startswith("HTTP 200 text/html")
    assert result.content.endswith("Title\nSome text.")
    assert "x=1" not in result.content
    missing = asyncio.run(run(box(work), "fetch_url", url=f"{pages}/nothing"))
    assert missing.error


def test_fetch_url_keeps_its_size_limit(work: Path, pages: str) -> None:
    result = asyncio.run(
        run(box(work, fetch_bytes=1024 * 1024, result_chars=10**8), "fetch_url", url=f"{pages}/big")
    )
    assert "(cut at 1048576)" in result.content
    assert result.content.count("w") == 1024 * 1024


@pytest.mark.parametrize("url", ["file:///etc/passwd", "ftp://example.com/x", "http:///nohost"])
def test_fetch_url_takes_only_http(work: Path, url: str) -> None:
    result = asyncio.run(prepared(box(work), "fetch_url", url=url))
    assert isinstance(result, ToolResult)
    assert result.error


# ---- approvals --------------------------------------------------------------------------------------
def test_approvals(work: Path) -> None:
    toolbox = box(work)
    asked: list[ApprovalRequest] = []
    answers = [Decision.DENY, Decision.SESSION, Decision.ONCE]

    async def ask(request: ApprovalRequest) -> Decision:
        asked.append(request)
        return answers.pop(0)

    async def decide(name: str, **args: Any) -> tuple[bool, str]:
        tool = toolbox.get(name)
        assert tool is not None
        call = await tool.prepare(args)
        assert isinstance(call, Prepared)
        return await approvals.decide(tool, call)

    approvals = Approvals(ask=ask)
    assert asyncio.run(decide("read_file", path="notes.txt")) == (True, "")  # read-only: never asked
    assert not asked
    allowed, why = asyncio.run(decide("run_shell", command="ls"))
    assert not allowed
    assert "denied" in why
    assert asked[-1].detail == "ls"
    assert asyncio.run(decide("run_shell", command="ls"))[0]  # allowed for the session
    assert asyncio.run(decide("run_shell", command="pwd"))[0]  # not asked again
    assert len(asked) == 2
    assert asyncio.run(decide("write_file", path="a.txt", content="a"))[0]  # asked once more: another tool
    assert asked[-1].detail_kind == "diff"
    nobody = Approvals(ask=None)
    approvals = nobody
    assert asyncio.run(decide("run_shell", command="ls")) == (False, NO_ONE_TO_ASK)
    approvals = Approvals(ask=None, approve_all=True)
    assert asyncio.run(decide("run_shell", command="ls")) == (True, "")
