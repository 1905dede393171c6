"""Sampling over numpy logits rows with the runtime's parameters (the MLX engine's sampler).

Same chain and semantics as the torch engine's device sampler (llama.cpp's order: penalties, top-k,
top-p, min-p, temperature, draw), and the same interface, so `speculation.verify` drives either.
Each request owns a seeded numpy Generator: its draws depend only on its seed and its history.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
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

    def _masked(self, logits: Any) -> Any:
        """logits [V] with what the grammar forbids next at -inf (the grammar runs on the host)."""
        assert self.grammar is not None
        return self.grammar.mask(np.asarray(logits, dtype=np.float32))

    def _pick(self, logits: Any, history: Sequence[int]) -> int:
        raise NotImplementedError


def penalty_knobs(samplers: Sequence[SamplerBase]) -> list[list[float]]:
    """A batch's penalty parameters, a row per request: repeat, frequency, presence."""
    return [
        [s.params.repeat_penalty, s.params.frequency_penalty, s.params.presence_penalty] for s in samplers
    ]


def chain_knobs(params: Sequence[SamplingParams], vocab: int) -> list[list[float]]:
    """A batch's chain parameters, a row per request: top-k (the vocabulary when off), top-p, min-p,
    temperature."""
    return [[p.top_k if 0 < p.top_k < vocab else vocab, p.top_p, p.min_p, p.temperature] for p in params]


def truncates(params: Sequence[SamplingParams], vocab: int) -> bool:
    """Whether any request of a batch cuts by top-k or top-p (the batch then sorts its rows)."""
    return any(0 < p.top_k < vocab or p.top_p < 1.0 for p in params)


class Sampler(SamplerBase):
    def __init__(self, params: SamplingParams, context_length: int, grammar: Grammar | None = None) -> None:
        super().__init__(params, context_length, grammar)
        self.rng = np.random.default_rng(self.seed)

    def penalized(self, logits: np.ndarray, history: Sequence[int]) -> np.ndarray:
        """logits [V] with llama.cpp's repeat / frequency / presence penalties over the recent window."""
        if not self.penalty_window or not history:
            return logits
        ids, counts = np.unique(np.asarray(history[-self.penalty_window :]), return_counts=True)
        p = self.params
        out = logits.astype(np.float32, copy=True)
        chosen = out[ids]
        chosen = np.where(chosen > 0, chosen / p.repeat_penalty, chosen * p.repeat_penalty)
        out[ids] = chosen - counts * p.frequency_penalty - p.presence_penalty
        return out

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
