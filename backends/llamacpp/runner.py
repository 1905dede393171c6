"""The llama.cpp engine's runner: the model's one context, its batch and its LoRA scales. It lays a
step's planned rows into the batch, evaluates the images a step reaches, decodes, and reads back what the
decode gave each row: logits to sample or score, hidden states to pool."""

from __future__ import annotations

from typing import Any

import numpy as np

from localrt import faults
from localrt.backends.base import close_each
from localrt.backends.outputs import float_array
from localrt.errors import LocalrtError

from .lib import Batch
from .lib import EndTokens
from .lib import LoraAdapters
from .lib import _lib
from .lib import logits_row
from .lib import sample
from .scheduler import StepPlan

# llama_decode's code for a compute graph that failed (1 is a full KV memory, 2 an abort); a decode that
# fails so leaves none of its batch in the memory
DECODE_FAILED = -3


class Runner:
    """A llama.cpp context (`ctx`: llama-cpp-python's LlamaContext on `model`) and one batch of up to
    `n_batch` rows; `adapters`: the model's LoRA adapters (None without), applied at their default scales
    by the caller."""

    def __init__(self, model: Any, ctx: Any, n_batch: int, adapters: LoraAdapters | None = None) -> None:
        self.lib = _lib()
        self.model, self.ctx = model, ctx
        self.n_vocab = model.n_vocab()
        self.n_embd = model.n_embd()
        self.batch = Batch(n_batch)
        self.adapters = adapters
        self.lora_now: tuple[float, ...] = adapters.default if adapters is not None else ()
        self.embeddings = False  # the context gives hidden states too (a step with rows to pool)
        self.ends_generation = EndTokens(model.vocab)
        self.steps = 0  # decodes run (for tests and benchmarks)

    def set_lora(self, scales: tuple[float, ...]) -> None:
        """The context under `scales`, set only on a change: a change makes llama.cpp reserve its compute
        graph again at the next decode."""
        if self.adapters is not None and scales != self.lora_now:
            self.adapters.apply(self.ctx.ctx, scales)
            self.lora_now = scales

    def evaluate_images(self, plan: StepPlan) -> None:
        """The external chunks (images) the step reaches, each decoded into its seq id by its own calls,
        before the batch that goes on after them."""
        for seq, chunk, pos in plan.external:
            if chunk.evaluate(self.ctx.ctx, seq.seq, pos) < pos:
                raise LocalrtError("an external prompt chunk failed to evaluate")

    def fill(self, plan: StepPlan) -> None:
        """The planned rows into the batch, by seq id (llama.cpp cuts micro-batches of consecutive ids);
        each sequence learns its rows with outputs."""
        self.batch.clear()
        for rows in sorted(plan.rows, key=lambda r: r.seq.seq):
            start = self.batch.add(rows.tokens, rows.pos0, rows.seq.seq, rows.output)
            if rows.output is True:
                rows.seq.rows = list(range(start, start + len(rows.tokens)))
            elif rows.output[-1]:
                rows.seq.rows = [start + len(rows.tokens) - 1]

    def decode(self, pooled: bool) -> int:
        """Decode the batch (llama_decode's return code); `pooled`: some rows want their hidden states,
        which llama.cpp then gives for every row of the batch, with their logits."""
        if pooled != self.embeddings:
            self.lib.llama_set_embeddings(self.ctx.ctx, pooled)
            self.embeddings = pooled
        if faults.injected("decode"):
            return DECODE_FAILED
        ret = self.batch.decode(self.ctx.ctx)
        if ret == 0:
            self.steps += 1
        return ret

    def sample(self, sampler: Any, row: int) -> int:
        """Draw from batch row `row` (the chain accepts the token, advancing its grammar and penalties)."""
        return sample(sampler, self.ctx.ctx, row)

    def logits(self, row: int) -> np.ndarray:
        """Batch row `row`'s logits from the last decode (llama.cpp's buffer: copy to keep them)."""
        return logits_row(self.ctx.ctx, row, self.n_vocab)

    def hidden(self, rows: list[int]) -> np.ndarray:
        """The final-normed hidden states [n, n_embd] of batch rows `rows` (a decode with `pooled`)."""
        out = np.empty((len(rows), self.n_embd), dtype=np.float32)
        for i, row in enumerate(rows):
            ptr = self.lib.llama_get_embeddings_ith(self.ctx.ctx, row)
            out[i] = float_array(ptr, (self.n_embd,), f"llama.cpp has no hidden state for batch row {row}")
        return out

    def close(self) -> None:
        close_each(self.batch, self.ctx)
