"""A model's caches and the model-based proposers of the batched engine (batch.py).

A `Runner` is a model with its own caches and the tokens they hold: the batched engine gives each row
one (its target), and a draft model has its own. `SelfProposer` and `DraftModelProposer` propose a
step's draft tokens for one row (with their distributions when sampling); the engine verifies them
(speculation.verify: exact for sampling too) and trims the rejected ones from the row's caches.
"lookup" draft tokens come from the row's own n-gram index, `SpecState.ngram`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import InitVar
from dataclasses import dataclass
from dataclasses import field
from typing import Any
from typing import Protocol

import mlx.core as mx
import numpy as np

from localrt.backends.base import common_prefix
from localrt.backends.sampler import Sampler

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


Proposal = tuple[list[int], np.ndarray | None]  # draft tokens, and their distributions [k, V] when sampled


class Proposer(Protocol):
    """Proposes a step's draft tokens from a model (`SelfProposer`, `DraftModelProposer`); "lookup" drafts
    come from the request's own n-gram index, `SpecState.ngram`."""

    cost_per_draft: float  # in units of one target decode step

    def propose(self, tokens: list[int], k: int, sampler: Sampler) -> Proposal: ...


def _draft_token(sampler: Sampler, logits: np.ndarray, history: list[int]) -> tuple[int, np.ndarray | None]:
    if sampler.greedy:
        return sampler.sample(logits, history), None
    q = sampler.probs(logits, history)
    return sampler.draw(q), q


def _model_draft_tokens(
    runner: Runner, first: Sequence[int], tokens: list[int], k: int, sampler: Sampler, num_layers: int | None
) -> tuple[list[int], list[np.ndarray]]:
    """k draft tokens from `runner` (fed `first` then each draft token but the last)."""
    drafts: list[int] = []
    qs: list[np.ndarray] = []
    feed = list(first)
    for _ in range(k):
        logits = runner.feed(feed, "last", num_layers)
        assert logits is not None
        d, q = _draft_token(sampler, logits, tokens + drafts)
        drafts.append(d)
        if q is not None:
            qs.append(q)
        feed = [d]
    return drafts, qs


@dataclass
class SelfProposer:
    """The target's first `num_layers` blocks + final norm + head, on the target's own caches.

    The draft tokens' KV in those layers is trimmed again before the verify pass recomputes them.
    """

    target: Runner
    num_layers: int
    cost_per_draft: float = field(init=False)

    def __post_init__(self) -> None:
        self.cost_per_draft = self.num_layers / self.target.model.cfg.block_count

    def propose(self, tokens: list[int], k: int, sampler: Sampler) -> Proposal:
        drafts, qs = _model_draft_tokens(self.target, [tokens[-1]], tokens, k, sampler, self.num_layers)
        trim_caches(self.target.caches[: self.num_layers], k)
        return drafts, np.stack(qs) if qs else None


@dataclass
class DraftModelProposer:
    """A smaller model with the same vocabulary and its own caches, caught up by prefix reuse."""

    draft: Runner
    cost_per_draft: float

    def propose(self, tokens: list[int], k: int, sampler: Sampler) -> Proposal:
        n = self.draft.reuse(tokens)
        drafts, qs = _model_draft_tokens(self.draft, tokens[n:], tokens, k, sampler, None)
        return drafts, np.stack(qs) if qs else None


class SelfOnRow:
    """Self-speculation on a row's own caches, which the engine gives the row (`row.runner`) when it
    admits it: a `SelfProposer` on whichever runner the row holds now."""

    def __init__(self, row: Any, num_layers: int, cost_per_draft: float) -> None:
        self.row, self.num_layers = row, num_layers
        self.cost_per_draft = cost_per_draft
        self._inner: SelfProposer | None = None

    def propose(self, tokens: list[int], k: int, sampler: Sampler) -> Proposal:
        if self._inner is None or self._inner.target is not self.row.runner:
            self._inner = SelfProposer(self.row.runner, self.num_layers)
        return self._inner.propose(tokens, k, sampler)
