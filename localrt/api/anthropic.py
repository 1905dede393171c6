"""Anthropic's Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`) as a
translation onto the runtime's chat.

Content blocks become the runtime's messages (tool results turn into tool turns placed before the
user's text of that turn), the answer's blocks become thinking / text / tool_use blocks, and
streaming follows Anthropic's event sequence: message_start, ping, per block content_block_start /
content_block_delta... / content_block_stop, message_delta (stop_reason, cumulative usage),
message_stop. Errors have Anthropic's shape (`security.error_body`, chosen by path in app.py).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from collections.abc import Awaitable
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from dataclasses import field
from typing import Annotated
from typing import Any
from typing import Literal

from fastapi import APIRouter
from fastapi import Request
from fastapi.responses import JSONResponse
from fastapi.responses import Response
from pydantic import BaseModel
from pydantic import Field

from localrt import wire
from localrt.api import schemas
from localrt.api.context_edits import EditReport
from localrt.api.context_edits import apply_edits
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
from localrt.api.translate import budget_from_anthropic
from localrt.api.translate import function_tool
from localrt.api.translate import image_source
from localrt.api.translate import new_id
from localrt.api.translate import parse_arguments
from localrt.api.translate import resolve_images
from localrt.api.translate import sampling_options
from localrt.api.translate import think_from_anthropic
from localrt.api.translate import tool_message
from localrt.errors import LocalrtError
from localrt.runtime.answers import Chunk
from localrt.runtime.answers import ContextLengthError

router = APIRouter(prefix="/v1")


# ---- the request (documented; the route checks meaning itself) -----------------------------------
class AnthropicMessage(wire.Wire):
    role: Literal["user", "assistant", "system"]
    content: str | list[dict[str, Any]]


class _MessagesBase(wire.Wire):
    model: wire.ModelName
    messages: Annotated[list[AnthropicMessage], Field(min_length=1)]
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None
    context_management: dict[str, Any] | None = None


class MessagesRequest(_MessagesBase):
    max_tokens: Annotated[wire.Int, Field(ge=1, le=10 * wire.MAX_NUM_CTX)]
    stop_sequences: Annotated[list[str] | None, Field(max_length=wire.MAX_STOP_STRINGS)] = None
    temperature: wire.option_field("temperature") = None
    top_p: wire.option_field("top_p") = None
    top_k: wire.option_field("top_k") = None
    stream: bool | None = None
    metadata: dict[str, Any] | None = None
    options: wire.OptionsField = None
    keep_alive: wire.KeepAlive = None


class CountTokensRequest(_MessagesBase):
    pass


class AnthropicErrorObject(BaseModel):
    type: str
    message: str


class AnthropicError(BaseModel):
    type: Literal["error"]
    error: AnthropicErrorObject


class MessageObject(wire.Out):
    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    model: str
    content: list[dict[str, Any]]
    stop_reason: str | None
    usage: dict[str, Any]


class TokenCount(wire.Out):
    input_tokens: int


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    return {
        code: {**entry, "model": AnthropicError}
        for code, entry in schemas.error_responses(True, *statuses).items()
    }


# ---- content blocks -> runtime messages ----------------------------------------------------------
def block_text(block: Any, where: str) -> str:
    if isinstance(block, str):
        return block
    if not isinstance(block, dict):
        raise ParamError(where, "content blocks must be objects")
    kind = block.get("type")
    if kind == "text":
        text = block.get("text")
        if not isinstance(text, str):
            raise ParamError(where, "a text block needs text")
        return text
    if kind == "image":
        raise ParamError(where, "image blocks go in user turns, not here")
    raise ParamError(where, f"content block type {kind!r} is not supported here")


def image_url(block: dict[str, Any], where: str) -> str:
    source = block.get("source") if isinstance(block.get("source"), dict) else {}
    if source.get("type") == "base64":
        return image_source(
            f"data:{source.get('media_type') or 'image/png'};base64,{source.get('data')}", where
        )
    if source.get("type") == "url":
        return image_source(source.get("url"), where)
    raise ParamError(where, "an image block's source must be base64 or url")


@dataclass
class ToolResult:
    """A tool_result's content: its text, its images (a computer tool's screenshots), and the deferred
    tools it references (a tool search's answer), which become callable from then on."""

    text: str = ""
    images: list[str] = field(default_factory=list)
    references: list[str] = field(default_factory=list)


def tool_result(content: Any, where: str) -> ToolResult:
    if content is None or isinstance(content, str):
        return ToolResult(content or "")
    if not isinstance(content, list):
        raise ParamError(where, "tool_result content must be a string or a list of blocks")
    result, texts = ToolResult(), []
    for block in content:
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "image":
            result.images.append(image_url(block, where))
        elif kind == "tool_reference":
            name = block.get("tool_name")
            if not isinstance(name, str) or not name:
                raise ParamError(where, "a tool_reference block needs tool_name")
            result.references.append(name)
            # the API puts the tool's definition here; the template shows it among the tools instead
            texts.append(f"Tool {name} is now available.")
        else:
            texts.append(block_text(block, where))
    result.text = "\n".join(t for t in texts if t) if result.references else "".join(texts)
    return result


def user_turn(content: list[Any], where: str, revealed: set[str]) -> list[dict[str, Any]]:
    """One user turn: its tool results first (each a tool message, in order), then its text. The
    deferred tools its results reference are added to `revealed`."""
    results, texts, images = [], [], []
    for block in content:
        if isinstance(block, dict) and block.get("type") == "image":
            images.append(image_url(block, where))
        elif isinstance(block, dict) and block.get("type") == "tool_result":
            call_id = block.get("tool_use_id")
            if not isinstance(call_id, str) or not call_id:
                raise ParamError(where, "a tool_result block needs tool_use_id")
            result = tool_result(block.get("content"), where)
            revealed.update(result.references)
            text = f"Error: {result.text}" if block.get("is_error") is True else result.text
            message = tool_message(call_id, None, text)
            if result.images:
                message["images"] = result.images
            results.append(message)
        else:
            texts.append(block_text(block, where))
    if texts or images or not results:
        message: dict[str, Any] = {"role": "user", "content": "".join(texts)}
        if images:
            message["images"] = images
        results.append(message)
    return results


def assistant_turn(content: list[Any], where: str, sealer: Sealer | None = None) -> dict[str, Any]:
    text, thinking, calls = [], [], []
    for block in content:
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "tool_use":
            call_id, name = block.get("id"), block.get("name")
            if not isinstance(call_id, str) or not isinstance(name, str) or not name:
                raise ParamError(where, "a tool_use block needs id and name")
            calls.append(
                {"id": call_id, "name": name, "arguments": parse_arguments(block.get("input") or {}, where)}
            )
        elif kind == "thinking":
            # a thinking sent back without its text (display "omitted") is restored from its signature
            text_of = block.get("thinking") or (sealer.open(block.get("signature")) if sealer else None)
            thinking.append(str(text_of or ""))
        elif kind == "redacted_thinking":
            continue  # opaque to us: another server's encrypted reasoning
        else:
            text.append(block_text(block, where))
    return assistant_message("".join(text), "".join(thinking), calls)


def system_text(system: Any) -> str:
    if system is None or isinstance(system, str):
        return system or ""
    if isinstance(system, list):
        return "\n".join(block_text(b, "system") for b in system)
    raise ParamError("system", "must be a string or a list of text blocks")


def messages_from(
    f: dict[str, Any], sealer: Sealer | None = None, revealed: set[str] | None = None
) -> list[dict[str, Any]]:
    """The runtime's messages; the deferred tools that tool results reference are added to `revealed`."""
    revealed = set() if revealed is None else revealed
    raw = f.get("messages")
    if not isinstance(raw, list) or not raw:
        raise ParamError("messages", "messages is required")
    out: list[dict[str, Any]] = []
    system = system_text(f.get("system"))
    if system:
        out.append({"role": "system", "content": system})
    names: dict[str, str] = {}
    for i, m in enumerate(raw):
        where = f"messages.{i}"
        content = m.get("content")
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
        if not isinstance(blocks, list):
            raise ParamError(where, "content must be a string or a list of blocks")
        if m.get("role") == "assistant":
            turn = assistant_turn(blocks, where, sealer)
            names.update({c["id"]: c["function"]["name"] for c in turn.get("tool_calls") or []})
            out.append(turn)
        elif m.get("role") == "system":  # Claude Code's reminders: kept in place, as Ollama does
            out.append({"role": "system", "content": "".join(block_text(b, where) for b in blocks)})
        elif m.get("role") == "user":
            for message in user_turn(blocks, where, revealed):
                if message["role"] == "tool" and message["tool_call_id"] in names:
                    message["tool_name"] = names[message["tool_call_id"]]
                out.append(message)
        else:
            raise ParamError(where, "role must be user, assistant or system")
    return out


# ---- request -> ChatCall -----------------------------------------------------------------------------
def _editor_input(commands: list[str]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {
            "command": {"type": "string", "enum": commands, "description": "The operation to perform."},
            "path": {"type": "string", "description": "Absolute path of the file or directory."},
            "file_text": {"type": "string", "description": "The new file's content (create)."},
            "old_str": {
                "type": "string",
                "description": "The exact text to replace, unique in the file (str_replace).",
            },
            "new_str": {
                "type": "string",
                "description": "The replacement (str_replace) or text to insert (insert).",
            },
            "insert_line": {
                "type": "integer",
                "description": "Insert after this line; 0 is the top (insert).",
            },
            "view_range": {
                "type": "array",
                "items": {"type": "integer"},
                "description": "First and last line to show, 1-based; -1 is the end (view).",
            },
        },
        "required": ["command", "path"],
    }


_BASH = (
    "bash",
    "Run a command in a persistent bash shell and get its output.",
    {
        "type": "object",
        "properties": {
            "command": {"type": "string", "description": "The command to run."},
            "restart": {"type": "boolean", "description": "Restart the shell instead of running a command."},
        },
    },
)
_EDITOR_DESCRIPTION = "View, create and edit text files: view, create, str_replace and insert"
_EDITOR_WITH_UNDO = (
    "str_replace_editor",
    _EDITOR_DESCRIPTION + ", and undo_edit to revert the last edit.",
    _editor_input(["view", "create", "str_replace", "insert", "undo_edit"]),
)
_EDITOR = (
    "str_replace_based_edit_tool",
    _EDITOR_DESCRIPTION + ".",
    _editor_input(["view", "create", "str_replace", "insert"]),
)
# Anthropic's client tools: the API gives each a fixed name and input shape and the client runs it, so a
# local model is shown them as function tools of that shape. Server tools (web search, code execution)
# run on Anthropic's side and have no counterpart here.
CLIENT_TOOLS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "bash_20241022": _BASH,
    "bash_20250124": _BASH,
    "text_editor_20241022": _EDITOR_WITH_UNDO,
    "text_editor_20250124": _EDITOR_WITH_UNDO,
    "text_editor_20250429": _EDITOR,
    "text_editor_20250728": _EDITOR,
}


