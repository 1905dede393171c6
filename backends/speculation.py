"""Speculative decoding shared by the engines: the method a request runs, its state and policy, the
exact verifier and the break-even rule.

A proposer proposes k draft tokens; the target scores [last, d1..dk] in one pass and `verify` keeps a
prefix:

  accept d_j with probability min(1, p_j(d_j) / q_j(d_j)); at the first rejection draw from
  norm(max(p_j - q_j, 0)); if every draft token survives, draw a bonus token from p_k.

This keeps the target's distribution exactly (Leviathan et al. 2023); a deterministic draft token is
q = one-hot, and greedy decoding reduces to "keep draft tokens while they equal the target's argmax".
`verify` is written over any array type with numpy/torch semantics (indexing, `clip`, `sum`), so
the torch engine runs it on device tensors and the MLX engine on numpy rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from dataclasses import field
from typing import Any
from typing import Protocol

from localrt.backends.lookup import NgramProposer

DEFAULT_NUM_DRAFT = {"lookup": 8, "self": 4, "draft": 4}  # draft tokens per step (num_speculative_tokens)
WARMUP_DRAFTS = 24  # draft tokens seen before a request's acceptance rate is trusted
# Extra query rows of one verify pass, in units of a one-token step: a CPU is compute-bound (every
# draft token costs), a GPU bandwidth-bound at decode (extra rows are nearly free).
VERIFY_COST_PER_DRAFT = {"cpu": 0.25, "gpu": 0.03}


def verify_cost_per_draft(on_gpu: bool) -> float:
    """What verifying one draft token costs on this device (VERIFY_COST_PER_DRAFT)."""
    return VERIFY_COST_PER_DRAFT["gpu" if on_gpu else "cpu"]


def speculative_method(mode: str, *, has_draft_model: bool, constrained: bool) -> str:
    """The method a checked request runs: "auto" is the draft model when one is loaded, else off; a
    grammar (`format`) decides token by token, so nothing is proposed ahead of it."""
    if mode == "auto":
        mode = "draft" if has_draft_model else "off"
    return "off" if constrained else mode


@dataclass
class SpecState:
    """One request's speculation: its method, the draft tokens a step proposes (`k`), whether it still
    pays, and its counts. One policy for every engine (`record`)."""

    mode: str  # "lookup" | "self" | "draft"
    k: int  # draft tokens the next step proposes (num_speculative_tokens), adapted by `record`
    cost_per_draft: float  # draft + verify cost of one draft token, in units of one target decode step
    k_max: int = 0  # the request's num_draft; 0: `k` as given
    enabled: bool = True
    drafted: int = 0  # every draft token verified, and those kept (the request's usage reports them)
    accepted: int = 0
    paid: int = 0  # the draft tokens the policy asked for, and those kept (its acceptance rate)
    paid_accepted: int = 0
    ngram: NgramProposer | None = field(default=None, repr=False)  # the "lookup" method's index

    @classmethod
    def begin(cls, mode: str, num_draft: int | None, draft_cost: float, verify_cost: float) -> SpecState:
        """A request's state: `k` its num_draft, else the method's default (DEFAULT_NUM_DRAFT); a draft
        token costs its proposer's `draft_cost` plus `verify_cost`, in target decode steps."""
        return cls(mode, num_draft or DEFAULT_NUM_DRAFT[mode], draft_cost + verify_cost)

    def __post_init__(self) -> None:
        self.k_max = self.k_max or self.k
        if self.mode == "lookup" and self.ngram is None:
            self.ngram = NgramProposer()

    @property
    def acceptance(self) -> float:
        """The acceptance rate of the draft tokens the policy asked for."""
        return self.paid_accepted / self.paid if self.paid else 1.0

    def record(self, drafted: int, accepted: int, free: int = 0) -> None:
        """After a verify step. How many: all draft tokens kept doubles the next step's k (up to
        `k_max`), a rejection brings it to what was kept plus one (each proposed position costs a CPU a
        row). Whether at all: once the acceptance rate is trusted and below break-even for even one
        draft token per step, speculation stops for this request. `free`: the last of the draft tokens
        rode in rows the step cost anyway (a verify step filled to a tile of the CPU's attention
        kernel): counted, and kept when the target agrees, but not held against the policy."""
        if drafted <= 0:
            return
        self.drafted += drafted
        self.accepted += accepted
        paid = drafted - free
        kept = min(accepted, paid)
        self.paid += paid
        self.paid_accepted += kept
        self.k = min(self.k_max, 2 * self.k) if kept == paid else max(1, kept + 1)
        if self.paid >= WARMUP_DRAFTS and self.acceptance < break_even_acceptance(1, self.cost_per_draft):
            self.enabled = False  # speculation costs this request more than it saves


class Sampler(Protocol):
    """What the verifier needs from a request's sampler (torch's RequestSampler, the numpy Sampler)."""

    greedy: bool

    def probs(self, logits: Any, history: Sequence[int]) -> Any: ...

    def draw(self, probs: Any) -> int: ...

    def uniform(self) -> float: ...

    def sample(self, logits: Any, history: Sequence[int]) -> int: ...


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens produced per verify step when each draft token survives with probability alpha."""
    if alpha >= 1.0:
        return k + 1.0
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def break_even_acceptance(k: int, cost_per_draft: float) -> float:
    """The acceptance rate below which k draft tokens per step are slower than plain decoding."""
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

    The tokens are the accepted draft tokens plus one more: the correction after a rejection or the
    bonus. `draft_q` [k, V] holds the draft distributions (None: deterministic draft tokens, q one-hot);
    `history` is the sequence before the draft tokens (for penalties).
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
