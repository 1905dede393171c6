"""Tool calls out of model text, for every common family, parsed incrementally while the reply streams.

Styles (what the model emits; the reference notes on agent APIs, section 3):
  * hermes:  `<tool_call>{"name": f, "arguments": {...}}</tool_call>`, repeatable (Hermes, Qwen2.5/3), or
             inside the same tags Qwen3-Coder's XML, `<function=f><parameter=p>v</parameter></function>`
             (values typed by the tool's schema: a string parameter keeps its text, others read as JSON)
  * llama3:  `{"name": f, "parameters": {...}}`, optionally after `<|python_tag|>`, several joined by `;`,
             or Llama 3.2/4's pythonic list `[f(a=1), g(b="x")]` (also read by the json fallback)
  * mistral: `[TOOL_CALLS][{"name": f, "arguments": {...}}]` (v3) or `[TOOL_CALLS]f{...}` /
             `[TOOL_CALLS]f[ARGS]{...}` (v11+)
  * granite: `<|tool_call|>[{"name": f, "arguments": {...}}]`
  * phi4:    `functools[{"name": f, "arguments": {...}}]`
  * harmony: a `commentary` message to `functions.f` (parsed by the harmony splitter in thinking.py)
  * json:    the fallback: a reply that is a bare JSON call (or list of calls), or `<tool_call>` blocks

Calls come back in Ollama's shape, `{"id": ..., "function": {"index": i, "name": str, "arguments": dict}}`.
A call that does not parse, or that names a tool the request did not offer, is given back as plain
content, never an error.
"""

from __future__ import annotations

import json
import re
import secrets
import string
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any

from localrt.errors import LocalrtError
from localrt.runtime.callformats import BLOCKS
from localrt.runtime.callformats import FAMILY_STYLES
from localrt.runtime.callformats import calls_of
from localrt.runtime.callformats import decode_prefix
from localrt.runtime.callformats import detect_family_style
from localrt.runtime.callformats import parse_block
from localrt.runtime.callformats import parse_json_calls
from localrt.runtime.callformats import parse_pythonic
from localrt.runtime.callformats import parse_xml_calls

TOOL_STYLES = (
    "hermes",
    "llama3",
    "mistral",
    "granite",
    "phi4",
    "harmony",
    "json",
    *FAMILY_STYLES,
)
# style -> the marker that opens a block of calls anywhere in the reply
_MARKERS = {
    "hermes": "<tool_call>",
    "mistral": "[TOOL_CALLS]",
    "granite": "<|tool_call|>",
    "phi4": "functools",
    **{style: block.opener for style, block in BLOCKS.items()},
}
_CLOSERS = {"hermes": "</tool_call>", **{s: b.closer for s, b in BLOCKS.items() if b.closer}}
OPENERS = ("<tool_call>", "{", "[", "```", "<|python_tag|>")
# the start of a bare JSON call (or list of calls), as a reply cut by the token limit may end in one
_CALL_START = re.compile(r'\s*;?\s*(?:```(?:json)?\s*)?\[?\s*\{\s*"(?:name|function)"')


def _whole_items(text: str) -> list[dict[str, Any]]:
    """The complete calls at the start of a JSON list that was cut off (`[{call}, {call}, {"na`)."""
    body = text.lstrip()
    if not body.startswith("["):
        return []
    found: list[dict[str, Any]] = []
    pos = 1
    while (decoded := decode_prefix(body[pos:])) is not None:
        call = calls_of(decoded[0])
        if call is None or isinstance(decoded[0], list):
            break
        found += call
        pos += decoded[1]
        rest = body[pos:].lstrip()
        if not rest.startswith(","):
            break
        pos = len(body) - len(rest) + 1
    return found


def detect_tool_style(template: str, special_tokens: set[str] | None = None) -> str:
    """The family's call syntax, from what its chat template (or vocabulary) shows."""
    specials = special_tokens or set()
    if all(m in template for m in ("<|start|>", "<|end|>", "<|channel|>")):
        return "harmony"
    family = detect_family_style(template)
    if family is not None:
        return family
    if "[TOOL_CALLS]" in template or "[TOOL_CALLS]" in specials:
        return "mistral"
    if "<|tool_call|>" in template:
        return "granite"
    if "functools" in template:
        return "phi4"
    if "<tool_call>" in template:
        return "hermes"
    if "<|python_tag|>" in template or "ipython" in template:
        return "llama3"
    return "json"