_COMPUTER_ACTIONS_2024 = [
    "key",
    "type",
    "mouse_move",
    "left_click",
    "left_click_drag",
    "right_click",
    "middle_click",
    "double_click",
    "screenshot",
    "cursor_position",
]
_COMPUTER_ACTIONS_2025 = [
    *_COMPUTER_ACTIONS_2024,
    "triple_click",
    "left_mouse_down",
    "left_mouse_up",
    "scroll",
    "hold_key",
    "wait",
]
# the computer-use tool's actions per version; the client takes the screenshots and sends them back
COMPUTER_TOOLS: dict[str, list[str]] = {
    "computer_20241022": _COMPUTER_ACTIONS_2024,
    "computer_20250124": _COMPUTER_ACTIONS_2025,
    "computer_20251124": [*_COMPUTER_ACTIONS_2025, "zoom"],
}
_POINT = {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 2}


def computer_tool(kind: str, t: dict[str, Any]) -> dict[str, Any]:
    """The computer-use tool as a function tool: its actions, and the screen's size in the description
    (the model's coordinates are pixels of that screen)."""
    if t.get("name") != "computer":
        raise ParamError("tools", f"a {kind} tool must be named 'computer', not {t.get('name')!r}")
    size = [t.get("display_width_px"), t.get("display_height_px")]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in size):
        raise ParamError("tools", f"a {kind} tool needs display_width_px and display_height_px (positive)")
    actions = COMPUTER_TOOLS[kind]
    if "zoom" in actions and t.get("enable_zoom") is not True:
        actions = [a for a in actions if a != "zoom"]
    properties: dict[str, Any] = {
        "action": {"type": "string", "enum": actions, "description": "The action to perform."},
        "coordinate": {**_POINT, "description": "[x, y] in screen pixels from the top left."},
        "text": {"type": "string", "description": "Text to type, or the key (combination) to press."},
    }
    if kind != "computer_20241022":
        properties |= {
            "start_coordinate": {**_POINT, "description": "[x, y] where a drag starts."},
            "scroll_direction": {"type": "string", "enum": ["up", "down", "left", "right"]},
            "scroll_amount": {"type": "integer", "description": "Scroll wheel clicks."},
            "duration": {"type": "number", "description": "Seconds to hold a key or to wait."},
        }
    if "zoom" in actions:
        properties["region"] = {
            "type": "array",
            "items": {"type": "integer"},
            "minItems": 4,
            "maxItems": 4,
            "description": "[x1, y1, x2, y2] of the screen area to zoom into.",
        }
    display = f" (X display :{t['display_number']})" if isinstance(t.get("display_number"), int) else ""
    description = (
        "Use a mouse and keyboard to interact with a computer, and take screenshots. "
        f"The screen is {size[0]}x{size[1]} pixels{display}."
    )
    schema = {"type": "object", "properties": properties, "required": ["action"]}
    return function_tool("computer", description, schema, "tools")


