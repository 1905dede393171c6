"""The llama.cpp engine's scheduler: which sequences run in the next step, and with which rows.

Admission: a new request gets a seq id and starts from the longest prefix any sequence holds
(`llama_memory_seq_cp`: in a pool the cells are shared, nothing is copied), or from an idle sequence's
state saved in RAM (`kv.KVRecord`); while a running request is still evaluating a long prefix the new one
shares, the new one waits a step or two and copies it instead of evaluating the same tokens twice. A
request that generates is admitted before a prompt-only one (an embedding, a score) that waits beside it.
In a pool, a request is admitted only when the cells it does not share yet are free (idle sequences give
theirs up first, saved in RAM); when the pool fills anyway, the latest admitted sequence is preempted:
its state goes to RAM, it waits, and it is resumed where it stopped (`preempt`).

A step's plan: the LoRA scale set of the step, every decoding sequence's next token (and draft tokens),
then prompt chunks, oldest first, up to the step's budget: `prefill_rows` rows per sequence, `prompt_work`
(rows x the cells they attend to), and, while the step decodes, `decode_step_rows` rows in all (vLLM's
chunked prefill), so that a long prompt arriving delays the running streams by a chunk a token, not by its
length. A prompt-only request's chunks are prompt chunks like any other, but while the step also decodes,
they take at most `pooled_rows` rows of it, fewer where the measured cost of a row (`StepCost`) says more
would make the step last more than (1 + `POOLED_SHARE`) decode steps.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass
from dataclasses import field

from localrt.backends.base import common_prefix
from localrt.backends.engine_thread import RequestQueues

from .kv import KVRecord
from .sequences import DECODE_STEP_ROWS
from .sequences import EXACT_ROWS
from .sequences import PROMPT_WORK
from .sequences import TILED_ROWS
from .sequences import ExternalChunk
from .sequences import PromptItem
from .sequences import Sequence
from .sequences import cells_of
from .sequences import chunk_boundary
from .sequences import items_from
from .sequences import items_upto

# The shared-prefix length from which a prefix is copied when the caller gives no cost figures, and the
# least a new request must share with a prompt still being evaluated to wait for it rather than start.
COPY_MIN = 32

# What an embedding's or a score's rows may add to a step that also decodes, as a share of the decode
# step's own time: a chat streaming beside an embedding then waits at most about (1 + share) times its
# usual gap between tokens, and the embedding still moves every step.
POOLED_SHARE = 1.0
# The weight of a new measurement in `StepCost`'s running cost of a row, and the decode-only steps whose
# median is its cost of a decode step (a median: one step slowed by the machine must not move it).
COST_WEIGHT = 0.2
DECODE_SAMPLES = 16


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


class StepCost:
    """What a step costs on this context, measured by the engine, and from it how many prompt-only rows a
    step that decodes may carry (`rows_within`): a decoding step of those rows should take at most
    (1 + `share`) times a step of decodes alone. The decodes' own cost grows with what the pool holds (a
    row attends over its used cells), so the allowance follows the steps' measured times rather than a
    model of them."""

    def __init__(self, share: float = POOLED_SHARE) -> None:
        self.share = share
        self._decodes: deque[float] = deque(maxlen=DECODE_SAMPLES)
        self.decode_s: float | None = None  # a step of decodes alone: the median of the latest ones
        self.row_s: float | None = None  # a prompt row on top of the decodes: a running estimate
        self.allowance: int | None = None  # prompt-only rows for the next decoding step

    def record(self, decode_rows: int, prompt_rows: int, seconds: float) -> None:
        """A decoded step: its rows of each kind and how long its decode took."""
        if not prompt_rows:
            if decode_rows:
                self._decodes.append(seconds)
                self.decode_s = statistics.median(self._decodes)
            return
        base = (self.decode_s or 0.0) if decode_rows else 0.0
        row = max(0.0, seconds - base) / prompt_rows
        self.row_s = row if self.row_s is None else self.row_s + COST_WEIGHT * (row - self.row_s)
        if decode_rows and self.decode_s is not None and self.row_s > 0.0:
            target = (1.0 + self.share) * self.decode_s
            self.allowance = max(1, int(prompt_rows + (target - seconds) / self.row_s))

    def rows_within(self, cap: int) -> int:
        """Prompt-only rows for a step that decodes: at least one, at most `cap`; one until the costs are
        measured."""
        if self.allowance is not None:
            return min(cap, self.allowance)
        if self.decode_s is None or not self.row_s:
            return 1
        return max(1, min(cap, int(self.share * self.decode_s / self.row_s)))


@dataclass
class Rows:
    """One sequence's rows in a step's batch: its tokens from position `pos0`, which give outputs (True:
    every row), and whether they are a chunk of what it had pending (else its last token and drafts)."""

    seq: Sequence
    tokens: list[int]
    pos0: int
    output: bool | list[bool]
    pending: bool = False


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
    `n_seq_max` seq ids of up to `n_ctx_seq` cells each, `step_tokens` batch rows a step, `prefill_rows`
    prompt rows per sequence and step (`sequences.EXACT_ROWS` keeps batching invisible on the CPU's
    kernels), `prompt_work` a step's prompt work (None: every prompt that fits), `decode_step_rows` the rows
    of a step that decodes (None: no budget), `copy_min` the shortest prefix worth copying between seq ids
    (`copy_threshold`). `last_row_apart`: a prompt whose last chunk would go through the tiled attention
    kernel (`TILED_ROWS` rows or more) evaluates its last row in a step of its own, so that a lone request's
    first token is computed the same way whether its prompt was cached or not."""

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
        decode_step_rows: int | None = DECODE_STEP_ROWS,
        copy_min: int = COPY_MIN,
        last_row_apart: bool = False,
    ) -> None:
        self.kv = kv
        self.n_parallel, self.n_seq_max, self.n_ctx_seq = n_parallel, n_seq_max, n_ctx_seq
        self.step_tokens = step_tokens
        self.prefill_rows = prefill_rows
        self.prompt_work = prompt_work
        self.decode_step_rows = decode_step_rows
        self.pooled_rows = min(prefill_rows, EXACT_ROWS)  # a step's prompt-only rows while it also decodes
        self.cost = StepCost()  # measured by the engine: how many of those rows a decoding step can carry
        self.copy_min = copy_min
        self.last_row_apart = last_row_apart
        self.waiting: list[Sequence] = []  # taken from the inbox, not yet admitted (or preempted)
        self.running: list[Sequence] = []
        self.owner: list[Sequence | None] = [None] * n_seq_max
        self.last_used = [0.0] * n_seq_max
        self.tick = 0  # steps planned (a sequence's `turn`)
        self.cancelled: list[Sequence] = []  # cancelled before they were admitted, for the engine to end
        self.preemptions = 0  # sequences sent back to wait for room (for tests and benchmarks)

    # ---- admission -----------------------------------------------------------------------------
    def admit(self) -> list[Sequence]:
        """Waiting sequences take free seq ids, generating ones first, while the pool has room for them (in
        arrival order: one that must wait for room holds the later ones back); the ones admitted now."""
        if not self.waiting:
            return []
        queue = sorted(self.waiting, key=lambda s: s.request.prompt_only)  # stable: in arrival order
        admitted: list[Sequence] = []
        held: list[Sequence] = []
        for seq in queue:
            if seq.request.cancel.cancelled:
                self.cancelled.append(seq)
            elif held and not self._fits_later(seq, held):
                held.append(seq)
            elif len(self.running) >= self.n_parallel or self._prefix_coming(seq) or not self._room_for(seq):
                held.append(seq)
            else:
                self._start(seq)
                admitted.append(seq)
        self.waiting = held
        return admitted

    def _fits_later(self, seq: Sequence, held: list[Sequence]) -> bool:
        """Whether seq may go ahead of the held ones: only while none of them waits for pool room."""
        return not self.kv.pool or all(h.request.prompt_only or self._prefix_coming(h) for h in held)

    def _items(self, seq: Sequence) -> list[PromptItem]:
        """What an admission evaluates: the prompt, or after a preemption what it held and had pending."""
        return seq.resume if seq.resume is not None else list(seq.prompt)

    def _room_for(self, seq: Sequence) -> bool:
        """In a pool: the cells seq does not share with a live sequence fit the free cells, once idle
        sequences have given theirs up (saved in RAM). The free cells exclude what the running sequences'
        pending prompts will take, and a step's rows: a sequence resumed after a preemption would otherwise
        take back at once the room its preemption made, and be preempted again. A request alone always goes
        in (the pool holds at least a whole context; idle sequences give up their cells as the decode needs
        them)."""
        kv = self.kv
        if not kv.pool or not self.running:
            return True
        cells = cells_of(self._items(seq))
        reserved = self.step_tokens + sum(len(cells_of(s.pending)) for s in self.running)
        while True:
            src, shared = (-1, 0) if seq.request.prompt_only else kv.best_prefix(cells, seq.lora)
            if kv.free - reserved >= len(cells) - shared:
                return True
            if not self.evict_idle(spare=src):
                return False

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
        items = self._items(seq)
        seq.admissions += 1
        if seq.admissions == 1:
            request.admitted_ns = time.perf_counter_ns()
            seq.prompt_cells = seq.prompt_cells or cells_of(seq.prompt)
            seq.history = [t for t in seq.prompt if isinstance(t, int)]
        cells = cells_of(items)
        seq.seq, n = self._place(seq, items, cells)
        self.owner[seq.seq] = seq
        self.kv.cell_lora[seq.seq] = seq.lora
        seq.turn = self.tick
        seq.pending = items_from(items, n)
        seq.resume = None
        if seq.admissions == 1:
            request.timings.prompt_eval_count = len(cells) - n
            request.timings.cached_count = n
        self.running.append(seq)

    def _place(self, seq: Sequence, items: list[PromptItem], cells: list[Hashable]) -> tuple[int, int]:
        """A seq id for a new prompt and how many of its cells it already holds (a live sequence's prefix,
        copied or taken over, or a saved one restored from RAM, made under the same LoRA scales); the rest
        of the seq's cells are gone. A prompt-only request reuses nothing: it needs every row's output."""
        kv = self.kv
        if seq.request.prompt_only:
            src, n = -1, 0
        else:
            src, n = kv.best_prefix(cells, seq.lora)
            saved, n_saved = kv.best_saved(cells, seq.lora)
            if saved is not None and n_saved > n:
                src = self._free_seq(-1, 0, len(cells))
                n = n_saved if kv.restore(saved, src) else 0
            n = min(n, len(cells) - 1)  # at least one token is evaluated, for its logits
            n = chunk_boundary(items, n)  # never start inside an external chunk
        target = self._free_seq(src, n, len(cells))
        if kv.cells[target] and (target != src or n < len(kv.cells[target])):
            kv.save(target)  # an idle conversation loses cells: keep its state in RAM
        if target != src and n >= self.copy_min:
            kv.copy(src, target)  # the whole stream, or in a pool the shared cells; keep then drops the tail
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

    def evict_idle(self, spare: int = -1) -> bool:
        """Free the least recently used idle sequence's cells (other than `spare`'s), saved in RAM; False
        when none holds any."""
        idle = [s for s in range(self.n_seq_max) if self.owner[s] is None and self.kv.cells[s] and s != spare]
        if not idle:
            return False
        seq = min(idle, key=lambda s: self.last_used[s])
        self.kv.save(seq)
        self.kv.evict(seq)
        return True

    def preempt(self) -> bool:
        """The pool is full: the latest admitted running sequence gives up its cells (its state saved in
        RAM) and waits, to be resumed where it stopped once there is room; False when no other sequence
        runs beside it."""
        if len(self.running) < 2:
            return False
        seq = max(self.running, key=lambda s: s.request.admitted_ns)
        kv, cells = self.kv, self.kv.cells[seq.seq]
        if seq.request.prompt_only:  # its outputs so far are lost with its cells: it starts over
            seq.resume = list(seq.prompt)
            seq.scored = 0
            if seq.pooled is not None:
                seq.pooled = type(seq.pooled)(seq.pooled.pooling)
        else:
            # what it holds as items again: its prompt's items as far as the cells follow the prompt, then
            # tokens (what it generated, or what a context shift kept)
            held = chunk_boundary(seq.prompt, common_prefix(cells, seq.prompt_cells))
            last = [seq.last] if seq.generating and not seq.pending else []
            seq.resume = [*items_upto(seq.prompt, held), *cells[held:], *seq.pending, *last]  # type: ignore[list-item]
            kv.save(seq.seq)
        seq.drafts = []
        self.running.remove(seq)
        self.owner[seq.seq] = None
        self.last_used[seq.seq] = time.monotonic()
        kv.evict(seq.seq)
        seq.seq, seq.pending = -1, []
        self.waiting.insert(0, seq)
        self.preemptions += 1
        return True

    def unplan(self, plan: StepPlan) -> None:
        """A step that could not run (no room in the pool): its rows go back to what they came from."""
        for rows in plan.rows:
            seq = rows.seq
            self.kv.cut(seq.seq, rows.pos0)
            seq.rows = []
            if rows.pending:
                seq.pending[:0] = rows.tokens
            else:
                seq.drafts = []

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
        if not seq.req.shift or n_discard <= 0 or not all(isinstance(c, int) for c in cells[n_keep:]):
            return False
        # A recompute rather than a K-shift: the cells may be shared with other sequences (seq_cp), and
        # moving shared cells' positions would move them for every sequence holding them. Where the
        # sliding-window layers no longer hold the window before the kept start, it is evaluated too.
        head = list(cells[:n_keep])
        if not all(isinstance(c, int) for c in head):
            return False
        n = self.kv.keep(seq.seq, n_keep)
        seq.pending = [*head[n:], *kept, seq.last]  # type: ignore[list-item]
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
        if plan.rows and self.decode_step_rows is not None:
            room = min(room, max(0, self.decode_step_rows - (self.step_tokens - room)))
        self._plan_prompts(plan, room)
        return plan

    def _plan_rows(
        self,
        plan: StepPlan,
        seq: Sequence,
        tokens: list[int],
        output: bool | list[bool],
        pending: bool = False,
    ) -> int:
        seq.turn = self.tick
        plan.rows.append(Rows(seq, tokens, len(self.kv.cells[seq.seq]), output, pending))
        self.kv.extend(seq.seq, tokens)  # type: ignore[arg-type]
        return len(tokens)

    def _plan_prompts(self, plan: StepPlan, room: int) -> None:
        """Prompt chunks, generating requests' first and then the oldest first, up to `prompt_work` (rows x
        the cells they attend to); prompt-only rows, while the step decodes, up to what adds `POOLED_SHARE`
        of its time."""
        planned = {id(r.seq) for r in plan.rows}
        decodes = bool(plan.rows)
        pooled_rows = self.cost.rows_within(self.pooled_rows) if decodes else 0
        work = pooled = 0
        for seq in sorted(self.running, key=lambda s: s.request.prompt_only):
            if not room:
                break
            if seq.lora != plan.lora or not seq.pending or id(seq) in planned:
                continue
            if self.prompt_work is not None and work >= self.prompt_work:
                break
            self._reach_text(plan, seq)
            limit = min(room, self.prefill_rows)
            if seq.request.prompt_only and decodes:
                limit = min(limit, pooled_rows - pooled)
            take = self._prompt_tokens(seq, limit)
            if not take:
                continue
            if (
                self.last_row_apart
                and not seq.request.prompt_only
                and len(take) == len(seq.pending)
                and len(take) >= TILED_ROWS
            ):
                take.pop()  # the last row in a step of its own, as when the rest of the prompt is cached
            work += len(take) * (len(self.kv.cells[seq.seq]) + len(take))
            if seq.request.prompt_only:
                pooled += len(take)
                output: bool | list[bool] = True  # every row's logits or hidden state is the answer
            else:
                output = [False] * len(take)
                output[-1] = len(take) == len(seq.pending)
            del seq.pending[: len(take)]
            room -= self._plan_rows(plan, seq, take, output, pending=True)

    def _reach_text(self, plan: StepPlan, seq: Sequence) -> None:
        """The external chunks (images) at the head of the sequence's pending prompt go to the plan, to be
        evaluated before the batch; their cells are the sequence's from now on."""
        while seq.pending and isinstance(seq.pending[0], ExternalChunk):
            chunk = seq.pending.pop(0)
            plan.external.append((seq, chunk, len(self.kv.cells[seq.seq])))
            self.kv.extend(seq.seq, chunk.cells)
            seq.request.timings.prompt_image_tokens += chunk.n_tokens

    @staticmethod
    def _prompt_tokens(seq: Sequence, limit: int) -> list[int]:
        take: list[int] = []
        for item in seq.pending:
            if not isinstance(item, int) or len(take) >= limit:
                break
            take.append(item)
        return take
