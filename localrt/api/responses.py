"""OpenAI's Responses API (`POST /v1/responses`) as a translation onto the runtime's chat.

Input items become the runtime's messages, the answer's blocks become output items (reasoning,
message, function_call); streaming sends the typed events in the order OpenAI's SDK accumulates them.
Responses are kept in memory for the server's lifetime (bounded, least recently used dropped first),
so `previous_response_id` continues a conversation and `GET /v1/responses/{id}` reads one back
(`"store": false` keeps none).
"""

from __future__ import annotations

import copy
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass
from dataclasses import field
from typing import Annotated
from typing import Any
from typing import Literal

from fastapi import APIRouter
from fastapi import Path
from fastapi import Query
from fastapi import Request
from fastapi.responses import JSONResponse
from fastapi.responses import Response
from pydantic import Field
from starlette.exceptions import HTTPException

from localrt import config
from localrt import wire
from localrt.api import schemas
from localrt.api.ollama import observe
from localrt.api.ollama import runtime_of
from localrt.api.sealing import Sealer
from localrt.api.sealing import sealer_of
from localrt.api.security import error_body
from localrt.api.streaming import typed_sse_response
from localrt.api.streaming import unless_client_leaves
from localrt.api.streaming import with_warnings
from localrt.api.translate import Assembler
from localrt.api.translate import Block
from localrt.api.translate import BlockEvent
from localrt.api.translate import ChatCall
from localrt.api.translate import ParamError
from localrt.api.translate import ToolChoice
from localrt.api.translate import assistant_message
from localrt.api.translate import effort_setting
from localrt.api.translate import function_tool
from localrt.api.translate import image_source
from localrt.api.translate import new_id
from localrt.api.translate import parse_arguments
from localrt.api.translate import resolve_images
from localrt.api.translate import sampling_options
from localrt.api.translate import tool_message
from localrt.errors import LocalrtError
from localrt.errors import ModelNotFound

router = APIRouter(prefix="/v1")


# ---- the request (documented; the route checks meaning itself) -----------------------------------
class ResponsesText(wire.Wire):
    format: dict[str, Any] | None = None


class ResponsesReasoning(wire.Wire):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    summary: str | None = None


class ResponsesRequest(wire.Wire):
    model: wire.ModelName
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: ResponsesText | None = None
    reasoning: ResponsesReasoning | None = None
    max_output_tokens: Annotated[wire.Int | None, Field(ge=1, le=10 * wire.MAX_NUM_CTX)] = None
    temperature: wire.option_field("temperature") = None
    top_p: wire.option_field("top_p") = None
    previous_response_id: str | None = None
    store: bool | None = None
    stream: bool | None = None
    metadata: dict[str, str] | None = None
    include: list[str] | None = None  # "reasoning.encrypted_content": reasoning sealed for a stateless client
    # accepted, not applied: the prefix cache reuses any repeated prompt; client_metadata is the client's
    # own. truncation "auto" drops the oldest turns of a prompt too long (the default), "disabled" refuses it
    prompt_cache_key: str | None = None
    truncation: Literal["auto", "disabled"] | None = None
    client_metadata: dict[str, Any] | None = None
    options: wire.OptionsField = None
    keep_alive: wire.KeepAlive = None


class InputTokensRequest(wire.Wire):
    """`POST /v1/responses/input_tokens`: the fields of a response request that shape its prompt."""

    model: wire.ModelName
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: ResponsesText | None = None
    reasoning: ResponsesReasoning | None = None
    previous_response_id: str | None = None
    options: wire.OptionsField = None


class ResponseObject(wire.Out):
    id: str
    object: Literal["response"]
    created_at: int
    status: str
    model: str
    output: list[dict[str, Any]]


# ---- memory of past responses ---------------------------------------------------------------------
@dataclass
class Stored:
    response: dict[str, Any]
    history: list[dict[str, Any]]  # the conversation up to and including this answer, without instructions
    input_items: list[dict[str, Any]] = field(default_factory=list)  # the request's input, as items with ids