# Anthropic's server tools run on its side; here they are not offered to the model, and a warning names them
SERVER_TOOL_PREFIXES = ("web_search_", "web_fetch_", "code_execution_", "tool_search_tool_")


@dataclass
class Tools:
    """The tools the model is shown, and the server tools left out (by name)."""

    shown: list[dict[str, Any]] | None = None
    server: list[str] = field(default_factory=list)

    def warnings(self) -> list[str]:
        if not self.server:
            return []
        return [
            f"server tools are not offered to the model (they run on Anthropic's side): {', '.join(self.server)}"
        ]


def tools_from(raw: Any, revealed: AbstractSet[str] = frozenset()) -> Tools:
    """The tools the model is shown: those not deferred, then the deferred ones that a tool result has
    referenced, so the prompt's prefix (and its cache) stays as it was when a tool is revealed."""
    if raw is None:
        if revealed:
            raise ParamError(
                "tools", f"a tool_reference names {sorted(revealed)[0]!r}, but there are no tools"
            )
        return Tools()
    if not isinstance(raw, list):
        raise ParamError("tools", "must be a list")
    tools, deferred, server = [], {}, []
    for t in raw:
        if not isinstance(t, dict):
            raise ParamError("tools", "every tool must be an object")
        kind = t.get("type")
        if isinstance(kind, str) and kind.startswith(SERVER_TOOL_PREFIXES):
            server.append(str(t.get("name") or kind))
            continue
        if kind in CLIENT_TOOLS:
            name, description, schema = CLIENT_TOOLS[kind]
            if t.get("name") != name:
                raise ParamError("tools", f"a {kind} tool must be named {name!r}, not {t.get('name')!r}")
            tool = function_tool(name, description, schema, "tools")
        elif kind in COMPUTER_TOOLS:
            tool = computer_tool(kind, t)
        elif kind in (None, "custom"):
            tool = function_tool(t.get("name"), t.get("description"), t.get("input_schema"), "tools")
        else:
            raise ParamError(
                "tools",
                f"tool type {kind!r} is not supported (custom tools, Anthropic's client tools "
                f"{', '.join(sorted([*CLIENT_TOOLS, *COMPUTER_TOOLS]))} and its server tools are)",
            )
        if t.get("defer_loading") is True:
            deferred[tool["function"]["name"]] = tool
        else:
            tools.append(tool)
    unknown = sorted(revealed - set(deferred) - {tool["function"]["name"] for tool in tools})
    if unknown:
        raise ParamError("tools", f"a tool_reference names {unknown[0]!r}, which is not among the tools")
    tools += [tool for name, tool in deferred.items() if name in revealed]
    return Tools(tools or None, server)


