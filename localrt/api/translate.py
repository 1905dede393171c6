"""The one translation layer between the agent-facing protocols and the runtime.

The OpenAI Responses route (`responses.py`) and the Anthropic Messages route (`anthropic.py`) turn
their requests into the runtime's one chat request (`ChatCall`: messages in Ollama's shape, options,
tools, format, think) and turn the runtime's chunks back through one `Assembler`, which sees an answer
as a sequence of content blocks — thinking, text, tool calls — opened, extended and closed. Each
protocol then only names those block events its own way. Thinking, tool choice and structured
output are therefore decided here once; the protocols differ only in spelling.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from collections.abc import Mapping
from dataclasses import dataclass
from dataclasses import field
from typing import Any
from typing import Literal

from localrt.errors import LocalrtError
from localrt.runtime import images as image_input
from localrt.runtime import thinking
from localrt.runtime.answers import Chunk
from localrt.runtime.answers import Metrics
from localrt.runtime.front import Runtime

Think = bool | str | None


class ParamError(LocalrtError):
    """A 400 that names the field, "<param>: <message>" (OpenAI's error `param`)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


# OpenAI's sampling fields, and ours and Ollama's options accepted at top level (an SDK's `extra_body`
# lands there)
TOP_LEVEL_OPTIONS = (
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "frequency_penalty",
    "presence_penalty",
    "min_p",
    "typical_p",
    "repeat_penalty",
    "repeat_last_n",
    "num_ctx",
    "grammar",
    "num_keep",
    "num_thread",
    "num_gpu",
    "num_batch",
    "kv_pool",
    "backend",
    "kv_cache_type",
    "speculative",
    "draft_model",
    "num_draft",
)


def new_id() -> str:
    return uuid.uuid4().hex[:24]


def image_source(url: Any, where: str) -> str:
    """An image as the request names it: a base64 data URL, or an http(s) URL (fetched only where
    LOCALRT_FETCH_IMAGES allows it); `resolve_images` turns it into bytes for the runtime."""
    if not isinstance(url, str) or not url:
        raise ParamError(where, "an image needs a data URL or a URL")
    return url


async def resolve_images(messages: list[dict[str, Any]]) -> None:
    """Each message's image sources -> bytes (the runtime's `images`), in a worker thread (a fetch blocks).
    A model without vision then answers the runtime's 400 naming it."""
    image_input.check_count(sum(len(m.get("images") or ()) for m in messages))  # before any fetch
    for i, message in enumerate(messages):
        if message.get("images"):
            message["images"] = [
                await asyncio.to_thread(image_input.image_url_bytes, url, f"messages[{i}] image")
                for url in message["images"]
            ]


# ---- request side --------------------------------------------------------------------------------
def sampling_options(f: Mapping[str, Any], renamed: Mapping[str, str]) -> dict[str, Any]:
    """Runtime options from a protocol's top-level fields, only those the client set: `renamed` maps its
    names to Ollama's (max_tokens -> num_predict), localrt's own options pass at top level or in
    `options` (an SDK's `extra_body`). A protocol's documented defaults go separately, as the runtime's
    `defaults` setting: a local model applies them, a remote model's upstream never sees them."""
    options: dict[str, Any] = {}
    for key in TOP_LEVEL_OPTIONS:
        if f.get(key) is not None:
            options[key] = f[key]
    for key, name in renamed.items():
        if f.get(key) is not None:
            options[name] = [f[key]] if name == "stop" and isinstance(f[key], str) else f[key]
    extra = f.get("options")
    if extra is not None:
        if not isinstance(extra, dict):
            raise ParamError("options", "must be an object")
        options.update(extra)
    return options


def effort_setting(effort: Any, param: str) -> Think:
    """A reasoning effort (OpenAI's `reasoning_effort` and `reasoning.effort`, Anthropic's
    `output_config.effort`) as a request's `think` value, through the runtime's one mapping
    (`thinking.think_from_effort`); a bad value is a 400 naming `param`."""
    try:
        wanted = thinking.think_from_effort(effort, param)
    except thinking.ThinkError as e:
        raise ParamError(param, str(e)) from None
    if not wanted.is_set:
        return None
    return wanted.level if wanted.enabled else False


def think_from_anthropic(thinking: Any, effort: Any) -> Think:
    """Anthropic `thinking`: enabled -> on (its `budget_tokens`: `budget_from_anthropic`), disabled -> off,
    adaptive or absent -> the model's default, unless `output_config.effort` names a level."""
    if thinking is None:
        return effort_setting(effort, "output_config.effort")
    kind = thinking.get("type") if isinstance(thinking, dict) else None
    if kind == "enabled":
        return effort_setting(effort, "output_config.effort") or True
    if kind == "disabled":
        return False
    if kind == "adaptive":
        return effort_setting(effort, "output_config.effort")
    raise ParamError("thinking", "type must be enabled, disabled or adaptive")


def budget_from_anthropic(thinking: Any) -> int | None:
    """`thinking.budget_tokens` of an enabled thinking: the most reply tokens the thinking may take
    (the runtime then closes it and the answer follows)."""
    if not isinstance(thinking, dict) or thinking.get("type") != "enabled":
        return None
    budget = thinking.get("budget_tokens")
    if budget is None:
        return None
    if not isinstance(budget, int) or isinstance(budget, bool) or budget < 1:
        raise ParamError("thinking.budget_tokens", "must be a positive integer")
    return budget


ToolChoice = Literal["auto", "none", "required"] | str  # or the name of the one tool to call


def function_tool(name: Any, description: Any, parameters: Any, where: str) -> dict[str, Any]:
    """A tool in the runtime's (Ollama / OpenAI chat) shape, checked."""
    if not isinstance(name, str) or not name:
        raise ParamError(where, "every tool needs a name")
    if parameters is None:
        parameters = {"type": "object", "properties": {}}
    if not isinstance(parameters, dict):
        raise ParamError(where, f"the parameters of tool {name!r} must be a JSON schema object")
    fn: dict[str, Any] = {"name": name, "parameters": parameters}
    if isinstance(description, str):
        fn["description"] = description
    return {"type": "function", "function": fn}


def call_schema(tools: list[dict[str, Any]]) -> dict[str, Any]:
    """The JSON schema of one call to one of `tools`: what the runtime's tool-call parser reads back."""
    shapes = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [t["function"]["name"]]},
                "arguments": t["function"]["parameters"],
            },
            "required": ["name", "arguments"],
        }
        for t in tools
    ]
    return shapes[0] if len(shapes) == 1 else {"anyOf": shapes}


