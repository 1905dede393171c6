"""How a model thinks, read once from its chat template and vocabulary, and the reply parser that splits
its output into thinking, content and tool calls while it streams.

Three ways of thinking are known (see the reference notes on agent APIs, section 2):
  * tags: `<think>…</think>` (Qwen3, DeepSeek-R1, their distills) or `[THINK]…[/THINK]` (Magistral);
    a template that mentions `enable_thinking` is hybrid (the switch turns thinking off); a rendered
    prompt that already ends with the open tag (DeepSeek-R1, Qwen3.5) starts the reply inside thinking;
  * harmony (gpt-oss): channels; `analysis` is thinking, `final` the answer, a recipient
    (`to=functions.f`) a tool call; the effort (low|medium|high) goes into the system message;
  * none: then `think: true` is a 400 naming the model, as Ollama answers.

Every route (Ollama, OpenAI, Anthropic, Responses) reads the split from the runtime's chunks, so this is
the one place that knows the formats.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from collections.abc import Sequence
from dataclasses import dataclass
from dataclasses import field
from typing import Any

from localrt.errors import LocalrtError
from localrt.runtime.toolcalls import ToolCallParser
from localrt.runtime.toolcalls import detect_tool_style
from localrt.runtime.toolcalls import new_call_id
from localrt.runtime.toolcalls import parse_harmony_call

THINK_LEVELS = ("low", "medium", "high")
HARMONY_MARKERS = (
    "<|start|>",
    "<|end|>",
    "<|message|>",
    "<|channel|>",
    "<|constrain|>",
    "<|return|>",
    "<|call|>",
)
# (open, close, other markers the splitter must see), the more specific first: a Seed-OSS template shows
# no `<think>`, but a template with `<think:opensource>` must not be read as one with `<think>`.
# Gemma 4 opens with its `<|channel>` token and the word `thought`; Apriel's prompt ends with the opening
# sentence, and its answer follows `[BEGIN FINAL RESPONSE]`.
_TAG_PAIRS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("<seed:think>", "</seed:think>", ()),
    ("<mm:think>", "</mm:think>", ()),
    ("<think:opensource>", "</think:opensource>", ()),
    ("<think{}>", "</think{}>", ()),  # Hunyuan 3 formats its tags with the `:opensource` suffix
    ("<|START_THINKING|>", "<|END_THINKING|>", ()),
    ("<|inner_prefix|>", "<|inner_suffix|>", ()),
    ("<|channel>thought", "<channel|>", ("<|channel>",)),
    ("Here are my reasoning steps:", "[BEGIN FINAL RESPONSE]", ()),
    ("<think>", "</think>", ()),
    ("[THINK]", "[/THINK]", ()),
)


class ThinkError(LocalrtError):
    status = 400


@dataclass(frozen=True)
class Think:
    """A request's `think`: unset (None), off, or on at a level (`true` is "medium", as Ollama reads it);
    `budget`: at most this many reply tokens of thinking (Anthropic's `budget_tokens`), then the runtime
    closes the thinking and the answer follows; `optional`: asked only where the model can think, so a
    model that cannot answers without thinking instead of refusing (Anthropic clients such as Claude Code
    ask every model to think, and Ollama answers them so on /v1/messages)."""

    enabled: bool | None = None
    level: str | None = None
    budget: int | None = None
    optional: bool = False

    @property
    def is_set(self) -> bool:
        return self.enabled is not None


def parse_think(value: Any) -> Think:
    """Ollama's `think` field: true, false, "low", "medium", "high" ("max" reads as "high"), or null."""
    if value is None:
        return Think()
    if isinstance(value, bool):
        return Think(value, "medium" if value else None)
    if isinstance(value, str):
        level = value.strip().lower()
        if level == "max":
            level = "high"
        if level in THINK_LEVELS:
            return Think(True, level)
        raise ThinkError(f'invalid think value: "{value}" (must be "high", "medium", "low", true, or false)')
    raise ThinkError(f"think must be a boolean or a string, got {type(value).__name__}")


EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
_EFFORT_LEVELS = {"minimal": "low", "xhigh": "high", "max": "high", "ultra": "high"}


def think_from_effort(effort: Any, param: str = "reasoning_effort") -> Think:
    """A reasoning effort as a Think, the one mapping every route uses (OpenAI's `reasoning_effort`,
    Responses' `reasoning.effort`, Anthropic's `output_config.effort`), as Ollama maps it: none is off,
    minimal is low, the levels above high are high (the most a template knows). `param` names the
    field in the 400."""
    if effort is None or effort == "":
        return Think()
    if not isinstance(effort, str):
        raise ThinkError(f"{param} must be a string")
    value = effort.strip().lower()
    if value == "none":
        return Think(False)
    mapped = _EFFORT_LEVELS.get(value, value)
    if mapped not in THINK_LEVELS:
        raise ThinkError(f"invalid {param} {effort!r} (use {', '.join(EFFORTS)})")
    return Think(True, mapped)


# ---- what the model can do -------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelFormat:
    """A model's thinking and tool-call formats, derived from its chat template and special tokens."""

    thinking: str = "none"  # none | tags | harmony
    open_tag: str = ""
    close_tag: str = ""
    hybrid: bool = False  # the template has a switch (`enable_thinking`) that turns thinking off
    tool_style: str = "json"  # see toolcalls.TOOL_STYLES
    renders_tools: bool = False
    markers: tuple[str, ...] = field(default=())  # texts the reply parser must see (kept when special)
    # Hunyuan 3's template refuses any `reasoning_effort` but these, and turns thinking off with the first
    efforts: tuple[str, ...] = field(default=())

    @property
    def can_think(self) -> bool:
        return self.thinking != "none"


def model_format(template: str, special_tokens: Sequence[str] = ()) -> ModelFormat:
    """Read the formats from the template source (and the vocabulary's special tokens)."""
    specials = set(special_tokens)
    tool_style = detect_tool_style(template, specials)
    renders_tools = "tools" in template or "tool_call" in template
    harmony = all(m in template for m in ("<|start|>", "<|end|>", "<|channel|>"))
    if harmony:
        return ModelFormat(
            thinking="harmony",
            tool_style="harmony",
            renders_tools=renders_tools,
            markers=HARMONY_MARKERS,
        )
    thinking, open_tag, close_tag, extra = "none", "", "", ()
    for opener, closer, others in _TAG_PAIRS:
        if opener in template and closer in template:
            thinking, open_tag, close_tag, extra = "tags", opener, closer, others
            if "{}" in opener and ":opensource" in template:
                open_tag, close_tag = opener.format(":opensource"), closer.format(":opensource")
            break
    from localrt.runtime.toolcalls import style_markers

    markers = tuple(m for m in (open_tag, close_tag, *extra, *style_markers(tool_style)) if m)
    return ModelFormat(
        thinking=thinking,
        open_tag=open_tag,
        close_tag=close_tag,
        hybrid=thinking == "tags" and ("enable_thinking" in template or "'no_think'" in template),
        tool_style=tool_style,
        renders_tools=renders_tools,
        markers=markers,
        efforts=("no_think", "low", "high") if "'no_think'" in template else (),
    )


def embedding_only(metadata: Mapping[str, Any]) -> bool:
    """An embedding model (a pooling type, or an encoder architecture): it embeds, it does not generate."""
    arch = str(metadata.get("general.architecture", ""))
    return any(key.endswith(".pooling_type") for key in metadata) or arch in ("bert", "nomic-bert")


def capabilities(fmt: ModelFormat, metadata: Mapping[str, Any]) -> list[str]:
    """Ollama's `/api/show` capabilities for a GGUF: what the file and its template can do."""
    embedding = embedding_only(metadata)
    caps = ["embedding"] if embedding else ["completion"]
    if fmt.renders_tools and not embedding:
        caps.append("tools")
    if fmt.can_think:
        caps.append("thinking")
    return caps  # vision and rerank come from the projector and the file's kind (localrt/show.py)


# ---- the prompt side -------------------------------------------------------------------------------
def check_think(fmt: ModelFormat, think: Think, model: str) -> Think:
    """Ollama's rule: asking a model that cannot think to think is a 400 naming it; unset on a model that
    thinks means on."""
    if not fmt.can_think:
        if think.enabled and think.optional:
            return Think()
        if think.enabled:
            raise ThinkError(f'"{model}" does not support thinking')
        return Think(False) if think.is_set else Think()
    if not think.is_set:
        return Think(True, "medium", think.budget)
    if fmt.thinking == "harmony" and not think.enabled:
        # gpt-oss cannot stop thinking: false is ignored, as Ollama does
        return Think(True, "medium", think.budget)
    return think


def template_variables(fmt: ModelFormat, think: Think) -> dict[str, Any]:
    """Variables the chat template reads: `enable_thinking` (Qwen3 and kin), `reasoning_effort` (gpt-oss;
    Hunyuan 3 with its own levels)."""
    if not fmt.can_think or not think.is_set:
        return {}
    out: dict[str, Any] = {"enable_thinking": bool(think.enabled), "thinking": bool(think.enabled)}
    if fmt.efforts:
        off, *levels = fmt.efforts
        level = think.level if think.level in levels else levels[-1]
        out["reasoning_effort"] = level if think.enabled else off
    elif think.level:
        out["reasoning_effort"] = think.level
    return out


def history_messages(fmt: ModelFormat, messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Earlier turns as templates expect them: an assistant's `thinking` also as `reasoning_content`
    (Qwen3's and DeepSeek's templates read that name), and thinking tags out of earlier content."""
    out = []
    for m in messages:
        msg = dict(m)
        if msg.get("role") == "assistant":
            thinking = msg.get("thinking") or msg.get("reasoning_content")
            if thinking:
                msg.setdefault("thinking", thinking)
                msg.setdefault("reasoning_content", thinking)
            content = msg.get("content")
            if fmt.thinking == "tags" and isinstance(content, str) and fmt.close_tag in content:
                msg["content"] = content.split(fmt.close_tag, 1)[1].lstrip()
        out.append(msg)
    return out


def close_thinking(fmt: ModelFormat, prompt_text: str) -> str:
    """Text to append so a reply that the prompt opened as thinking starts as the answer (think off on a
    template without a switch, as Ollama's DeepSeek renderer closes the tag)."""
    if fmt.thinking == "tags" and prompt_text.rstrip().endswith(fmt.open_tag):
        return f"\n{fmt.close_tag}\n\n"
    return ""


def prompt_opens_thinking(fmt: ModelFormat, prompt_text: str) -> bool:
    return fmt.thinking == "tags" and prompt_text.rstrip().endswith(fmt.open_tag)


def end_of_thinking(fmt: ModelFormat) -> str:
    """The text that closes a reply's thinking so the answer follows (a thinking budget ran out): the
    close tag, or harmony's end of the analysis message and the header of the final one."""
    if fmt.thinking == "harmony":
        return "<|end|><|start|>assistant<|channel|>final<|message|>"
    return f"\n{fmt.close_tag}\n\n" if fmt.thinking == "tags" else ""


# ---- the output side -------------------------------------------------------------------------------
@dataclass
class Piece:
    """What one step of the parser releases."""

    content: str = ""
    thinking: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.thinking or self.tool_calls)

    def add(self, other: Piece) -> None:
        self.content += other.content
        self.thinking += other.thinking
        self.tool_calls.extend(other.tool_calls)


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that begins `marker` (held back until it is decided)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


class _TagSplitter:
    """`<think>…</think>` then the answer; a split tag is held back until it is decided."""

    def __init__(self, open_tag: str, close_tag: str, started: bool) -> None:
        self.open_tag, self.close_tag = open_tag, close_tag
        self.state = "thinking" if started else "looking"
        self.buffer = ""

    def feed(self, text: str) -> tuple[str, str]:
        """Returns (thinking, content) released by this text."""
        self.buffer += text
        thinking, content = "", ""
        while True:
            if self.state == "looking":
                head = self.buffer.lstrip()
                if not head:
                    return thinking, content
                if head.startswith(self.open_tag):
                    self.buffer, self.state = head[len(self.open_tag) :], "eat"
                    continue
                if self.open_tag.startswith(head):
                    return thinking, content  # may still become the open tag
                self.state = "content"  # no thinking this time
                continue
            if self.state == "eat":  # whitespace right after a tag is not part of either text
                self.buffer = self.buffer.lstrip()
                if not self.buffer:
                    return thinking, content
                self.state = "thinking"
                continue
            if self.state == "thinking":
                at = self.buffer.find(self.close_tag)
                if at >= 0:
                    thinking += self.buffer[:at].rstrip()
                    self.buffer, self.state = self.buffer[at + len(self.close_tag) :], "after"
                    continue
                hold = _partial_suffix(self.buffer, self.close_tag)
                # trailing whitespace waits too: before the close tag it belongs to neither text
                cut = len(self.buffer[: len(self.buffer) - hold].rstrip())
                thinking += self.buffer[:cut]
                self.buffer = self.buffer[cut:]
                return thinking, content
            if self.state == "after":
                self.buffer = self.buffer.lstrip()
                if not self.buffer:
                    return thinking, content
                self.state = "content"
                continue
            content += self.buffer
            self.buffer = ""
            return thinking, content

    @property
    def thinking_now(self) -> bool:
        return self.state in ("eat", "thinking")

    def finish(self) -> tuple[str, str]:
        rest, self.buffer = self.buffer, ""
        if self.state == "thinking":
            return rest.rstrip(), ""
        if self.state == "looking":
            return "", rest
        return "", rest if self.state == "content" else ""


class _HarmonySplitter:
    """gpt-oss channels: `<|channel|>analysis<|message|>…<|end|><|start|>assistant<|channel|>final…`.

    The reply begins inside an assistant header (the prompt ends with `<|start|>assistant`). Headers are
    read once `<|message|>` arrives; a body runs to `<|end|>`, `<|call|>`, `<|return|>` or the end.
    """

    def __init__(self, tool_names: Sequence[str]) -> None:
        self.tool_names = list(tool_names)
        self.state = "header"
        self.buffer = ""
        self.kind = "content"
        self.recipient = ""
        self.call_args = ""

    def _header(self, header: str) -> None:
        channel = ""
        m = re.search(r"<\|channel\|>\s*([A-Za-z_]+)", header)
        if m:
            channel = m.group(1)
        to = re.search(r"to=([^\s<]+)", header)
        self.recipient = to.group(1) if to else ""
        if self.recipient:
            self.kind = "call"
        elif channel == "analysis":
            self.kind = "thinking"
        else:
            self.kind = "content"  # final, or a preamble on commentary
        self.call_args = ""

    def feed(self, text: str) -> Piece:
        self.buffer += text
        out = Piece()
        while True:
            if self.state == "header":
                at = self.buffer.find("<|message|>")
                if at < 0:
                    return out
                self._header(self.buffer[:at])
                self.buffer, self.state = self.buffer[at + len("<|message|>") :], "body"
                continue
            if self.state == "between":  # after <|end|>: the next message's <|start|>role header
                at = self.buffer.find("<|start|>")
                if at < 0:
                    if self.buffer and not "<|start|>".startswith(self.buffer[:9]):
                        self.state = "header"  # a header without <|start|>: read it anyway
                        continue
                    return out
                self.buffer, self.state = self.buffer[at + len("<|start|>") :], "header"
                continue
            ends = [(self.buffer.find(e), e) for e in ("<|end|>", "<|call|>", "<|return|>")]
            found = [(i, e) for i, e in ends if i >= 0]
            if found:
                at, end = min(found)
                self._body(self.buffer[:at], out, final=True)
                self.buffer, self.state = self.buffer[at + len(end) :], "between"
                continue
            hold = max(_partial_suffix(self.buffer, e) for _, e in ends)
            cut = len(self.buffer) - hold
            self._body(self.buffer[:cut], out, final=False)
            self.buffer = self.buffer[cut:]
            return out

    def _body(self, text: str, out: Piece, final: bool) -> None:
        if self.kind == "thinking":
            out.thinking += text
        elif self.kind == "content":
            out.content += text
        else:
            self.call_args += text
            if final:
                self._emit_call(out)

    @property
    def thinking_now(self) -> bool:
        return self.state == "body" and self.kind == "thinking"

    def _emit_call(self, out: Piece, cut: bool = False) -> None:
        call = parse_harmony_call(self.recipient, self.call_args, self.tool_names)
        if call is not None:
            out.tool_calls.append(call)
        elif not cut:  # malformed: the text comes back as content, never an error
            out.content += self.call_args
        self.kind, self.call_args = "content", ""

    def finish(self, cut: bool = False) -> Piece:
        """The rest; `cut`: the token limit ended the reply, so a call it cut off is dropped."""
        out = Piece()
        if self.state == "body" and self.kind == "call":
            self.call_args += self.buffer
            self._emit_call(out, cut)
        elif self.state == "body":
            self._body(self.buffer, out, final=True)
        elif self.state in ("header", "between") and self.buffer.strip() and not cut:
            # text that never became a message (no `<|message|>`): plain content, never lost
            out.content += self.buffer
        self.buffer = ""
        return out


class ReplyParser:
    """One reply: text in (as the backend streams it), thinking / content / tool calls out.

    `think` decides whether thinking is returned (off on a model that cannot switch it off: dropped,
    never leaked into content); `tools` turns tool-call parsing on with the model's style.
    """

    def __init__(
        self,
        fmt: ModelFormat,
        *,
        think: Think,
        prompt_text: str = "",
        tools: Sequence[Mapping[str, Any]] | None = None,
        parallel_tool_calls: bool = True,
    ) -> None:
        self.fmt = fmt
        self.keep_thinking = think.enabled is not False or fmt.thinking == "harmony"
        names = [tool_name(t) for t in tools or ()]
        self.harmony = _HarmonySplitter(names) if fmt.thinking == "harmony" else None
        self.tags = (
            _TagSplitter(fmt.open_tag, fmt.close_tag, prompt_opens_thinking(fmt, prompt_text))
            if fmt.thinking == "tags"
            else None
        )
        self.calls = (
            ToolCallParser(fmt.tool_style, names, parameter_types(tools))
            if tools and fmt.tool_style != "harmony"
            else None
        )
        self.parallel = parallel_tool_calls
        self.n_calls = 0

    def feed(self, text: str) -> Piece:
        return self._finish_piece(self._split(text, final=False))

    @property
    def thinking_now(self) -> bool:
        """Is the reply inside its thinking right now (the tokens fed so far opened and did not close it)?"""
        splitter = self.harmony or self.tags
        return splitter is not None and splitter.thinking_now

    def finish(self, cut: bool = False) -> Piece:
        """What the reply still holds. `cut`: the token limit ended it, so a tool call it cut off is
        dropped rather than given back as content (the complete calls are kept)."""
        return self._finish_piece(self._split("", final=True, cut=cut))

    def _split(self, text: str, final: bool, cut: bool = False) -> Piece:
        if self.harmony is not None:
            piece = self.harmony.feed(text)
            if final:
                piece.add(self.harmony.finish(cut))
            return piece
        piece = Piece()
        if self.tags is not None:
            piece.thinking, content = self.tags.feed(text)
            if final:
                more_thinking, more_content = self.tags.finish()
                piece.thinking += more_thinking
                content += more_content
        else:
            content = text
        if self.calls is not None:
            released, calls = self.calls.feed(content)
            if final:
                tail, more = self.calls.finish(cut)
                released += tail
                calls.extend(more)
            piece.content, piece.tool_calls = released, calls
        else:
            piece.content = content
        return piece

    def _finish_piece(self, piece: Piece) -> Piece:
        if not self.keep_thinking:
            piece.thinking = ""
        calls = []
        for call in piece.tool_calls:
            if self.n_calls and not self.parallel:
                continue  # parallel_tool_calls: false keeps the first call only
            call.setdefault("id", new_call_id(self.fmt.tool_style))
            call["function"]["index"] = self.n_calls
            self.n_calls += 1
            calls.append(call)
        piece.tool_calls = calls
        return piece


def parameter_types(tools: Sequence[Mapping[str, Any]] | None) -> dict[str, dict[str, Any]]:
    """Each tool's parameter schemas by name (`properties` of its JSON schema)."""
    out: dict[str, dict[str, Any]] = {}
    for tool in tools or ():
        fn = tool.get("function") if isinstance(tool.get("function"), Mapping) else tool
        params = fn.get("parameters") if isinstance(fn, Mapping) else None
        props = params.get("properties") if isinstance(params, Mapping) else None
        if isinstance(props, Mapping):
            out[tool_name(tool)] = {k: v for k, v in props.items() if isinstance(v, Mapping)}
    return out


def tool_name(tool: Mapping[str, Any]) -> str:
    fn = tool.get("function") if isinstance(tool.get("function"), Mapping) else tool
    name = fn.get("name") if isinstance(fn, Mapping) else None
    return name if isinstance(name, str) else ""
