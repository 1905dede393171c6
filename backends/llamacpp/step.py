"""The one batched llama.cpp context and its step loop.

One thread owns the context. Each step it builds one `llama_batch` holding every running sequence's next
token(s) — the last sampled token plus any draft tokens, each sequence on its own seq id and
positions — and fills the rest of a per-step token budget with prompt chunks (chunked prefill), then runs
one `llama_decode` and samples every sequence from its own rows with its own sampler chain. Requests join
and leave at every step. Sequence ids outnumber the running sequences: finished sequences stay in the KV
cache (least recently used first out), and a new request starts from the longest prefix any sequence
holds (`llama_memory_seq_cp` shares the cells, nothing is copied).

A prompt is a list of items: token ids, or `ExternalChunk`s that something else evaluates into the context
for a seq id (image embeddings through libmtmd); the loop calls a chunk's `evaluate` when the sequence's
prefill reaches it and records the chunk's cells under its key, so an identical chunk is a prefix hit too.
"""

from __future__ import annotations

import ctypes
import queue
import threading
import time
from collections.abc import Callable
from collections.abc import Hashable
from collections.abc import Iterator
from collections.abc import Sequence
from dataclasses import dataclass
from dataclasses import field
from typing import Any

import numpy as np

from localrt.backends.base import DoneEvent
from localrt.backends.base import Event
from localrt.backends.base import GenerateRequest
from localrt.backends.base import TextAssembler
from localrt.backends.base import Timings
from localrt.backends.base import TokenLogprob
from localrt.backends.base import close_each
from localrt.backends.base import common_prefix
from localrt.backends.base import longest_prefix
from localrt.backends.engine_thread import EngineThread
from localrt.backends.engine_thread import RequestQueues
from localrt.backends.outputs import logprob_from_logits
from localrt.backends.speculation import DEFAULT_NUM_DRAFT
from localrt.backends.speculation import VERIFY_COST_PER_DRAFT
from localrt.backends.speculation import SpecState
from localrt.backends.speculation import speculative_method
from localrt.errors import LocalrtError

from .lib import Batch
from .lib import _lib
from .lib import logits_row
from .lib import make_sampler
from .lib import sample
from .lib import token_piece

# Rows of one sequence in a step (prompt chunk, or last token + drafts). Under 64 query rows of a KV stream
# in a micro-batch the CPU flash-attention kernel computes every row on its own (a sequence's logits do
# not depend on what else is in the batch); from 64 on it switches to a tiled kernel with other rounding.
# Capping each sequence's rows (not the micro-batch) keeps batching invisible while the micro-batch holds
# every sequence's rows at once: llama.cpp splits a multi-stream batch into micro-batches of equal rows per
# stream, so one step of many prefilling sequences is one pass over the weights, not one per 48 rows.
EXACT_ROWS = 48
MAX_VERIFY = EXACT_ROWS  # draft tokens + 1 per sequence and step
# The shared-prefix length from which a prefix is copied when the caller gives no cost figures, and the
# least a new request must share with a prompt still being evaluated to wait for it rather than start.
COPY_MIN = 32
# RAM for the states of idle sequences that lost their cells to another request (llama-server's
# --cache-ram): a conversation coming back after its sequence was reused is restored, not re-evaluated.
RAM_CACHE_BYTES = 512 << 20


