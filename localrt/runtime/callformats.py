"""Tool-call syntaxes of the model families whose calls are a block between markers, and the reading of
what is inside a block. `toolcalls.ToolCallParser` finds the blocks while the reply streams (a marker
split over chunks waits until it is decided); this module says what each family's markers are and turns
a whole block into calls.

Each family's markers are read from its official chat template (the ones llama.cpp ships in
`models/templates/`), as that template renders an assistant's calls:

  * glm:        `<tool_call>f<arg_key>k</arg_key><arg_value>v</arg_value>...</tool_call>` (GLM-4.5/4.6/4.7,
                Ling, Laguna, Spark); a value is text for a string parameter, JSON otherwise
  * hy3:        the same inside `<tool_calls:opensource>`, every tag suffixed `:opensource` (Hunyuan 3)
  * kimi:       `<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>
                {...}<|tool_call_end|>...<|tool_calls_section_end|>` (Kimi K2)
  * deepseek:   `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>{...}<｜tool▁call▁end｜>...` (V3.1), or
                `...begin｜>function<｜tool▁sep｜>f\n```json\n{...}\n```<｜tool▁call▁end｜>` (R1)
  * dsml:       `<｜DSML｜function_calls><｜DSML｜invoke name="f"><｜DSML｜parameter name="k" string="true">v
                </｜DSML｜parameter>...` (DeepSeek V3.2; V4 says `tool_calls` for `function_calls`)
  * minimax:    `<minimax:tool_call><invoke name="f"><parameter name="k">v</parameter></invoke>...` (M2)
  * minimax-m3: `]<]minimax[>[<tool_call>` then `<invoke name="f">` with one `<k>v</k>` per argument (nested
                objects as nested tags, lists as `<item>`), every tag after the `]<]minimax[>[` token
  * seed:       `<seed:tool_call><function=f><parameter=k>v</parameter></function></seed:tool_call>` (Seed-OSS)
  * lfm2:       `<|tool_call_start|>[f(k="v")]<|tool_call_end|>` (LFM2, LFM2.5)
  * functionary: `<function=f>{...}</function>` (functionary v3.1)
  * minicpm:    `<function name="f"><param name="k">v</param></function>` (MiniCPM 5)
  * cohere:     `<|START_ACTION|>[{"tool_call_id": "0", "tool_name": f, "parameters": {...}}]<|END_ACTION|>`
                (Command R7B, Command A)
  * command-r:  `Action:\n```json\n[{"tool_name": f, "parameters": {...}}]```` (Command R+)
  * apertus:    `<|tools_prefix|>[{"f": {...}}]<|tools_suffix|>` (Apertus)
  * tool-list:  `<tool_calls>[{"name": f, "arguments": {...}}]</tool_calls>` (Apriel), or one JSON call per
                line inside the same tags (MiniMax-M1)
  * nemotron:   `<TOOLCALL>[{"name": f, "arguments": {...}}]</TOOLCALL>` (Nemotron Nano v2)
  * solar:      `<|tool_calls|><|tool_call:begin|>id<|tool_call:name|>f<|tool_call:args|>{...}<|tool_call:end|>
                ...<|calls|>` (Solar Open)
  * gemma4:     `<|tool_call>call:f{k:<|"|>text<|"|>,n:3}<tool_call|>` (Gemma 4)
  * kimi-k3:    `<|open|>tools<|sep|><|open|>call tool="f" index="1"<|sep|><|open|>argument key="k"
                type="string"<|sep|>v<|close|>argument<|sep|>...<|close|>call<|sep|><|close|>tools<|sep|>`
  * gigachat:   `<|function_call|>{"name": f, "arguments": {...}}` (GigaChat 3.1; no closing marker)

Every block also reads a plain JSON call (`{"name": f, "arguments": {...}}`): that is what a grammar for
`tool_choice: required` writes between a family's markers.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Callable
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

Calls = list[dict[str, Any]]
Types = Mapping[str, Mapping[str, Any]]  # tool -> its parameters' schemas


# ---- the generic readers (JSON, Qwen3-Coder XML, pythonic) ----------------------------------------
def as_call(obj: Any) -> dict[str, Any] | None:
    if not isinstance(obj, dict):
        return None
    if isinstance(obj.get("function"), dict):  # OpenAI-style wrapper
        obj = obj["function"]
    name = obj.get("name", obj.get("tool_name"))  # Command R's calls name the tool `tool_name`
    if not isinstance(name, str) or not name:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return {"function": {"name": name, "arguments": args}}


def calls_of(obj: Any) -> list[dict[str, Any]] | None:
    items = obj if isinstance(obj, list) else [obj]
    calls = [as_call(item) for item in items]
    if not calls or any(c is None for c in calls):
        return None
    return calls  # type: ignore[return-value]


def parse_json_calls(text: str) -> list[dict[str, Any]] | None:
    text = text.strip()
    if text.startswith("```"):
        text = re.sub(r"^```[a-zA-Z]*\s*|\s*```$", "", text)
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    return calls_of(obj)


_DECODER = json.JSONDecoder()


def decode_prefix(text: str) -> tuple[Any, int] | None:
    """The first complete JSON value at the start of `text` (after whitespace) and where it ends."""
    start = len(text) - len(text.lstrip())
    try:
        return _DECODER.raw_decode(text, start)
    except ValueError:
        return None


_XML_FUNCTION = re.compile(r"<function=([^>\s]+)>(.*?)</function>", re.S)
_XML_PARAMETER = re.compile(r"<parameter=([^>\s]+)>(.*?)</parameter>", re.S)


def xml_value(text: str, schema_type: Any) -> Any:
    """A Qwen3-Coder parameter's text as its schema types it: strings stay text, the rest read as JSON
    (a value that is no JSON stays text)."""
    value = text.removeprefix("\n").removesuffix("\n")
    if schema_type == "string":
        return value
    try:
        return json.loads(value)
    except ValueError:
        return value


def parse_xml_calls(text: str, types: Mapping[str, Mapping[str, Any]]) -> list[dict[str, Any]] | None:
    """Qwen3-Coder's `<function=f><parameter=p>v</parameter>...</function>` (one or more), or None when the
    text is anything else (then the block is no call)."""
    rest = _XML_FUNCTION.sub("", text).strip()
    found = _XML_FUNCTION.findall(text)
    if not found or rest:
        return None
    calls = []
    for name, body in found:
        params = _XML_PARAMETER.findall(body)
        if _XML_PARAMETER.sub("", body).strip():
            return None  # text between the parameters: not this format
        known = types.get(name, {})
        args = {p: xml_value(v, (known.get(p) or {}).get("type")) for p, v in params}
        calls.append({"function": {"name": name, "arguments": args}})
    return calls


_PY_CONSTANTS = {"true": True, "false": False, "null": None, "none": None}


def _py_value(node: ast.expr) -> Any:
    if isinstance(node, ast.Name) and node.id.lower() in _PY_CONSTANTS:
        return _PY_CONSTANTS[node.id.lower()]
    return ast.literal_eval(node)


def _py_name(node: ast.expr) -> str | None:
    """`f` or `module.f` as the call's name."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        owner = _py_name(node.value)
        return f"{owner}.{node.attr}" if owner else None
    return None


