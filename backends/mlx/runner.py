"""A model with its own caches and the tokens they hold (`Runner`): the MLX engine gives each row one
(its target), and a draft model has its own."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import InitVar
from dataclasses import dataclass
from dataclasses import field
from typing import Any

import mlx.core as mx
import numpy as np

from localrt.backends.base import common_prefix

from .cache import trim_caches
from .llama import Transformer


@dataclass(eq=False)
class Runner:
    """A model with its own caches and the tokens they hold (the target, or a draft model): `reused`
    caches holding `tokens` (a prompt-cache hit), or fresh empty ones."""

    model: Transformer
    kv_cache_type: str
    num_batch: int
    reused: InitVar[list[Any] | None] = None
    tokens: list[int] = field(default_factory=list)
    caches: list[Any] = field(init=False)

    def __post_init__(self, reused: list[Any] | None) -> None:
        self.num_batch = max(1, self.num_batch)
        self.caches = self.model.make_caches(self.kv_cache_type) if reused is None else reused

    def reuse(self, tokens: Sequence[int], keep_last: int = 1) -> int:
        """Trim the caches to their longest prefix shared with `tokens`, leaving at least `keep_last`
        tokens to feed (their logits are needed); returns how many tokens are reused."""
        n = min(common_prefix(self.tokens, tokens), max(0, len(tokens) - keep_last))
        if not all(c.can_trim(len(self.tokens) - n) for c in self.caches):
            # a sliding layer's cache no longer holds the window before position n: start over
            self.caches, n = self.model.make_caches(self.kv_cache_type), 0
            self.tokens.clear()
        self.trim(len(self.tokens) - n)
        return n

    def trim(self, n: int) -> None:
        if n > 0:
            trim_caches(self.caches, n)
            del self.tokens[len(self.tokens) - n :]

    def feed(
        self, tokens: Sequence[int], rows: str = "last", num_layers: int | None = None
    ) -> np.ndarray | None:
        """Append tokens to the caches, chunk by chunk; logits (float32 numpy) for the last token
        (rows="last": [V]), every token ("all": [n, V]) or none ("none")."""
        out: list[np.ndarray] = []
        caches = self.caches
        for s in range(0, len(tokens), self.num_batch):
            chunk = list(tokens[s : s + self.num_batch])
            last_chunk = s + self.num_batch >= len(tokens)
            hidden = self.model.hidden(mx.array(chunk, dtype=mx.int32), caches, num_layers)  # [n, dim]
            if rows == "all":
                out.append(np.array(self.model.logits(hidden)))
            elif rows == "last" and last_chunk:
                out.append(np.array(self.model.logits(hidden[-1:]))[0])
            else:
                mx.eval(hidden)  # materialises the chunk's KV in every layer; the head is skipped
            if num_layers is None:
                self.tokens.extend(chunk)
        if rows == "none":
            return None
        return np.concatenate(out) if rows == "all" else out[-1]