def tool_choice_from(raw: Any) -> ToolChoice:
    if raw is None:
        return "auto"
    kind = raw.get("type") if isinstance(raw, dict) else None
    if kind in ("auto", "none"):
        return kind
    if kind == "any":
        return "required"
    if kind == "tool" and isinstance(raw.get("name"), str):
        return raw["name"]
    raise ParamError("tool_choice", "type must be auto, any, tool (with name) or none")


def format_from(output_config: Any) -> dict[str, Any] | None:
    fmt = output_config.get("format") if isinstance(output_config, dict) else None
    if fmt is None:
        return None
    if (
        not isinstance(fmt, dict)
        or fmt.get("type") != "json_schema"
        or not isinstance(fmt.get("schema"), dict)
    ):
        raise ParamError("output_config.format", "must be {type: json_schema, schema: {...}}")
    return fmt["schema"]


def chat_call(
    f: dict[str, Any], *, counting: bool = False, sealer: Sealer | None = None
) -> tuple[ChatCall, EditReport, list[str]]:
    """The runtime's call, the context edits applied, and what was accepted but not done (warnings)."""
    model = f.get("model")
    if not isinstance(model, str) or not model:
        raise ParamError("model", "model is required")
    max_tokens = f.get("max_tokens")
    if not counting and (not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1):
        raise ParamError("max_tokens", "max_tokens is required and must be positive")
    output_config = f.get("output_config") or {}
    choice = f.get("tool_choice") if isinstance(f.get("tool_choice"), dict) else {}
    renamed = {"max_tokens": "num_predict", "stop_sequences": "stop"}
    edited, report = apply_edits(f.get("context_management"), f.get("messages") or [])
    revealed: set[str] = set()
    messages = messages_from({**f, "messages": edited}, sealer, revealed)
    tools = tools_from(f.get("tools"), revealed)
    if choice.get("type") == "tool" and choice.get("name") in tools.server:
        raise ParamError("tool_choice", f"the server tool {choice['name']!r} cannot run here")
    call = ChatCall(
        model=model,
        messages=messages,
        options=sampling_options(f, renamed),
        defaults={"temperature": 1.0},
        tools=tools.shown,
        format=format_from(output_config),
        think=think_from_anthropic(f.get("thinking"), output_config.get("effort")),
        think_budget=budget_from_anthropic(f.get("thinking")),
        keep_alive=f.get("keep_alive"),
        stream=f.get("stream") is True,
        tool_choice=tool_choice_from(f.get("tool_choice")),
        parallel_tool_calls=False if choice.get("disable_parallel_tool_use") is True else None,
        relax_think=True,
    )
    return call, report, [*report.skipped, *tools.warnings()]


