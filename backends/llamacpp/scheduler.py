"""The llama.cpp engine's scheduler: which sequences run in the next step, and with which rows.

Admission: a new request gets a seq id and starts from the longest prefix any sequence holds
(`llama_memory_seq_cp` shares the cells, nothing is copied), or from an idle sequence's state saved in
RAM (`kv.KVRecord`); while a running request is still evaluating a long prefix the new one shares, the
new one waits a step or two and copies it instead of evaluating the same tokens twice. A request that
generates is admitted before a prompt-only one (an embedding, a score) that waits beside it.

A step's plan: the LoRA scale set of the step, every decoding sequence's next token (and draft tokens),
then prompt chunks, oldest first, up to the step's budget (`prompt_work`, rows x the cells they attend
to). A prompt-only request's chunks are prompt chunks like any other, but while the step also decodes,
they take at most `pooled_rows` rows of it: a stream then waits at most one chunk longer between two
tokens while an embedding runs beside it, instead of the whole embedding.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from dataclasses import field

from localrt.backends.base import common_prefix
from localrt.backends.engine_thread import RequestQueues

from .kv import KVRecord
from .sequences import EXACT_ROWS
from .sequences import PROMPT_WORK
from .sequences import ExternalChunk
from .sequences import Sequence
from .sequences import cells_of
from .sequences import chunk_boundary
from .sequences import items_from

# The shared-prefix length from which a prefix is copied when the caller gives no cost figures, and the
# least a new request must share with a prompt still being evaluated to wait for it rather than start.
COPY_MIN = 32


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
class Rows:
    """One sequence's rows in a step's batch: its tokens from position `pos0`, and which give outputs
    (True: every row)."""

    seq: Sequence
    tokens: list[int]
    pos0: int
    output: bool | list[bool]


@dataclass
class StepPlan:
    """A step's work: its LoRA scale set, the images to evaluate first (sequence, chunk, position),
    and the rows of its batch."""

    lora: tuple[float, ...] = ()
    external: list[tuple[Sequence, ExternalChunk, int]] = field(default_factory=list)
    rows: list[Rows] = field(default_factory=list)

    @property
    def pooled(self) -> bool:
        """Some rows want their hidden states (an embedding's chunk)."""
        return any(r.seq.pooled is not None for r in self.rows)


class Scheduler(RequestQueues):
    """Admission and each step's plan over a context's `KVRecord`: `n_parallel` sequences at once in
    `n_seq_max` seq ids of `n_ctx_seq` cells each, `step_tokens` batch rows a step, `prefill_rows` prompt
    rows per sequence and step (`sequences.EXACT_ROWS` keeps batching invisible on the CPU's kernels),
    `prompt_work` a step's prompt work (None: every prompt that fits), `copy_min` the shortest prefix worth
    copying between seq ids (`copy_threshold`)."""

    def __init__(
        self,
        kv: KVRecord,
        *,
        n_parallel: int,
        n_seq_max: int,
        n_ctx_seq: int,
        step_tokens: int,
        prefill_rows: int = EXACT_ROWS,
        prompt_work: int | None = PROMPT_WORK,
        copy_min: int = COPY_MIN,
    ) -> None:
        self.kv = kv
        self.n_parallel, self.n_seq_max, self.n_ctx_seq = n_parallel, n_seq_max, n_ctx_seq
        self.step_tokens = step_tokens
        self.prefill_rows = prefill_rows
        self.prompt_work = prompt_work
        self.pooled_rows = prefill_rows  # a step's prompt-only rows while it also decodes
        self.copy_min = copy_min
        self.waiting: list[Sequence] = []  # taken from the inbox, not yet admitted
        self.running: list[Sequence] = []
        self.owner: list[Sequence | None] = [None] * n_seq_max
        self.last_used = [0.0] * n_seq_max
        self.tick = 0  # steps planned (a sequence's `turn`)
        self.cancelled: list[Sequence] = []  # cancelled before they were admitted, for the engine to end

    # ---- admission -----------------------------------------------------------------------------
    def admit(self) -> list[Sequence]:
        """Waiting sequences take free seq ids, generating ones first; the ones admitted now."""
        if not self.waiting:
            return []
        queue = sorted(self.waiting, key=lambda s: s.request.prompt_only)  # stable: in arrival order
        admitted: list[Sequence] = []
        held: list[Sequence] = []
        for seq in queue:
            if len(self.running) >= self.n_parallel or self._prefix_coming(seq):
                held.append(seq)
            elif seq.request.cancel.cancelled:
                self.cancelled.append(seq)
            else:
                self._start(seq)
                admitted.append(seq)
        self.waiting = held
        return admitted

    def _prefix_coming(self, seq: Sequence) -> bool:
        """True while a running request is still evaluating a long prefix this one shares: waiting a step or
        two and copying it beats evaluating the same tokens twice (N clients behind one system prompt)."""
        if seq.request.prompt_only:
            return False
        if not seq.prompt_cells:
            seq.prompt_cells = cells_of(seq.prompt)
        cached = self.kv.best_prefix(seq.prompt_cells, seq.lora)[1]
        for other in self.running:
            if other.generating or not other.pending or other.lora != seq.lora:
                continue
            shared = common_prefix(other.prompt_cells, seq.prompt_cells)
            # a wait of a step or more pays only for a long shared part, however cheap the copy is
            if shared >= max(self.copy_min, COPY_MIN) and shared > cached:
                return True
        return False

    def _start(self, seq: Sequence) -> None:
        request = seq.request
        request.admitted_ns = time.perf_counter_ns()
        seq.prompt_cells = seq.prompt_cells or cells_of(seq.prompt)
        seq.seq, n = self._place(seq)
        self.owner[seq.seq] = seq
        self.kv.cell_lora[seq.seq] = seq.lora
        seq.turn = self.tick
        seq.pending = items_from(seq.prompt, n)
        request.timings.prompt_eval_count = len(seq.prompt_cells) - n
        request.timings.cached_count = n
        seq.history = [t for t in seq.prompt if isinstance(t, int)]
        self.running.append(seq)

    def _place(self, seq: Sequence) -> tuple[int, int]:
        """A seq id for a new prompt and how many of its cells it already holds (a live sequence's prefix,
        copied or taken over, or a saved one restored from RAM, made under the same LoRA scales); the rest
        of the seq's cells are gone. A prompt-only request reuses nothing: it needs every row's output."""
        kv, cells = self.kv, seq.prompt_cells
        if seq.request.prompt_only:
            src, n = -1, 0
        else:
            src, n = kv.best_prefix(cells, seq.lora)
            saved, n_saved = kv.best_saved(cells, seq.lora)
            if saved is not None and n_saved > n:
                src = self._free_seq(-1, 0, len(cells))
                n = n_saved if kv.restore(saved, src) else 0
            n = min(n, len(cells) - 1)  # at least one token is evaluated, for its logits
            n = chunk_boundary(seq.prompt, n)  # never start inside an external chunk
        target = self._free_seq(src, n, len(cells))
        if kv.cells[target] and (target != src or n < len(kv.cells[target])):
            kv.save(target)  # an idle conversation loses cells: keep its state in RAM
        if target != src and n >= self.copy_min:
            kv.copy(src, target)  # the whole stream; keep then drops the tail
        elif target != src:
            n = 0
        return target, kv.keep(target, n)

    def _free_seq(self, src: int, n: int, prompt_len: int) -> int:
        """A seq id for a new request whose best cached prefix is n cells of seq `src`.

        An idle source the prompt extends (a conversation's next turn) or repeats is taken over; a prefix of
        at least `copy_min` cells (what the copy costs, see `copy_threshold`) is copied to another id, so that
        the source keeps its tail for its own conversation; a shorter one is evaluated again on an empty id
        rather than cut another conversation. Otherwise the lowest empty id,
        else the least recently used idle one: low ids keep the running ids together (llama.cpp cuts
        micro-batches of consecutive seq ids).
        """
        cells = self.kv.cells
        idle = [s for s in range(self.n_seq_max) if self.owner[s] is None]
        src_idle = src >= 0 and self.owner[src] is None
        held = len(cells[src]) if src >= 0 else 0
        if src_idle and (n >= held - 1 or n >= prompt_len - 1):
            return src  # the request extends it, or repeats its prompt
        others = [s for s in idle if s != src]
        empty = [s for s in others if not cells[s]]
        if n >= self.copy_min and others:
            return empty[0] if empty else min(others, key=lambda s: self.last_used[s])
        if empty:
            return empty[0]
        if src_idle and n > 0:
            return src  # something is evicted anyway: the source at least gives n cells
        return min(idle, key=lambda s: self.last_used[s])

    # ---- leaving -------------------------------------------------------------------------------
    def release(self, seq: Sequence, keep: bool) -> None:
        """The sequence leaves; its cells stay cached for prefix reuse, or (`keep` False) go at once."""
        if seq in self.running:
            self.running.remove(seq)
        if seq.seq >= 0 and self.owner[seq.seq] is seq:
            self.owner[seq.seq] = None
            self.last_used[seq.seq] = time.monotonic()
            if not keep:
                self.kv.evict(seq.seq)

    def evict_idle(self) -> bool:
        """Free the least recently used idle sequence's cells; False when none holds any."""
        idle = [s for s in range(self.n_seq_max) if self.owner[s] is None and self.kv.cells[s]]
        if not idle:
            return False
        seq = min(idle, key=lambda s: self.last_used[s])
        self.kv.save(seq)
        self.kv.evict(seq)
        return True

    # ---- a step's plan -------------------------------------------------------------------------
    def choose_lora(self) -> tuple[float, ...]:
        """This step's LoRA scale set: the one of the sequence that has waited longest (the oldest of
        equals).

        llama.cpp applies adapters to the whole context, not per sequence, so a step batches only the
        sequences of one set and the others sit it out: with two sets running they take alternate steps,
        each at about half its speed alone (as llama-server, which batches only slots with equal adapters)."""
        return min(self.running, key=lambda s: s.turn).lora

    def decoding(self, lora: tuple[float, ...]) -> tuple[list[Sequence], list[Sequence]]:
        """The sequences that decode this step under `lora`, and those among them whose context is full
        and that do not shift: they end ("length")."""
        decoding = [s for s in self.running if s.lora == lora and s.generating and not s.pending]
        full = [s for s in decoding if len(self.kv.cells[s.seq]) + 1 > self.n_ctx_seq and not self._shift(s)]
        return [s for s in decoding if s not in full and not s.pending], full

    def _shift(self, seq: Sequence) -> bool:
        """The sequence fills its context: shift it (keep num_keep, drop half the rest, recompute the
        rest); False when it cannot (it ends)."""
        cells = self.kv.cells[seq.seq]
        n_keep = max(0, min(seq.req.num_keep, self.n_ctx_seq // 2))
        n_discard = (len(cells) - n_keep) // 2
        kept = cells[n_keep + n_discard :]
        if not seq.req.shift or n_discard <= 0 or not all(isinstance(c, int) for c in kept):
            return False
        # A recompute rather than a K-shift: the cells may be shared with other sequences (seq_cp), and
        # moving shared cells' positions would move them for every sequence holding them.
        self.kv.cut(seq.seq, n_keep)
        seq.pending = [*kept, seq.last]  # type: ignore[list-item]
        return True

    def plan(self, lora: tuple[float, ...], decoding: list[Sequence]) -> StepPlan:
        """The step's rows: each decoding sequence's last token and draft tokens (already proposed), then
        prompt chunks."""
        self.tick += 1
        plan = StepPlan(lora)
        room = self.step_tokens
        for seq in decoding:
            tokens = [seq.last, *seq.drafts]
            if len(tokens) > room:
                seq.drafts, tokens = [], [seq.last]
            if not room:
                break
            room -= self._plan_rows(plan, seq, tokens, True)
        self._plan_prompts(plan, room)
        return plan

    def _plan_rows(self, plan: StepPlan, seq: Sequence, tokens: list[int], output: bool | list[bool]) -> int:
        cells = self.kv.cells[seq.seq]
        seq.turn = self.tick
        plan.rows.append(Rows(seq, tokens, len(cells), output))
        cells.extend(tokens)
        return len(tokens)

    def _plan_prompts(self, plan: StepPlan, room: int) -> None:
        """Prompt chunks, generating requests' first and then the oldest first, up to `prompt_work` (rows x
        the cells they attend to); prompt-only rows up to `pooled_rows` while the step decodes."""
        planned = {id(r.seq) for r in plan.rows}
        decodes = bool(plan.rows)
        work = pooled = 0
        for seq in sorted(self.running, key=lambda s: s.request.prompt_only):
            if seq.lora != plan.lora or not seq.pending or id(seq) in planned:
                continue
            if self.prompt_work is not None and work >= self.prompt_work:
                break
            self._reach_text(plan, seq)
            limit = min(room, self.prefill_rows)
            if seq.request.prompt_only and decodes:
                limit = min(limit, self.pooled_rows - pooled)
            take = self._prompt_tokens(seq, limit)
            if not take:
                continue
            work += len(take) * (len(self.kv.cells[seq.seq]) + len(take))
            if seq.request.prompt_only:
                pooled += len(take)
                output: bool | list[bool] = True  # every row's logits or hidden state is the answer
            else:
                output = [False] * len(take)
                output[-1] = len(take) == len(seq.pending)
            del seq.pending[: len(take)]
            room -= self._plan_rows(plan, seq, take, output)
            if not room:
                break

    def _reach_text(self, plan: StepPlan, seq: Sequence) -> None:
        """The external chunks (images) at the head of the sequence's pending prompt go to the plan, to be
        evaluated before the batch; their cells are the sequence's from now on."""
        while seq.pending and isinstance(seq.pending[0], ExternalChunk):
            chunk = seq.pending.pop(0)
            cells = self.kv.cells[seq.seq]
            plan.external.append((seq, chunk, len(cells)))
            cells.extend(chunk.cells)
            seq.request.timings.prompt_image_tokens += chunk.n_tokens

    @staticmethod
    def _prompt_tokens(seq: Sequence, limit: int) -> list[int]:
        take: list[int] = []
        for item in seq.pending:
            if not isinstance(item, int) or len(take) >= limit:
                break
            take.append(item)
        return take
