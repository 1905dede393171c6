"""Anthropic's `context_management` edits, applied to a request's messages before they are rendered.

- `clear_thinking_*`: thinking blocks of all but the last `keep` assistant turns that have some are
  dropped (`keep: "all"` keeps every one; the default keeps the last turn's).
- `clear_tool_uses_*`: once more tool uses than the trigger's `value` are in the history (a trigger of
  type `tool_uses`), the results of all but the last `keep` of them are replaced by a placeholder
  (their inputs too with `clear_tool_inputs`); tools named in `exclude_tools` are kept. A trigger
  counted in `input_tokens` (the default) would need the prompt rendered first, so such an edit is
  accepted and reported as not applied.

Applied edits are reported in the answer's `context_management.applied_edits`, others in a warning.
"""

from __future__ import annotations

from dataclasses import dataclass
from dataclasses import field
from typing import Any

from localrt.api.translate import ParamError

CLEARED = "[tool result cleared to save context]"
DEFAULT_KEPT_TOOL_USES = 3


@dataclass
class EditReport:
    applied: list[dict[str, Any]] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # why an edit changed nothing


def apply_edits(raw: Any, messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], EditReport]:
    """The messages with the edits applied (a new list; the request's own stay as sent)."""
    report = EditReport()
    if raw is None or not all(isinstance(m, dict) for m in messages):
        return messages, report  # malformed messages get their own 400 when they are read
    edits = raw.get("edits") if isinstance(raw, dict) else None
    if not isinstance(edits, list):
        raise ParamError("context_management", "must be {edits: [...]}")
    out = [dict(m) for m in messages]
    for i, edit in enumerate(edits):
        kind = edit.get("type") if isinstance(edit, dict) else None
        if not isinstance(kind, str):
            raise ParamError(f"context_management.edits.{i}", "every edit needs a type")
        if kind.startswith("clear_thinking_"):
            out = _clear_thinking(edit, out, report)
        elif kind.startswith("clear_tool_uses_"):
            out = _clear_tool_uses(edit, out, report)
        else:
            report.skipped.append(f"context_management edit {kind!r} is not known here")
    return out, report


def _blocks(message: dict[str, Any]) -> list[Any]:
    content = message.get("content")
    return content if isinstance(content, list) else []


def _clear_thinking(edit: dict[str, Any], messages: list[dict[str, Any]], report: EditReport) -> list[Any]:
    keep = edit.get("keep", {"type": "thinking_turns", "value": 1})
    if keep == "all":
        return messages
    if not isinstance(keep, dict) or not isinstance(keep.get("value"), int) or keep["value"] < 0:
        raise ParamError(
            "context_management", "clear_thinking keep must be 'all' or {type: thinking_turns, value}"
        )
    thinking = ("thinking", "redacted_thinking")
    turns = [
        i
        for i, m in enumerate(messages)
        if m.get("role") == "assistant"
        and any(isinstance(b, dict) and b.get("type") in thinking for b in _blocks(m))
    ]
    cleared = turns[: max(0, len(turns) - keep["value"])]
    for i in cleared:
        kept = [b for b in _blocks(messages[i]) if not (isinstance(b, dict) and b.get("type") in thinking)]
        messages[i] = {**messages[i], "content": kept}
    if cleared:
        report.applied.append(
            {"type": edit["type"], "cleared_thinking_turns": len(cleared), "cleared_input_tokens": 0}
        )
    return messages


def _tool_uses(messages: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """(id, name) of every tool_use block, in order."""
    return [
        (b.get("id"), b.get("name"))
        for m in messages
        if m.get("role") == "assistant"
        for b in _blocks(m)
        if isinstance(b, dict) and b.get("type") == "tool_use"
    ]


def _clear_tool_uses(edit: dict[str, Any], messages: list[dict[str, Any]], report: EditReport) -> list[Any]:
    trigger = edit.get("trigger") or {"type": "input_tokens", "value": 100_000}
    if not isinstance(trigger, dict) or trigger.get("type") != "tool_uses":
        report.skipped.append(f"{edit['type']} with an input_tokens trigger is not applied")
        return messages
    uses = _tool_uses(messages)
    if not isinstance(trigger.get("value"), int) or len(uses) <= trigger["value"]:
        return messages
    keep = edit.get("keep") or {}
    kept = keep.get("value", DEFAULT_KEPT_TOOL_USES) if isinstance(keep, dict) else DEFAULT_KEPT_TOOL_USES
    excluded = set(edit.get("exclude_tools") or [])
    old = uses[: max(0, len(uses) - int(kept))]
    ids = {call_id for call_id, name in old if name not in excluded}
    if not ids:
        return messages
    inputs = edit.get("clear_tool_inputs") is True
    messages = [
        {**m, "content": [_cleared(b, ids, inputs) for b in _blocks(m)]} if _blocks(m) else m
        for m in messages
    ]
    report.applied.append({"type": edit["type"], "cleared_tool_uses": len(ids), "cleared_input_tokens": 0})
    return messages


def _cleared(block: Any, ids: set[str], inputs: bool) -> Any:
    if not isinstance(block, dict):
        return block
    if block.get("type") == "tool_result" and block.get("tool_use_id") in ids:
        return {**block, "content": CLEARED}
    if inputs and block.get("type") == "tool_use" and block.get("id") in ids:
        return {**block, "input": {}}
    return block
