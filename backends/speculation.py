"""Speculative decoding maths shared by the engines: the exact verifier and the break-even rule.

A proposer guesses k tokens; the target scores [last, d1..dk] in one pass and `verify` keeps a prefix:

  accept d_j with probability min(1, p_j(d_j) / q_j(d_j)); at the first rejection draw from
  norm(max(p_j - q_j, 0)); if every guess survives, draw a bonus token from p_k.

This keeps the target's distribution exactly (Leviathan et al. 2023); a deterministic guess is
q = one-hot, and greedy decoding reduces to "keep guesses while they equal the target's argmax".
`verify` is written over any array type with numpy/torch semantics (indexing, `clip`, `sum`), so
the torch engine runs it on device tensors and the MLX engine on numpy rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

DEFAULT_NUM_DRAFT = {"lookup": 8, "self": 4, "draft": 4}
WARMUP_DRAFTS = 24  # drafts seen before a request's acceptance rate is trusted


class Sampler(Protocol):
    """What the verifier needs from a request's sampler (torch's RequestSampler, the numpy Sampler)."""

    greedy: bool

    def probs(self, logits: Any, history: Sequence[int]) -> Any: ...

    def draw(self, probs: Any) -> int: ...

    def uniform(self) -> float: ...

    def sample(self, logits: Any, history: Sequence[int]) -> int: ...


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens produced per verify step when each guess survives with probability alpha."""
    if alpha >= 1.0:
        return k + 1.0
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def break_even_acceptance(k: int, cost_per_draft: float) -> float:
    """The acceptance rate below which k guesses per step are slower than plain decoding."""
    lo, hi = 0.0, 1.0
    cost = 1.0 + k * cost_per_draft
    if expected_tokens(1.0, k) <= cost:
        return 1.0
    for _ in range(40):  # expected_tokens is increasing in alpha: bisect
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected_tokens(mid, k) < cost else (lo, mid)
    return hi


def verify(
    sampler: Sampler,
    target_logits: Any,
    drafts: Sequence[int],
    draft_q: Any | None,
    history: Sequence[int],
) -> tuple[list[int], int]:
    """target_logits [k+1, V] for [last, d1..dk]; returns (tokens to append, drafts accepted).

    The tokens are the accepted drafts plus one more: the correction after a rejection or the bonus.
    `draft_q` [k, V] holds the draft distributions (None: deterministic guesses); `history` is the
    sequence before the drafts (for penalties).
    """
    k = len(drafts)
    hist = list(history)
    for j in range(k):
        d = drafts[j]
        if sampler.greedy:
            t = sampler.sample(target_logits[j], hist)
            if t != d:
                return [*drafts[:j], t], j
        else:
            p = sampler.probs(target_logits[j], hist)
            q_d = 1.0 if draft_q is None else float(draft_q[j, d])
            if not (q_d > 0 and sampler.uniform() < min(1.0, float(p[d]) / q_d)):
                # clip returns a fresh array (numpy and torch alike), so p itself is left alone
                residual = p.clip(min=0.0) if draft_q is None else (p - draft_q[j]).clip(min=0.0)
                if draft_q is None:
                    residual[d] = 0.0
                total = float(residual.sum())
                # p == q leaves nothing: then any draw from p is exact (the rejection had probability 0)
                t = sampler.draw(residual / total if total > 0 else p)
                return [*drafts[:j], t], j
        hist.append(d)
    return [*drafts, sampler.sample(target_logits[k], hist)], k
