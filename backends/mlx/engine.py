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

A prompt-only request (an embedding, a score) is a row too: its whole prompt goes through in chunks
like a prefill, beside the others, and each chunk's hidden rows (pooled) or logits (scored) are read
back when the step is resolved; after its last chunk, the answer is its output.

`step()` returns its outputs (`engine.EngineOutput`: tokens per request, logprobs, finish reasons,
answers); `start(sink)` runs it on the engine thread, which owns every MLX call of the model (`call`
runs the load there).
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Callable
from collections.abc import Iterable
from dataclasses import dataclass
from dataclasses import field
from typing import Any

import mlx.core as mx
import numpy as np

from localrt.backends.base import CancelToken
from localrt.backends.base import GenerateRequest
from localrt.backends.engine import EngineOutput
from localrt.backends.engine import EngineRequest
from localrt.backends.engine import OfRequest
from localrt.backends.engine import Pooled
from localrt.backends.engine import StepOutputs
from localrt.backends.engine import take_each
from localrt.backends.engine_thread import EngineThread
from localrt.backends.engine_thread import RequestQueues
from localrt.backends.grammar import GrammarDeadEnd
from localrt.backends.lookup import NgramProposer
from localrt.backends.outputs import fill_score
from localrt.backends.outputs import logprob_values
from localrt.backends.speculation import SpecState
from localrt.backends.speculation import verify
from localrt.errors import LocalrtError

from .llama import Transformer
from .prompt_cache import PromptCache
from .runner import Runner
from .sampling import Logprobs
from .sampling import RowSampler
from .sampling import logprobs_of
from .sampling import sample_rows
from .sampling import window_of
from .speculative import DraftModelProposer
from .speculative import Proposer
from .speculative import SelfOnRow


@dataclass(eq=False)  # a row is itself: the engine finds and removes rows in its lists by identity
class Row(OfRequest):
    """One request in the engine: its sampler (none for a prompt-only request), limits, proposer and
    where its caches stand."""

    request: EngineRequest
    sampler: RowSampler | None
    max_tokens: int  # prompt + output
    proposer: Proposer | None = None
    # ---- the engine's state of the row
    tokens: list[int] = field(init=False)  # every token known on the host (the last one is not in the caches)
    runner: Runner | None = field(default=None, init=False)
    # steps in flight that sample its next token (its newest token is on the device), and whether the
    # step queued after them was fed that token
    pending: int = field(default=0, init=False)
    fed_pending: bool = field(default=False, init=False)
    finish: str | None = field(default=None, init=False)
    pooled: Pooled | None = field(default=None, init=False)  # an embed request's pooled vector so far

    def __post_init__(self) -> None:
        self.tokens = list(self.prompt)

    @property
    def cached_count(self) -> int:
        return self.request.timings.cached_count

    @property
    def prompt_eval_count(self) -> int:
        return self.request.timings.prompt_eval_count

    @property
    def needs_host(self) -> bool:
        """Its next input depends on the host (a grammar's mask, the proposer's draft tokens)."""
        assert self.sampler is not None
        return self.sampler.grammar is not None or (self.spec is not None and self.spec.enabled)

    @property
    def output(self) -> list[int]:
        return self.tokens[len(self.prompt) :]


@dataclass
class _Planned:
    row: Row
    # "prefill" (no logits), "device" (sampled on the device), "host" (logits read back), "prompt" (a
    # prompt-only request's chunk: its hidden rows or logits read back)
    kind: str
    index: int = -1  # its place among the device rows or the host rows
    drafts: list[int] = field(default_factory=list)
    q: Any = None  # the draft tokens' distributions (None: deterministic draft tokens)
    logits_rows: int = 0
    start: int = 0  # "prompt": the chunk's first position in the prompt
    rows: Any = None  # "prompt": the chunk's hidden rows (pooled) or logits (scored), on the device


@dataclass
class _InFlight:
    planned: list[_Planned]
    tokens: mx.array | None  # [device rows]
    host_logits: mx.array | None  # [sum of host rows' logits rows, V]
    logprobs: Logprobs | None  # for the device rows that asked, in their order
    asked: list[int]  # device indexes that asked for logprobs
    position: dict[int, int]  # row id -> device index


