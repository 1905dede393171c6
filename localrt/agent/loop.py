"""The tool loop: ask the model, run the tool calls it makes, send their results back as tool messages,
and ask again, until it answers without a call, the user stops it, or `max_steps` requests were made.

It speaks to the model only through `localrt.client.Client.chat` (Ollama's chat API: `tools`, then
`tool_calls` parsed from the model's own format by the runtime), so every backend and remote models
behave the same. `run` yields events for a front end to show (text as it streams, each call, its
result) and keeps `messages` complete: every call in it has its tool message, even when the user
stopped the loop in the middle, so the conversation can go on.

`tool_choice` applies to the first request only: a forced call answered, the model chooses again
(a choice kept for every request would call tools forever).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from collections.abc import Mapping
from dataclasses import dataclass
from dataclasses import field
from typing import TYPE_CHECKING
from typing import Any

from localrt.agent.approvals import Approvals
from localrt.agent.toolbox import Toolbox
from localrt.agent.tools import Limits
from localrt.agent.tools import Prepared
from localrt.agent.tools import ToolResult
from localrt.agent.tools import cap_text
from localrt.errors import LocalrtError

if TYPE_CHECKING:
    from localrt.client import Client

DEFAULT_MAX_STEPS = 25
STOPPED = "The user stopped this call before it finished."
NOT_RUN = "Not run: the step limit ({steps}) was reached first."
TOOL_CHOICES = ("auto", "required", "none")


# ---- what a front end sees ------------------------------------------------------------------------
@dataclass
class TextDelta:
    """A piece of the answer as it streams (its thinking apart)."""

    content: str = ""
    thinking: str = ""


@dataclass
class StepDone:
    """One request answered: the assistant message it added (with its `tool_calls`), the final chunk."""

    step: int
    message: dict[str, Any]
    final: Any  # localrt.runtime.answers.Chunk (done=True), None when the stream ended without one


@dataclass
class ToolStarted:
    """A call the model made, before approval: `summary` (one line) and `detail` (a diff, a command)."""

    call_id: str
    name: str
    arguments: dict[str, Any]
    summary: str
    detail: str = ""
    detail_kind: str = ""


@dataclass
class ToolFinished:
    """A call's end: `status` is ok, error, denied, stopped or not run; `message` the tool message added."""

    call_id: str
    name: str
    result: ToolResult
    status: str
    message: dict[str, Any] = field(default_factory=dict)


@dataclass
class Finished:
    """The loop's end: `answer` (no more calls), `max_steps`, or the last request's done_reason."""

    reason: str
    steps: int


Event = TextDelta | StepDone | ToolStarted | ToolFinished | Finished


def choice_for(value: str | Mapping[str, Any] | None, toolbox: Toolbox) -> Any:
    """`--tool-choice` as `/api/chat` takes it: auto, required, none, or a tool's name (a forced call)."""
    if value is None or isinstance(value, Mapping):
        return value
    if value in TOOL_CHOICES:
        if value == "required" and not toolbox.enabled():
            raise LocalrtError("tool_choice 'required' needs at least one tool switched on")
        return value
    if toolbox.get(value) is None:
        known = ", ".join(t.name for t in toolbox.enabled()) or "none"
        raise LocalrtError(f"tool_choice names {value!r}, which is not a tool switched on (tools: {known})")
    return {"type": "function", "function": {"name": value}}


def call_parts(call: Mapping[str, Any]) -> tuple[str, str, dict[str, Any] | str]:
    """(id, name, arguments) of a call in Ollama's shape; arguments a string when they are not JSON."""
    fn = call.get("function") if isinstance(call.get("function"), Mapping) else {}
    name = str(fn.get("name") or "")
    args = fn.get("arguments")
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            return str(call.get("id") or ""), name, args
    return str(call.get("id") or ""), name, dict(args) if isinstance(args, Mapping) else {}


async def tools_refused(client: Client, model: str) -> str | None:
    """Why `model` cannot take tools (one line), or None when it can or the server did not say."""
    try:
        details = await client.details(model)
    except LocalrtError:
        return None  # the request itself will say what is wrong with the model
    if details.architecture == "remote" or not details.capabilities or "tools" in details.capabilities:
        return None
    return f"{model} does not support tools (its chat template shows none): tools are off"


