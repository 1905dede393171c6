"""Sampling on the device: a whole step's rows through one chain, each request drawing with its own key.

The chain is the numpy reference's (`localrt.backends.sampler.Sampler`, llama.cpp's order): penalties,
top-k, top-p, min-p, temperature, draw. The knobs are [rows, 1] arrays, so every row of a step goes
through the same operations at once; each operation works row by row over the whole vocabulary, so a
row's result does not depend on the other rows. Top-k and top-p become one cut-off value per row,
read off a descending sort on the device (no host argsort). Each request owns an `mx.random` key that
is split once per draw: its tokens depend only on its seed and its own history, never on the batch.

`RowSampler` also offers the per-row interface `speculation.verify` and the proposers use (`probs`,
`draw`, `uniform`, `sample` over numpy rows), with the same keys, so a request that speculates or
follows a grammar draws from the same stream as one that does not.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from localrt.backends.base import SamplingParams
from localrt.backends.grammar import Grammar
from localrt.backends.sampler import SamplerBase
from localrt.backends.sampler import chain_knobs
from localrt.backends.sampler import penalize
from localrt.backends.sampler import penalty_knobs
from localrt.backends.sampler import truncates

NEG_INF = float("-inf")


class RowSampler(SamplerBase):
    """One request's sampling state: its parameters, its key stream and its grammar (a row with a
    grammar is sampled on the host side of the step)."""

    def __init__(self, params: SamplingParams, context_length: int, grammar: Grammar | None = None) -> None:
        super().__init__(params, context_length, grammar)
        self.key = mx.random.key(self.seed)

    def next_key(self) -> mx.array:
        pair = mx.random.split(self.key)
        self.key = pair[0]
        return pair[1]

    def noise(self, vocab: int) -> mx.array:
        """Exp(1) noise [V] from the next key: argmax(p / E) is an exact draw from p."""
        return -mx.log(mx.random.uniform(shape=(vocab,), key=self.next_key()))

    # ---- the per-row interface (speculation.verify, proposers, grammar rows) -------------------
    def probs(self, logits: np.ndarray, history: Sequence[int]) -> np.ndarray:
        row = mx.array(np.asarray(logits, dtype=np.float32))[None]
        x = penalized([self], row, [window_of(self, history)])
        if self.greedy:
            out = np.zeros(row.shape[-1])
            out[int(mx.argmax(x, axis=-1).item())] = 1.0
            return out
        return np.array(chain_probs([self.params], x))[0].astype(np.float64)

    def draw(self, probs: np.ndarray) -> int:
        if self.greedy:
            return int(np.argmax(probs))
        noise = np.array(self.noise(probs.shape[-1])).astype(np.float64)
        return int(np.argmax(probs / noise))

    def uniform(self) -> float:
        return float(mx.random.uniform(key=self.next_key()).item())

    def _pick(self, logits: np.ndarray, history: Sequence[int]) -> int:
        row = mx.array(np.asarray(logits, dtype=np.float32))[None]
        return int(sample_rows([self], row, [window_of(self, history)]).item())


def window_of(
    sampler: RowSampler, history: Sequence[int], pending: mx.array | None = None
) -> mx.array | None:
    """The tokens the penalties count (the recent window), `pending` (a device token) last."""
    w = sampler.penalty_window
    if not w:
        return None
    if pending is None:
        return mx.array(list(history[-w:]), dtype=mx.int32) if history else None
    tail = list(history[-(w - 1) :]) if w > 1 and history else []
    return mx.concatenate([mx.array(tail, dtype=mx.int32), pending.reshape(1).astype(mx.int32)])


def penalized(samplers: Sequence[RowSampler], x: mx.array, windows: Sequence[mx.array | None]) -> mx.array:
    """x [B, V] with each row's repeat / frequency / presence penalties over its window."""
    if all(w is None or w.size == 0 for w in windows):
        return x
    b, v = x.shape
    counts = []
    for w in windows:
        c = mx.zeros((v,), dtype=x.dtype)
        counts.append(c if w is None or w.size == 0 else c.at[w].add(1.0))
    count = mx.stack(counts)  # [B, V]
    return penalize(mx, x, count, mx.array(penalty_knobs(samplers), dtype=x.dtype))