class Engine(RequestQueues, EngineThread):
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
        self.steps = 0
        self._init_thread()

    def attach(
        self,
        model: Transformer | None,
        *,
        max_rows: int,
        prompt_cache: PromptCache,
        eog: Iterable[int] = (),
        context_length: int = 0,
        speculation: Speculation | None = None,
    ) -> None:
        """The model and what a request's row needs of it: its context (0: the model's own), and the
        model-based proposers' settings."""
        self._model = model
        self.max_rows = max(1, max_rows)
        self.prompt_cache = prompt_cache
        self.eog = set(eog)
        self.context_length = context_length or (model.cfg.context_length if model is not None else 0)
        self.speculation = speculation or Speculation()

    @property
    def model(self) -> Transformer:
        assert self._model is not None, "no model attached"
        return self._model

    # ---- requests ---------------------------------------------------------------------------
    def row(self, request: EngineRequest) -> Row:
        """The engine's row for a checked request: sampler, limits, its own proposer (on its own caches)."""
        prompt = request.prompt
        if request.prompt_only:
            row = Row(request, None, len(prompt))
            row.pooled = Pooled() if request.task == "embed" else None
            return row
        req = request.req
        room = self.context_length - len(prompt)
        max_tokens = len(prompt) + (room if req.num_predict < 0 else min(req.num_predict, room))
        row = Row(request, RowSampler(req.sampling, self.context_length, request.grammar), max_tokens)
        method, spec = request.method, self.speculation
        if method == "lookup":  # the SpecState's own n-gram index proposes (backends/lookup.py)
            request.spec = SpecState.begin(
                method, req.num_draft, NgramProposer.cost_per_draft, spec.verify_cost
            )
        elif method == "draft" and spec.draft_model is not None:
            draft = Runner(spec.draft_model, self.kv_cache_type, self.num_batch)
            row.proposer = DraftModelProposer(draft, spec.draft_cost)
        elif method == "self":  # the row's own caches, once the engine gives them
            row.proposer = SelfOnRow(row, spec.self_layers, spec.self_layers / self.model.cfg.block_count)
        if row.proposer is not None:
            cost = row.proposer.cost_per_draft
            request.spec = SpecState.begin(method, req.num_draft, cost, spec.verify_cost)
        return row

    def new_row(
        self,
        prompt: list[int],
        sampler: RowSampler,
        max_tokens: int,
        *,
        cancel: CancelToken | None = None,
        top_logprobs: int = -1,
        proposer: Proposer | None = None,
        spec: SpecState | None = None,
    ) -> Row:
        """A row from loose settings, for synchronous use (tests): `add` it, `step` or `run`."""
        req = GenerateRequest(list(prompt), cancel=cancel or CancelToken())
        req.logprobs, req.top_logprobs = top_logprobs >= 0, max(0, top_logprobs)
        request = EngineRequest(req, spec=spec)
        return Row(request, sampler, max_tokens, proposer)

    def _take(self, queued: list[EngineRequest]) -> list[EngineOutput]:
        return take_each(lambda request: self.add(self.row(request)), queued)

    @property
    def has_work(self) -> bool:
        return super().has_work or self._inflight is not None

    # ---- a step -----------------------------------------------------------------------------
    def step(self) -> list[EngineOutput]:
        self.steps += 1
        out = StepOutputs()
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
        return out.take()

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.max_rows:
            row = self.waiting.popleft()
            # a prompt-only request needs every row's output: it reuses no cached prefix
            caches, n = (None, 0) if row.request.prompt_only else self.prompt_cache.lookup(row.prompt)
            row.runner = Runner(self.model, self.kv_cache_type, self.num_batch, caches, row.prompt[:n])
            timings = row.request.timings
            timings.cached_count, timings.prompt_eval_count = n, len(row.prompt) - n
            row.request.admitted_ns = self.clock()
            self.running.append(row)

    def _plan_row(self, row: Row, previous: _InFlight | None, budget: int) -> tuple[_Planned, Any] | None:
        """The row's input this step: (plan, tokens as a list or a device array), or None to skip."""
        runner = row.runner
        assert runner is not None
        fed = len(runner.tokens)
        if row.request.prompt_only:  # every token of the prompt, chunk by chunk
            if fed >= len(row.prompt) or budget <= 0:
                return None
            chunk = row.prompt[fed : fed + self.num_batch]
            runner.tokens.extend(chunk)
            return _Planned(row, "prompt", start=fed), chunk
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
            if p.kind in ("prefill", "prompt"):
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
        outs: list[mx.array] = []
        for i, p in enumerate(planned):
            if p.kind == "prompt":
                chunk = hidden[int(ends[i]) - lengths[i] : int(ends[i])]
                p.rows = chunk if p.row.pooled is not None else self.model.logits(chunk)
                outs.append(p.rows)
        if not pick:
            mx.async_eval(*outs, hidden)  # prefill only: the caches fill in the background
            return flight
        logits = self.model.logits(hidden[mx.array(pick)])  # [R, V], device rows first
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

    def _resolve(self, flight: _InFlight, out: StepOutputs) -> None:
        """Read a step's results on the host and advance its rows."""
        tokens = flight.tokens.tolist() if flight.tokens is not None else []
        host = np.array(flight.host_logits) if flight.host_logits is not None else None
        lps = self._logprobs(flight)
        offset = 0
        for p in flight.planned:
            row = p.row
            if p.kind == "prefill":
                continue
            if p.kind == "prompt":
                self._take_prompt(p, out)
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
                    self._end(row, "error", out, error)
                    continue
                lp = [self._host_logprob(row, rows[j], t) for j, t in enumerate(new)]
            if row.finish is not None:
                continue
            if row.cancel.cancelled:
                self._end(row, "cancel", out)
                continue
            self._advance(row, new, lp, out)

    def _take_prompt(self, p: _Planned, out: StepOutputs) -> None:
        """A prompt-only row's chunk, read back: pooled or scored; after its last chunk, its answer."""
        row, request = p.row, p.row.request
        if row.finish is not None:
            return
        rows = np.array(p.rows)
        if row.pooled is not None:
            row.pooled.add(rows)
        elif request.scores is not None:
            scored = rows[: max(0, len(row.prompt) - 1 - p.start)]  # the last token scores nothing
            if len(scored):
                fill_score(request.scores, row.prompt, p.start, scored)
        if p.start + len(rows) < len(row.prompt):
            return
        out.of(request).result = row.pooled.vector() if row.pooled is not None else request.scores
        self._end(row, "stop", out)

    def _host_tokens(self, p: _Planned, rows: np.ndarray) -> list[int]:
        row = p.row
        assert row.sampler is not None
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
        out: StepOutputs,
    ) -> None:
        request = row.request
        if not request.first_token_ns:
            request.first_token_ns = self.clock()
        o = out.of(request)
        for token, lp in zip(new, lps):
            row.tokens.append(token)
            request.generated += 1
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

    def _end(self, row: Row, reason: str, out: StepOutputs, error: BaseException | None = None) -> None:
        """A row leaves: its caches go to the prompt cache (holding exactly the tokens they were fed); a
        prompt-only row's do not (nobody continues an embedding)."""
        row.finish = reason
        if row in self.running:
            self.running.remove(row)
        if row.runner is not None and reason != "error" and not row.request.prompt_only:
            self.prompt_cache.insert(row.runner.tokens, row.runner.caches)
        row.runner = None
        out.end(row.request, reason, error)

    def _fail_step(self, error: Exception) -> list[EngineOutput]:
        """A step raised: every row ends with `error` (the caches are in an unknown state)."""
        out = StepOutputs()
        self._inflight = None
        for row in [*self.running, *self.waiting]:
            self._end(row, "error", out, error)
        self.waiting.clear()
        self.prompt_cache.clear()
        return out.take()

    # ---- threaded mode (engine_thread.py) ---------------------------------------------------------
    def _thread_context(self) -> Any:
        mx.set_default_stream(mx.new_stream(mx.default_device()))  # MLX streams belong to their thread
        return contextlib.nullcontext()

    def _unload(self, queued: list[EngineRequest], error: LocalrtError) -> list[EngineOutput]:
        """Stopped: the requests cancelled before it (an unload cancels every request first) end as
        cancelled, the others with `error`."""
        out = StepOutputs()
        self._inflight = None
        for row in [*self.running, *self.waiting]:
            if row.request.cancel.cancelled:
                self._end(row, "cancel", out)
            else:
                self._end(row, "error", out, error)
        for request in queued:
            if request.cancel.cancelled:
                out.end(request, "cancel")
            else:
                out.end(request, "error", error)
        return out.take()


@dataclass
class Speculation:
    """What the model-based proposers need: the draft model (None: no "draft"), its cost in target decode
    steps, the target layers "self" drafts with, and what verifying one draft token costs."""

    draft_model: Transformer | None = None
    draft_cost: float = 0.0
    self_layers: int = 1
    verify_cost: float = 0.0
