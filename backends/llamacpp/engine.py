"""The llama.cpp engine: one context per model, stepped on its own thread (`EngineThread`).

A step schedules (`scheduler.Scheduler`: admission, the step's LoRA set, decodes, prompt chunks), runs
(`runner.Runner`: one `llama_decode` over a batch holding every running sequence's next token and draft
tokens, its seq id and positions, and prompt chunks up to the step's budget), and returns what each
request got (`engine.EngineOutput`): sampled tokens (every sequence from its own rows with its own
sampler chain, draft tokens kept while the target agrees), an embedding's pooled vector or a score's
logprobs once its last chunk ran. An embedding or a score is a prompt-only sequence in the same batch,
chunked like any prompt, so a stream beside it keeps getting tokens.

A model whose own context cannot give hidden states chunk by chunk (an encoder) embeds, and a reranker
ranks, on a pooled context of its own (`rerank.PooledContexts`): one input a step, between two decodes.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

import numpy as np

from localrt.backends.engine import EngineOutput
from localrt.backends.engine import EngineRequest
from localrt.backends.engine import Pooled
from localrt.backends.engine import StepOutputs
from localrt.backends.engine import take_each
from localrt.backends.engine_thread import EngineThread
from localrt.backends.grammar import GrammarDeadEnd
from localrt.backends.outputs import fill_score
from localrt.backends.outputs import logprob_values
from localrt.backends.speculation import DEFAULT_NUM_DRAFT
from localrt.backends.speculation import VERIFY_COST_PER_DRAFT
from localrt.backends.speculation import SpecState
from localrt.errors import EngineFailure
from localrt.errors import LocalrtError

from .draft import DraftContext
from .lib import make_sampler
from .pooled import PooledContexts
from .runner import Runner
from .scheduler import Scheduler
from .scheduler import StepPlan
from .sequences import MAX_VERIFY
from .sequences import ExternalChunk
from .sequences import Sequence


class Engine(EngineThread):
    """The loaded model's one context, driven by one thread: requests are queued from any thread and
    join between steps. `pooling`: how an embedding pools its hidden rows in the batch ("mean", "cls",
    "last"), or None when embeddings run on a pooled context (`pooled`) instead."""

    thread_name = "localrt-llamacpp-step"

    def __init__(
        self,
        runner: Runner,
        scheduler: Scheduler,
        *,
        draft: DraftContext | None = None,
        verify_cost: float = VERIFY_COST_PER_DRAFT["cpu"],
        verify_rows: int = MAX_VERIFY,
        tile_rows: int = 0,
        pooling: str | None = "mean",
        pooled: PooledContexts | None = None,
    ) -> None:
        self.runner, self.scheduler, self.kv = runner, scheduler, scheduler.kv
        self.n_ctx_seq = scheduler.n_ctx_seq
        self.draft = draft
        self.verify_rows = verify_rows  # a sequence's rows in a verify step: its last token and drafts
        # > 0: a decoding step of more than half this many rows is filled up to it with longer lookup
        # drafts (`_fill_tile`)
        self.tile_rows = tile_rows
        # draft + verify cost of one draft token, in target decode steps (speculation.SpecState)
        self.draft_cost = {"lookup": verify_cost}
        if draft is not None:
            self.draft_cost["draft"] = verify_cost + draft.model.size() / max(1, runner.model.size())
        self.pooling = pooling
        self.pooled = pooled
        self.pooled_waiting: deque[Sequence] = deque()  # inputs for the pooled contexts, one a step
        self._init_thread()

    @property
    def steps(self) -> int:
        """Decodes run (for tests and benchmarks)."""
        return self.runner.steps

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work or bool(self.pooled_waiting)

    # ---- requests joining --------------------------------------------------------------------------
    def add(self, request: EngineRequest) -> Sequence:
        """A checked request joins the engine (on its thread); its sequence."""
        seq = Sequence(request, lora=self._lora(request))
        if request.task == "rank" or (request.task == "embed" and self.pooling is None):
            self.pooled_waiting.append(seq)
            return seq
        if request.task == "embed":
            seq.pooled = Pooled(self.pooling or "mean")
        self.scheduler.add(seq)
        return seq

    def _take(self, queued: list[EngineRequest]) -> list[EngineOutput]:
        return take_each(self.add, queued)

    def _lora(self, request: EngineRequest) -> tuple[float, ...]:
        """The request's LoRA scale set (a step batches only sequences of one set): a prompt-only request
        runs on the model as it loaded."""
        adapters = self.runner.adapters
        if adapters is None:
            return ()
        return adapters.default if request.prompt_only else adapters.scales_for(request.req.lora)

    def _prepare(self, seq: Sequence) -> None:
        """An admitted sequence's sampler, limits and speculation."""
        if seq.request.prompt_only:
            return
        req = seq.req
        seq.sampler = make_sampler(self.runner.model, self.n_ctx_seq, req.sampling, req.format, seq.history)
        room = self.n_ctx_seq - len(seq.prompt_cells)
        seq.max_new = room if req.num_predict < 0 else req.num_predict
        if not req.shift:
            seq.max_new = min(seq.max_new, room)
        seq.request.spec = self._spec_state(seq)

    def _spec_state(self, seq: Sequence) -> SpecState | None:
        """The sequence's speculation (lookup, or draft with a draft model); None when it runs without."""
        method = seq.request.method
        if method not in self.draft_cost or any(isinstance(item, ExternalChunk) for item in seq.prompt):
            return None  # off, or an image in the prompt: the proposers see text only
        k = min(seq.req.num_draft or DEFAULT_NUM_DRAFT[method], self.verify_rows - 1)
        # prompt lookup's drafts cost nothing to propose: while they are all accepted they grow to what a
        # verify step takes, since on the CPU a step of TILED_ROWS rows or more runs the tiled attention
        # kernel at about half the cost a row of one under it (benchmarks/README.md, "Prompt lookup and
        # the attention kernel")
        most = self.verify_rows - 1 if method == "lookup" and not seq.req.num_draft else k
        return SpecState(method, k, self.draft_cost[method], k_max=most)

    # ---- a step ------------------------------------------------------------------------------------
    def step(self) -> list[EngineOutput]:
        """One iteration: drop cancelled requests, admit new ones, decode one batch, sample and pool;
        returns what it did to each request."""
        out = StepOutputs()
        sched = self.scheduler
        for seq in [s for s in sched.running if s.request.cancel.cancelled]:
            self._finish(seq, "cancel", out)
        for seq in sched.admit():
            if seq.admissions > 1:
                continue  # resumed after a preemption: its sampler and limits are made
            try:
                self._prepare(seq)
            except Exception as e:  # this request's sampler (its grammar) could not be made
                self._fail(seq, e, out)
        for seq in sched.cancelled:  # before their admission, or while waiting to resume
            self._release(seq, keep=False)
            out.end(seq.request, "cancel")
        sched.cancelled.clear()
        if sched.running:
            self._run(out)
        self._pool_one(out)
        return out.take()

    def _run(self, out: StepOutputs) -> None:
        sched = self.scheduler
        lora = sched.choose_lora()
        self.runner.set_lora(lora)
        decoding, full = sched.decoding(lora)
        for seq in full:
            self._finish(seq, "length", out)
        self._propose(decoding)
        if not self.kv.pool:
            _even_drafts(decoding)
        elif self.tile_rows:
            self._fill_tile(decoding)
        plan = sched.plan(lora, decoding)
        self.runner.evaluate_images(plan)
        if not plan.rows:
            return
        self.runner.fill(plan)
        start = time.perf_counter()
        try:
            decoded = self._decode(plan)
        except EngineFailure as error:
            # llama.cpp took none of the batch into the memory; its sequences fail, cleared, and the
            # sequences outside the batch, and the model, go on
            for seq in {id(rows.seq): rows.seq for rows in plan.rows}.values():
                self._fail(seq, error, out)
            return
        if not decoded:
            # no room, even without idle sequences: the latest admitted one waits, and the next step plans
            # again without it
            sched.unplan(plan)
            if not sched.preempt():
                raise LocalrtError("the KV cache is full")
            return
        prompt_rows = sum(len(rows.tokens) for rows in plan.rows if rows.pending)
        decode_rows = sum(len(rows.tokens) for rows in plan.rows if not rows.pending)
        sched.cost.record(decode_rows, prompt_rows, time.perf_counter() - start)
        for seq in list(sched.running):
            if seq.rows:
                rows, drafts = seq.rows, seq.drafts
                seq.rows, seq.drafts = [], []
                if seq.request.prompt_only:
                    self._take_pooled(seq, rows, out)
                else:
                    self._consume(seq, rows, drafts, out)

    def _propose(self, decoding: list[Sequence]) -> None:
        wants: list[tuple[int, list[int], int]] = []
        drafting: list[Sequence] = []
        for seq in decoding:
            seq.free_drafts = 0
            spec = seq.spec
            if spec is None or not spec.enabled:
                continue
            budget = self._budget(seq, spec.k)
            if budget <= 0:
                continue
            history = [*seq.history]
            if spec.ngram is not None:
                seq.drafts = spec.ngram.propose(history, budget)
            else:
                wants.append((seq.seq, history, budget))
                drafting.append(seq)
        if wants and self.draft is not None:
            for seq, tokens in zip(drafting, self.draft.propose(wants)):
                seq.drafts = tokens

    def _budget(self, seq: Sequence, k: int) -> int:
        """Draft tokens the sequence may take this step: up to k, within its output limit, its context and
        a verify step's rows."""
        return min(
            k,
            seq.max_new - seq.request.generated - 1,
            self.n_ctx_seq - len(self.kv.cells[seq.seq]) - 2,
            self.verify_rows - 1,
        )

    def _fill_tile(self, decoding: list[Sequence]) -> None:
        """A decoding step of more than half a tile of rows, filled up to `tile_rows` with longer drafts.

        From TILED_ROWS query rows the CPU's flash-attention kernel runs tiled; under it each row is
        computed on its own, and a step of 33 to 63 rows costs more than one of 64 (benchmarks/README.md,
        "Prompt lookup and the attention kernel"). The rows that fill the tile are free: the drafting
        sequences' lookups go on further, and what they add is not held against their policy. Only when
        the step's rows are known (no prompt chunk waits to join it) and the lookups reach the tile."""
        rows = sum(1 + len(s.drafts) for s in decoding)
        tile = min(self.tile_rows, self.scheduler.step_tokens)
        if not tile // 2 < rows < tile or any(s.pending for s in self.scheduler.running):
            return
        riders = [s for s in decoding if s.drafts and s.spec is not None and s.spec.ngram is not None]
        longer = {id(s): s.drafts for s in riders}
        spare = tile - rows
        while spare and riders:
            share = -(-spare // len(riders))
            grown = []
            for seq in riders:
                before = longer[id(seq)]
                budget = self._budget(seq, len(before) + min(share, spare))
                assert seq.spec is not None and seq.spec.ngram is not None
                after = seq.spec.ngram.propose(seq.history, budget) if budget > len(before) else before
                spare -= len(after) - len(before)
                longer[id(seq)] = after
                if len(after) > len(before):
                    grown.append(seq)
            riders = grown
        if spare:
            return  # the lookups end short of the tile: the step as proposed
        for seq in decoding:
            drafts = longer.get(id(seq), seq.drafts)
            seq.free_drafts = len(drafts) - len(seq.drafts)
            seq.drafts = drafts

    def _decode(self, plan: StepPlan) -> bool:
        """Decode the planned batch; False when the KV memory has no room for it even without idle
        sequences (nothing was decoded), an `EngineFailure` when the decode failed otherwise."""
        while True:
            ret = self.runner.decode(plan.pooled)
            if ret == 0:
                return True
            if ret == 1 and self.scheduler.evict_idle():
                continue  # the cache was full: room made by dropping an idle sequence, try again
            if ret == 1:
                return False
            raise EngineFailure(f"llama.cpp decode failed (llama_decode returned {ret})")

    # ---- after the decode --------------------------------------------------------------------------
    def _consume(self, seq: Sequence, rows: list[int], drafts: list[int], out: StepOutputs) -> None:
        """Sample the sequence's rows in order: keep draft tokens while the target agrees, roll back the
        rest."""
        if not seq.generating:
            seq.generating = True
            seq.request.first_token_ns = time.perf_counter_ns()
        accepted, finish = 0, None
        for j, row in enumerate(rows):
            try:
                token, finish = self._take_token(seq, row, out)
            except GrammarDeadEnd as error:  # this request's grammar, not the batch's fault
                self._fail(seq, error, out)
                return
            if finish is not None:
                break
            if j < len(drafts) and token == drafts[j]:
                accepted += 1
                continue
            break
        if drafts:
            rejected = len(drafts) - accepted
            if rejected:
                self.kv.cut(seq.seq, len(self.kv.cells[seq.seq]) - rejected)
            assert seq.spec is not None
            seq.spec.record(len(drafts), accepted, free=seq.free_drafts)
        if finish is not None:
            self._finish(seq, finish, out)

    def _take_token(self, seq: Sequence, row: int, out: StepOutputs) -> tuple[int, str | None]:
        if seq.request.cancel.cancelled:
            return -1, "cancel"
        token = self.runner.sample(seq.sampler, row)
        seq.request.generated += 1
        seq.history.append(token)
        seq.last = token
        if self.runner.ends_generation(token):
            return token, "stop"
        req = seq.req
        output = out.of(seq.request)
        output.tokens.append(token)
        output.logprobs.append(
            logprob_values(self.runner.logits(row), token, req.top_logprobs) if req.wants_logprobs else None
        )
        if seq.request.generated >= seq.max_new:
            return token, "length"
        return token, None

    def _take_pooled(self, seq: Sequence, rows: list[int], out: StepOutputs) -> None:
        """A prompt-only sequence's chunk: its hidden rows into the pooled vector, or its logits rows into
        the scores; after its last chunk, the answer."""
        request = seq.request
        if seq.pooled is not None:
            seq.pooled.add(self.runner.hidden(rows))
        elif request.scores is not None:
            tokens = seq.history
            scored = rows[: max(0, len(tokens) - 1 - seq.scored)]  # the last token scores nothing
            if scored:
                fill_score(
                    request.scores, tokens, seq.scored, np.stack([self.runner.logits(r) for r in scored])
                )
        seq.scored += len(rows)
        if seq.pending:
            return
        out.of(request).result = seq.pooled.vector() if seq.pooled is not None else request.scores
        self._finish(seq, "stop", out)

    def _pool_one(self, out: StepOutputs) -> None:
        """One input on a pooled context (a rerank pair, an encoder's embedding): whole, as its attention
        needs it, and one a step, between two decodes."""
        if not self.pooled_waiting:
            return
        seq = self.pooled_waiting.popleft()
        request = seq.request
        if request.cancel.cancelled:
            out.end(request, "cancel")
            return
        request.admitted_ns = time.perf_counter_ns()
        try:
            assert self.pooled is not None
            tokens = [t for t in request.prompt if isinstance(t, int)]
            if request.task == "rank":
                result: Any = float(
                    self.pooled.context("rerank").pool(tokens, 1)[0]
                )  # the head's first output
            else:
                result = np.array(
                    self.pooled.context("embedding").pool(tokens, self.runner.n_embd), dtype=np.float64
                )
        except Exception as e:
            out.end(request, "error", e)
            return
        request.timings.prompt_eval_count = len(tokens)
        out.of(request).result = result
        out.end(request, "stop")

    # ---- leaving -----------------------------------------------------------------------------------
    def _finish(self, seq: Sequence, reason: str, out: StepOutputs) -> None:
        keep = not seq.request.prompt_only and (reason != "cancel" or seq.request.stopped_by_text)
        self._release(seq, keep)
        out.end(seq.request, reason)

    def _fail(self, seq: Sequence, error: BaseException, out: StepOutputs) -> None:
        self._release(seq, keep=False)
        out.end(seq.request, "error", error)

    def _release(self, seq: Sequence, keep: bool) -> None:
        """The sequence leaves; its cells stay cached for prefix reuse, or go at once."""
        self.scheduler.release(seq, keep)
        if seq.sampler is not None:
            seq.sampler.close()
            seq.sampler = None

    def _fail_step(self, error: Exception) -> list[EngineOutput]:
        """A failed decode: every running request gets the error."""
        out = StepOutputs()
        for seq in list(self.scheduler.running):
            self._fail(seq, error, out)
        return out.take()

    def _unload(self, queued: list[EngineRequest], error: LocalrtError) -> list[EngineOutput]:
        out = StepOutputs()
        sched = self.scheduler
        waiting = [*sched.waiting, *self.pooled_waiting]
        sched.waiting, self.pooled_waiting = [], deque()
        for seq in list(sched.running):
            if seq.request.cancel.cancelled:  # model.cancel() before an unload: a clean end, not an error
                self._finish(seq, "cancel", out)
            else:
                self._fail(seq, error, out)
        for request in [*(s.request for s in waiting), *queued]:
            if request.cancel.cancelled:
                out.end(request, "cancel")
            else:
                out.end(request, "error", error)
        return out.take()

    def close(self) -> None:
        """Free the contexts (after `stop`)."""
        self.runner.close()
        if self.draft is not None:
            self.draft.close()
        if self.pooled is not None:
            self.pooled.close()


def _even_drafts(seqs: list[Sequence]) -> None:
    """Give every drafting sequence of a step the same draft length.

    llama.cpp cuts a batch over several KV streams into micro-batches that take the same number of rows
    from each stream, and every micro-batch is a pass over the weights: drafts of unequal lengths cost a
    pass per length. The common length n keeps the most draft rows, n x (drafts at least n long); shorter
    drafts are dropped (their sequences decode one token)."""
    lengths = sorted({len(s.drafts) for s in seqs if s.drafts})
    if not lengths:
        return
    n = max(lengths, key=lambda k: k * sum(len(s.drafts) >= k for s in seqs))
    for seq in seqs:
        seq.drafts = seq.drafts[:n] if len(seq.drafts) >= n else []