def copy_threshold(stream_bytes: int, weight_bytes: int) -> int:
    """The shortest shared prefix worth copying rather than evaluating again.

    A copy between sequences copies the source's whole KV stream (every cell of its context, used or not),
    so it costs a memory copy of `stream_bytes`; evaluating a prompt token costs a pass of compute over the
    weights. Counted on SmolLM2-135M Q4_1 (one thread, CPU time of the decode that carries the copy): a
    2,048-cell stream (47 MB) costs about one token's evaluation, an 8,192-cell one about five, i.e. one
    token per half the weights' bytes. Below that, re-evaluating the prefix is cheaper.
    """
    if stream_bytes <= 0 or weight_bytes <= 0:
        return COPY_MIN
    return max(1, -(-2 * stream_bytes // weight_bytes))


@dataclass
class ExternalChunk:
    """Prompt cells evaluated by someone else into the context (an image through libmtmd).

    `evaluate(ctx, seq_id, pos)` runs on the step thread with the raw `llama_context*`, decodes the chunk
    into `seq_id` starting at position `pos` (no logits needed) and returns the next position. `cells` are
    the chunk's keys, one per KV cell (an image's digest and index), so an identical chunk is a prefix hit.
    """

    cells: list[Hashable]
    evaluate: Callable[[Any, int, int], int]

    @property
    def n_tokens(self) -> int:
        return len(self.cells)


PromptItem = int | ExternalChunk


@dataclass
class SavedSeq:
    """An evicted idle sequence: its cells and its KV state as llama_state_seq_get_data wrote it."""

    cells: list[Hashable]
    data: Any  # a ctypes uint8 array


@dataclass(eq=False)  # a request is itself: `job in self.running` must not compare field by field
class Job:
    """One generation request as the step loop sees it."""

    req: GenerateRequest
    emit: Callable[[Event], None]
    prompt: list[PromptItem] = field(default_factory=list)
    prompt_cells: list[Hashable] = field(default_factory=list)
    seq: int = -1
    pending: list[PromptItem] = field(default_factory=list)  # still to evaluate before sampling
    generating: bool = False  # the prompt is done (pending is then only a context-shift recompute)
    history: list[int] = field(default_factory=list)  # prompt tokens + sampled tokens
    last: int = -1  # the sampled token not yet in the KV cache
    sampler: Any = None
    text: TextAssembler = field(init=False)  # the answer's text: pieces to UTF-8, stop strings
    timings: Timings = field(default_factory=Timings)
    t_admit: int = 0
    t_prompt: int = 0
    n_gen: int = 0
    max_new: int = 0
    spec: SpecState | None = None  # None: no speculation
    drafts: list[int] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)  # batch indices with logits for this job this step
    finished: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None
    capture: bool = False  # keep a copy of the logits after the prompt in `logits` (tests, inspection)
    logits: np.ndarray | None = None

    def __post_init__(self) -> None:
        self.text = TextAssembler(self.req.stop)


class SeqContext:
    """A llama.cpp context (`ctx`: llama-cpp-python's LlamaContext on `model`), one batch of up to n_batch
    rows, and the record of the cells each seq id holds in the context's KV memory (`cells`). The methods
    below change the memory (`llama_memory_*`) and the record together."""

    def __init__(self, model: Any, ctx: Any, n_seq_max: int, n_batch: int) -> None:
        self.lib = _lib()
        self.model, self.ctx = model, ctx
        self.n_vocab = model.n_vocab()
        self.mem = self.lib.llama_get_memory(ctx.ctx)
        self.batch = Batch(n_batch)
        self.cells: list[list[Hashable]] = [[] for _ in range(n_seq_max)]

    def logits(self, row: int) -> np.ndarray:
        """Batch row `row`'s logits from the last decode (llama.cpp's buffer: copy to keep them)."""
        return logits_row(self.lib, self.ctx.ctx, row, self.n_vocab)

    def _append(self, seq: int, tokens: list[int], output: bool | list[bool]) -> int:
        """Add tokens to the batch at seq's next positions (recorded as held); their first batch index."""
        start = self.batch.add(tokens, len(self.cells[seq]), seq, output)
        self.cells[seq].extend(tokens)
        return start

    def _cut(self, seq: int, n: int) -> bool:
        """Drop seq's cells from the n-th on; False when the memory cannot cut a sequence partway."""
        del self.cells[seq][n:]
        return bool(self.lib.llama_memory_seq_rm(self.mem, seq, n, -1))

    def _keep(self, seq: int, n: int) -> int:
        """Keep seq's first n cells; how many are kept: none when the memory cannot cut a sequence
        partway (it is cleared then)."""
        if self._cut(seq, n):
            return n
        self._evict(seq)
        return 0

    def _evict(self, seq: int) -> None:
        self.lib.llama_memory_seq_rm(self.mem, seq, -1, -1)
        self.cells[seq] = []

    def _evict_all(self) -> None:
        self.lib.llama_memory_clear(self.mem, True)
        self.cells = [[] for _ in self.cells]

    def _copy(self, src: int, dst: int) -> None:
        """dst holds what src holds: each sequence has a KV stream of its own, so the whole stream is copied."""
        self.lib.llama_memory_seq_cp(self.mem, src, dst, -1, -1)
        self.cells[dst] = list(self.cells[src])


class DraftContext(SeqContext):
    """The draft model's context: the same seq ids as the target, greedy draft tokens for many sequences at once."""

    def propose(self, wants: list[tuple[int, list[int], int]]) -> list[list[int]]:
        """wants: (seq id, history, k) -> up to k greedy draft tokens per entry (one draft decode per round)."""
        remaining: list[list[int]] = []
        for seq, history, _ in wants:
            keep = min(common_prefix(self.cells[seq], history), len(history) - 1)
            keep = self._keep(seq, keep)
            remaining.append(history[keep:])
        out: list[list[int]] = [[] for _ in wants]
        live = self._catch_up(wants, remaining, out)
        while live:
            self.batch.clear()
            rows = {}
            for i in live:
                rows[i] = self._append(wants[i][0], [out[i][-1]], True)
            if not self._decode():
                break
            live = [i for i in live if self._take(i, rows[i], wants, out)]
        return out

    def _catch_up(
        self, wants: list[tuple[int, list[int], int]], remaining: list[list[int]], out: list[list[int]]
    ) -> list[int]:
        live: list[int] = []
        while any(remaining):
            self.batch.clear()
            rows = {}
            for i, tokens in enumerate(remaining):
                take = tokens[: self.batch.room]
                if not take:
                    continue
                last = len(take) == len(tokens)
                flags = [False] * len(take)
                flags[-1] = last
                idx = self._append(wants[i][0], take, flags)
                remaining[i] = tokens[len(take) :]
                if last:
                    rows[i] = idx + len(take) - 1
            if not self._decode():
                return []
            live += [i for i, row in rows.items() if self._take(i, row, wants, out)]
        return live

    def _take(self, i: int, row: int, wants: list[tuple[int, list[int], int]], out: list[list[int]]) -> bool:
        """Append the argmax of `row` to entry i's draft tokens; True while it wants more."""
        token = int(np.argmax(self.logits(row)))
        if self.lib.llama_vocab_is_eog(self.model.vocab, token):
            return False
        out[i].append(token)
        return len(out[i]) < wants[i][2]

    def _decode(self) -> bool:
        if self.batch.decode(self.ctx.ctx) != 0:  # full or failed: start the draft cache over
            self._evict_all()
            return False
        return True

    def close(self) -> None:
        close_each(self.batch, self.ctx)


class BatchedContext(RequestQueues, EngineThread, SeqContext):
    """The loaded model's one context, driven by one thread (`EngineThread`: requests and jobs queued from
    any thread, taken between steps); `submit` jobs, `run_task` exclusive work. Events go out through a
    hand-over thread of its own (`_flush`), not the engine thread's sink."""

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
    ) -> None:
        SeqContext.__init__(self, model, ctx, n_seq_max, step_tokens)
        self.vocab = model.vocab
        self.n_parallel = n_parallel
        self.n_seq_max = n_seq_max
        self.n_ctx_seq = n_ctx_seq
        self.step_tokens = step_tokens
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
        self.pieces: dict[tuple[int, bool], bytes] = {}
        self.plan: list[tuple[int, list[int], int, bool | list[bool], Job]] = []  # this step's rows
        self.room = step_tokens  # batch rows this step has not planned yet
        self.waiting: list[Job] = []  # taken from the inbox, not yet admitted (owned by the step thread)
        self.running: list[Job] = []
        self._init_thread()
        self.steps = 0  # decodes run (for tests and benchmarks)
        self.outbox: list[Callable[[], None]] = []  # events of the last step, handed over by _flush
        # flushed steps' events, in order, for the hand-over thread; None closes it
        self.handing: queue.SimpleQueue[list[Callable[[], None]] | None] = queue.SimpleQueue()
        self.hand_thread = threading.Thread(target=self._hand_over, daemon=True, name="localrt-llamacpp-emit")
        self.hand_thread.start()
        self.start()

    # ---- requests from other threads (`submit`: EngineThread's) ------------------------------------
    def run_task(self, fn: Callable[[Any, int], Any]) -> Any:
        """Exclusive work on the context between steps (scoring): `fn(ctx, seq_id)` on a free sequence."""
        return self.call(lambda: self._run_task(fn)).result()

    def jobs(self) -> list[Job]:
        """The requests not finished: running, waiting for admission, and queued."""
        with self._cv:
            return [*self.running, *self.waiting, *self._inbox]

    def close(self) -> None:
        self.stop()
        self.handing.put(None)
        self.hand_thread.join()

    # ---- EngineThread's hooks, on the step thread ------------------------------------------------
    def _fail_step(self, error: Exception) -> list[Any]:
        """A failed decode: every running request gets the error."""
        return self._fail_all(list(self.running), error)

    def _unload(self, queued: list[Job]) -> list[Any]:
        pending, self.waiting = [*self.waiting, *queued], []
        failing: list[Job] = []
        for job in [*self.running, *pending]:
            if not job.req.cancel.cancelled:
                failing.append(job)
            elif job in self.running:  # model.cancel() before the unload: a clean end, not an error
                self._finish(job, "cancel")
            else:
                _end_cancelled(job)
        return self._fail_all(failing, LocalrtError("the model was unloaded"))

    def _fail_all(self, jobs: list[Job], error: BaseException) -> list[Any]:
        """The jobs end with `error`. Their events go out through the hand-over thread, none through the
        engine thread's sink."""
        for job in jobs:
            self._fail(job, error)
        self._flush()
        return []

    def step(self) -> list[Any]:
        """One iteration: drop cancelled requests, admit new ones, decode one batch, sample. The events go
        out through `_flush` (none through the engine thread's sink): before the next decode, or at once
        when no request is left running."""
        for job in [j for j in self.running if j.req.cancel.cancelled]:
            self._finish(job, "cancel")
        if self.waiting:
            self._flush()  # admission may take a while (a grammar to compile): tokens go out first
        self._admit()
        if self.running:
            self._add_decodes()
            self._add_prefills()
            self._fill_batch()
            self._flush()
            if self.batch.n:
                self._decode()
                for job in list(self.running):
                    if job.rows:
                        rows, drafts = job.rows, job.drafts
                        job.rows, job.drafts = [], []
                        self._consume(job, rows, drafts)
        if not self.running:
            self._flush()  # nothing left to step: the last events go out now
        return []

    def _emit(self, job: Job, event: Event) -> None:
        self.outbox.append(lambda: job.emit(event))

    def _flush(self) -> None:
        """Pass the last step's events to the hand-over thread, right before the next `llama_decode`.

        Emitting wakes the consumer's event loop (`call_soon_threadsafe` writes to its socket), which takes
        the GIL at once; emitted from the step thread, the loop's work (runtime, HTTP, JSON) ran while the
        step thread waited for the GIL to come back (cProfile on the step thread, loaded machine: that
        `socket.send` took 14-20 ms of wall per step). The hand-over thread gets the GIL when the step
        thread enters `llama_decode` (ctypes releases it), so the consumers' work overlaps the decode. On
        the loaded machine the step's total time outside the decode did not measurably change (A/B over
        64 steps); a quiet 2-core run decides whether it pays."""
        if not self.outbox:
            return
        self.handing.put(self.outbox)
        self.outbox = []

    def _hand_over(self) -> None:
        """The hand-over thread: run flushed emits in order (events, then `finished`), until closed."""
        while (out := self.handing.get()) is not None:
            for hand_over in out:
                hand_over()

    # ---- admission and prefix reuse ------------------------------------------------------------
    def _admit(self) -> None:
        with self._cv:  # `jobs` sees each request waiting or running, never between the two
            held: list[Job] = []
            while self.waiting and len(self.running) < self.n_parallel:
                job = self.waiting.pop(0)
                if job.req.cancel.cancelled:
                    _end_cancelled(job)
                    continue
                if self._prefix_coming(job):
                    held.append(job)
                    continue
                try:
                    self._start(job)
                except Exception as e:
                    self._fail(job, e)
            self.waiting[:0] = held

    def _prefix_coming(self, job: Job) -> bool:
        """True while a running request is still evaluating a long prefix this one shares: waiting a step or
        two and copying it beats evaluating the same tokens twice (N clients behind one system prompt)."""
        if not job.prompt_cells:
            job.prompt_cells = _cells(job.prompt)
        cached = self._best_prefix(job.prompt_cells)[1]
        for other in self.running:
            if other.generating or not other.pending:
                continue
            shared = common_prefix(other.prompt_cells, job.prompt_cells)
            # a wait of a step or more pays only for a long shared part, however cheap the copy is
            if shared >= max(self.copy_min, COPY_MIN) and shared > cached:
                return True
        return False

    def _start(self, job: Job) -> None:
        req = job.req
        job.t_admit = time.perf_counter_ns()
        prompt_cells = job.prompt_cells or _cells(job.prompt)
        job.prompt_cells = prompt_cells
        seq, n = self._place(job.prompt, prompt_cells)
        job.seq = seq
        self.owner[seq] = job
        job.pending = _items_from(job.prompt, n)
        job.timings.prompt_eval_count = len(prompt_cells) - n
        job.history = [t for t in job.prompt if isinstance(t, int)]
        job.sampler = make_sampler(self.model, self.n_ctx_seq, req.sampling, req.format, job.history)
        room = self.n_ctx_seq - len(prompt_cells)
        job.max_new = room if req.num_predict < 0 else req.num_predict
        if not req.shift:
            job.max_new = min(job.max_new, room)
        job.spec = self._spec_state(job)
        self.running.append(job)
        job.timings.cached_count = n

    def _place(self, prompt: list[PromptItem], prompt_cells: list[Hashable]) -> tuple[int, int]:
        """A seq id for a new prompt and how many of its cells it already holds (a live sequence's prefix,
        copied or taken over, or a saved one restored from RAM); the rest of the seq's cells are gone."""
        src, n = self._best_prefix(prompt_cells)
        saved, n_saved = self._best_saved(prompt_cells)
        if saved is not None and n_saved > n:
            src = self._free_seq(-1, 0, len(prompt_cells))
            n = n_saved if self._restore(saved, src) else 0
        n = min(n, len(prompt_cells) - 1)  # at least one token is evaluated, for its logits
        n = _chunk_boundary(prompt, n)  # never start inside an external chunk
        seq = self._free_seq(src, n, len(prompt_cells))
        if self.cells[seq] and (seq != src or n < len(self.cells[seq])):
            self._save(seq)  # an idle conversation loses cells: keep its state in RAM
        if seq != src and n >= self.copy_min:
            self._copy(src, seq)  # the whole stream; _keep then drops the tail
        elif seq != src:
            n = 0
        return seq, self._keep(seq, n)

    # ---- the RAM prompt cache: states of idle sequences that lost their cells ---------------------
    def _save(self, seq: int) -> None:
        """Keep seq's KV state (llama_state_seq_get_data) in RAM, newest last, within ram_cache_bytes."""
        cells = self.cells[seq]
        if self.ram_cache_bytes <= 0 or any(s.cells[: len(cells)] == cells for s in self.saved):
            return  # off, or a saved state already holds all of it
        size = int(self.lib.llama_state_seq_get_size(self.ctx.ctx, seq))
        if size <= 0 or size > self.ram_cache_bytes:
            return
        buf = (ctypes.c_uint8 * size)()
        if int(self.lib.llama_state_seq_get_data(self.ctx.ctx, buf, size, seq)) == 0:
            return
        self.saved = [s for s in self.saved if cells[: len(s.cells)] != s.cells]  # prefixes of this one
        self.saved.append(SavedSeq(list(cells), buf))
        while sum(len(s.data) for s in self.saved) > self.ram_cache_bytes:
            self.saved.pop(0)

    def _best_saved(self, cells: list[Hashable]) -> tuple[SavedSeq | None, int]:
        return longest_prefix(((saved, saved.cells) for saved in self.saved), cells, None)

    def _restore(self, saved: SavedSeq, seq: int) -> bool:
        """Load a saved state into seq (whatever it held is saved or dropped first); False if llama.cpp
        refused it (seq is then empty)."""
        # taken out first: saving seq's current state may drop the oldest states, this one among them
        self.saved.remove(saved)
        if self.cells[seq]:
            self._save(seq)
        self._evict(seq)
        if int(self.lib.llama_state_seq_set_data(self.ctx.ctx, saved.data, len(saved.data), seq)) == 0:
            self._evict(seq)
            return False
        self.cells[seq] = list(saved.cells)
        return True

    def _best_prefix(self, cells: list[Hashable]) -> tuple[int, int]:
        return longest_prefix(enumerate(self.cells), cells, -1)

    def _free_seq(self, src: int, n: int, prompt_len: int) -> int:
        """A seq id for a new request whose best cached prefix is n cells of seq `src`.

        An idle source the prompt extends (a conversation's next turn) or repeats is taken over; a prefix of
        at least `copy_min` cells (what the copy costs, see `copy_threshold`) is copied to another id, so that
        the source keeps its tail for its own conversation; a shorter one is evaluated again on an empty id
        rather than cut another conversation. Otherwise the lowest empty id,
        else the least recently used idle one: low ids keep the running ids together (llama.cpp cuts
        micro-batches of consecutive seq ids).
        """
        idle = [s for s in range(self.n_seq_max) if self.owner[s] is None]
        src_idle = src >= 0 and self.owner[src] is None
        held = len(self.cells[src]) if src >= 0 else 0
        if src_idle and (n >= held - 1 or n >= prompt_len - 1):
            return src  # the request extends it, or repeats its prompt
        others = [s for s in idle if s != src]
        empty = [s for s in others if not self.cells[s]]
        if n >= self.copy_min and others:
            return empty[0] if empty else min(others, key=lambda s: self.last_used[s])
        if empty:
            return empty[0]
        if src_idle and n > 0:
            return src  # something is evicted anyway: the source at least gives n cells
        return min(idle, key=lambda s: self.last_used[s])

    def _evict_idle(self) -> bool:
        """Free the least recently used idle sequence's cells; False when none holds any."""
        idle = [s for s in range(self.n_seq_max) if self.owner[s] is None and self.cells[s]]
        if not idle:
            return False
        seq = min(idle, key=lambda s: self.last_used[s])
        self._save(seq)
        self._evict(seq)
        return True

    def _spec_state(self, job: Job) -> SpecState | None:
        """The job's speculation (lookup, or draft with a draft model); None when it runs without."""
        req = job.req
        mode = speculative_method(
            req.speculative, has_draft_model=self.draft is not None, constrained=req.format is not None
        )
        if mode not in self.draft_cost or any(isinstance(item, ExternalChunk) for item in job.prompt):
            return None  # off, or an image in the prompt: the proposers see text only
        k = min(req.num_draft or DEFAULT_NUM_DRAFT[mode], MAX_VERIFY - 1)
        return SpecState(mode, k, self.draft_cost[mode])

    # ---- building the batch --------------------------------------------------------------------
    def _add_decodes(self) -> None:
        decoding = [j for j in self.running if j.generating and not j.pending]
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
        for job in self.running:
            if not job.pending or job in (e[4] for e in self.plan):
                continue
            self._run_external(job)
            take: list[int] = []
            limit = min(self.room, EXACT_ROWS)
            for item in job.pending:
                if not isinstance(item, int) or len(take) >= limit:
                    break
                take.append(item)
            if not take:
                continue
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
            token, finish = self._take_token(job, row)
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
        if self.lib.llama_vocab_is_eog(self.vocab, token):
            return token, "stop"
        req = job.req
        lp = self._logprob(row, token, req.top_logprobs) if req.logprobs or req.top_logprobs > 0 else None
        event, stopped = job.text.add(token, self.piece(token, token in req.preserve_tokens), lp)
        if event is not None:
            self._emit(job, event)
        if stopped:
            return token, "stop"
        if job.n_gen >= job.max_new:
            return token, "length"
        return token, None

    def _logprob(self, row: int, token: int, top_n: int) -> TokenLogprob:
        return logprob_from_logits(self.logits(row), token, top_n, self.text_of)

    def piece(self, token: int, special: bool = False) -> bytes:
        return token_piece(self.lib, self.vocab, token, special, self.pieces)

    def text_of(self, ids: Sequence[int]) -> str:
        return b"".join(self.piece(int(t)) for t in ids).decode("utf-8", errors="replace")

    def _finish(self, job: Job, reason: str) -> None:
        now = time.perf_counter_ns()
        if not job.generating:
            job.timings.prompt_eval_ns = now - job.t_admit
        job.timings.eval_count = job.n_gen
        job.timings.eval_ns = now - job.t_prompt if job.t_prompt else 0
        for event in job.text.end(reason, job.timings):  # the text still held back, then the done event
            self._emit(job, event)
        self._release(job, keep=reason != "cancel")

    def _fail(self, job: Job, error: BaseException) -> None:
        job.error = error
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
        self.outbox.append(job.finished.set)  # after the job's last event

    # ---- exclusive tasks -----------------------------------------------------------------------
    def _run_task(self, fn: Callable[[Any, int], Any]) -> Any:
        idle = [s for s in range(self.n_seq_max) if self.owner[s] is None]
        if not idle:
            raise LocalrtError("no free sequence for this request")
        seq = min(idle, key=lambda s: (bool(self.cells[s]), self.last_used[s]))
        self._evict(seq)
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