def parse_pythonic(text: str) -> tuple[list[dict[str, Any]], int] | None:
    """Llama's pythonic calls at the start of `text`, `[f(a=1), g(b="x")]`, and where the list ends; None
    while no complete list of keyword-only calls with literal values is there."""
    start = len(text) - len(text.lstrip())
    if not text.startswith("[", start):
        return None
    for end in (m.end() for m in re.finditer(r"\]", text)):
        try:
            node = ast.parse(text[start:end].strip(), mode="eval").body
        except (SyntaxError, ValueError):
            continue
        if not isinstance(node, ast.List) or not node.elts:
            return None
        calls = []
        for item in node.elts:
            name = _py_name(item.func) if isinstance(item, ast.Call) else None
            if name is None or not isinstance(item, ast.Call) or item.args:
                return None
            try:
                args = {kw.arg: _py_value(kw.value) for kw in item.keywords if kw.arg is not None}
            except (ValueError, SyntaxError):
                return None
            if len(args) != len(item.keywords):
                return None  # **kwargs
            calls.append({"function": {"name": name, "arguments": args}})
        return calls, end
    return None


# ---- values -----------------------------------------------------------------------------------------
def typed_value(text: str, schema: Mapping[str, Any] | None) -> Any:
    """An argument written as text: kept as text for a string parameter (or one the schema does not
    name as anything else), read as JSON otherwise (a value that is no JSON stays text)."""
    kind = (schema or {}).get("type")
    if kind == "string":
        return text
    try:
        return json.loads(text)
    except ValueError:
        return text


