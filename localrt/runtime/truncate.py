"""Fitting a prompt into the context (Ollama's `truncate`, on by default).

Chat: drop the oldest messages, never a system message nor the last one, until the rendered prompt leaves
room for an answer. Generate: keep the first `num_keep` tokens and drop the middle, as one context shift
would. With `truncate: false` the runtime refuses an oversized prompt with a 400 naming the sizes instead.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any


def fit_messages(
    messages: Sequence[dict[str, Any]], count: Callable[[list[dict[str, Any]]], int], limit: int
) -> list[dict[str, Any]]:
    """The messages with the oldest droppable ones removed until `count(messages) < limit` (or none left)."""
    kept = list(messages)
    while count(kept) >= limit:
        droppable = [i for i, m in enumerate(kept[:-1]) if m.get("role") != "system"]
        if not droppable:
            break
        del kept[droppable[0]]
    return kept


def fit_tokens(tokens: Sequence[int], limit: int, num_keep: int) -> list[int]:
    """A prompt of `limit` tokens or more cut to `limit - max((limit - num_keep) // 2, 1)`: the first
    `num_keep` tokens, then the newest ones (Ollama's generate truncation)."""
    if len(tokens) < limit:
        return list(tokens)
    keep = max(0, min(num_keep, limit // 2))
    target = limit - max((limit - keep) // 2, 1)
    return [*tokens[:keep], *tokens[len(tokens) - (target - keep) :]]
