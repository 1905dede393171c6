"""Admission, prefix reuse and the RAM cache of the batched context.

A new request starts from the longest prefix any sequence holds (`llama_memory_seq_cp` shares the cells,
nothing is copied), or from an idle sequence's state saved in RAM when its cells went to another request;
while a running request is still evaluating a long prefix the new one shares, the new one waits a step or
two and copies it instead of evaluating the same tokens twice.
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

from localrt.backends.base import common_prefix
from localrt.backends.base import longest_prefix
from localrt.backends.speculation import DEFAULT_NUM_DRAFT
from localrt.backends.speculation import SpecState
from localrt.backends.speculation import speculative_method

from .lib import make_sampler
from .sequences import MAX_VERIFY
from .sequences import ExternalChunk
from .sequences import Job
from .sequences import Output
from .sequences import PromptItem
from .sequences import SeqContext
from .sequences import cells_of
from .sequences import chunk_boundary
from .sequences import items_from

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
class SavedSeq:
    """An evicted idle sequence: its cells, its KV state as llama_state_seq_get_data wrote it, and the
    LoRA scale set the state was computed under."""

    cells: list[Hashable]
    data: Any  # a ctypes uint8 array
    lora: tuple[float, ...] = ()


class Admission(SeqContext):
    """Which seq id a new request gets and what of its prompt is already there. The step loop
    (step.BatchedContext) gives the fields below and `_fail`; `_output` is a job's output of this step."""

    n_parallel: int
    n_seq_max: int
    n_ctx_seq: int
    copy_min: int
    ram_cache_bytes: int
    draft_cost: dict[str, float]
    tick: int  # the step loop's step count
    saved: list[SavedSeq]  # evicted idle sequences' states, least recently saved first
    owner: list[Job | None]
    last_used: list[float]
    waiting: list[Job]
    running: list[Job]
    outputs: dict[Job, Output]
    _cv: Any

    def _fail(self, job: Job, error: BaseException) -> None:
        raise NotImplementedError

    def _output(self, job: Job) -> Output:
        """The job's output of this step (made on first use)."""
        out = self.outputs.get(job)
        if out is None:
            out = self.outputs[job] = Output(job)
        return out

    def _end_cancelled(self, job: Job) -> None:
        """A job cancelled before it started: it ends at once."""
        self._output(job).finish = "cancel"
        job.finished.set()

    def _admit(self) -> None:
        if not self.waiting:  # nothing to move (`waiting` is the step thread's own)
            return
        with self._cv:  # `jobs` sees each request waiting or running, never between the two
            held: list[Job] = []
            while self.waiting and len(self.running) < self.n_parallel:
                job = self.waiting.pop(0)
                if job.req.cancel.cancelled:
                    self._end_cancelled(job)
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
            job.prompt_cells = cells_of(job.prompt)
        cached = self._best_prefix(job.prompt_cells, job.lora)[1]
        for other in self.running:
            if other.generating or not other.pending or other.lora != job.lora:
                continue
            shared = common_prefix(other.prompt_cells, job.prompt_cells)
            # a wait of a step or more pays only for a long shared part, however cheap the copy is
            if shared >= max(self.copy_min, COPY_MIN) and shared > cached:
                return True
        return False

    def _start(self, job: Job) -> None:
        req = job.req
        job.t_admit = time.perf_counter_ns()
        prompt_cells = job.prompt_cells or cells_of(job.prompt)
        job.prompt_cells = prompt_cells
        seq, n = self._place(job.prompt, prompt_cells, job.lora)
        job.seq = seq
        self.owner[seq] = job
        self.cell_lora[seq] = job.lora
        job.turn = self.tick
        job.pending = items_from(job.prompt, n)
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

    def _place(
        self, prompt: list[PromptItem], prompt_cells: list[Hashable], lora: tuple[float, ...]
    ) -> tuple[int, int]:
        """A seq id for a new prompt and how many of its cells it already holds (a live sequence's prefix,
        copied or taken over, or a saved one restored from RAM, made under the same LoRA scales); the rest
        of the seq's cells are gone."""
        src, n = self._best_prefix(prompt_cells, lora)
        saved, n_saved = self._best_saved(prompt_cells, lora)
        if saved is not None and n_saved > n:
            src = self._free_seq(-1, 0, len(prompt_cells))
            n = n_saved if self._restore(saved, src) else 0
        n = min(n, len(prompt_cells) - 1)  # at least one token is evaluated, for its logits
        n = chunk_boundary(prompt, n)  # never start inside an external chunk
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
        cells, lora = self.cells[seq], self.cell_lora[seq]
        if self.ram_cache_bytes <= 0 or any(
            s.lora == lora and s.cells[: len(cells)] == cells for s in self.saved
        ):
            return  # off, or a saved state already holds all of it
        size = int(self.lib.llama_state_seq_get_size(self.ctx.ctx, seq))
        if size <= 0 or size > self.ram_cache_bytes:
            return
        buf = (ctypes.c_uint8 * size)()
        if int(self.lib.llama_state_seq_get_data(self.ctx.ctx, buf, size, seq)) == 0:
            return
        # prefixes of this one go
        self.saved = [s for s in self.saved if s.lora != lora or cells[: len(s.cells)] != s.cells]
        self.saved.append(SavedSeq(list(cells), buf, lora))
        while sum(len(s.data) for s in self.saved) > self.ram_cache_bytes:
            self.saved.pop(0)

    def _best_saved(self, cells: list[Hashable], lora: tuple[float, ...]) -> tuple[SavedSeq | None, int]:
        return longest_prefix(((s, s.cells) for s in self.saved if s.lora == lora), cells, None)

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
        self.cell_lora[seq] = saved.lora
        return True

    def _best_prefix(self, cells: list[Hashable], lora: tuple[float, ...]) -> tuple[int, int]:
        held = ((seq, held) for seq, held in enumerate(self.cells) if self.cell_lora[seq] == lora)
        return longest_prefix(held, cells, -1)

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