def constrain_tools(
    tools: list[dict[str, Any]] | None,
    choice: ToolChoice,
    fmt: str | dict[str, Any] | None,
    param: str,
) -> tuple[list[dict[str, Any]] | None, str | dict[str, Any] | None]:
    """Apply a tool choice: `none` hides the tools, `required` or a tool's name forces one call by
    grammar (the output is the call's JSON, parsed back into a tool call by the runtime)."""
    if choice == "none" or not tools:
        if choice not in ("auto", "none") and not tools:
            raise ParamError(param, "a tool call is required but no tools were given")
        return (None if choice == "none" else tools), fmt
    if choice == "auto":
        return tools, fmt
    if fmt is not None:
        raise ParamError(param, "a forced tool call cannot be combined with a response format")
    chosen = tools if choice == "required" else [t for t in tools if t["function"]["name"] == choice]
    if not chosen:
        raise ParamError(param, f"no tool named {choice!r} was given")
    return tools, call_schema(chosen)


def openai_tool_choice(choice: ToolChoice) -> str | dict[str, Any]:
    """A tool choice in OpenAI chat's form, the one the runtime takes."""
    if choice in ("auto", "none", "required"):
        return choice
    return {"type": "function", "function": {"name": choice}}


def assistant_message(
    text: str = "", thinking: str = "", calls: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    """An assistant turn of the history in the runtime's shape (calls: {"id", "name", "arguments": dict})."""
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if thinking:
        message["thinking"] = thinking
    if calls:
        message["tool_calls"] = [
            {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
            for c in calls
        ]
    return message


def tool_message(call_id: str, name: str | None, content: str) -> dict[str, Any]:
    message = {"role": "tool", "content": content, "tool_call_id": call_id}
    if name:
        message["tool_name"] = name
    return message


def parse_arguments(raw: Any, where: str) -> dict[str, Any]:
    """Tool-call arguments sent back in a history: a JSON object, or a string holding one."""
    if isinstance(raw, str):
        try:
            raw = json.loads(raw) if raw.strip() else {}
        except ValueError:
            raise ParamError(where, "tool call arguments must be JSON") from None
    if not isinstance(raw, dict):
        raise ParamError(where, "tool call arguments must be a JSON object")
    return raw


@dataclass
class ChatCall:
    """The runtime's one chat request, as every protocol route builds it."""

    model: str
    messages: list[dict[str, Any]]
    options: dict[str, Any]  # only what the client set
    defaults: dict[str, Any] = field(default_factory=dict)  # the protocol's, for what it did not set
    tools: list[dict[str, Any]] | None = None
    format: str | dict[str, Any] | None = None
    think: Think = None
    keep_alive: Any = None
    stream: bool = False
    tool_choice: ToolChoice = "auto"
    parallel_tool_calls: bool | None = None
    # Anthropic clients (Claude Code) ask every model to think: then a model that cannot is answered
    # without thinking rather than refused, as Ollama does on /v1/messages.
    relax_think: bool = False
    think_budget: int | None = None  # reply tokens the thinking may take (Anthropic's budget_tokens)
    truncate: bool | None = (
        None  # False: a prompt longer than the context is a 400, not cut (runtime default)
    )

    def __post_init__(self) -> None:
        # checked now, so a bad choice is a 400 before the model loads
        constrain_tools(self.tools, self.tool_choice, self.format, "tool_choice")

    def _start(self, runtime: Runtime) -> AsyncIterator[Chunk]:
        kwargs: dict[str, Any] = {}
        # the runtime takes `think` and `tool_choice` itself: it knows each model family's thinking and
        # call format
        if self.think is not None:
            wanted = thinking.parse_think(self.think)
            # the budget travels in the runtime's Think
            kwargs["think"] = thinking.Think(
                wanted.enabled, wanted.level, self.think_budget, optional=self.relax_think
            )
        if self.truncate is not None:
            kwargs["truncate"] = self.truncate
        return runtime.chat(
            self.model,
            self.messages,
            options=self.options,
            defaults=self.defaults,
            tools=self.tools,
            format=self.format,
            keep_alive=self.keep_alive,
            stream=self.stream,
            tool_choice=openai_tool_choice(self.tool_choice),
            parallel_tool_calls=self.parallel_tool_calls,
            **kwargs,
        )

    async def start(self, runtime: Runtime) -> AsyncIterator[Chunk]:
        """Start the generation and wait for its first chunk, so errors (unknown model, bad option,
        prompt too long) raise here, before any byte of an answer is sent."""
        await resolve_images(self.messages)
        chunks = self._start(runtime)
        first = await anext(aiter(chunks))

        async def chain() -> AsyncIterator[Chunk]:
            yield first
            async for chunk in chunks:
                yield chunk

        return chain()


# ---- answer side ---------------------------------------------------------------------------------
BlockKind = Literal["thinking", "text", "tool_call"]


@dataclass
class Block:
    kind: BlockKind
    index: int
    id: str = field(default_factory=new_id)
    text: str = ""  # thinking or text
    call: dict[str, Any] | None = None  # tool_call: {"id": "call_...", "name", "arguments": dict}

    @property
    def arguments_json(self) -> str:
        return json.dumps((self.call or {}).get("arguments", {}), ensure_ascii=False)


@dataclass
class BlockEvent:
    """`start` opens a block, `delta` adds `text` to it, `stop` closes it (its content is complete)."""

    kind: Literal["start", "delta", "stop"]
    block: Block
    text: str = ""


class Assembler:
    """Runtime chunks in, content blocks out, in the order the model produced them: thinking, text and
    tool calls (which the runtime reports whole, in the final chunk). Streamed or not, the same blocks."""

    def __init__(self) -> None:
        self.blocks: list[Block] = []
        self.final: Chunk | None = None
        self._open: Block | None = None

    def feed(self, chunk: Chunk) -> list[BlockEvent]:
        events: list[BlockEvent] = []
        if chunk.thinking:
            events += self._append("thinking", chunk.thinking)
        if chunk.content:
            events += self._append("text", chunk.content)
        for raw in chunk.tool_calls or []:
            events += self._close()
            fn = raw.get("function") or {}
            call = {
                "id": raw.get("id") or f"call_{new_id()}",
                "name": fn.get("name", ""),
                "arguments": fn.get("arguments") or {},
            }
            block = self._new("tool_call")
            block.call = call
            events += [BlockEvent("start", block), BlockEvent("stop", block)]
        if chunk.done:
            events += self._close()
            self.final = chunk
        return events

    def _new(self, kind: BlockKind) -> Block:
        block = Block(kind, len(self.blocks))
        self.blocks.append(block)
        return block

    def _append(self, kind: BlockKind, text: str) -> list[BlockEvent]:
        events: list[BlockEvent] = []
        if self._open is None or self._open.kind != kind:
            events += self._close()
            self._open = self._new(kind)
            events.append(BlockEvent("start", self._open))
        self._open.text += text
        events.append(BlockEvent("delta", self._open, text))
        return events

    def _close(self) -> list[BlockEvent]:
        if self._open is None:
            return []
        block, self._open = self._open, None
        return [BlockEvent("stop", block)]

    # ---- the finished answer ----
    def of_kind(self, kind: BlockKind) -> list[Block]:
        return [b for b in self.blocks if b.kind == kind]

    @property
    def text(self) -> str:
        return "".join(b.text for b in self.of_kind("text"))

    @property
    def thinking(self) -> str:
        return "".join(b.text for b in self.of_kind("thinking"))

    @property
    def calls(self) -> list[dict[str, Any]]:
        return [b.call for b in self.of_kind("tool_call") if b.call is not None]

    @property
    def ending(self) -> Literal["tool_calls", "length", "stop"]:
        """The token limit's ending first, even after complete calls (a call it cut off is dropped)."""
        if self.final is not None and self.final.done_reason == "length":
            return "length"
        return "tool_calls" if self.calls else "stop"

    @property
    def stop_sequence(self) -> str | None:
        """The stop string that ended the answer, if one did (Anthropic's `stop_sequence`)."""
        return self.final.stop_sequence if self.final is not None and self.ending == "stop" else None

    @property
    def metrics(self) -> Metrics:
        return (self.final.metrics if self.final is not None else None) or Metrics()

    @property
    def input_tokens(self) -> int:
        """The whole prompt (a reused prefix included), as OpenAI and Anthropic count input."""
        m = self.metrics
        return max(m.prompt_tokens, m.prompt_eval_count)

    @property
    def cached_tokens(self) -> int:
        """The part of the prompt a previous request had already evaluated (the prefix cache)."""
        return self.input_tokens - self.metrics.prompt_eval_count

    @property
    def output_tokens(self) -> int:
        return self.metrics.eval_count

    @property
    def reasoning_tokens(self) -> int:
        """Of the output: tokens generated inside the thinking."""
        return self.metrics.reasoning_tokens

    def history_message(self) -> dict[str, Any]:
        """This answer as the assistant turn of the next request's history."""
        return assistant_message(self.text, self.thinking, self.calls)