def style_markers(style: str) -> tuple[str, ...]:
    """Texts of this style the reply parser must see (kept even when they are special tokens)."""
    if style in BLOCKS:
        return BLOCKS[style].markers
    return {
        "hermes": ("<tool_call>", "</tool_call>"),
        "mistral": ("[TOOL_CALLS]", "[ARGS]"),
        "granite": ("<|tool_call|>",),
        "llama3": ("<|python_tag|>",),
        "json": ("<tool_call>", "</tool_call>"),
    }.get(style, ())


def new_call_id(style: str = "json") -> str:
    """Ollama's `call_` + 8 characters; Mistral templates insist on 9 alphanumerics."""
    if style == "mistral":
        return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))
    return "call_" + "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))


_MISTRAL_NAMED = re.compile(r"\s*([A-Za-z_][\w.\-]*)\s*(?:\[ARGS\])?\s*(?=\{)")


def _parse_after_marker(style: str, text: str) -> tuple[list[dict[str, Any]], int] | None:
    """Calls right after a block marker: a JSON call or list (all styles), or Mistral's `name{args}`."""
    decoded = decode_prefix(text)
    if decoded is not None:
        calls = calls_of(decoded[0])
        return (calls, decoded[1]) if calls else None
    if style == "mistral":
        m = _MISTRAL_NAMED.match(text)
        if m:
            args = decode_prefix(text[m.end() :])
            if args is not None and isinstance(args[0], dict):
                return [{"function": {"name": m.group(1), "arguments": args[0]}}], m.end() + args[1]
    return None


def _could_be_pythonic(text: str) -> bool:
    """`[` then a name: may still become a pythonic call list (a JSON list would start otherwise)."""
    return re.match(r"\s*\[\s*[A-Za-z_]", text) is not None


def _partial(text: str, marker: str) -> int:
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