class ResponseStore:
    """Past responses by id, least recently used dropped past `limit` (LOCALRT_MAX_RESPONSES)."""

    def __init__(self, limit: int | None = None) -> None:
        self.limit = max(1, limit if limit is not None else config.env_int("LOCALRT_MAX_RESPONSES"))
        self._items: OrderedDict[str, Stored] = OrderedDict()

    def put(self, response_id: str, item: Stored) -> None:
        self._items[response_id] = item
        self._items.move_to_end(response_id)
        while len(self._items) > self.limit:
            self._items.popitem(last=False)

    def delete(self, response_id: str) -> bool:
        return self._items.pop(response_id, None) is not None

    def get(self, response_id: str) -> Stored | None:
        item = self._items.get(response_id)
        if item is not None:
            self._items.move_to_end(response_id)
        return item

    def __len__(self) -> int:
        return len(self._items)


def responses_of(request: Request) -> ResponseStore:
    return request.app.state.responses


# ---- input items -> runtime messages --------------------------------------------------------------
ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}


def part_text(part: Any) -> str:
    if isinstance(part, str):
        return part
    if not isinstance(part, dict):
        raise ParamError("input", "content parts must be objects")
    kind = part.get("type")
    if kind in ("input_text", "output_text", "text", "summary_text", "reasoning_text"):
        return str(part.get("text") or "")
    if kind == "refusal":
        return str(part.get("refusal") or "")
    if kind == "input_image":
        raise ParamError("input", "input_image parts go in user, system or developer messages")
    if kind == "input_file":
        raise ParamError("input", "file inputs are not supported")
    raise ParamError("input", f"unknown content part type {kind!r}")


def image_of(part: dict[str, Any]) -> str:
    if part.get("image_url") is None:
        raise ParamError("input", "input_image needs image_url (a data URL or URL); file_id is not supported")
    return image_source(part["image_url"], "input")


def content_text(content: Any) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        return "".join(part_text(p) for p in content)
    raise ParamError("input", "content must be a string or a list of parts")


class HistoryBuilder:
    """Input items in order -> messages; calls join the assistant turn before them, outputs become tool turns."""

    def __init__(self, messages: list[dict[str, Any]], sealer: Sealer | None = None) -> None:
        self.messages = messages
        self.sealer = sealer
        self.warnings: list[str] = []
        self.pending_thinking = ""
        self.call_names: dict[str, str] = {
            c["id"]: c["function"]["name"] for m in messages for c in m.get("tool_calls") or [] if c.get("id")
        }

    def add(self, item: Any) -> None:
        if not isinstance(item, dict):
            raise ParamError("input", "every input item must be an object")
        kind = item.get("type", "message" if "role" in item else None)
        if kind is None:
            raise ParamError("input", "input item missing required 'type' field")
        if not isinstance(kind, str):
            raise ParamError("input", "an input item's type must be a string")
        handler = {
            "message": self._message,
            "function_call": self._call,
            "function_call_output": self._output,
            "reasoning": self._reasoning,
        }.get(kind)
        if handler is None:
            raise ParamError("input", f"unknown input item type {kind!r}")
        handler(item)

    def _assistant(self) -> dict[str, Any]:
        last = self.messages[-1] if self.messages else None
        if last is None or last.get("role") != "assistant":
            last = assistant_message(thinking=self.pending_thinking)
            self.pending_thinking = ""
            self.messages.append(last)
        return last

    def _message(self, item: dict[str, Any]) -> None:
        role = ROLES.get(item["role"]) if isinstance(item.get("role"), str) else None
        if role is None:
            raise ParamError("input", f"invalid message role {item.get('role')!r}")
        content = item.get("content")
        parts = content if isinstance(content, list) else []
        images = [image_of(p) for p in parts if isinstance(p, dict) and p.get("type") == "input_image"]
        text = content_text(
            [p for p in parts if not (isinstance(p, dict) and p.get("type") == "input_image")]
            if parts
            else content
        )
        if role == "assistant":
            if images:
                raise ParamError("input", "assistant messages cannot carry images")
            self._assistant()["content"] += text
        else:
            message: dict[str, Any] = {"role": role, "content": text}
            if images:
                message["images"] = images
            self.messages.append(message)

    def _call(self, item: dict[str, Any]) -> None:
        call_id, name = item.get("call_id"), item.get("name")
        if not isinstance(call_id, str) or not isinstance(name, str) or not name:
            raise ParamError("input", "a function_call item needs call_id and name")
        if isinstance(item.get("namespace"), str) and item["namespace"]:
            name = f"{item['namespace']}.{name}"  # the member's name as the model was shown it
        args = parse_arguments(item.get("arguments", "{}"), "input")
        message = self._assistant()
        message.setdefault("tool_calls", []).append(
            {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}
        )
        self.call_names[call_id] = name

    def _output(self, item: dict[str, Any]) -> None:
        call_id = item.get("call_id")
        if not isinstance(call_id, str):
            raise ParamError("input", "a function_call_output item needs call_id")
        output = item.get("output")
        text = output if isinstance(output, str) else content_text(output)
        self.messages.append(tool_message(call_id, self.call_names.get(call_id), text))

    def _reasoning(self, item: dict[str, Any]) -> None:
        sealed = item.get("encrypted_content")
        if sealed is not None:
            restored = self.sealer.open(sealed) if self.sealer is not None else None
            if restored is not None:
                self.pending_thinking += restored
                return
            self.warnings.append(
                "a reasoning item's encrypted_content was not sealed by this server: ignored"
            )
        parts = item.get("content") or item.get("summary") or []
        self.pending_thinking += content_text(parts) if isinstance(parts, list) else ""