def _call(name: str, args: dict[str, Any]) -> dict[str, Any]:
    return {"function": {"name": name.strip(), "arguments": args}}


def _only(pattern: re.Pattern[str], text: str) -> list[re.Match[str]] | None:
    """Every match of `pattern` in `text`, or None when anything but whitespace lies between them."""
    found = list(pattern.finditer(text))
    if not found or pattern.sub("", text).strip():
        return None
    return found


def _json_object(text: str) -> dict[str, Any] | None:
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


# ---- one reader per family ---------------------------------------------------------------------------
def _glm_reader(suffix: str = "", sep: str = "") -> Callable[[str, Types], Calls | None]:
    key = re.compile(
        rf"<arg_key{suffix}>(.*?)</arg_key{suffix}>\s*<arg_value{suffix}>(.*?)</arg_value{suffix}>", re.S
    )
    call = re.compile(rf"<tool_call{suffix}>(.*?)</tool_call{suffix}>", re.S)

    def one(body: str, types: Types) -> dict[str, Any] | None:
        head, _, rest = body.partition(f"<arg_key{suffix}>")
        rest = f"<arg_key{suffix}>" + rest if rest else ""
        name = head.replace(sep, "").strip() if sep else head.strip()
        if not name or "<" in name or (rest and _only(key, rest) is None):
            return None
        known = types.get(name, {})
        return _call(name, {k.strip(): typed_value(v, known.get(k.strip())) for k, v in key.findall(rest)})

    def read(body: str, types: Types) -> Calls | None:
        if suffix:  # a section of calls, each in its own tags
            found = _only(call, body)
            bodies = [m.group(1) for m in found] if found else None
        else:
            bodies = [body]
        if not bodies:
            return None
        calls = [one(b, types) for b in bodies]
        return None if any(c is None for c in calls) else calls  # type: ignore[return-value]

    return read


_KIMI_CALL = re.compile(
    r"<\|tool_call_begin\|>\s*(?:functions\.)?([^<]+?)(?::\d+)?\s*<\|tool_call_argument_begin\|>(.*?)"
    r"<\|tool_call_end\|>",
    re.S,
)


def _read_kimi(body: str, types: Types) -> Calls | None:
    found = _only(_KIMI_CALL, body)
    return _json_calls(found, 1, 2)


def _json_calls(found: list[re.Match[str]] | None, name_group: int, args_group: int) -> Calls | None:
    if not found:
        return None
    calls = []
    for m in found:
        args = _json_object(m.group(args_group).strip())
        if args is None:
            return None
        calls.append(_call(m.group(name_group), args))
    return calls


_DEEPSEEK_CALL = re.compile(r"<｜tool▁call▁begin｜>(.*?)<｜tool▁sep｜>(.*?)<｜tool▁call▁end｜>", re.S)
_FENCED = re.compile(r"\s*([^\n`]+?)\s*\n```(?:json)?\s*\n?(.*?)\n?```\s*$", re.S)


def _read_deepseek(body: str, types: Types) -> Calls | None:
    found = _only(_DEEPSEEK_CALL, body)
    if not found:
        return None
    calls = []
    for m in found:
        kind, rest = m.group(1).strip(), m.group(2)
        args = _json_object(rest.strip())
        if args is not None:  # V3.1: the name, then the arguments
            calls.append(_call(kind, args))
            continue
        fenced = _FENCED.match(rest)  # R1: the type, then the name and a fenced JSON block
        args = _json_object(fenced.group(2)) if fenced else None
        if fenced is None or args is None:
            return None
        calls.append(_call(fenced.group(1), args))
    return calls


