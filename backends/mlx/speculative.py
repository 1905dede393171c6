"""The model-based proposers of the MLX engine (engine.py).

`SelfProposer` and `DraftModelProposer` propose a step's draft tokens for one row (with their
distributions when sampling), on a `runner.Runner` (the row's own caches, or a draft model's); the engine
verifies them (speculation.verify: exact for sampling too) and trims the rejected ones from the row's
caches. "lookup" draft tokens come from the row's own n-gram index, `SpecState.ngram`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from dataclasses import field
from typing import Any
from typing import Protocol

import numpy as np

from localrt.backends.sampler import Sampler

from .cache import trim_caches
from .runner import Runner

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
