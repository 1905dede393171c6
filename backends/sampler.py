"""Sampling over numpy logits rows with the runtime's parameters (the MLX engine's sampler).

Same chain and semantics as the torch engine's device sampler (llama.cpp's order: penalties, top-k,
top-p, min-p, temperature, draw), and the same interface, so `speculation.verify` drives either.
Each request owns a seeded numpy Generator: its draws depend only on its seed and its history.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from functools import cached_property
from typing import Any

import numpy as np

from localrt.backends.base import SamplingParams
from localrt.backends.grammar import Grammar


class SamplerBase:
    """What every engine's per-request sampler holds and does the same way (numpy here, torch, MLX):
    the parameters, the seed its draws start from, the penalty window, and `sample` with a grammar.
    An engine's sampler adds its random stream and the chain over its array library (`_pick`)."""

    def __init__(self, params: SamplingParams, context_length: int, grammar: Grammar | None = None) -> None:
        self.params = params
        self.greedy = params.greedy
        self.grammar = grammar  # `format`: sample() only picks what it allows (no speculation then)
        self.seed = params.seed if params.seed >= 0 else random.getrandbits(63)
        self.penalty_window = params.penalty_window(context_length)  # 0: no penalties

    def sample(self, logits: Any, history: Sequence[int]) -> int:
        if self.grammar is not None:  # constrained output: only what the grammar allows next
            logits = self._masked(logits)
        token = self._pick(logits, history)
        if self.grammar is not None:
            self.grammar.accept(token)
        return token

    @property
    def penalties(self) -> tuple[float, float, float]:
        """This request's `penalize` knobs: (repeat, frequency, presence)."""
        p = self.params
        return p.repeat_penalty, p.frequency_penalty, p.presence_penalty

    def penalized(self, logits: Any, history: Sequence[int]) -> Any:
        """logits [V] with llama.cpp's repeat / frequency / presence penalties over the recent window."""
        if not self.penalty_window or not history:
            return logits
        return self._apply_penalties(logits, history[-self.penalty_window :])

    def _apply_penalties(self, logits: Any, window: Sequence[int]) -> Any:
        """`penalized` over the engine's array library (`window` is not empty)."""
        raise NotImplementedError

    def _masked(self, logits: Any) -> Any:
        """logits [V] with what the grammar forbids next at -inf (the grammar runs on the host)."""
        assert self.grammar is not None
        return self.grammar.mask(np.asarray(logits, dtype=np.float32))

    def _pick(self, logits: Any, history: Sequence[int]) -> int:
        raise NotImplementedError


def penalize(xp: Any, x: Any, counts: Any, knobs: Any) -> Any:
    """llama.cpp's repeat / frequency / presence penalties, one formula for numpy, torch and MLX (`xp`: the
    array module): logits x [..., V], `counts` [..., V] how often each token is in the window, `knobs`
    (repeat, frequency, presence): numbers for one row, [B, 1] columns for a batch (`penalty_knobs`)."""
    repeat, frequency, presence = knobs
    out = xp.where(x > 0, x / repeat, x * repeat) - counts * frequency - presence
    return xp.where(counts > 0, out, x)


def penalty_knobs(samplers: Sequence[SamplerBase]) -> list[list[list[float]]]:
    """A batch's penalty parameters as `penalize` takes them: three [B, 1] columns (repeat, frequency,
    presence)."""
    return [[[s.penalties[k]] for s in samplers] for k in range(3)]


def chain_knobs(params: Sequence[SamplingParams], vocab: int) -> list[list[float]]:
    """A batch's chain parameters, a row per request: top-k (the vocabulary when off), top-p, min-p,
    temperature."""
    return [[p.top_k if 0 < p.top_k < vocab else vocab, p.top_p, p.min_p, p.temperature] for p in params]


def truncates(params: Sequence[SamplingParams], vocab: int) -> bool:
    """Whether any request of a batch cuts by top-k or top-p (the batch then sorts its rows)."""
    return any(0 < p.top_k < vocab or p.top_p < 1.0 for p in params)


class Sampler(SamplerBase):
    @cached_property
    def rng(self) -> np.random.Generator:
        """The request's random stream, from its seed."""
        return np.random.default_rng(self.seed)

    def _apply_penalties(self, logits: np.ndarray, window: Sequence[int]) -> np.ndarray:
        x = np.asarray(logits, dtype=np.float32)
        counts = np.bincount(np.asarray(window), minlength=x.shape[-1])  # int64: the penalties in float64
        return penalize(np, x, counts, self.penalties).astype(np.float32)  # rounded once, to float32

    def probs(self, logits: np.ndarray, history: Sequence[int]) -> np.ndarray:
        """The distribution a token is drawn from: logits [V] -> probabilities [V] (float64)."""
        x = self.penalized(np.asarray(logits, dtype=np.float32), history).astype(np.float64)
        p = self.params
        if self.greedy:
            out = np.zeros_like(x)
            out[int(x.argmax())] = 1.0
            return out
        if 0 < p.top_k < x.shape[-1]:
            kth = np.partition(x, -p.top_k)[-p.top_k]
            x = np.where(x < kth, -np.inf, x)
        if p.top_p < 1.0:
            order = np.argsort(-x, kind="stable")
            sorted_p = _softmax(x[order])
            # keep the smallest head whose mass reaches top_p (the token that crosses it stays)
            drop = (np.cumsum(sorted_p) - sorted_p) >= p.top_p
            x[order[drop]] = -np.inf
        if p.min_p > 0.0:
            probs = _softmax(x)
            x = np.where(probs < p.min_p * probs.max(), -np.inf, x)
        return _softmax(x / p.temperature)

    def draw(self, probs: np.ndarray) -> int:
        """One token from probs [V]: argmax(p / E) with E ~ Exp(1) is an exact draw from p."""
        if self.greedy:
            return int(probs.argmax())
        return int((probs / self.rng.exponential(size=probs.shape)).argmax())

    def uniform(self) -> float:
        return float(self.rng.random())

    def _pick(self, logits: np.ndarray, history: Sequence[int]) -> int:
        if self.greedy:
            return int(self.penalized(np.asarray(logits, dtype=np.float32), history).argmax())
        return self.draw(self.probs(logits, history))


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()
