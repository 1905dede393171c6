"""Fitting a prompt into the context (Ollama's `truncate`, on by default).

Chat: drop the oldest messages, never a system message nor the last one, until the rendered prompt leaves
room for an answer. Generate: keep the first `num_keep` tokens and drop the middle, as one context shift
would. With `truncate: false` the runtime refuses an oversized prompt with a 400 naming the sizes instead.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence
from typing import Any


def drop_oldest(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]] | None:
    """The messages without the oldest one that may go (never a system message nor the last); None if none."""
    droppable = [i for i, m in enumerate(messages[:-1]) if m.get("role") != "system"]
    if not droppable:
        return None
    return [m for i, m in enumerate(messages) if i != droppable[0]]


def fit_messages(
    messages: Sequence[dict[str, Any]], count: Callable[[list[dict[str, Any]]], int], limit: int
) -> list[dict[str, Any]]:
    """The messages with the oldest droppable ones removed until `count(messages) < limit` (or none left)."""
    kept = list(messages)
    while count(kept) >= limit:
        fewer = drop_oldest(kept)
        if fewer is None:
            break
        kept = fewer
    return kept


def fit_tokens(tokens: Sequence[int], limit: int, num_keep: int) -> list[int]:
    """A prompt of `limit` tokens or more cut to `limit - max((limit - num_keep) // 2, 1)`: the first
    `num_keep` tokens, then the newest ones (Ollama's generate truncation)."""
    if len(tokens) < limit:
        return list(tokens)
    keep = max(0, min(num_keep, limit // 2))
    target = limit - max((limit - keep) // 2, 1)
    return [*tokens[:keep], *tokens[len(tokens) - (target - keep) :]]