class ToolCallParser:
    """Content in, (content safe to show now, complete calls) out; a call split over many chunks waits
    in the buffer until it is whole. `finish()` gives back whatever is left: calls, or plain text."""

    def __init__(
        self,
        style: str,
        tool_names: Sequence[str] = (),
        param_types: Mapping[str, Mapping[str, Any]] | None = None,
    ) -> None:
        self.style = style if style in TOOL_STYLES else "json"
        self.names = list(tool_names)  # the request's tools: a call to another name is no call
        self.types = param_types or {}  # tool -> its parameters' schemas (types Qwen3-Coder's XML values)
        self.leading = self.style in ("llama3", "json")  # a call only as the whole reply's start
        self.state = "start" if self.leading else "content"
        self.buffer = ""
        self.marker = _MARKERS.get(self.style, "<tool_call>")

    # -- streaming --
    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        self.buffer += text
        out, calls = "", []
        while self.buffer:
            step = getattr(self, f"_step_{self.state}")()
            if step is None:
                break
            released, found = step
            out += released
            calls.extend(found)
        return out, calls

    def finish(self, cut: bool = False) -> tuple[str, list[dict[str, Any]]]:
        """The rest of the reply. `cut`: the token limit ended it, so a call it cut off is dropped (the
        complete calls before it are kept), never given back as its markup."""
        out, calls = self.feed("")
        if self.state == "block":
            closed = self._closer() is not None and self._closer() in self.buffer
            parsed = self._close_block(self.buffer, final=True)
            if cut and not closed and (parsed is None or not parsed[1]):
                whole = _whole_items(self.buffer)  # a list of calls cut inside: its complete ones
                self.buffer = ""
                return out, calls + (whole if whole and self._known(whole) else [])
            if parsed is None:  # malformed: the block comes back as text
                out, self.buffer = out + self.marker + self.buffer, ""
                return out, calls
            more, more_calls = self.finish(cut)  # the buffer now holds what followed the block
            return out + parsed[0] + more, calls + parsed[1] + more_calls
        rest, self.buffer = self.buffer, ""
        if self.state in ("start", "leading") and rest.strip():
            body = rest.strip().removeprefix("<|python_tag|>")
            found = parse_json_calls(body)
            if found is None:
                pythonic = parse_pythonic(body)
                found = pythonic[0] if pythonic is not None and not body[pythonic[1] :].strip() else None
            if found and self._known(found):
                return out, calls + found
            if cut and _CALL_START.match(body):  # a call the limit cut off; a list keeps its whole calls
                whole = _whole_items(body)
                return out, calls + (whole if whole and self._known(whole) else [])
        if cut and self.state == "content":
            rest = ""  # held back as the start of a call marker
        return out + rest, calls

    def _closer(self) -> str | None:
        return _CLOSERS.get(self.style) or ("</tool_call>" if self.marker == "<tool_call>" else None)

    def _known(self, calls: list[dict[str, Any]]) -> bool:
        """Every call names one of the request's tools (a model inventing a tool wrote text, not a call)."""
        return all(c["function"]["name"] in self.names for c in calls) if self.names else True

    # -- states; each returns (released text, calls) or None to wait for more text --
    def _step_start(self) -> tuple[str, list[dict[str, Any]]] | None:
        head = self.buffer.lstrip()
        if not head:
            return None
        if head.startswith("<tool_call>") and self.style == "json":
            self.state = "content"  # Hermes-style blocks in a template we could not place
            self.marker = "<tool_call>"
            return "", []
        if any(head.startswith(o) for o in OPENERS):
            self.state = "leading"
            return "", []
        if any(o.startswith(head) for o in OPENERS):
            return None  # may still become an opener
        # the fallback still finds Hermes-style blocks later in the text; Llama's JSON only leads
        self.state = "content" if self.style == "json" else "text"
        return "", []

    def _step_leading(self) -> tuple[str, list[dict[str, Any]]] | None:
        """A reply that starts like JSON: calls one after another (`;` between), else plain text."""
        body = self.buffer.lstrip().removeprefix("<|python_tag|>").lstrip().removeprefix(";")
        if body.lstrip().startswith("```"):
            return None  # fenced: decided at the end
        decoded = decode_prefix(body)
        if decoded is None:
            pythonic = parse_pythonic(body) if _could_be_pythonic(body) else None
            if pythonic is None:
                return None  # still arriving (or decided at the end)
            calls, end = pythonic
        else:
            calls, end = calls_of(decoded[0]), decoded[1]
        if not calls or not self._known(calls):
            self.state = "text"
            return "", []
        self.buffer = body[end:].lstrip()
        return "", calls

    def _step_text(self) -> tuple[str, list[dict[str, Any]]]:
        out, self.buffer = self.buffer, ""
        return out, []

    def _step_content(self) -> tuple[str, list[dict[str, Any]]] | None:
        at = self.buffer.find(self.marker)
        if at >= 0:
            before = self.buffer[:at]
            self.buffer, self.state = self.buffer[at + len(self.marker) :], "block"
            return before, []
        hold = _partial(self.buffer, self.marker)
        cut = len(self.buffer) - hold
        if cut == 0:
            return None
        out, self.buffer = self.buffer[:cut], self.buffer[cut:]
        return out, []

    def _step_block(self) -> tuple[str, list[dict[str, Any]]] | None:
        parsed = self._close_block(self.buffer, final=False)
        if parsed is None:
            return None
        return parsed

    def _read_block(self, body: str) -> list[dict[str, Any]] | None:
        if self.style in BLOCKS:
            return parse_block(self.style, body, self.types)
        calls = parse_json_calls(body)
        return calls if calls is not None else parse_xml_calls(body, self.types)

    def _close_block(self, text: str, final: bool) -> tuple[str, list[dict[str, Any]]] | None:
        """A block after the marker, once decided: its calls (the buffer moves on), or its text given back
        as content when it is malformed; None while it may still grow into a call."""
        closer = self._closer()
        if closer is not None:
            at = text.find(closer)
            if at < 0 and not final:
                return None
            body = text[:at] if at >= 0 else text
            rest = text[at + len(closer) :] if at >= 0 else ""
            calls = self._read_block(body)
            if calls is not None and not self._known(calls):
                calls = None
            self.state, self.buffer = "content", rest.lstrip() if calls else rest
            if calls:
                return "", calls
            return self.marker + body + (closer if at >= 0 else ""), []
        parsed = _parse_after_marker(self.style, text)
        if parsed is None:
            return None
        calls, end = parsed
        if not self._known(calls):  # given back as written, the text after it read on as content
            self.state, self.buffer = "content", text[end:]
            return self.marker + text[:end], []
        self.state, self.buffer = "content", text[end:].lstrip()
        return "", calls


def parse_tool_calls(text: str, style: str = "json") -> tuple[str, list[dict[str, Any]]]:
    """Split a whole reply into (remaining content, tool calls). No calls found: (text, [])."""
    parser = ToolCallParser(style)
    content, calls = parser.feed(text)
    tail, more = parser.finish()
    calls = calls + more
    if not calls:
        return text, []
    return (content + tail).strip(), calls


def could_be_tool_call(prefix: str) -> bool:
    """While streaming: might the output (so far) turn into a bare-JSON or `<tool_call>` reply?"""
    head = prefix.lstrip()
    if not head:
        return True
    return any(head.startswith(o) or o.startswith(head) for o in OPENERS)