# ---- answer -> message -------------------------------------------------------------------------------
STOP_REASONS = {"tool_calls": "tool_use", "length": "max_tokens", "stop": "end_turn"}


def stop_reason(answer: Assembler) -> str:
    """Anthropic's stop_reason: `stop_sequence` when one of the request's stop sequences ended the text."""
    return "stop_sequence" if answer.stop_sequence is not None else STOP_REASONS[answer.ending]


@dataclass
class Shape:
    """How this request's answer shows thinking: its text (or none, with `display: omitted`) and a
    signature that seals it, so a client that sends the block back gets the thinking restored."""

    sealer: Sealer | None = None
    omit_thinking: bool = False

    def signature(self, block: Block) -> str:
        return self.sealer.seal(block.text) if self.sealer is not None else ""


def content_block(block: Block, done: bool, shape: Shape) -> dict[str, Any]:
    if block.kind == "thinking":
        shown = block.text if done and not shape.omit_thinking else ""
        return {"type": "thinking", "thinking": shown, "signature": shape.signature(block) if done else ""}
    if block.kind == "text":
        return {"type": "text", "text": block.text if done else ""}
    call = block.call or {}
    return {
        "type": "tool_use",
        "id": f"toolu_{block.id}",
        "name": call.get("name"),
        "input": call.get("arguments", {}) if done else {},
    }


def usage(answer: Assembler | None) -> dict[str, int]:
    """Anthropic counts input without the cache read: input_tokens + cache_read_input_tokens is the prompt."""
    if answer is None:
        return {"input_tokens": 0, "output_tokens": 0}
    return {
        "input_tokens": answer.input_tokens - answer.cached_tokens,
        "cache_read_input_tokens": answer.cached_tokens,
        "cache_creation_input_tokens": 0,
        "output_tokens": answer.output_tokens,
    }


def message(
    message_id: str, model: str, answer: Assembler | None, shape: Shape | None = None
) -> dict[str, Any]:
    shape = shape or Shape()
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [content_block(b, True, shape) for b in answer.blocks] if answer is not None else [],
        "stop_reason": stop_reason(answer) if answer is not None else None,
        "stop_sequence": answer.stop_sequence if answer is not None else None,
        "usage": usage(answer),
    }


