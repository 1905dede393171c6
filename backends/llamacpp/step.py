"""The one batched llama.cpp context and its step loop.

One thread owns the context (`EngineThread`). Each step builds one `llama_batch` holding every running
sequence's next token(s) — the last sampled token plus any draft tokens, each sequence on its own seq id
and positions — and fills the rest of a per-step token budget with prompt chunks (chunked prefill), then
runs one `llama_decode` and samples every sequence from its own rows with its own sampler chain. Requests
join and leave at every step; `step()` returns what it did to each (`Output`: token ids, logprob values,
the finish), and the adapter turns them into text on the request's event loop, as for every engine.

Sequences and their KV record are in `sequences.py`; admission, prefix reuse and the RAM cache in
`admission.py`. A prompt is a list of items: token ids, or `ExternalChunk`s that something else evaluates
into the context for a seq id (image embeddings through libmtmd); the loop calls a chunk's `evaluate` when
the sequence's prefill reaches it and records the chunk's cells under its key, so an identical chunk is a
prefix hit too.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from localrt.backends.engine_thread import EngineThread
from localrt.backends.engine_thread import RequestQueues
from localrt.backends.grammar import GrammarDeadEnd
from localrt.backends.outputs import logprob_values
from localrt.backends.speculation import VERIFY_COST_PER_DRAFT
from localrt.errors import LocalrtError

from .admission import COPY_MIN
from .admission import RAM_CACHE_BYTES
from .admission import Admission
from .admission import SavedSeq
from .lib import Batch
from .lib import LoraAdapters
from .lib import sample
from .sequences import EXACT_ROWS
from .sequences import PROMPT_WORK
from .sequences import DraftContext
from .sequences import ExternalChunk
from .sequences import Job
from .sequences import Output
from .sequences import SeqContext


class BatchedContext(RequestQueues, EngineThread, Admission):
    """The loaded model's one context, driven by one thread (`EngineThread`: requests and jobs queued from
    any thread, taken between steps); `submit` jobs, `run_task` exclusive work."""

    thread_name = "localrt-llamacpp-step"

    def __init__(
        self,
        model: Any,
        ctx: Any,
        *,
        n_parallel: int,
        n_seq_max: int,
        n_ctx_seq: int,
        step_tokens: int,
        draft: DraftContext | None = None,
        verify_cost: float = VERIFY_COST_PER_DRAFT["cpu"],
        copy_min: int = COPY_MIN,
        ram_cache_bytes: int = RAM_CACHE_BYTES,
        adapters: LoraAdapters | None = None,
        prefill_rows: int = EXACT_ROWS,
        prompt_work: int | None = PROMPT_WORK,
    ) -> None:
        SeqContext.__init__(self, model, ctx, n_seq_max, step_tokens)
        self.n_parallel = n_parallel
        self.n_seq_max = n_seq_max
        self.n_ctx_seq = n_ctx_seq
        self.step_tokens = step_tokens
        # a sequence's prompt rows per step: EXACT_ROWS keeps batching invisible on the CPU's kernels
        # (sequences.py); more (LOCALRT_FAST_PREFILL, or layers on a GPU, whose kernels that cap was not
        # made for) lets a long prompt go through the faster kernels of large batches
        self.prefill_rows = prefill_rows
        # a step's prompt work (sequences.PROMPT_WORK); None: every prompt that fits (a GPU's kernels
        # batch prompt rows for little more than one costs, where that estimate was not made)
        self.prompt_work = prompt_work
        self.draft = draft
        # draft + verify cost of one draft token, in target decode steps (speculation.SpecState)
        self.draft_cost = {"lookup": verify_cost}
        if draft is not None:
            self.draft_cost["draft"] = verify_cost + draft.model.size() / max(1, model.size())
        self.copy_min = copy_min
        self.ram_cache_bytes = ram_cache_bytes
        self.saved: list[SavedSeq] = []  # evicted idle sequences' states, least recently saved first
        self.owner: list[Job | None] = [None] * n_seq_max
        self.last_used = [0.0] * n_seq_max
        self.outputs: dict[Job, Output] = {}  # this step's, by job
        self.plan: list[tuple[int, list[int], int, bool | list[bool], Job]] = []  # this step's rows
        self.room = step_tokens  # batch rows this step has not planned yet
        self.waiting: list[Job] = []  # taken from the inbox, not yet admitted (owned by the step thread)
        self.running: list[Job] = []
        # the model's LoRA adapters (none: None) and the scale set the context has now (the caller
        # applied the default) and this step's: a step batches only jobs of one set (`_choose_lora`)
        self.adapters = adapters
        self.lora_now: tuple[float, ...] = adapters.default if adapters is not None else ()
        self.lora = self.lora_now
        self.tick = 0  # steps taken, decoding or not (a job's `turn`)
        self._init_thread()
        self.steps = 0  # decodes run (for tests and benchmarks)

    # ---- requests from other threads (`submit`: EngineThread's) ------------------------------------
    def run_task(self, fn: Callable[[Any, int], Any]) -> Any:
        """Exclusive work on the context between steps (scoring): `fn(ctx, seq_id)` on a free sequence."""
        return self.call(lambda: self._run_task(fn)).result()

    def jobs(self) -> list[Job]:
        """The requests not finished: running, waiting for admission, and queued."""
        with self._cv:
            return [*self.running, *self.waiting, *self._inbox]

    # ---- EngineThread's hooks, on the step thread ------------------------------------------------
    def _fail_step(self, error: Exception) -> list[Output]:
        """A failed decode: every running request gets the error."""
        return self._fail_all(list(self.running), error)

    def _unload(self, queued: list[Job]) -> list[Output]:
        pending, self.waiting = [*self.waiting, *queued], []
        failing: list[Job] = []
        for job in [*self.running, *pending]:
            if not job.req.cancel.cancelled:
                failing.append(job)
            elif job in self.running:  # model.cancel() before the unload: a clean end, not an error
                self._finish(job, "cancel")
            else:
                self._end_cancelled(job)
        return self._fail_all(failing, LocalrtError("the model was unloaded"))

    def _fail_all(self, jobs: list[Job], error: BaseException) -> list[Output]:
        for job in jobs:
            self._fail(job, error)
        return self._take_outputs()

    def step(self) -> list[Output]:
        """One iteration: drop cancelled requests, admit new ones, decode one batch, sample; returns what it
        did to each request."""
        for job in [j for j in self.running if j.req.cancel.cancelled]:
            self._finish(job, "cancel")
        self._admit()
        self.tick += 1
        if self.running:
            self._choose_lora()
            self._add_decodes()
            self._add_prefills()
            self._fill_batch()
            if self.batch.n:
                self._decode()
                for job in list(self.running):
                    if job.rows:
                        rows, drafts = job.rows, job.drafts
                        job.rows, job.drafts = [], []
                        self._consume(job, rows, drafts)
        return self._take_outputs()

    def _take_outputs(self) -> list[Output]:
        outputs = list(self.outputs.values())
        self.outputs = {}
        return outputs

    # ---- building the batch --------------------------------------------------------------------
    def _choose_lora(self) -> None:
        """This step's LoRA scale set: the one of the job that has waited longest (the oldest of equals).

        llama.cpp applies adapters to the whole context, not per sequence, so a step batches only the jobs
        of one set and the others sit it out: with two sets running they take alternate steps, each at
        about half its speed alone (as llama-server, which batches only slots with equal adapters)."""
        self.lora = min(self.running, key=lambda j: j.turn).lora
        self._set_lora(self.lora)

    def _set_lora(self, scales: tuple[float, ...]) -> None:
        """The context under `scales`, set only on a change: a change makes llama.cpp reserve its compute
        graph again at the next decode."""
        if self.adapters is not None and scales != self.lora_now:
            self.adapters.apply(self.ctx.ctx, scales)
            self.lora_now = scales

    def _add_decodes(self) -> None:
        decoding = [j for j in self.running if j.lora == self.lora and j.generating and not j.pending]
        for job in decoding:
            if len(self.cells[job.seq]) + 1 > self.n_ctx_seq:
                self._context_full(job)
        decoding = [j for j in decoding if j in self.running and not j.pending]
        self._propose(decoding)
        _even_drafts(decoding)
        for job in decoding:
            tokens = [job.last, *job.drafts]
            if len(tokens) > self.room:
                job.drafts, tokens = [], [job.last]
            if not self.room:
                break
            self._plan_rows(job, tokens, True)
            job.timings.draft_count += len(job.drafts)

    def _plan_rows(self, job: Job, tokens: list[int], output: bool | list[bool]) -> None:
        seq = job.seq
        job.turn = self.tick
        self.plan.append((seq, tokens, len(self.cells[seq]), output, job))
        self.cells[seq].extend(tokens)
        self.room -= len(tokens)

    def _fill_batch(self) -> None:
        """The planned rows into the batch, by seq id: llama.cpp cuts micro-batches of consecutive ids."""
        self.batch.clear()
        for seq, tokens, pos0, output, job in sorted(self.plan, key=lambda e: e[0]):
            start = self.batch.add(tokens, pos0, seq, output)
            if output is True:
                job.rows = list(range(start, start + len(tokens)))
            elif output[-1]:
                job.rows = [start + len(tokens) - 1]
        self.plan, self.room = [], self.step_tokens

    def _propose(self, jobs: list[Job]) -> None:
        wants: list[tuple[int, list[int], int]] = []
        drafting: list[Job] = []
        for job in jobs:
            spec = job.spec
            if spec is None or not spec.enabled:
                continue
            budget = min(spec.k, job.max_new - job.n_gen - 1, self.n_ctx_seq - len(self.cells[job.seq]) - 2)
            if budget <= 0:
                continue
            history = [*job.history]
            if spec.ngram is not None:
                job.drafts = spec.ngram.propose(history, budget)
            else:
                wants.append((job.seq, history, budget))
                drafting.append(job)
        if wants and self.draft is not None:
            for job, tokens in zip(drafting, self.draft.propose(wants)):
                job.drafts = tokens

    def _add_prefills(self) -> None:
        """Prompt chunks, oldest request first, up to `prompt_work` (rows x the cells they attend to)."""
        work = 0
        for job in self.running:
            if job.lora != self.lora or not job.pending or job in (e[4] for e in self.plan):
                continue
            if self.prompt_work is not None and work >= self.prompt_work:
                break
            self._run_external(job)
            take: list[int] = []
            limit = min(self.room, self.prefill_rows)
            for item in job.pending:
                if not isinstance(item, int) or len(take) >= limit:
                    break
                take.append(item)
            if not take:
                continue
            work += len(take) * (len(self.cells[job.seq]) + len(take))
            flags = [False] * len(take)
            flags[-1] = len(take) == len(job.pending)
            del job.pending[: len(take)]
            self._plan_rows(job, take, flags)
            if not self.room:
                break

    def _run_external(self, job: Job) -> None:
        """Evaluate external chunks at the head of the job's pending prompt (their own decodes, now)."""
        while job.pending and isinstance(job.pending[0], ExternalChunk):
            chunk = job.pending.pop(0)
            seq = job.seq
            pos = len(self.cells[seq])
            new_pos = chunk.evaluate(self.ctx.ctx, seq, pos)
            if new_pos < pos:
                raise LocalrtError("an external prompt chunk failed to evaluate")
            self.cells[seq].extend(chunk.cells)
            job.timings.prompt_image_tokens += chunk.n_tokens

    def _context_full(self, job: Job) -> None:
        """The sequence fills its context: shift (keep num_keep, drop half the rest, recompute) or stop."""
        cells = self.cells[job.seq]
        n_keep = max(0, min(job.req.num_keep, self.n_ctx_seq // 2))
        n_discard = (len(cells) - n_keep) // 2
        kept = cells[n_keep + n_discard :]
        if not job.req.shift or n_discard <= 0 or not all(isinstance(c, int) for c in kept):
            self._finish(job, "length")
            return
        # A recompute rather than a K-shift: the cells may be shared with other sequences (seq_cp), and
        # moving shared cells' positions would move them for every sequence holding them.
        self._cut(job.seq, n_keep)
        job.pending = [*kept, job.last]  # type: ignore[list-item]

    def _decode(self) -> None:
        while True:
            ret = self.batch.decode(self.ctx.ctx)
            if ret == 0:
                self.steps += 1
                return
            if ret == 1 and self._evict_idle():
                continue  # the cache was full: room made by dropping an idle sequence, try again
            raise LocalrtError(
                "the KV cache is full"
                if ret == 1
                else f"llama.cpp decode failed (llama_decode returned {ret})"
            )

    # ---- after the decode ----------------------------------------------------------------------
    def _consume(self, job: Job, rows: list[int], drafts: list[int]) -> None:
        """Sample the job's rows in order: keep draft tokens while the target agrees, roll back the rest."""
        if not job.generating:
            job.generating = True
            job.t_prompt = time.perf_counter_ns()
            if job.capture:
                job.logits = self.logits(rows[0]).copy()
            job.timings.prompt_eval_ns = job.t_prompt - job.t_admit
        accepted, finish = 0, None
        for j, row in enumerate(rows):
            try:
                token, finish = self._take_token(job, row)
            except GrammarDeadEnd as error:  # this request's grammar, not the batch's fault
                self._fail(job, error)
                return
            if finish is not None:
                break
            if j < len(drafts) and token == drafts[j]:
                accepted += 1
                continue
            break
        if drafts:
            job.timings.draft_accepted_count += accepted
            rejected = len(drafts) - accepted
            if rejected:
                self._cut(job.seq, len(self.cells[job.seq]) - rejected)
            assert job.spec is not None
            job.spec.record(len(drafts), accepted)
        if finish is not None:
            self._finish(job, finish)

    def _take_token(self, job: Job, row: int) -> tuple[int, str | None]:
        if job.req.cancel.cancelled:
            return -1, "cancel"
        token = sample(job.sampler, self.ctx.ctx, row)
        job.n_gen += 1
        job.history.append(token)
        job.last = token
        if self.ends_generation(token):
            return token, "stop"
        req = job.req
        out = self._output(job)
        out.tokens.append(token)
        out.logprobs.append(
            logprob_values(self.logits(row), token, req.top_logprobs) if req.wants_logprobs else None
        )
        if job.n_gen >= job.max_new:
            return token, "length"
        return token, None

    def _finish(self, job: Job, reason: str) -> None:
        now = time.perf_counter_ns()
        if not job.generating:
            job.timings.prompt_eval_ns = now - job.t_admit
        job.timings.eval_count = job.n_gen
        job.timings.eval_ns = now - job.t_prompt if job.t_prompt else 0
        self._output(job).finish = reason
        self._release(job, keep=reason != "cancel" or job.stopped_by_text)

    def _fail(self, job: Job, error: BaseException) -> None:
        job.error = error
        self._output(job).finish = "error"
        self._release(job, keep=False)

    def _release(self, job: Job, keep: bool) -> None:
        """The job leaves; its sequence stays cached for prefix reuse, or (cancelled) is freed at once."""
        if job in self.running:
            self.running.remove(job)
        seq = job.seq
        if seq >= 0 and self.owner[seq] is job:
            self.owner[seq] = None
            self.last_used[seq] = time.monotonic()
            if not keep:
                self._evict(seq)
        if job.sampler is not None:
            job.sampler.close()
            job.sampler = None
        job.finished.set()

    # ---- exclusive tasks -----------------------------------------------------------------------
    def _run_task(self, fn: Callable[[Any, int], Any]) -> Any:
        idle = [s for s in range(self.n_seq_max) if self.owner[s] is None]
        if not idle:
            raise LocalrtError("no free sequence for this request")
        seq = min(idle, key=lambda s: (bool(self.cells[s]), self.last_used[s]))
        self._evict(seq)
        if self.adapters is not None:
            self._set_lora(self.adapters.default)  # scoring takes no scales: the model as it loaded
        try:
            return fn(self.ctx.ctx, seq)
        finally:
            self._evict(seq)

    def decode_exclusive(self, batch: Batch) -> None:
        """For tasks: decode `batch`, dropping idle sequences when the cache is full."""
        while True:
            ret = batch.decode(self.ctx.ctx)
            if ret == 0:
                return
            if ret == 1 and self._evict_idle():
                continue
            raise LocalrtError(f"llama.cpp decode failed (llama_decode returned {ret})")


def _even_drafts(jobs: list[Job]) -> None:
    """Give every drafting sequence of a step the same draft length.

    llama.cpp cuts a batch over several KV streams into micro-batches that take the same number of rows
    from each stream, and every micro-batch is a pass over the weights: drafts of unequal lengths cost a
    pass per length (counted on 16 grounded requests with lookup: 2% more rows than without speculation,
    but 235 micro-batches against 84; 209 with this). The common length n keeps the most draft rows,
    n x (drafts at least n long); shorter drafts are dropped (their sequences decode one token)."""
    lengths = sorted({len(j.drafts) for j in jobs if j.drafts})
    if not lengths:
        return
    n = max(lengths, key=lambda k: k * sum(len(j.drafts) >= k for j in jobs))
    for job in jobs:
        job.drafts = job.drafts[:n] if len(job.drafts) >= n else []