def _invoke_reader(prefix: str) -> Callable[[str, Types], Calls | None]:
    p = re.escape(prefix)
    invoke = re.compile(rf'<{p}invoke name="([^"]+)">(.*?)</{p}invoke>', re.S)
    param = re.compile(rf'<{p}parameter name="([^"]+)"(?: string="(true|false)")?>(.*?)</{p}parameter>', re.S)

    def read(body: str, types: Types) -> Calls | None:
        found = _only(invoke, body)
        if not found:
            return None
        calls = []
        for m in found:
            name, inner = m.group(1), m.group(2)
            params = _only(param, inner) if inner.strip() else []
            if params is None:
                return None
            known = types.get(name, {})
            args = {}
            for pm in params:
                key, is_string, value = pm.group(1), pm.group(2), pm.group(3)
                schema = {"type": "string"} if is_string == "true" else known.get(key)
                args[key] = typed_value(value, None if is_string == "false" else schema)
            calls.append(_call(name, args))
        return calls

    return read


_M3_TOKEN = "]<]minimax[>["
_M3_INVOKE = re.compile(r'<invoke name="([^"]+)">(.*?)</invoke>', re.S)
_XML_ELEMENT = re.compile(r"<([A-Za-z_][\w.\-]*)>(.*?)</\1>", re.S)


def _xml_tree(text: str) -> Any:
    """MiniMax-M3's nested arguments: `<item>` children make a list, other children an object, a leaf
    is read as JSON where it is JSON (else text)."""
    found = _only(_XML_ELEMENT, text)
    if not found:
        return typed_value(text, None)
    if all(m.group(1) == "item" for m in found):
        return [_xml_tree(m.group(2)) for m in found]
    return {m.group(1): _xml_tree(m.group(2)) for m in found}


def _read_minimax_m3(body: str, types: Types) -> Calls | None:
    found = _only(_M3_INVOKE, body.replace(_M3_TOKEN, ""))
    if not found:
        return None
    calls = []
    for m in found:
        known = types.get(m.group(1), {})
        inner = m.group(2)
        elements = _only(_XML_ELEMENT, inner) if inner.strip() else []
        if elements is None:
            return None
        args = {}
        for e in elements:
            leaf = _only(_XML_ELEMENT, e.group(2)) is None
            args[e.group(1)] = (
                typed_value(e.group(2), known.get(e.group(1))) if leaf else _xml_tree(e.group(2))
            )
        calls.append(_call(m.group(1), args))
    return calls


def _read_seed(body: str, types: Types) -> Calls | None:
    return parse_xml_calls(body, types)


def _read_lfm2(body: str, types: Types) -> Calls | None:
    parsed = parse_pythonic(body)
    if parsed is None or body[parsed[1] :].strip():
        return None
    return parsed[0]


_FUNCTIONARY = re.compile(r"^([^>\s]+)>(.*)$", re.S)


def _read_functionary(body: str, types: Types) -> Calls | None:
    m = _FUNCTIONARY.match(body.strip())
    args = _json_object(m.group(2).strip()) if m else None
    return [_call(m.group(1), args)] if m and args is not None else None


_MINICPM = re.compile(r'^([^"]+)">(.*)$', re.S)
_MINICPM_PARAM = re.compile(r'<param name="([^"]+)">(.*?)</param>', re.S)


def _read_minicpm(body: str, types: Types) -> Calls | None:
    m = _MINICPM.match(body.strip())
    if m is None:
        return None
    params = _only(_MINICPM_PARAM, m.group(2)) if m.group(2).strip() else []
    if params is None:
        return None
    known = types.get(m.group(1), {})
    return [_call(m.group(1), {p.group(1): typed_value(p.group(2), known.get(p.group(1))) for p in params})]


def _read_apertus(body: str, types: Types) -> Calls | None:
    try:
        items = json.loads(body)
    except ValueError:
        return None
    items = items if isinstance(items, list) else [items]
    calls = []
    for item in items:  # each call is {name: arguments}
        if not isinstance(item, dict) or len(item) != 1:
            return None
        [(name, args)] = item.items()
        if not isinstance(args, dict):
            return None
        calls.append(_call(name, args))
    return calls or None


def _read_json_lines(body: str, types: Types) -> Calls | None:
    """A JSON call or list of calls, or one JSON call per line (MiniMax-M1)."""
    whole = parse_json_calls(body)
    if whole is not None:
        return whole
    lines = [line for line in body.splitlines() if line.strip()]
    calls = [parse_json_calls(line) for line in lines]
    if not calls or any(c is None for c in calls):
        return None
    return [c for group in calls for c in group]  # type: ignore[union-attr]