def stream_events(ev: BlockEvent, shape: Shape | None = None) -> list[dict[str, Any]]:
    shape = shape or Shape()
    b = ev.block
    if ev.kind == "start":
        return [
            {"type": "content_block_start", "index": b.index, "content_block": content_block(b, False, shape)}
        ]
    if ev.kind == "delta" and b.kind == "thinking" and shape.omit_thinking:
        return []
    if ev.kind == "delta":
        delta = (
            {"type": "thinking_delta", "thinking": ev.text}
            if b.kind == "thinking"
            else {"type": "text_delta", "text": ev.text}
        )
        return [{"type": "content_block_delta", "index": b.index, "delta": delta}]
    out = []
    if b.kind == "thinking":  # the signature closes a thinking block, as Anthropic streams it
        delta = {"type": "signature_delta", "signature": shape.signature(b)}
        out.append({"type": "content_block_delta", "index": b.index, "delta": delta})
    if b.kind == "tool_call":  # the runtime reports a call whole: its input is one JSON delta
        delta = {"type": "input_json_delta", "partial_json": json.dumps((b.call or {}).get("arguments", {}))}
        out.append({"type": "content_block_delta", "index": b.index, "delta": delta})
    out.append({"type": "content_block_stop", "index": b.index})
    return out


def stream_error(e: LocalrtError) -> dict[str, Any]:
    return error_body(str(e), e.status, "anthropic")


# ---- routes -------------------------------------------------------------------------------------------
@router.post(
    "/messages",
    openapi_extra=schemas.request_body(MessagesRequest),
    responses={200: schemas.ok(MessageObject, schemas.SSE), **error_responses(404, 499, 501, 503)},
)
async def create_message(request: Request) -> Response:
    f = await schemas.read_json(request, MessagesRequest)
    sealer = sealer_of(request)
    call, edits, warnings = chat_call(f, sealer=sealer)
    shape = Shape(sealer, isinstance(f.get("thinking"), dict) and f["thinking"].get("display") == "omitted")
    message_id = f"msg_{new_id()}"
    chunks = await unless_client_leaves(request, too_long_worded(call.start(runtime_of(request))))
    answer = Assembler()
    managed = {"context_management": {"applied_edits": edits.applied}} if f.get("context_management") else {}
    if not call.stream:

        async def whole() -> None:
            async for chunk in chunks:
                observe(request, chunk)
                answer.feed(chunk)

        await unless_client_leaves(request, whole())
        body = {**message(message_id, call.model, answer, shape), **managed}
        return with_warnings(JSONResponse(body), warnings)

    async def events() -> AsyncIterator[dict[str, Any]]:
        yield {"type": "message_start", "message": message(message_id, call.model, None, shape)}
        yield {"type": "ping"}
        async for chunk in chunks:
            observe(request, chunk)
            for ev in answer.feed(chunk):
                for event in stream_events(ev, shape):
                    yield event
        yield {
            "type": "message_delta",
            "delta": {"stop_reason": stop_reason(answer), "stop_sequence": answer.stop_sequence},
            "usage": usage(answer),
            **managed,
        }
        yield {"type": "message_stop"}

    return with_warnings(typed_sse_response(events(), stream_error), warnings)


async def too_long_worded(start: Awaitable[AsyncIterator[Chunk]]) -> AsyncIterator[Chunk]:
    """A prompt longer than the context, worded as Anthropic's API words it (Claude Code shows that
    message and offers to compact the conversation)."""
    try:
        return await start
    except ContextLengthError as e:
        if e.tokens is None or e.limit is None:
            raise
        raise ContextLengthError(f"prompt is too long: {e.tokens} tokens > {e.limit} maximum") from None


@router.post(
    "/messages/count_tokens",
    openapi_extra=schemas.request_body(CountTokensRequest),
    responses={200: schemas.ok(TokenCount), **error_responses(404, 501, 503)},
)
async def count_tokens(request: Request) -> dict[str, int]:
    f = await schemas.read_json(request, CountTokensRequest)
    call, _, _ = chat_call(f, counting=True, sealer=sealer_of(request))
    await resolve_images(call.messages)
    runtime = runtime_of(request)
    # the prompt the answer would start from: thinking switched on or off in the template as asked
    _, tokens = await runtime.render(
        call.model, call.messages, tools=call.tools, options=call.options, think=call.think
    )
    return {"input_tokens": len(tokens)}