# ---- harmony (gpt-oss) ----------------------------------------------------------------------------
def harmony_name(name: str) -> str:
    """A tool name as harmony's TypeScript-like namespace writes it (space, `-`, `.` -> `_`)."""
    return re.sub(r"[^A-Za-z0-9_]", "", re.sub(r"[ \-.]", "_", name))


def parse_harmony_call(recipient: str, args: str, tool_names: Sequence[str]) -> dict[str, Any] | None:
    name = recipient.strip().removeprefix("functions.")
    if not name:
        return None
    known = [original for original in tool_names if harmony_name(original) == name]
    if tool_names and not known:
        return None  # a tool the request did not offer: the text comes back as content
    name = known[0] if known else name
    try:
        arguments = json.loads(args) if args.strip() else {}
    except ValueError:
        return None
    if not isinstance(arguments, dict):
        return None
    return {"function": {"name": name, "arguments": arguments}}


# ---- tool_choice: required -----------------------------------------------------------------------
def _gbnf_string(text: str) -> str:
    return json.dumps(text)  # a JSON string literal is a valid GBNF literal for this text


def _function_name(tool: Mapping[str, Any]) -> str:
    fn = tool.get("function") if isinstance(tool.get("function"), Mapping) else tool
    name = fn.get("name") if isinstance(fn, Mapping) else None
    return name if isinstance(name, str) else ""


def _call_schema(tools: Sequence[Mapping[str, Any]], args_key: str) -> dict[str, Any]:
    alternatives = []
    for tool in tools:
        fn = tool.get("function") if isinstance(tool.get("function"), Mapping) else tool
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
            continue
        params = fn.get("parameters") if isinstance(fn.get("parameters"), Mapping) else {"type": "object"}
        alternatives.append(
            {
                "type": "object",
                "properties": {"name": {"const": fn["name"]}, args_key: dict(params)},
                "required": ["name", args_key],
            }
        )
    if not alternatives:
        raise LocalrtError("tool_choice asks for a call, but no tool is a function with a name")
    return {"anyOf": alternatives} if len(alternatives) != 1 else alternatives[0]


def required_grammar(
    style: str,
    tools: Sequence[Mapping[str, Any]],
    *,
    parallel: bool = True,
    schema_gbnf: Any,
    thinking: tuple[str, str] | None = None,
) -> str:
    """GBNF that makes the reply a tool call in the family's own syntax (`tool_choice: required`).

    `schema_gbnf` turns a JSON schema into GBNF (the backend's converter); `thinking` (open, close) lets
    a thinking model think first; open is "" when the prompt already opened the thinking block.
    """
    if style == "harmony":
        _call_schema(tools, "arguments")  # the same check: at least one named function
        names = [harmony_name(_function_name(t)) for t in tools]
        recipients = " | ".join(_gbnf_string(n) for n in names if n)
        rules = schema_gbnf({"type": "object"}).replace("root ::=", "call-args ::=", 1)
        return (
            'root ::= ("<|channel|>analysis<|message|>" [^<]* "<|end|><|start|>assistant")? '
            '"<|channel|>commentary to=functions." call-name " <|constrain|>json<|message|>" call-args\n'
            f"call-name ::= {recipients}\n{rules}"
        )
    args_key = "parameters" if style == "llama3" else "arguments"
    rules = schema_gbnf(_call_schema(tools, args_key)).replace("root ::=", "call ::=", 1)
    many = parallel and style != "llama3"
    if style in ("mistral", "granite", "phi4"):
        opener = {"mistral": "[TOOL_CALLS]", "granite": "<|tool_call|>", "phi4": "functools"}[style]
        body = (
            f'{_gbnf_string(opener)} "[" call ("," space call)* "]"'
            if many
            else (f'{_gbnf_string(opener)} "[" call "]"')
        )
    elif style == "llama3":
        body = "call"
    elif style in BLOCKS:  # the family's own markers around a JSON call, which every block also reads
        markers = BLOCKS[style]
        one = f"{_gbnf_string(markers.opener)} call" + (
            f" {_gbnf_string(markers.closer)}" if markers.closer else ""
        )
        body = f'{one} ("\\n" {one})*' if many and markers.closer else one
    else:  # hermes and the fallback
        block = '"<tool_call>\\n" call "\\n</tool_call>"'
        body = f'{block} ("\\n" {block})*' if many else block
    prefix = ""
    if thinking is not None:
        open_tag, close_tag = thinking
        think_body = f"think-text {_gbnf_string(close_tag)} [ \\n]*"
        prefix = f"({_gbnf_string(open_tag)} {think_body})? " if open_tag else f"{think_body} "
        rules += '\nthink-text ::= ([^<] | "<" [^/])*'
    return f"root ::= {prefix}{body}\n{rules}"
