"""Sampling over numpy logits rows with the runtime's parameters (the MLX engine's sampler).

Same chain and semantics as the torch engine's device sampler (llama.cpp's order: penalties, top-k,
top-p, min-p, temperature, draw), and the same interface, so `speculation.verify` drives either.
Each request owns a seeded numpy Generator: its draws depend only on its seed and its history.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import numpy as np

from localrt.backends.base import SamplingParams
from localrt.backends.grammar import Grammar


class Sampler:
    def __init__(self, params: SamplingParams, context_length: int, grammar: Grammar | None = None) -> None:
        self.params = params
        self.greedy = params.greedy
        self.grammar = grammar  # `format`: sample() only picks what it allows (no speculation then)
        seed = params.seed if params.seed >= 0 else random.getrandbits(63)
        self.rng = np.random.default_rng(seed)
        self.penalty_window = params.penalty_window(context_length)  # 0: no penalties

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

    def sample(self, logits: np.ndarray, history: Sequence[int]) -> int:
        if self.grammar is not None:  # constrained output: only what the grammar allows next
            logits = self.grammar.mask(np.asarray(logits, dtype=np.float32))
        if self.greedy:
            token = int(self.penalized(np.asarray(logits, dtype=np.float32), history).argmax())
        else:
            token = self.draw(self.probs(logits, history))
        if self.grammar is not None:
            self.grammar.accept(token)
        return token


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()
