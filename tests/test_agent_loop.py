"""The whole tool loop with a real model through a real `localrt serve` (SmolLM2 under the Qwen2.5 template,
its tool calls parsed by the runtime from `<tool_call>` blocks): a file edited after approval, with the
diff shown first; the same call denied, the file untouched and the denial in the model's next request;
a shell command that times out cleanly; the step limit; a model without tools.

The first call of each answer is made exact by a grammar (`ForcedFirstCall`: the model is too small to
choose arguments); the request after the tool result is the model's own.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from localrt.agent.approvals import DENIED
from localrt.agent.approvals import ApprovalRequest
from localrt.agent.approvals import Approvals
from localrt.agent.approvals import Decision
from localrt.agent.loop import NOT_RUN
from localrt.agent.loop import AgentLoop
from localrt.agent.loop import Finished
from localrt.agent.loop import StepDone
from localrt.agent.loop import ToolFinished
from localrt.agent.loop import ToolStarted
from localrt.agent.loop import tools_refused
from localrt.agent.toolbox import Toolbox
from localrt.agent.toolbox import builtin_tools
from localrt.agent.tools import Limits
from localrt.client import ServerClient
from localrt.errors import LocalrtError
from localrt.store.importer import import_gguf
from localrt.store.store import Store
from tests.conftest import async_test
from tests.servers.serve import LocalrtServer
from tests.tool_loop_fixtures import MODEL
from tests.tool_loop_fixtures import ForcedFirstCall
from tests.tool_loop_fixtures import serve_tool_model

EDIT = ("edit_file", {"path": "notes.txt", "old_string": "apples", "new_string": "cherries"})


@pytest.fixture(scope="module")
def tool_server(smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalrtServer]:
    yield from serve_tool_model(smollm2_gguf, tmp_path_factory)


@pytest.fixture
def work(tmp_path: Path) -> Path:
    root = tmp_path / "work"
    root.mkdir()
    (root / "notes.txt").write_text("apples\npears\n")
    return root


def only(root: Path, *names: str, **limits: Any) -> Toolbox:
    """The built-in tools in `root` with all but `names` switched off (a short prompt for a small model)."""
    box = Toolbox(builtin_tools(root, Limits(**limits)))
    for tool in box.all():
        box.set_enabled(tool.name, tool.name in names)
    return box


async def answer(loop: AgentLoop, question: str) -> tuple[list[dict[str, Any]], list[Any]]:
    messages: list[dict[str, Any]] = [{"role": "user", "content": question}]
    events = [event async for event in loop.run(messages)]
    return messages, events


@async_test
async def test_an_edit_runs_after_approval_and_the_diff_is_shown_first(
    tool_server: LocalrtServer, work: Path
) -> None:
    client = ForcedFirstCall(tool_server.url, [EDIT])
    asked: list[ApprovalRequest] = []

    async def approve(request: ApprovalRequest) -> Decision:
        asked.append(request)
        assert (work / "notes.txt").read_text() == "apples\npears\n"  # asked before anything changed
        return Decision.ONCE

    loop = AgentLoop(client, MODEL, only(work, "edit_file"), Approvals(ask=approve), max_steps=2)
    messages, events = await answer(loop, "In notes.txt, replace apples with cherries.")
    await client.close()
    [request] = asked
    assert request.tool == "edit_file"
    assert request.detail_kind == "diff"
    assert "-apples\n+cherries\n" in request.detail
    assert (work / "notes.txt").read_text() == "cherries\npears\n"
    [finished] = [e for e in events if isinstance(e, ToolFinished)]
    assert finished.status == "ok"
    assert finished.result.content == "edited notes.txt (2 lines)"
    # the model's second request carried the result, after its own call
    second = client.requests[1]["messages"]
    assert [m["role"] for m in second] == ["user", "assistant", "tool"]
    assert second[1]["tool_calls"][0]["function"]["name"] == "edit_file"
    assert second[2]["content"] == "edited notes.txt (2 lines)"
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "assistant"]
    steps = [e for e in events if isinstance(e, StepDone)]
    assert len(steps) == len(client.requests)
    assert steps[0].final.done
    assert isinstance(events[-1], Finished)


@async_test
async def test_a_denied_edit_leaves_the_file_and_the_model_is_told(
    tool_server: LocalrtServer, work: Path
) -> None:
    client = ForcedFirstCall(tool_server.url, [EDIT])

    async def deny(request: ApprovalRequest) -> Decision:
        return Decision.DENY

    loop = AgentLoop(client, MODEL, only(work, "edit_file"), Approvals(ask=deny), max_steps=2)
    _, events = await answer(loop, "In notes.txt, replace apples with cherries.")
    await client.close()
    assert (work / "notes.txt").read_text() == "apples\npears\n"
    [finished] = [e for e in events if isinstance(e, ToolFinished)]
    assert finished.status == "denied"
    tool_message = client.requests[1]["messages"][-1]
    assert tool_message["role"] == "tool"
    assert tool_message["content"] == DENIED
    assert tool_message["tool_call_id"] == client.requests[1]["messages"][-2]["tool_calls"][0]["id"]


@async_test
async def test_a_shell_command_times_out_cleanly(tool_server: LocalrtServer, work: Path) -> None:
    client = ForcedFirstCall(tool_server.url, [("run_shell", {"command": "sleep 600"})])
    loop = AgentLoop(
        client, MODEL, only(work, "run_shell", shell_timeout=2), Approvals(approve_all=True), max_steps=2
    )
    messages, events = await answer(loop, "Run sleep 600.")
    await client.close()
    [finished] = [e for e in events if isinstance(e, ToolFinished)]
    assert finished.status == "error"
    assert finished.result.content == "[timed out after 2s: the command and its children were stopped]"
    assert client.requests[1]["messages"][-1]["content"] == finished.result.content  # the model read it
    assert isinstance(events[-1], Finished)
    assert messages[-1]["role"] == "assistant"  # and answered after it


@async_test
async def test_the_step_limit_stops_the_loop_and_answers_every_call(
    tool_server: LocalrtServer, work: Path
) -> None:
    client = ForcedFirstCall(tool_server.url, [("read_file", {"path": "notes.txt"})])
    loop = AgentLoop(client, MODEL, only(work, "read_file"), Approvals(), max_steps=1)
    messages, events = await answer(loop, "Read notes.txt.")
    await client.close()
    assert len(client.requests) == 1
    assert not [e for e in events if isinstance(e, ToolStarted)]  # the call was not run
    assert messages[-1] == {
        "role": "tool",
        "content": NOT_RUN.format(steps=1),
        "tool_name": "read_file",
        "tool_call_id": messages[-2]["tool_calls"][0]["id"],
    }
    assert events[-1] == Finished("max_steps", 1)


@async_test
async def test_tool_choice_names_a_tool_that_is_on(tool_server: LocalrtServer, work: Path) -> None:
    client = ServerClient(tool_server.url)
    with pytest.raises(LocalrtError, match="not a tool switched on"):
        AgentLoop(client, MODEL, only(work, "read_file"), tool_choice="run_shell")
    loop = AgentLoop(client, MODEL, only(work, "read_file"), tool_choice="read_file")
    assert loop.tool_choice == {"type": "function", "function": {"name": "read_file"}}
    await client.close()


@async_test
async def test_a_model_without_tools_is_said_so(
    tool_server: LocalrtServer, smollm2_gguf: Path, tmp_path: Path
) -> None:
    with_tools = ServerClient(tool_server.url)
    assert await tools_refused(with_tools, MODEL) is None
    await with_tools.close()
    # SmolLM2's own template shows no tools
    import_gguf(Store(tmp_path / "models"), MODEL, smollm2_gguf)
    plain = LocalrtServer(tmp_path / "models", tmp_path / "serve.log")
    client = ServerClient(plain.url)
    try:
        why = await tools_refused(client, MODEL)
    finally:
        await client.close()
        plain.stop()
    assert why == f"{MODEL} does not support tools (its chat template shows none): tools are off"
