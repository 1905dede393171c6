"""Sampling on the device with the runtime's parameters: per request, or a whole step's batch at once.

The chain follows llama.cpp's order (penalties, top-k, top-p, min-p, temperature, draw) so both
backends read the parameters the same way. Each request owns a `torch.Generator`: its draws depend
only on its own seed and history, never on which other requests share the step. `sample_batch` runs
the chain once over a step's stacked rows, the knobs as [B, 1] tensors (one sort for every row that
truncates), then draws each sampled row with its own generator over the whole vocabulary, exactly as
`RequestSampler` would alone; logprobs for the rows that asked come from the same pass, and
everything is read back with one host sync.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from localrt.backends.base import SamplingParams
from localrt.backends.grammar import Grammar
from localrt.backends.sampler import SamplerBase
from localrt.backends.sampler import chain_knobs
from localrt.backends.sampler import penalize
from localrt.backends.sampler import penalty_knobs
from localrt.backends.sampler import truncates


class RequestSampler(SamplerBase):
    def __init__(
        self,
        params: SamplingParams,
        device: torch.device | str,
        context_length: int,
        grammar: Grammar | None = None,
    ) -> None:
        super().__init__(params, context_length, grammar)
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(self.seed)

    def _apply_penalties(self, logits: torch.Tensor, window: Sequence[int]) -> torch.Tensor:
        # counts over the whole vocabulary instead of torch.unique: no data-dependent shape, so no sync
        ids = torch.tensor(list(window), dtype=torch.long)
        if logits.is_cuda:  # pinned: the upload queues behind the forward instead of waiting for it
            ids = ids.pin_memory()
        ids = ids.to(logits.device, non_blocking=True)
        counts = torch.zeros_like(logits).index_add_(0, ids, torch.ones_like(ids, dtype=logits.dtype))  # [V]
        return penalize(torch, logits, counts, self.penalties)

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
            sorted_x, order = torch.sort(x, descending=True, stable=True)
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

    def _masked(self, logits: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(super()._masked(logits.float().cpu().numpy())).to(logits.device)

    def _pick(self, logits: torch.Tensor, history: Sequence[int]) -> int:
        return int(self.pick(logits, history))

    def pick(self, logits: torch.Tensor, history: Sequence[int]) -> torch.Tensor:
        """logits [V] -> the token as a device scalar (no host sync); the grammar is not applied here."""
        if self.greedy:
            return self.penalized(logits.float(), history).argmax()
        return self._draw(self.probs(logits, history))


@dataclass
class Sampled:
    """One step's draws, on the host: a token per row, and for rows that asked, logprobs."""

    tokens: list[int]
    logprob: list[float | None]  # log-softmax of the raw logits at the chosen token
    top: list[list[tuple[int, float]]]  # the top_logprobs most likely (token, logprob), best first


def _penalized(
    samplers: Sequence[RequestSampler], x: torch.Tensor, histories: Sequence[Sequence[int]]
) -> torch.Tensor:
    """x [B, V] with each row's repeat / frequency / presence penalties over its recent window."""
    windows = [
        list(h[-s.penalty_window :]) if s.penalty_window and h else [] for s, h in zip(samplers, histories)
    ]
    width = max(len(w) for w in windows)
    if width == 0:
        return x
    b, v = x.shape
    # padded with the index v, a column past the vocabulary that is dropped after counting
    idx = torch.full((b, width), v, dtype=torch.long)
    for i, w in enumerate(windows):
        idx[i, : len(w)] = torch.as_tensor(w, dtype=torch.long)
    idx = idx.to(x.device, non_blocking=True)
    counts = torch.zeros(b, v + 1, dtype=x.dtype, device=x.device).scatter_add_(
        1, idx, torch.ones_like(idx, dtype=x.dtype)
    )
    counts = counts[:, :v]  # [B, V]
    knobs = torch.tensor(penalty_knobs(samplers), dtype=x.dtype).to(x.device, non_blocking=True)  # [3, B, 1]
    return penalize(torch, x, counts, knobs)


