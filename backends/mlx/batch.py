"""The batched MLX engine: many sequences per model, one forward per step, the next step queued early.

A step lays every active sequence's input end to end and runs one forward (`Transformer.hidden_batch`:
shared matrix products, per-sequence caches and attention): a prompt chunk (no logits) for sequences
still prefilling, the last token for decoding ones, the last token and its draft tokens for speculating
ones. Sequences join and leave at every step; each one's caches start from the prompt cache's longest
match and go back to it when the sequence ends.

Pipelining (`mx.async_eval`): a step samples on the device and starts evaluating; the next step is
built on the device tokens it sampled, before the host reads them, and only then are the first
step's tokens read. A sequence that ended in the meantime wasted one row of the queued step; its
cache keeps the last token it was fed. Rows that need the host before their next input exists
(a grammar mask, speculative draft tokens) are read first: they are sampled on the host side from their
logits rows, with the same per-request key stream (`sampling.RowSampler`).

`step()` returns its outputs (tokens per sequence, logprobs, finish reasons); `start(sink)` runs it on
the engine thread, which owns every MLX call of the model (`call` runs score/embed jobs between steps).
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Callable
from collections.abc import Iterable
from dataclasses import KW_ONLY
from dataclasses import dataclass
from dataclasses import field
from itertools import count
from typing import Any

import mlx.core as mx
import numpy as np

from localrt.backends.base import CancelToken
from localrt.backends.engine_thread import EngineThread
from localrt.backends.engine_thread import RequestQueues
from localrt.backends.grammar import GrammarDeadEnd
from localrt.backends.outputs import logprob_values
from localrt.backends.speculation import SpecState
from localrt.backends.speculation import verify

from .engine import Proposer
from .engine import Runner
from .llama import Transformer
from .prompt_cache import PromptCache
from .sampling import Logprobs
from .sampling import RowSampler
from .sampling import logprobs_of
from .sampling import sample_rows
from .sampling import window_of


@dataclass(eq=False)  # a row is itself: the engine finds and removes rows in its lists by identity
class Row:
    """One request in the engine: its prompt, sampler, limits and where its caches stand."""

    id: int
    prompt: list[int]
    sampler: RowSampler
    max_tokens: int  # prompt + output
    _: KW_ONLY
    cancel: CancelToken = field(default_factory=CancelToken)
    top_logprobs: int = -1  # -1: no logprobs
    proposer: Proposer | None = None
    spec: SpecState | None = None
    # ---- the engine's state of the row
    tokens: list[int] = field(init=False)  # every token known on the host (the last one is not in the caches)
    runner: Runner | None = field(default=None, init=False)
    # steps in flight that sample its next token (its newest token is on the device), and whether the
    # step queued after them was fed that token
    pending: int = field(default=0, init=False)
    fed_pending: bool = field(default=False, init=False)
    cached_count: int = field(default=0, init=False)
    prompt_eval_count: int = field(default=0, init=False)
    generated: int = field(default=0, init=False)  # tokens produced, an end token included
    first_token_ns: int = field(default=0, init=False)
    finish: str | None = field(default=None, init=False)
    error: BaseException | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        self.tokens = list(self.prompt)

    @property
    def needs_host(self) -> bool:
        """Its next input depends on the host (a grammar's mask, the proposer's draft tokens)."""
        return self.sampler.grammar is not None or (self.spec is not None and self.spec.enabled)

    @property
    def output(self) -> list[int]:
        return self.tokens[len(self.prompt) :]


@dataclass
class RowOutput:
    """What one step did to one row."""

    row: Row
    tokens: list[int] = field(default_factory=list)  # for the client (an end token is not)
    logprobs: list[tuple[float, list[tuple[int, float]]] | None] = field(default_factory=list)
    finish: str | None = None  # "stop", "length", "cancel" or "error" once it ended


@dataclass
class _Planned:
    row: Row
    kind: str  # "prefill" (no logits), "device" (sampled on the device), "host" (logits read back)
    index: int = -1  # its place among the device rows or the host rows
    drafts: list[int] = field(default_factory=list)
    q: Any = None  # the draft tokens' distributions (None: deterministic draft tokens)
    logits_rows: int = 0


@dataclass
class _InFlight:
    planned: list[_Planned]
    tokens: mx.array | None  # [device rows]
    host_logits: mx.array | None  # [sum of host rows' logits rows, V]
    logprobs: Logprobs | None  # for the device rows that asked, in their order
    asked: list[int]  # device indexes that asked for logprobs
    position: dict[int, int]  # row id -> device index


class BatchEngine(RequestQueues, EngineThread):
    thread_name = "mlx-engine"
    idle_end = None  # MLX runs no OpenMP pool to free, and its streams were not tried from a new thread

    def __init__(
        self,
        kv_cache_type: str,
        num_batch: int,
        model: Transformer | None = None,
        *,
        max_rows: int = 1,
        prompt_cache: PromptCache | None = None,
        eog: Iterable[int] = (),
        clock: Callable[[], int] = time.perf_counter_ns,
    ) -> None:
        """`model` may come later (`attach`): the backend starts the thread first and loads on it."""
        self.kv_cache_type = kv_cache_type
        self.num_batch = max(1, num_batch)
        self.clock = clock
        self.attach(model, max_rows=max_rows, prompt_cache=prompt_cache or PromptCache(0), eog=eog)
        self.waiting: deque[Row] = deque()
        self.running: list[Row] = []
        self._inflight: _InFlight | None = None
        self._ids = count()
        self.steps = 0
        self._init_thread()

    def attach(
        self, model: Transformer | None, *, max_rows: int, prompt_cache: PromptCache, eog: Iterable[int] = ()
    ) -> None:
        self._model = model
        self.max_rows = max(1, max_rows)
        self.prompt_cache = prompt_cache
        self.eog = set(eog)

    @property
    def model(self) -> Transformer:
        assert self._model is not None, "no model attached"
        return self._model

    # ---- requests ---------------------------------------------------------------------------
    def new_row(self, prompt: list[int], sampler: RowSampler, max_tokens: int, **kw: Any) -> Row:
        return Row(next(self._ids), list(prompt), sampler, max_tokens, **kw)

    @property
    def has_work(self) -> bool:
        return super().has_work or self._inflight is not None

    # ---- a step -----------------------------------------------------------------------------
    def step(self) -> list[RowOutput]:
        self.steps += 1
        out: dict[int, RowOutput] = {}
        self._admit()
        previous, self._inflight = self._inflight, None
        if previous is not None and any(p.kind == "host" for p in previous.planned):
            self._resolve(previous, out)  # those rows' next input is decided on the host
            previous = None
        for row in [r for r in self.running if r.cancel.cancelled and not r.pending]:
            self._end(row, "cancel", out)
        self._inflight = self._queue(previous)
        if previous is not None:
            self._resolve(previous, out)
        return list(out.values())

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.max_rows:
            row = self.waiting.popleft()
            caches, n = self.prompt_cache.lookup(row.prompt)
            row.runner = Runner(self.model, self.kv_cache_type, self.num_batch, caches, row.prompt[:n])
            row.cached_count = n
            row.prompt_eval_count = len(row.prompt) - n
            self.running.append(row)

    def _plan_row(self, row: Row, previous: _InFlight | None, budget: int) -> tuple[_Planned, Any] | None:
        """The row's input this step: (plan, tokens as a list or a device array), or None to skip."""
        runner = row.runner
        assert runner is not None
        fed = len(runner.tokens)
        if not row.pending and fed < len(row.prompt) - 1:  # prefill: chunks of the prompt but its last token
            if budget <= 0:
                return None
            chunk = row.prompt[fed : min(fed + self.num_batch, len(row.prompt) - 1)]
            runner.tokens.extend(chunk)
            return _Planned(row, "prefill"), chunk
        if len(row.tokens) + row.pending >= row.max_tokens or row.cancel.cancelled:
            return None  # ends when the step in flight is read
        if row.pending:
            assert previous is not None and previous.tokens is not None
            row.fed_pending = True
            j = previous.position[row.id]
            return _Planned(row, "device"), previous.tokens[j : j + 1]
        last = row.tokens[-1]
        if not row.needs_host:
            runner.tokens.append(last)
            return _Planned(row, "device"), [last]
        drafts: list[int] = []
        q = None
        room = row.max_tokens - len(row.tokens) - 1
        if row.spec is not None and row.spec.enabled and room > 0:
            if row.spec.ngram is not None:  # lookup: nothing runs a model, so no distributions
                drafts = row.spec.ngram.propose(row.tokens, min(row.spec.k, room))
            elif row.proposer is not None:
                drafts, q = row.proposer.propose(row.tokens, min(row.spec.k, room), row.sampler)
        runner.tokens.extend([last, *drafts])
        return _Planned(row, "host", drafts=drafts, q=q, logits_rows=1 + len(drafts)), [last, *drafts]

    def _queue(self, previous: _InFlight | None) -> _InFlight | None:
        """Build this step's forward and sampling over every active row and start evaluating it."""
        planned: list[_Planned] = []
        parts: list[mx.array] = []
        budget = self.num_batch
        for row in self.running:
            plan = self._plan_row(row, previous, budget)
            if plan is None:
                continue
            p, ids = plan
            if p.kind == "prefill":
                budget -= len(ids)
            planned.append(p)
            parts.append(ids if isinstance(ids, mx.array) else mx.array(ids, dtype=mx.int32))
        if not planned:
            return None
        lengths = [int(a.shape[0]) for a in parts]
        tokens = mx.concatenate(parts).astype(mx.int32) if len(parts) > 1 else parts[0].astype(mx.int32)
        caches = [p.row.runner.caches for p in planned]  # type: ignore[union-attr]
        hidden = self.model.hidden_batch(tokens, caches, lengths)  # [L_total, dim]
        ends = np.cumsum(lengths)
        device = [p for p in planned if p.kind == "device"]
        host = [p for p in planned if p.kind == "host"]
        for i, p in enumerate(device):
            p.index = i
        for i, p in enumerate(host):
            p.index = i
        pick = [int(ends[planned.index(p)]) - 1 for p in device]
        for p in host:
            end = int(ends[planned.index(p)])
            pick += list(range(end - p.logits_rows, end))
        flight = _InFlight(planned, None, None, None, [], {p.row.id: p.index for p in device})
        if not pick:
            mx.async_eval(hidden)  # prefill only: the caches fill in the background
            return flight
        logits = self.model.logits(hidden[mx.array(pick)])  # [R, V], device rows first
        outs: list[mx.array] = []
        if device:
            rows = logits[: len(device)]
            samplers = [p.row.sampler for p in device]
            windows = [
                window_of(p.row.sampler, p.row.tokens, previous.tokens[previous.position[p.row.id]])
                if p.row.pending and previous is not None and previous.tokens is not None
                else window_of(p.row.sampler, p.row.tokens)
                for p in device
            ]
            flight.tokens = sample_rows(samplers, rows, windows)
            outs.append(flight.tokens)
            flight.asked = [p.index for p in device if p.row.top_logprobs >= 0]
            if flight.asked:
                sel = mx.array(flight.asked)
                n_top = max(device[i].row.top_logprobs for i in flight.asked)
                flight.logprobs = logprobs_of(rows[sel], flight.tokens[sel], n_top)
                outs += [a for a in vars(flight.logprobs).values() if a is not None]
        if host:
            flight.host_logits = logits[len(device) :]
            outs.append(flight.host_logits)
        for p in device:
            p.row.pending += 1
        mx.async_eval(*outs)
        return flight

    def _resolve(self, flight: _InFlight, out: dict[int, RowOutput]) -> None:
        """Read a step's results on the host and advance its rows."""
        tokens = flight.tokens.tolist() if flight.tokens is not None else []
        host = np.array(flight.host_logits) if flight.host_logits is not None else None
        lps = self._logprobs(flight)
        offset = 0
        for p in flight.planned:
            row = p.row
            if p.kind == "prefill":
                continue
            if p.kind == "device":
                new = [int(tokens[p.index])]
                row.pending -= 1
                if row.fed_pending:  # the step queued after this one was fed it already
                    row.fed_pending = False
                    assert row.runner is not None
                    row.runner.tokens.append(new[0])
                lp = [lps.get(p.index)]
            else:
                assert host is not None
                rows = host[offset : offset + p.logits_rows]
                offset += p.logits_rows
                try:
                    new = self._host_tokens(p, rows)
                except GrammarDeadEnd as error:  # this request's grammar, not the batch's fault
                    row.error = error
                    self._end(row, "error", out)
                    continue
                lp = [self._host_logprob(row, rows[j], t) for j, t in enumerate(new)]
            if row.finish is not None:
                continue
            if row.cancel.cancelled:
                self._end(row, "cancel", out)
                continue
            self._advance(row, new, lp, out)

    def _host_tokens(self, p: _Planned, rows: np.ndarray) -> list[int]:
        row = p.row
        if not p.drafts:
            return [row.sampler.sample(rows[0], row.tokens)]
        new, accepted = verify(row.sampler, rows, p.drafts, p.q, row.tokens)
        assert row.runner is not None and row.spec is not None
        row.runner.trim(len(p.drafts) - accepted)  # the rejected draft tokens leave the caches
        row.spec.record(len(p.drafts), accepted)
        return new

    @staticmethod
    def _host_logprob(
        row: Row, logits: np.ndarray, token: int
    ) -> tuple[float, list[tuple[int, float]]] | None:
        return None if row.top_logprobs < 0 else logprob_values(logits, token, row.top_logprobs)

    @staticmethod
    def _logprobs(flight: _InFlight) -> dict[int, tuple[float, list[tuple[int, float]]]]:
        got: dict[int, tuple[float, list[tuple[int, float]]]] = {}
        lp = flight.logprobs
        if lp is None:
            return got
        chosen = lp.chosen.tolist()
        values = lp.values.tolist() if lp.values is not None else None
        ids = lp.ids.tolist() if lp.ids is not None else None
        device = {p.index: p for p in flight.planned if p.kind == "device"}
        for j, i in enumerate(flight.asked):
            n = device[i].row.top_logprobs
            top = [] if values is None or ids is None else list(zip(ids[j][:n], values[j][:n]))
            got[i] = (float(chosen[j]), [(int(t), float(v)) for t, v in top])
        return got

    def _advance(
        self,
        row: Row,
        new: list[int],
        lps: list[tuple[float, list[tuple[int, float]]] | None],
        out: dict[int, RowOutput],
    ) -> None:
        if not row.first_token_ns:
            row.first_token_ns = self.clock()
        o = out.setdefault(row.id, RowOutput(row))
        for token, lp in zip(new, lps):
            row.tokens.append(token)
            row.generated += 1
            if token in self.eog:
                if row.runner is not None and len(row.runner.tokens) == len(row.tokens):
                    row.runner.trim(1)  # fed by the step queued ahead: the caches keep only the answer
                self._end(row, "stop", out)
                return
            o.tokens.append(token)
            o.logprobs.append(lp)
            if len(row.tokens) >= row.max_tokens:
                self._end(row, "length", out)
                return

    def _end(self, row: Row, reason: str, out: dict[int, RowOutput]) -> None:
        """A row leaves: its caches go to the prompt cache (holding exactly the tokens they were fed)."""
        row.finish = reason
        out.setdefault(row.id, RowOutput(row)).finish = reason
        if row in self.running:
            self.running.remove(row)
        if row.runner is not None and reason != "error":
            self.prompt_cache.insert(row.runner.tokens, row.runner.caches)
            row.runner = None

    def _fail_step(self, error: Exception) -> list[RowOutput]:
        """A step raised: every row ends with `error` (the caches are in an unknown state)."""
        out: dict[int, RowOutput] = {}
        self._inflight = None
        for row in [*self.running, *self.waiting]:
            row.error = error
            self._end(row, "error", out)
        self.waiting.clear()
        self.prompt_cache.clear()
        return list(out.values())

    # ---- threaded mode (engine_thread.py) ---------------------------------------------------------
    def _thread_context(self) -> Any:
        mx.set_default_stream(mx.new_stream(mx.default_device()))  # MLX streams belong to their thread
        return contextlib.nullcontext()

    def _unload(self, queued: list[Row]) -> list[RowOutput]:
        """Unloaded: the rows still running end as cancelled."""
        out: dict[int, RowOutput] = {}
        self._inflight = None
        for row in [*self.running, *self.waiting, *queued]:
            self._end(row, "cancel", out)
        return list(out.values())
