"""Monte Carlo checks shared by the samplers' and verifiers' tests (no scipy needed)."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

Z_999 = 3.0902  # one-sided normal quantile for alpha = 0.001


def chi2_critical(dof: int, z: float = Z_999) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile (no scipy needed)."""
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


def chi2_statistic(counts: np.ndarray, probs: np.ndarray, min_expected: float = 5.0) -> tuple[float, int]:
    """Pearson's statistic, rare cells pooled so every expected count is at least min_expected."""
    n = counts.sum()
    expected = probs * n
    order = np.argsort(expected)
    obs_bins, exp_bins, acc_o, acc_e = [], [], 0.0, 0.0
    for i in order:
        acc_o, acc_e = acc_o + counts[i], acc_e + expected[i]
        if acc_e >= min_expected:
            obs_bins.append(acc_o)
            exp_bins.append(acc_e)
            acc_o = acc_e = 0.0
    if acc_e > 0:
        obs_bins[-1] += acc_o
        exp_bins[-1] += acc_e
    o, e = np.array(obs_bins), np.array(exp_bins)
    return float(((o - e) ** 2 / e).sum()), len(o) - 1


def assert_same_distribution(counts: np.ndarray, probs: np.ndarray) -> None:
    stat, dof = chi2_statistic(counts.astype(float), probs)
    assert stat < chi2_critical(dof), f"chi2 {stat:.1f} with {dof} dof"
    n = counts.sum()
    tv = 0.5 * np.abs(counts / n - probs).sum()
    noise = 0.5 * np.sqrt(2 * probs * (1 - probs) / (math.pi * n)).sum()  # E[TV] of an exact sampler
    assert tv < 2 * noise, f"total variation {tv:.3f}, sampling noise alone {noise:.3f}"


def de_bruijn_prompt(vocab: int) -> list[int]:
    """Every 2-gram over the vocabulary occurs, so prompt lookup always finds a continuation."""
    return [x for a in range(vocab) for b in range(vocab) for x in (a, b)]  # [V * V * 2]


def exact_pair_distribution(
    next_probs: Callable[[list[int]], np.ndarray], prompt: list[int], vocab: int
) -> np.ndarray:
    """P(t2, t3) after `prompt` with t1 marginalised, [V * V], from a next-token distribution [V]."""
    joint = np.zeros((vocab, vocab))
    p1 = next_probs(prompt)
    for t1 in range(vocab):
        p2 = next_probs([*prompt, t1])
        for t2 in range(vocab):
            if p1[t1] * p2[t2] > 0:
                joint[t2] += p1[t1] * p2[t2] * next_probs([*prompt, t1, t2])
    return joint.flatten()