_SOLAR_CALL = re.compile(
    r"<\|tool_call:begin\|>[^<]*<\|tool_call:name\|>([^<]+)<\|tool_call:args\|>(.*?)<\|tool_call:end\|>", re.S
)


def _read_solar(body: str, types: Types) -> Calls | None:
    # `<|calls|>` ends the turn (the model stops there, so the block is read at the end of the reply)
    # and may come after several `<|tool_calls|>` openers
    return _json_calls(_only(_SOLAR_CALL, body.replace("<|tool_calls|>", "")), 1, 2)


_GEMMA_QUOTE = '<|"|>'
_GEMMA_CALL = re.compile(r"^\s*call:([^{\s]+)\s*(\{.*\})\s*$", re.S)
_BARE_KEY = re.compile(r"([{,]\s*)([A-Za-z_][\w\-.]*)\s*:")


def gemma_value(text: str) -> Any:
    """Gemma 4's argument syntax as JSON: keys bare, strings between `<|"|>` quotes."""
    parts = text.split(_GEMMA_QUOTE)
    if len(parts) % 2 == 0:
        raise ValueError("an unclosed string")
    out = []
    for i, part in enumerate(parts):
        out.append(json.dumps(part) if i % 2 else _BARE_KEY.sub(r'\1"\2":', part))
    return json.loads("".join(out))


def _read_gemma4(body: str, types: Types) -> Calls | None:
    m = _GEMMA_CALL.match(body)
    if m is None:
        return None
    try:
        args = gemma_value(m.group(2))
    except ValueError:
        return None
    return [_call(m.group(1), args)] if isinstance(args, dict) else None


_K3_CALL = re.compile(r'<\|open\|>call tool="([^"]+)"[^<]*<\|sep\|>(.*?)<\|close\|>call<\|sep\|>', re.S)
_K3_ARG = re.compile(
    r'<\|open\|>argument key="([^"]+)"(?: type="([^"]*)")?<\|sep\|>(.*?)<\|close\|>argument<\|sep\|>', re.S
)


def _read_kimi_k3(body: str, types: Types) -> Calls | None:
    found = _only(_K3_CALL, body)
    if not found:
        return None
    calls = []
    for m in found:
        args_found = _only(_K3_ARG, m.group(2)) if m.group(2).strip() else []
        if args_found is None:
            return None
        args = {a.group(1): typed_value(a.group(3), {"type": a.group(2)}) for a in args_found}
        calls.append(_call(m.group(1), args))
    return calls


# ---- the table ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Block:
    """One family's call block: the marker that opens it, the one that closes it (None: the call ends
    where its JSON ends), the other markers inside it, and its reader (body, parameter types) -> calls."""

    opener: str
    closer: str | None
    read: Callable[[str, Types], Calls | None]
    inner: tuple[str, ...] = ()

    @property
    def markers(self) -> tuple[str, ...]:
        return tuple(m for m in (self.opener, self.closer, *self.inner) if m)