def _batch_probs(samplers: Sequence[RequestSampler], x: torch.Tensor) -> torch.Tensor:
    """Penalized rows [S, V] of sampled requests -> the distributions they draw from (RequestSampler.probs)."""
    s, v = x.shape
    params = [r.params for r in samplers]
    knobs = torch.tensor(chain_knobs(params, v), dtype=torch.float64).to(x.device, non_blocking=True)
    top_k, top_p = knobs[:, 0:1].long(), knobs[:, 1:2].float()
    min_p, temperature = knobs[:, 2:3].float(), knobs[:, 3:4].float()
    if truncates(params, v):
        sorted_x, order = torch.sort(x, dim=-1, descending=True, stable=True)  # [S, V]
        kth = sorted_x.gather(1, top_k - 1)  # [S, 1]: ties with the k-th value stay, as alone
        sorted_x = sorted_x.masked_fill(sorted_x < kth, float("-inf"))
        sorted_p = torch.softmax(sorted_x, -1)
        drop = ((torch.cumsum(sorted_p, -1) - sorted_p) >= top_p) & (top_p < 1.0)
        sorted_x = sorted_x.masked_fill(drop, float("-inf"))
        x = torch.empty_like(x).scatter_(1, order, sorted_x)  # back to token order
    if any(r.params.min_p > 0.0 for r in samplers):
        probs = torch.softmax(x, -1)
        cut = (probs < min_p * probs.amax(-1, keepdim=True)) & (min_p > 0.0)
        x = x.masked_fill(cut, float("-inf"))
    return torch.softmax(x / temperature, -1)


def sample_batch(
    samplers: Sequence[RequestSampler],
    logits: torch.Tensor,
    histories: Sequence[Sequence[int]],
    top_logprobs: Sequence[int] | None = None,
) -> Sampled:
    """One token per row of logits [B, V], with one device->host copy for the whole batch.

    Greedy rows take the argmax of their penalized row; sampled rows go through the chain together
    and draw with their own generators (noise over the whole vocabulary, in token order, as alone),
    so a seeded request gives the same tokens in any batch. `top_logprobs[i]` >= 0 asks for row i's
    logprob (and that many alternatives). Requests with a grammar need the host per token: use
    `RequestSampler.sample` for those.
    """
    assert all(s.grammar is None for s in samplers)
    x = _penalized(samplers, logits.float(), histories)
    picks = x.argmax(-1)  # [B]: right for greedy rows
    sampled = [i for i, s in enumerate(samplers) if not s.greedy]
    if sampled:
        rows = torch.tensor(sampled, device=x.device)
        probs = _batch_probs([samplers[i] for i in sampled], x[rows])
        noise = torch.stack(
            [torch.empty_like(probs[0]).exponential_(generator=samplers[i].generator) for i in sampled]
        )  # each request's own generator, the draws it would make alone
        picks[rows] = (probs / noise).argmax(-1)
    asked = [i for i, n in enumerate(top_logprobs or ()) if n >= 0]
    if not asked:
        return Sampled(picks.tolist(), [None] * len(samplers), [[] for _ in samplers])
    rows = torch.tensor(asked, device=x.device)
    lp = torch.log_softmax(logits[rows].double(), -1)  # [A, V]
    chosen = lp.gather(1, picks[rows, None]).squeeze(1)
    n_top = max(top_logprobs[i] for i in asked)  # type: ignore[index]
    values, ids = torch.topk(lp, n_top) if n_top > 0 else (lp[:, :0], lp[:, :0].long())
    host = torch.cat([picks.double(), chosen, values.flatten(), ids.double().flatten()]).tolist()
    b, a = len(samplers), len(asked)
    logprob: list[float | None] = [None] * b
    top: list[list[tuple[int, float]]] = [[] for _ in range(b)]
    for j, i in enumerate(asked):
        logprob[i] = host[b + j]
        n = top_logprobs[i]  # type: ignore[index]
        vals = host[b + a + j * n_top : b + a + j * n_top + n]
        toks = host[b + a + a * n_top + j * n_top : b + a + a * n_top + j * n_top + n]
        top[i] = [(int(t), v) for t, v in zip(toks, vals)]
    return Sampled([int(t) for t in host[:b]], logprob, top)
