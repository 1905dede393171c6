"""Sampling on the device with the runtime's parameters: per request, or a whole step's batch at once.

The chain follows llama.cpp's order (penalties, top-k, top-p, min-p, temperature, draw) so both
backends read the parameters the same way. Each request owns a `torch.Generator`: its draws depend
only on its own seed and history, never on which other requests share the step. `sample_batch`
picks one token per row on the device and reads them all back with a single host sync.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import torch

from localrt.backends.base import SamplingParams
from localrt.backends.grammar import Grammar


class RequestSampler:
    def __init__(
        self,
        params: SamplingParams,
        device: torch.device | str,
        context_length: int,
        grammar: Grammar | None = None,
    ) -> None:
        self.params = params
        self.greedy = params.greedy
        self.grammar = grammar  # `format`: sample() only picks what it allows (no speculation then)
        self.generator = torch.Generator(device=device)
        seed = params.seed if params.seed >= 0 else random.getrandbits(63)
        self.generator.manual_seed(seed)
        self.penalty_window = params.penalty_window(context_length)  # 0: no penalties

    def penalized(self, logits: torch.Tensor, history: Sequence[int]) -> torch.Tensor:
        """logits [V] with llama.cpp's repeat / frequency / presence penalties over the recent window."""
        if not self.penalty_window or not history:
            return logits
        # counts over the whole vocabulary instead of torch.unique: no data-dependent shape, so no sync
        window = torch.tensor(list(history[-self.penalty_window :]), dtype=torch.long)
        if logits.is_cuda:  # pinned: the upload queues behind the forward instead of waiting for it
            window = window.pin_memory()
        window = window.to(logits.device, non_blocking=True)
        counts = torch.zeros_like(logits).index_add_(
            0, window, torch.ones_like(window, dtype=logits.dtype)
        )  # [V]
        p = self.params
        out = torch.where(logits > 0, logits / p.repeat_penalty, logits * p.repeat_penalty)
        out = out - counts * p.frequency_penalty - p.presence_penalty
        return torch.where(counts > 0, out, logits)

    def probs(self, logits: torch.Tensor, history: Sequence[int]) -> torch.Tensor:
        """The distribution a token is drawn from: logits [V] -> probabilities [V] (float32)."""
        x = self.penalized(logits.float(), history)
        p = self.params
        if self.greedy:
            return torch.nn.functional.one_hot(x.argmax(), x.shape[-1]).float()
        if 0 < p.top_k < x.shape[-1]:
            kth = torch.topk(x, p.top_k).values[-1]
            x = x.masked_fill(x < kth, float("-inf"))
        if p.top_p < 1.0:
            sorted_x, order = torch.sort(x, descending=True)
            sorted_p = torch.softmax(sorted_x, -1)
            # keep the smallest head whose mass reaches top_p (the token that crosses it stays)
            drop = (torch.cumsum(sorted_p, -1) - sorted_p) >= p.top_p
            x = x.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
        if p.min_p > 0.0:
            probs = torch.softmax(x, -1)
            x = x.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
        return torch.softmax(x / p.temperature, -1)

    def draw(self, probs: torch.Tensor) -> int:
        return int(self._draw(probs))

    def _draw(self, probs: torch.Tensor) -> torch.Tensor:
        """One token from probs [V]: argmax(p / E) with E ~ Exp(1) is a draw from p, without a sync-heavy multinomial."""
        if self.greedy:
            return probs.argmax()
        noise = torch.empty_like(probs).exponential_(generator=self.generator)
        return (probs / noise).argmax()

    def uniform(self) -> float:
        # float64: a float32 uniform can be exactly 0, which would accept a draft with p = 0
        return float(
            torch.rand(1, generator=self.generator, dtype=torch.float64, device=self.generator.device)
        )

    def sample(self, logits: torch.Tensor, history: Sequence[int]) -> int:
        if self.grammar is not None:  # constrained output: the grammar runs on the host, one row per step
            allowed = self.grammar.mask(logits.float().cpu().numpy())
            logits = torch.from_numpy(allowed).to(logits.device)
        token = int(self.pick(logits, history))
        if self.grammar is not None:
            self.grammar.accept(token)
        return token

    def pick(self, logits: torch.Tensor, history: Sequence[int]) -> torch.Tensor:
        """logits [V] -> the token as a device scalar (no host sync); the grammar is not applied here."""
        if self.greedy:
            return self.penalized(logits.float(), history).argmax()
        return self._draw(self.probs(logits, history))


def sample_batch(
    samplers: Sequence[RequestSampler], logits: Sequence[torch.Tensor], histories: Sequence[Sequence[int]]
) -> list[int]:
    """One token per request from its logits row [V], with one device->host copy for the whole batch.

    Greedy rows share one argmax over the stacked rows (penalties applied per row first); sampled rows
    draw with their own generators, so a seeded request gives the same tokens in any batch. Requests
    with a grammar need the host per token: use `RequestSampler.sample` for those.
    """
    assert all(s.grammar is None for s in samplers)
    picks: list[torch.Tensor | None] = [
        None if s.greedy else s.pick(row, history) for s, row, history in zip(samplers, logits, histories)
    ]
    greedy = [i for i, s in enumerate(samplers) if s.greedy]
    if greedy:
        best = torch.stack([samplers[i].penalized(logits[i].float(), histories[i]) for i in greedy]).argmax(
            -1
        )  # [G]
        for j, i in enumerate(greedy):
            picks[i] = best[j]
    return torch.stack(picks).tolist()  # type: ignore[arg-type]  # every slot is filled by now