def _end_cancelled(job: Job) -> None:
    """A job cancelled before it started: its end, at once (nothing of it is in the outbox)."""
    job.emit(DoneEvent("cancel", Timings()))
    job.finished.set()


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


def _cells(prompt: Sequence[PromptItem]) -> list[Hashable]:
    out: list[Hashable] = []
    for item in prompt:
        if isinstance(item, ExternalChunk):
            out.extend(item.cells)
        else:
            out.append(item)
    return out


def _spans(prompt: Sequence[PromptItem]) -> Iterator[tuple[int, int, PromptItem]]:
    """Each prompt item with the cells it spans: [start, end)."""
    start = 0
    for item in prompt:
        end = start + (item.n_tokens if isinstance(item, ExternalChunk) else 1)
        yield start, end, item
        start = end


def _chunk_boundary(prompt: Sequence[PromptItem], n_cells: int) -> int:
    """The largest cell count <= n_cells that does not end inside an external chunk."""
    return next((start for start, end, _ in _spans(prompt) if end > n_cells), n_cells)


def _items_from(prompt: Sequence[PromptItem], n_cells: int) -> list[PromptItem]:
    """The prompt items after its first n_cells cells (n_cells never falls inside an external chunk)."""
    return [item for start, _, item in _spans(prompt) if start >= n_cells]
