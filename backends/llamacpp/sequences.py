"""Sequences and their KV state: what a request is to the step loop (`Job`, its `Output` of a step), the
prompt items (token ids, or `ExternalChunk`s evaluated by someone else), and the context's record of the
cells each seq id holds (`SeqContext`), changed together with llama.cpp's memory. `DraftContext` is the
draft model's context on the same seq ids.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from collections.abc import Hashable
from collections.abc import Iterator
from collections.abc import Sequence
from dataclasses import dataclass
from dataclasses import field
from itertools import count
from typing import Any

import numpy as np

from localrt.backends.base import GenerateRequest
from localrt.backends.base import Timings
from localrt.backends.base import close_each
from localrt.backends.base import common_prefix
from localrt.backends.speculation import SpecState

from .lib import Batch
from .lib import _lib
from .lib import logits_row

_job_ids = count()

# Rows of one sequence in a step (prompt chunk, or last token + drafts). Under 64 query rows of a KV stream
# in a micro-batch the CPU flash-attention kernel computes every row on its own (a sequence's logits do
# not depend on what else is in the batch); from 64 on it switches to a tiled kernel with other rounding.
# Capping each sequence's rows (not the micro-batch) keeps batching invisible while the micro-batch holds
# every sequence's rows at once: llama.cpp splits a multi-stream batch into micro-batches of equal rows per
# stream, so one step of many prefilling sequences is one pass over the weights, not one per 48 rows.
EXACT_ROWS = 48
MAX_VERIFY = EXACT_ROWS  # draft tokens + 1 per sequence and step
# A CPU step's prompt work, in rows times the cells each row attends to. The row-at-a-time attention kernel
# makes a prompt row cost about its sequence's length, so at long contexts attention, not the pass over the
# weights, is most of a step, and batching prompts saves little: seven agent turns of 21 rows over 1,200
# cells each take within a tenth as long in one step as one after the other. In one step they all get their first
# token at its end; in steps of this much work, in arrival order, the first get theirs steps earlier. Short
# prompts still share a step (30 rows over 30 cells is 900). The first prompt of a step always goes in.
PROMPT_WORK = EXACT_ROWS * 1024
LogprobValues = tuple[float, list[tuple[int, float]]]  # a token's logprob and the best (id, logprob)


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


@dataclass(eq=False)  # a request is itself: `job in self.running` must not compare field by field
class Job:
    """One generation request as the step loop sees it."""

    req: GenerateRequest
    prompt: list[PromptItem] = field(default_factory=list)
    prompt_cells: list[Hashable] = field(default_factory=list)
    seq: int = -1
    pending: list[PromptItem] = field(default_factory=list)  # still to evaluate before sampling
    generating: bool = False  # the prompt is done (pending is then only a context-shift recompute)
    history: list[int] = field(default_factory=list)  # prompt tokens + sampled tokens
    last: int = -1  # the sampled token not yet in the KV cache
    sampler: Any = None
    timings: Timings = field(default_factory=Timings)
    t_admit: int = 0
    t_prompt: int = 0
    n_gen: int = 0
    max_new: int = 0
    spec: SpecState | None = None  # None: no speculation
    drafts: list[int] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)  # batch indices with logits for this job this step
    finished: threading.Event = field(default_factory=threading.Event)  # the step loop has let go of it
    error: BaseException | None = None
    # the reader ended it at a stop string: its cancel then keeps the sequence cached, as an end would
    stopped_by_text: bool = False
    capture: bool = False  # keep a copy of the logits after the prompt in `logits` (tests, inspection)
    # the LoRA scale set it runs under (one per adapter; () without adapters): llama.cpp applies adapters
    # to the whole context, so a step batches only jobs of one set, and reuses only KV made under it
    lora: tuple[float, ...] = ()
    turn: int = 0  # the step it last ran in (or was admitted at): the set of the longest-waiting job runs
    logits: np.ndarray | None = None
    id: int = field(default_factory=lambda: next(_job_ids))


@dataclass(eq=False)
class Output:
    """What one step did to one job: the tokens it gained (an end token is not one), their logprob values
    when asked, and `finish` once it ended ("stop", "length", "cancel", or "error": `job.error`)."""

    job: Job
    tokens: list[int] = field(default_factory=list)
    logprobs: list[LogprobValues | None] = field(default_factory=list)
    finish: str | None = None


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
        # the LoRA scale set each seq's cells were computed under: KV made under one set is not reused
        # for a request under another (the same tokens give other keys and values)
        self.cell_lora: list[tuple[float, ...]] = [() for _ in range(n_seq_max)]
        self._ends: dict[int, bool] = {}

    def ends_generation(self, token: int) -> bool:
        """llama.cpp's end-of-generation test, asked once per generated token and remembered per token
        (a dictionary lookup, not a call into C through ctypes)."""
        end = self._ends.get(token)
        if end is None:
            end = self._ends[token] = bool(self.lib.llama_vocab_is_eog(self.model.vocab, token))
        return end

    def logits(self, row: int) -> np.ndarray:
        """Batch row `row`'s logits from the last decode (llama.cpp's buffer: copy to keep them)."""
        return logits_row(self.ctx.ctx, row, self.n_vocab)

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
        self.cell_lora[seq] = ()

    def _evict_all(self) -> None:
        self.lib.llama_memory_clear(self.mem, True)
        self.cells = [[] for _ in self.cells]
        self.cell_lora = [() for _ in self.cell_lora]

    def _copy(self, src: int, dst: int) -> None:
        """dst holds what src holds: each sequence has a KV stream of its own, so the whole stream is copied."""
        self.lib.llama_memory_seq_cp(self.mem, src, dst, -1, -1)
        self.cells[dst] = list(self.cells[src])
        self.cell_lora[dst] = self.cell_lora[src]


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
        if self.ends_generation(token):
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


def cells_of(prompt: Sequence[PromptItem]) -> list[Hashable]:
    """The cells a prompt fills: its token ids, and each external chunk's keys."""
    out: list[Hashable] = []
    for item in prompt:
        if isinstance(item, ExternalChunk):
            out.extend(item.cells)
        else:
            out.append(item)
    return out


def spans(prompt: Sequence[PromptItem]) -> Iterator[tuple[int, int, PromptItem]]:
    """Each prompt item with the cells it spans: [start, end)."""
    start = 0
    for item in prompt:
        end = start + (item.n_tokens if isinstance(item, ExternalChunk) else 1)
        yield start, end, item
        start = end


def chunk_boundary(prompt: Sequence[PromptItem], n_cells: int) -> int:
    """The largest cell count <= n_cells that does not end inside an external chunk."""
    return next((start for start, end, _ in spans(prompt) if end > n_cells), n_cells)


def items_from(prompt: Sequence[PromptItem], n_cells: int) -> list[PromptItem]:
    """The prompt items after its first n_cells cells (n_cells never falls inside an external chunk)."""
    return [item for start, _, item in spans(prompt) if start >= n_cells]