BLOCKS: dict[str, Block] = {
    "glm": Block(
        "<tool_call>",
        "</tool_call>",
        _glm_reader(),
        ("<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"),
    ),
    "hy3": Block(
        "<tool_calls:opensource>",
        "</tool_calls:opensource>",
        _glm_reader(":opensource", "<tool_sep:opensource>"),
        tuple(
            f"<{slash}{tag}:opensource>"
            for tag in ("tool_call", "arg_key", "arg_value")
            for slash in ("", "/")
        )
        + ("<tool_sep:opensource>",),
    ),
    "kimi": Block(
        "<|tool_calls_section_begin|>",
        "<|tool_calls_section_end|>",
        _read_kimi,
        ("<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"),
    ),
    "deepseek": Block(
        "<｜tool▁calls▁begin｜>",
        "<｜tool▁calls▁end｜>",
        _read_deepseek,
        ("<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"),
    ),
    "dsml": Block("<｜DSML｜function_calls>", "</｜DSML｜function_calls>", _invoke_reader("｜DSML｜")),
    "dsml-v4": Block("<｜DSML｜tool_calls>", "</｜DSML｜tool_calls>", _invoke_reader("｜DSML｜")),
    "minimax": Block("<minimax:tool_call>", "</minimax:tool_call>", _invoke_reader("")),
    "minimax-m3": Block(
        _M3_TOKEN + "<tool_call>", _M3_TOKEN + "</tool_call>", _read_minimax_m3, (_M3_TOKEN,)
    ),
    "seed": Block("<seed:tool_call>", "</seed:tool_call>", _read_seed),
    "lfm2": Block("<|tool_call_start|>", "<|tool_call_end|>", _read_lfm2),
    "functionary": Block("<function=", "</function>", _read_functionary),
    "minicpm": Block('<function name="', "</function>", _read_minicpm),
    "cohere": Block("<|START_ACTION|>", "<|END_ACTION|>", _read_json_lines),
    # Command R+: the fence's opening line is part of the marker, else the closing fence would match it
    "command-r": Block("Action:\n```json", "```", _read_json_lines),
    "apertus": Block("<|tools_prefix|>", "<|tools_suffix|>", _read_apertus),
    "tool-list": Block("<tool_calls>", "</tool_calls>", _read_json_lines),
    "nemotron": Block("<TOOLCALL>", "</TOOLCALL>", _read_json_lines),
    "solar": Block(
        "<|tool_calls|>",
        "<|calls|>",
        _read_solar,
        ("<|tool_call:begin|>", "<|tool_call:name|>", "<|tool_call:args|>", "<|tool_call:end|>"),
    ),
    "gemma4": Block("<|tool_call>", "<tool_call|>", _read_gemma4, (_GEMMA_QUOTE,)),
    "kimi-k3": Block(
        "<|open|>tools<|sep|>", "<|close|>tools<|sep|>", _read_kimi_k3, ("<|open|>", "<|close|>", "<|sep|>")
    ),
    "gigachat": Block("<|function_call|>", None, _read_json_lines),
}
FAMILY_STYLES = tuple(BLOCKS)

# (style, texts that all appear in the family's template), tried in order: the more specific first (a
# GLM template also shows `<tool_call>`, Hermes' marker; Apriel's shows `<tool_call>` beside `<tool_calls>`)
_DETECT: tuple[tuple[str, tuple[str, ...]], ...] = (
    # DeepSeek's templates spell the DSML tags by joining '｜DSML｜' to the tag's name
    ("dsml", ("｜DSML｜", "function_calls>")),
    ("dsml-v4", ("｜DSML｜", "tool_calls>")),
    ("deepseek", ("tool▁calls▁begin",)),
    ("kimi", ("<|tool_calls_section_begin|>",)),
    ("kimi-k3", ("<|open|>", "open_tag('call'")),  # its tags are built by a macro
    ("minimax-m3", (_M3_TOKEN, "<invoke name=")),
    ("minimax", ("<minimax:tool_call>",)),
    ("seed", ("<seed:tool_call>",)),
    ("hy3", ("<tool_call{}>", ":opensource")),  # its tags are formatted with the suffix
    ("lfm2", ("<|tool_call_start|>",)),
    ("lfm2", ("<|tool_list_start|>",)),  # LFM2's first template lists tools but renders no call
    ("cohere", ("<|START_ACTION|>",)),
    ("command-r", ("Action:", "tool_name")),
    ("apertus", ("<|tools_prefix|>",)),
    ("nemotron", ("<TOOLCALL>",)),
    ("solar", ("<|tool_calls|>", "<|tool_call:begin|>")),
    ("gemma4", ("<|tool_call>", "<tool_call|>")),
    ("gigachat", ("<|function_call|>",)),
    ("glm", ("<arg_key>", "<tool_call>")),
    ("tool-list", ("<tool_calls>",)),
    ("minicpm", ('<function name="', "<param name=")),
)


def detect_family_style(template: str) -> str | None:
    """The block family whose markers the template shows, or None (then the older styles are tried)."""
    for style, needles in _DETECT:
        if all(n in template for n in needles):
            return style
    if "<function=" in template and "<tool_call>" not in template and "<|python_tag|>" in template:
        return "functionary"  # v3.1; Qwen3-Coder writes the same `<function=` inside <tool_call>
    return None


def parse_block(style: str, body: str, types: Types) -> Calls | None:
    """The calls in one block of the family's syntax (what lies between its markers), or None when the
    block is no call: a plain JSON call first, then the family's own syntax."""
    calls = parse_json_calls(body)
    if calls is None:
        calls = BLOCKS[style].read(body, types)
    return calls