def input_items(raw: Any) -> list[dict[str, Any]]:
    """A request's `input` as the items `GET /v1/responses/{id}/input_items` lists: a string is one user
    message; every item gets an id (the ones the client sent are kept)."""
    items = [{"type": "message", "role": "user", "content": raw}] if isinstance(raw, str) else raw
    out = []
    for item in items if isinstance(items, list) else []:
        entry = copy.deepcopy(item) if isinstance(item, dict) else {}
        kind = entry.setdefault("type", "message")
        if kind == "message" and isinstance(entry.get("content"), str):
            part = "output_text" if entry.get("role") == "assistant" else "input_text"
            entry["content"] = [{"type": part, "text": entry["content"]}]
        prefix = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}
        entry.setdefault("id", f"{prefix.get(kind, 'item')}_{new_id()}")
        if kind != "reasoning":
            entry.setdefault("status", "completed")
        out.append(entry)
    return out


def input_messages(f: dict[str, Any], history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return read_input(f, history).messages


def read_input(
    f: dict[str, Any], history: list[dict[str, Any]], sealer: Sealer | None = None
) -> HistoryBuilder:
    """The request's input items after `history`, read into messages (and warnings)."""
    raw = f.get("input")
    # new items may extend the history's last turn; the stored one stays
    builder = HistoryBuilder(copy.deepcopy(history), sealer)
    if isinstance(raw, str):
        builder.messages.append({"role": "user", "content": raw})
    elif isinstance(raw, list) and raw:
        for item in raw:
            builder.add(item)
    else:
        raise ParamError("input", "must be a string or a non-empty list of items")
    return builder


# ---- request -> ChatCall -----------------------------------------------------------------------------
# tools the model cannot be offered: OpenAI runs them on its side, localrt has nothing to run them with
HOSTED_TOOLS = "web_search, file_search, code_interpreter, computer_use, image_generation, mcp, local_shell"


@dataclass
class ToolSet:
    """A request's tools as the runtime takes them: functions, namespace members as `ns.member`."""

    tools: list[dict[str, Any]] | None = None
    members: dict[str, tuple[str, str]] = field(default_factory=dict)  # "ns.member" -> (ns, member)
    hosted: list[str] = field(default_factory=list)  # the types of tools left out

    @property
    def warnings(self) -> list[str]:
        if not self.hosted:
            return []
        return [
            f"hosted tools are not offered to the model (localrt cannot run them): {', '.join(self.hosted)}"
        ]


def tools_from(raw: Any) -> ToolSet:
    out = ToolSet()
    if raw is None:
        return out
    if not isinstance(raw, list):
        raise ParamError("tools", "must be a list")
    tools = []
    for t in raw:
        kind = t.get("type") if isinstance(t, dict) else None
        if not isinstance(kind, str):
            raise ParamError("tools", "every tool must be an object with a type")
        if kind == "function":
            tools.append(function_tool(t.get("name"), t.get("description"), t.get("parameters"), "tools"))
        elif kind == "namespace":
            tools += namespace_members(t, out.members)
        elif kind not in out.hosted:
            out.hosted.append(kind)
    out.tools = tools or None
    return out


def namespace_members(t: dict[str, Any], members: dict[str, tuple[str, str]]) -> list[dict[str, Any]]:
    """A namespace's functions, each named `ns.member` (as Ollama shows them), its description kept."""
    ns = t.get("name")
    if not isinstance(ns, str) or not ns or not isinstance(t.get("tools"), list):
        raise ParamError("tools", "a namespace tool needs a name and a list of tools")
    out = []
    for member in t["tools"]:
        if not isinstance(member, dict) or member.get("type", "function") != "function":
            raise ParamError("tools", f"namespace {ns!r}: only function members are supported")
        full = f"{ns}.{member.get('name')}"
        members[full] = (ns, str(member.get("name")))
        out.append(function_tool(full, member.get("description"), member.get("parameters"), "tools"))
    return out


def tool_choice_from(raw: Any) -> ToolChoice:
    if raw is None:
        return "auto"
    if raw in ("auto", "none", "required"):
        return raw
    if isinstance(raw, dict) and raw.get("type") == "function" and isinstance(raw.get("name"), str):
        return raw["name"]
    if isinstance(raw, dict) and raw.get("type") not in ("function", "allowed_tools"):
        raise ParamError("tool_choice", f"the hosted tool {raw.get('type')!r} cannot run here")
    if (
        isinstance(raw, dict)
        and raw.get("type") == "allowed_tools"
        and raw.get("mode") in ("auto", "required")
    ):
        return raw["mode"]
    raise ParamError("tool_choice", "must be none, auto, required or {type: function, name}")


def format_from(text: Any) -> str | dict[str, Any] | None:
    fmt = (text or {}).get("format") if isinstance(text, dict) else None
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return "json"
    if kind == "json_schema":
        schema = fmt.get("schema")
        if not isinstance(schema, dict):
            raise ParamError("text.format", "json_schema needs a schema object")
        return schema
    raise ParamError("text.format", "type must be text, json_object or json_schema")


@dataclass
class Translated:
    """A request as the runtime's chat, with what the answer needs to name things the request's way."""

    call: ChatCall
    tools: ToolSet
    warnings: list[str]


def chat_call(f: dict[str, Any], history: list[dict[str, Any]], sealer: Sealer | None = None) -> Translated:
    model = f.get("model")
    if not isinstance(model, str) or not model:
        raise ParamError("model", "model is required")
    builder = read_input(f, history, sealer)
    messages, warnings = builder.messages, builder.warnings
    toolset = tools_from(f.get("tools"))
    instructions = f.get("instructions")
    if instructions:
        messages = [{"role": "system", "content": instructions}, *messages]
    reasoning = f.get("reasoning") or {}
    call = ChatCall(
        model=model,
        messages=messages,
        options=sampling_options(f, {"max_output_tokens": "num_predict"}),
        defaults={"temperature": 1.0, "top_p": 1.0},
        tools=toolset.tools,
        format=format_from(f.get("text")),
        think=effort_setting(reasoning.get("effort"), "reasoning.effort"),
        keep_alive=f.get("keep_alive"),
        stream=f.get("stream") is True,
        tool_choice=tool_choice_from(f.get("tool_choice")),
        parallel_tool_calls=f.get("parallel_tool_calls"),
        truncate=False if f.get("truncation") == "disabled" else None,
    )
    return Translated(call, toolset, [*warnings, *toolset.warnings])


# ---- answer -> response object ------------------------------------------------------------------------
def summary_part(text: str) -> dict[str, Any]:
    return {"type": "summary_text", "text": text}


def text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


@dataclass
class Envelope:
    """What every form of one response shares: its id, the request's echoed settings."""

    id: str
    created_at: int
    f: dict[str, Any]
    members: dict[str, tuple[str, str]] = field(default_factory=dict)  # namespace members by full name
    sealer: Sealer | None = None

    def item(self, block: Block, done: bool) -> dict[str, Any]:
        """The output item a block is, in progress (as first announced) or complete."""
        status = "completed" if done else "in_progress"
        if block.kind == "thinking":
            return self.reasoning_item(block, done, status)
        if block.kind == "text":
            content = [text_part(block.text)] if done else []
            return {
                "type": "message",
                "id": f"msg_{block.id}",
                "role": "assistant",
                "status": status,
                "content": content,
            }
        call = block.call or {}
        item = {
            "type": "function_call",
            "id": f"fc_{block.id}",
            "call_id": call.get("id"),
            "name": call.get("name"),
            "arguments": block.arguments_json if done else "",
            "status": status,
        }
        if call.get("name") in self.members:  # a namespace member: named the namespace's way again
            item["namespace"], item["name"] = self.members[call["name"]]
        return item

    def reasoning_item(self, block: Block, done: bool, status: str) -> dict[str, Any]:
        """Reasoning: its text; as `summary` too when one was asked for (the whole reasoning: nothing
        here writes shorter summaries); sealed in `encrypted_content` where `include` asks."""
        item: dict[str, Any] = {
            "type": "reasoning",
            "id": f"rs_{block.id}",
            "summary": [summary_part(block.text)] if done and self.wants_summary else [],
            "content": [{"type": "reasoning_text", "text": block.text}] if done else [],
            "status": status,
        }
        if self.sealer is not None and "reasoning.encrypted_content" in (self.f.get("include") or []):
            item["encrypted_content"] = self.sealer.seal(block.text) if done else None
        return item

    @property
    def wants_summary(self) -> bool:
        reasoning = self.f.get("reasoning")
        return isinstance(reasoning, dict) and reasoning.get("summary") not in (None, "none")

    def body(
        self, status: str, output: list[dict[str, Any]], answer: Assembler | None = None
    ) -> dict[str, Any]:
        f = self.f
        out: dict[str, Any] = {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": None,
            "incomplete_details": None,
            "model": f.get("model"),
            "instructions": f.get("instructions"),
            "output": output,
            "tools": f.get("tools") or [],
            "tool_choice": f.get("tool_choice") or "auto",
            "parallel_tool_calls": f.get("parallel_tool_calls") is not False,
            "temperature": f.get("temperature"),
            "top_p": f.get("top_p"),
            "max_output_tokens": f.get("max_output_tokens"),
            "previous_response_id": f.get("previous_response_id"),
            "reasoning": f.get("reasoning") or {"effort": None, "summary": None},
            "text": f.get("text") or {"format": {"type": "text"}},
            "store": f.get("store") is not False,
            "metadata": f.get("metadata") or {},
        }
        if answer is not None:
            out["usage"] = usage(answer)
            out["completed_at"] = int(time.time())
            if answer.ending == "length":
                out["incomplete_details"] = {"reason": "max_output_tokens"}
        return out


def final_status(answer: Assembler) -> str:
    return "incomplete" if answer.ending == "length" else "completed"


def usage(answer: Assembler) -> dict[str, Any]:
    return {
        "input_tokens": answer.input_tokens,
        "input_tokens_details": {"cached_tokens": answer.cached_tokens},
        "output_tokens": answer.output_tokens,
        "output_tokens_details": {"reasoning_tokens": answer.reasoning_tokens},
        "total_tokens": answer.input_tokens + answer.output_tokens,
    }


def finished(envelope: Envelope, answer: Assembler) -> dict[str, Any]:
    return envelope.body(final_status(answer), [envelope.item(b, True) for b in answer.blocks], answer)


def remember(
    request: Request, envelope: Envelope, call: ChatCall, answer: Assembler, response: dict[str, Any]
) -> None:
    if envelope.f.get("store") is False:
        return
    # instructions apply to one request; a continuation sends its own (as OpenAI documents)
    history = call.messages[1:] if envelope.f.get("instructions") else call.messages
    responses_of(request).put(
        envelope.id,
        Stored(response, [*history, answer.history_message()], input_items(envelope.f.get("input"))),
    )


# ---- streaming ---------------------------------------------------------------------------------------
class EventWriter:
    """Block events -> Responses stream events, numbered."""

    def __init__(self, envelope: Envelope) -> None:
        self.envelope = envelope
        self.sequence = 0

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        out = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return out

    def opening(self) -> list[dict[str, Any]]:
        response = self.envelope.body("in_progress", [])
        return [
            self.event("response.created", response=response),
            self.event("response.in_progress", response=response),
        ]

    def block(self, ev: BlockEvent) -> list[dict[str, Any]]:
        b = ev.block
        item_id = self.envelope.item(b, False)["id"]
        where = {"item_id": item_id, "output_index": b.index}
        summary = b.kind == "thinking" and self.envelope.wants_summary
        if ev.kind == "start":
            out = [
                self.event(
                    "response.output_item.added", output_index=b.index, item=self.envelope.item(b, False)
                )
            ]
            if summary:
                out.append(self.summary_event("part.added", where, part=summary_part("")))
            if b.kind == "thinking":
                part = {"type": "reasoning_text", "text": ""}
                out.append(self.event("response.content_part.added", **where, content_index=0, part=part))
            elif b.kind == "text":
                out.append(
                    self.event("response.content_part.added", **where, content_index=0, part=text_part(""))
                )
            return out
        if ev.kind == "delta":
            kind = "response.reasoning_text.delta" if b.kind == "thinking" else "response.output_text.delta"
            extra = {} if b.kind == "thinking" else {"logprobs": []}
            out = [self.event(kind, **where, content_index=0, delta=ev.text, **extra)]
            if summary:
                out.append(self.summary_event("text.delta", where, delta=ev.text))
            return out
        if summary:
            return [
                self.summary_event("text.done", where, text=b.text),
                self.summary_event("part.done", where, part=summary_part(b.text)),
                *self._stop(b, where),
            ]
        return self._stop(b, where)

    def summary_event(self, kind: str, where: dict[str, Any], **fields: Any) -> dict[str, Any]:
        """The reasoning's summary as it streams (Codex shows these), one summary part per item."""
        return self.event(f"response.reasoning_summary_{kind}", **where, summary_index=0, **fields)

    def _stop(self, b: Block, where: dict[str, Any]) -> list[dict[str, Any]]:
        out = []
        if b.kind == "thinking":
            out.append(self.event("response.reasoning_text.done", **where, content_index=0, text=b.text))
            part = {"type": "reasoning_text", "text": b.text}
            out.append(self.event("response.content_part.done", **where, content_index=0, part=part))
        elif b.kind == "text":
            out.append(
                self.event("response.output_text.done", **where, content_index=0, text=b.text, logprobs=[])
            )
            out.append(
                self.event("response.content_part.done", **where, content_index=0, part=text_part(b.text))
            )
        else:
            out.append(self.event("response.function_call_arguments.delta", **where, delta=b.arguments_json))
            out.append(
                self.event(
                    "response.function_call_arguments.done",
                    **where,
                    name=self.envelope.item(b, True)["name"],
                    arguments=b.arguments_json,
                )
            )
        out.append(
            self.event("response.output_item.done", output_index=b.index, item=self.envelope.item(b, True))
        )
        return out

    def error(self, e: LocalrtError) -> dict[str, Any]:
        body = error_body(str(e), e.status, True)["error"]
        return self.event(
            "error", code=body["type"], message=body["message"], param=getattr(e, "param", None)
        )


# ---- routes -------------------------------------------------------------------------------------------
ERRORS = schemas.error_responses(True, 404, 499, 501, 503)


def history_for(request: Request, f: dict[str, Any]) -> list[dict[str, Any]]:
    previous = f.get("previous_response_id")
    if previous is None:
        return []
    stored = responses_of(request).get(previous) if isinstance(previous, str) else None
    if stored is None:
        raise ParamError("previous_response_id", f"previous response with id {previous!r} not found")
    return stored.history


@router.post(
    "/responses",
    openapi_extra=schemas.request_body(ResponsesRequest),
    responses={200: schemas.ok(ResponseObject, schemas.SSE), **ERRORS},
)
async def create_response(request: Request) -> Response:
    f = await schemas.read_json(request, ResponsesRequest)
    sealer = sealer_of(request)
    translated = chat_call(f, history_for(request, f), sealer)
    call = translated.call
    envelope = Envelope(f"resp_{new_id()}", int(time.time()), f, translated.tools.members, sealer)
    chunks = await unless_client_leaves(request, call.start(runtime_of(request)))
    answer = Assembler()
    if not call.stream:

        async def whole() -> None:
            async for chunk in chunks:
                observe(request, chunk)
                answer.feed(chunk)

        await unless_client_leaves(request, whole())
        response = finished(envelope, answer)
        remember(request, envelope, call, answer, response)
        return with_warnings(JSONResponse(response), translated.warnings)
    writer = EventWriter(envelope)

    async def events() -> AsyncIterator[dict[str, Any]]:
        for event in writer.opening():
            yield event
        async for chunk in chunks:
            observe(request, chunk)
            for ev in answer.feed(chunk):
                for event in writer.block(ev):
                    yield event
        response = finished(envelope, answer)
        remember(request, envelope, call, answer, response)
        yield writer.event(f"response.{response['status']}", response=response)

    return with_warnings(typed_sse_response(events(), writer.error), translated.warnings)


ResponseId = Annotated[str, Path(json_schema_extra={"pattern": "^resp_[0-9a-f]{1,64}$"})]


@router.get(
    "/responses/{response_id}",
    responses={200: schemas.ok(ResponseObject), **schemas.error_responses(True, 404)},
)
async def get_response(request: Request, response_id: ResponseId) -> dict[str, Any]:
    not_the_counting_route(response_id)
    return stored_response(request, response_id).response


def stored_response(request: Request, response_id: str) -> Stored:
    stored = responses_of(request).get(response_id)
    if stored is None:
        raise ModelNotFound(f"response with id {response_id!r} not found")
    return stored


def not_the_counting_route(response_id: str) -> None:
    """`/v1/responses/input_tokens` is POST only; another method there is no response id but a 405."""
    if response_id == "input_tokens":
        raise HTTPException(405, "Method Not Allowed", headers={"Allow": "POST"})


class DeletedResponse(wire.Out):
    id: str
    object: Literal["response.deleted"]
    deleted: bool


@router.delete(
    "/responses/{response_id}",
    responses={200: schemas.ok(DeletedResponse), **schemas.error_responses(True, 404)},
)
async def delete_response(request: Request, response_id: ResponseId) -> dict[str, Any]:
    """Forget a stored response: it can no longer be read or continued (`previous_response_id`)."""
    not_the_counting_route(response_id)
    if not responses_of(request).delete(response_id):
        raise ModelNotFound(f"response with id {response_id!r} not found")
    return {"id": response_id, "object": "response.deleted", "deleted": True}


class InputItemList(wire.Out):
    object: Literal["list"]
    data: list[dict[str, Any]]
    first_id: str | None
    last_id: str | None
    has_more: bool


@router.get(
    "/responses/{response_id}/input_items",
    responses={200: schemas.ok(InputItemList), **schemas.error_responses(True, 404)},
)
async def list_input_items(
    request: Request,
    response_id: ResponseId,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    order: Literal["asc", "desc"] = "desc",
    after: Annotated[str | None, Query(max_length=200)] = None,
    before: Annotated[str | None, Query(max_length=200)] = None,
) -> dict[str, Any]:
    """The input items of a stored response, a page at a time (OpenAI's cursor: `after` / `before` an id;
    newest first by default, as OpenAI lists them)."""
    items = stored_response(request, response_id).input_items
    items = list(reversed(items)) if order == "desc" else list(items)
    ids = [item["id"] for item in items]
    if after is not None:
        items = items[ids.index(after) + 1 :] if after in ids else []
    if before is not None:
        cut = [item["id"] for item in items]
        items = items[: cut.index(before)] if before in cut else []
    page = items[:limit]
    return {
        "object": "list",
        "data": page,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
        "has_more": len(items) > limit,
    }


class InputTokens(wire.Out):
    object: Literal["response.input_tokens"]
    input_tokens: int


@router.post(
    "/responses/input_tokens",
    openapi_extra=schemas.request_body(InputTokensRequest),
    responses={200: schemas.ok(InputTokens), **schemas.error_responses(True, 404, 501, 503)},
)
async def count_input_tokens(request: Request) -> dict[str, Any]:
    """The prompt a `POST /v1/responses` with this body would start from, counted like Anthropic's
    count_tokens: the same messages, instructions, tools and thinking switch, through the template."""
    f = await schemas.read_json(request, InputTokensRequest)
    call = chat_call(f, history_for(request, f), sealer_of(request)).call
    await resolve_images(call.messages)
    runtime = runtime_of(request)
    think = {"think": call.think} if call.think is not None else {}
    _, tokens = await runtime.render(
        call.model, call.messages, tools=call.tools, options=call.options, **think
    )
    return {"object": "response.input_tokens", "input_tokens": len(tokens)}