class AgentLoop:
    """One model, its tools and the session's approvals; `run(messages)` answers the last user turn."""

    def __init__(
        self,
        client: Client,
        model: str,
        toolbox: Toolbox,
        approvals: Approvals | None = None,
        *,
        max_steps: int = DEFAULT_MAX_STEPS,
        tool_choice: str | Mapping[str, Any] | None = None,
        options: Mapping[str, Any] | None = None,
        format: str | None = None,
        think: bool | str | None = None,
        keep_alive: str | float | None = None,
        limits: Limits | None = None,
    ) -> None:
        if max_steps < 1:
            raise LocalrtError(f"maxsteps must be at least 1, got {max_steps}")
        self.client, self.model, self.toolbox = client, model, toolbox
        self.approvals = approvals or Approvals()
        self.max_steps = max_steps
        self.tool_choice = choice_for(tool_choice, toolbox)
        self.options, self.format, self.think, self.keep_alive = options, format, think, keep_alive
        self.limits = limits or Limits()

    async def run(self, messages: list[dict[str, Any]]) -> AsyncIterator[Event]:
        """Answer, running tools as asked; `messages` grows by each assistant turn and tool message."""
        step = 0
        while True:
            step += 1
            message, final = {"role": "assistant", "content": ""}, None
            async for event in self._ask(messages, step, message):
                if isinstance(event, TextDelta):
                    yield event
                else:
                    final = event
            yield StepDone(step, message, final)
            calls = message.get("tool_calls") or []
            if not calls:
                reason = final.done_reason if final is not None else None
                yield Finished("answer" if reason in (None, "stop") else reason, step)
                return
            if step >= self.max_steps:
                for call in calls:
                    yield self._answer(
                        messages, call, ToolResult.failed(NOT_RUN.format(steps=step)), "not run"
                    )
                yield Finished("max_steps", step)
                return
            start = len(messages)
            try:
                for call in calls:
                    async for event in self._call(messages, call):
                        yield event
            except BaseException:  # stopped (Esc) or closed: the calls left still get their tool messages
                for call in calls[len(messages) - start :]:
                    self._answer(messages, call, ToolResult.failed(STOPPED), "stopped")
                raise

    async def _ask(
        self, messages: list[dict[str, Any]], step: int, message: dict[str, Any]
    ) -> AsyncIterator[Any]:
        """One request; the streamed text goes into `message`, which is added to `messages` even when the
        stream is stopped half way (the partial answer stays, as the chat keeps it)."""
        tools = self.toolbox.schemas() or None
        text: list[str] = []
        thoughts: list[str] = []
        calls: list[dict[str, Any]] = []
        chunks = self.client.chat(
            self.model,
            messages,
            options=self.options,
            format=self.format,
            keep_alive=self.keep_alive,
            think=self.think,
            tools=tools,
            tool_choice=self.tool_choice if step == 1 and tools else None,
        )
        try:
            async for chunk in chunks:
                if chunk.content or chunk.thinking:
                    text.append(chunk.content)
                    thoughts.append(chunk.thinking)
                    yield TextDelta(chunk.content, chunk.thinking)
                if chunk.tool_calls:
                    calls.extend(chunk.tool_calls)
                if chunk.done:
                    yield chunk
        finally:
            message["content"] = "".join(text)
            if any(thoughts):
                message["thinking"] = "".join(thoughts)
            if calls:
                message["tool_calls"] = calls
            messages.append(message)

    async def _call(self, messages: list[dict[str, Any]], call: Mapping[str, Any]) -> AsyncIterator[Event]:
        call_id, name, arguments = call_parts(call)
        tool = self.toolbox.get(name)
        shown = arguments if isinstance(arguments, dict) else {}
        prepared: Prepared | ToolResult
        if isinstance(arguments, str):
            prepared = ToolResult.failed(f"the arguments of {name} are not valid JSON: {arguments[:200]!r}")
        elif tool is None:
            off = self.toolbox.find(name) is not None
            prepared = ToolResult.failed(
                f"the tool {name!r} is switched off by the user"
                if off
                else f"there is no tool named {name!r}"
            )
        else:
            try:
                prepared = await tool.prepare(arguments)
            except (ValueError, OSError) as e:
                prepared = ToolResult.failed(f"{name}: {e}")
        if isinstance(prepared, ToolResult):
            yield ToolStarted(call_id, name, shown, f"{name} {json.dumps(shown, ensure_ascii=False)}")
            yield self._answer(messages, call, prepared, "error")
            return
        yield ToolStarted(call_id, name, shown, prepared.summary, prepared.detail, prepared.detail_kind)
        assert tool is not None
        allowed, why = await self.approvals.decide(tool, prepared)
        if not allowed:
            yield self._answer(messages, call, ToolResult.failed(why), "denied")
            return
        try:
            result = await prepared.run()
        except (ValueError, OSError, LocalrtError) as e:
            result = ToolResult.failed(f"{name}: {e}")
        except Exception as e:  # a tool's bug is the model's error result, not the end of the chat
            result = ToolResult.failed(f"{name} failed: {type(e).__name__}: {e}")
        yield self._answer(messages, call, result, "error" if result.error else "ok")

    def _answer(
        self, messages: list[dict[str, Any]], call: Mapping[str, Any], result: ToolResult, status: str
    ) -> ToolFinished:
        """Add the tool message that answers `call` (its text capped) and say so."""
        call_id, name, _ = call_parts(call)
        result = ToolResult(cap_text(result.content, self.limits.result_chars), result.error)
        message: dict[str, Any] = {"role": "tool", "content": result.content, "tool_name": name}
        if call_id:
            message["tool_call_id"] = call_id
        messages.append(message)
        return ToolFinished(call_id, name, result, status, message)