def chain_probs(params: Sequence[SamplingParams], x: mx.array) -> mx.array:
    """Penalized rows [S, V] -> the distributions they draw from (top-k, top-p, min-p, temperature)."""
    s, v = x.shape
    knobs = mx.array(chain_knobs(params, v), dtype=mx.float32)
    top_k, top_p = knobs[:, 0:1].astype(mx.int32), knobs[:, 1:2]
    min_p, temperature = knobs[:, 2:3], knobs[:, 3:4]
    if truncates(params, v):
        desc = -mx.sort(-x, axis=-1)  # [S, V], best first
        kth = mx.take_along_axis(desc, top_k - 1, axis=-1)  # ties with the k-th value stay
        desc = mx.where(desc < kth, NEG_INF, desc)
        p_sorted = mx.softmax(desc, axis=-1)
        # keep the smallest head whose mass reaches top_p (the token that crosses it stays)
        keep = ((mx.cumsum(p_sorted, axis=-1) - p_sorted) < top_p) | (top_p >= 1.0)
        n_keep = mx.maximum(keep.astype(mx.int32).sum(axis=-1, keepdims=True), 1)
        cut = mx.maximum(mx.take_along_axis(desc, n_keep - 1, axis=-1), kth)
        x = mx.where(x < cut, NEG_INF, x)
    if any(p.min_p > 0.0 for p in params):
        probs = mx.softmax(x, axis=-1)
        low = (probs < min_p * probs.max(axis=-1, keepdims=True)) & (min_p > 0.0)
        x = mx.where(low, NEG_INF, x)
    return mx.softmax(x / temperature, axis=-1)


def sample_rows(
    samplers: Sequence[RowSampler], logits: mx.array, windows: Sequence[mx.array | None]
) -> mx.array:
    """One token per row of logits [B, V], on the device (nothing is read back here)."""
    x = penalized(samplers, logits.astype(mx.float32), windows)
    picks = mx.argmax(x, axis=-1)  # [B]: right for greedy rows
    sampled = [i for i, s in enumerate(samplers) if not s.greedy]
    if not sampled:
        return picks
    rows = mx.array(sampled)
    probs = chain_probs([samplers[i].params for i in sampled], x[rows])
    v = x.shape[-1]
    noise = mx.stack([samplers[i].noise(v) for i in sampled])  # each request's own key, as alone
    drawn = mx.argmax(probs / noise, axis=-1)
    if len(sampled) == len(samplers):
        return drawn
    out = picks
    for j, i in enumerate(sampled):  # few rows: a scatter of the drawn ones into the greedy picks
        out = mx.where(mx.arange(len(samplers)) == i, drawn[j], out)
    return out


@dataclass
class Logprobs:
    """A step's logprob request on the device: chosen [R], top values/ids [R, n] (n = the most asked)."""

    chosen: mx.array
    values: mx.array | None
    ids: mx.array | None


def logprobs_of(logits: mx.array, tokens: mx.array, n_top: int) -> Logprobs:
    """Log-softmax of the raw logits [R, V] at the chosen tokens [R], and the n_top best per row."""
    lp = logits.astype(mx.float32)
    lp = lp - mx.logsumexp(lp, axis=-1, keepdims=True)
    chosen = mx.take_along_axis(lp, tokens.reshape(-1, 1).astype(mx.int32), axis=-1)[:, 0]
    if n_top <= 0:
        return Logprobs(chosen, None, None)
    ids = mx.argpartition(-lp, kth=n_top - 1, axis=-1)[:, :n_top]
    values = mx.take_along_axis(lp, ids, axis=-1)
    order = mx.argsort(-values, axis=-1)
    return Logprobs(
        chosen, mx.take_along_axis(values, order, axis=-1), mx.take_along_axis(ids, order, axis=-1)
    )
