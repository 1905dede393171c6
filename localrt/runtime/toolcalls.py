"""Best-effort parsing of tool calls out of model text (Hermes/Qwen `<tool_call>` blocks, bare JSON).

Calls come back in Ollama's shape: `{"function": {"name": str, "arguments": dict}}`.
"""

from __future__ import annotations

import json
import re
from typing import Any

_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
OPENERS = ("<tool_call>", "{", "[", "```")


def _as_call(obj: Any) -> dict[str, Any] | None:
    if not isinstance(obj, dict):
        return None
    if isinstance(obj.get("function"), dict):  # OpenAI-style wrapper
        obj = obj["function"]
    name = obj.get("name")
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


def _parse_json_calls(text: str) -> list[dict[str, Any]] | None:
    text = text.strip()
    if text.startswith("```"):
        text = re.sub(r"^```[a-zA-Z]*\s*|\s*```$", "", text)
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    items = obj if isinstance(obj, list) else [obj]
    calls = [_as_call(item) for item in items]
    if not calls or any(c is None for c in calls):
        return None
    return calls  # type: ignore[return-value]


def parse_tool_calls(text: str) -> tuple[str, list[dict[str, Any]]]:
    """Split model output into (remaining content, tool calls). No calls found: (text, [])."""
    calls: list[dict[str, Any]] = []
    if "<tool_call>" in text:
        for match in _BLOCK.finditer(text):
            parsed = _parse_json_calls(match.group(1))
            if parsed:
                calls.extend(parsed)
        if calls:
            return _BLOCK.sub("", text).strip(), calls
        return text, []
    parsed = _parse_json_calls(text)
    if parsed:
        return "", parsed
    return text, []


def could_be_tool_call(prefix: str) -> bool:
    """While streaming: might the output (so far) turn into a tool call? Then hold it back."""
    head = prefix.lstrip()
    if not head:
        return True
    return any(head.startswith(o) or o.startswith(head) for o in OPENERS)
