"""What a request is to the llama.cpp engine (`Sequence`) and its prompt items: token ids, or
`ExternalChunk`s that something else evaluates into the context (an image through libmtmd).
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Hashable
from collections.abc import Iterator
from collections.abc import Sequence as Items
from dataclasses import dataclass
from dataclasses import field
from typing import Any

from localrt.backends.engine import EngineRequest
from localrt.backends.engine import OfRequest
from localrt.backends.engine import Pooled

# Rows of one sequence in a step under batch invariance (prompt chunk, or last token + drafts). Under 64
# query rows of a KV stream in a micro-batch the CPU flash-attention kernel computes every row on its own
# (a sequence's logits do not depend on what else is in the batch); from 64 on (TILED_ROWS) it switches to
# a tiled kernel with other rounding. Capping each sequence's rows (not the micro-batch) keeps batching
# invisible while the micro-batch holds every sequence's rows at once: llama.cpp splits a multi-stream
# batch into micro-batches of equal rows per stream, so one step of many prefilling sequences is one pass
# over the weights, not one per 48 rows.
EXACT_ROWS = 48
TILED_ROWS = 64
MAX_VERIFY = EXACT_ROWS  # draft tokens + 1 per sequence and step
# A CPU step's prompt work, in rows times the cells each row attends to. The row-at-a-time attention kernel
# makes a prompt row cost about its sequence's length, so at long contexts attention, not the pass over the
# weights, is most of a step, and batching long prompts saves little (benchmarks/README.md). In one step
# they all get their first token at its end; in steps of this much work, in arrival order, the first get
# theirs steps earlier. Short prompts still share a step (30 rows over 30 cells is 900). The first prompt of
# a step always goes in.
PROMPT_WORK = EXACT_ROWS * 1024
# The rows of a step that also decodes (vLLM's chunked prefill budget): prompt chunks fill it beside the
# decode and draft rows, so a long prompt arriving delays the running streams by at most this many rows a
# token, not by its whole length. A prompt row costs about half a decode step on the CPU; 128 is not tuned
# by a measurement yet.
DECODE_STEP_ROWS = 128


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


@dataclass(eq=False)  # a sequence is itself: `seq in scheduler.running` must not compare field by field
class Sequence(OfRequest):
    """A request as the llama.cpp engine runs it: its seq id, the prompt items still to evaluate, its
    sampler and draft tokens; a prompt-only request's pooled vector or scores so far."""

    request: EngineRequest
    # the LoRA scale set it runs under (one per adapter; () without adapters): llama.cpp applies adapters
    # to the whole context, so a step batches only sequences of one set, and reuses only KV made under it
    lora: tuple[float, ...] = ()
    prompt_cells: list[Hashable] = field(default_factory=list)
    seq: int = -1
    pending: list[PromptItem] = field(default_factory=list)  # still to evaluate before sampling
    generating: bool = False  # the prompt is done (pending is then only a context-shift recompute)
    history: list[int] = field(default_factory=list)  # prompt tokens + sampled tokens
    last: int = -1  # the sampled token not yet in the KV cache
    sampler: Any = None
    max_new: int = 0
    drafts: list[int] = field(default_factory=list)
    free_drafts: int = 0  # the last of `drafts` that fill the step to a tile (`Engine._fill_tile`)
    rows: list[int] = field(default_factory=list)  # batch indices with outputs for it this step
    turn: int = 0  # the step it last ran in (or was admitted at): the set of the longest-waiting one runs
    pooled: Pooled | None = None  # an embed request's pooled vector so far
    scored: int = 0  # a score request's prompt positions whose logits were read
    # what it evaluates again when admitted after a preemption (its cells, then what was pending), its
    # first admission's prompt otherwise (None)
    resume: list[PromptItem] | None = None
    admissions: int = 0


def cells_of(prompt: Items[PromptItem]) -> list[Hashable]:
    """The cells a prompt fills: its token ids, and each external chunk's keys."""
    out: list[Hashable] = []
    for item in prompt:
        if isinstance(item, ExternalChunk):
            out.extend(item.cells)
        else:
            out.append(item)
    return out


def spans(prompt: Items[PromptItem]) -> Iterator[tuple[int, int, PromptItem]]:
    """Each prompt item with the cells it spans: [start, end)."""
    start = 0
    for item in prompt:
        end = start + (item.n_tokens if isinstance(item, ExternalChunk) else 1)
        yield start, end, item
        start = end


def chunk_boundary(prompt: Items[PromptItem], n_cells: int) -> int:
    """The largest cell count <= n_cells that does not end inside an external chunk."""
    return next((start for start, end, _ in spans(prompt) if end > n_cells), n_cells)


def items_upto(prompt: Items[PromptItem], n_cells: int) -> list[PromptItem]:
    """The prompt items in its first n_cells cells (n_cells never falls inside an external chunk)."""
    return [item for _, end, item in spans(prompt) if end <= n_cells]


def items_from(prompt: Items[PromptItem], n_cells: int) -> list[PromptItem]:
    """The prompt items after its first n_cells cells (n_cells never falls inside an external chunk)."""
    return [item for start, _, item in spans(prompt) if start >= n_cells]
