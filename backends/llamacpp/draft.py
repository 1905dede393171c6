"""The draft model's context: the target's seq ids, greedy draft tokens for many sequences at once."""

from __future__ import annotations

from typing import Any

import numpy as np

from localrt.backends.base import close_each
from localrt.backends.base import common_prefix

from .kv import KVRecord
from .lib import Batch
from .lib import EndTokens
from .lib import _lib
from .lib import logits_row


class DraftContext:
    """A draft model (`model`: llama-cpp-python's LlamaModel) and a context on it (`ctx`) with the
    target's parameters, so the same seq ids and batch size; its own record of what each seq id holds."""

    def __init__(self, model: Any, ctx: Any, n_seq_max: int, n_batch: int, n_swa: int = 0) -> None:
        self.lib = _lib()
        self.model, self.ctx = model, ctx
        self.n_vocab = model.n_vocab()
        self.kv = KVRecord(ctx, n_seq_max, n_swa=n_swa)
        self.batch = Batch(n_batch)
        self.ends_generation = EndTokens(model.vocab)

    def propose(self, wants: list[tuple[int, list[int], int]]) -> list[list[int]]:
        """wants: (seq id, history, k) -> up to k greedy draft tokens per entry (one draft decode per round)."""
        remaining: list[list[int]] = []
        for seq, history, _ in wants:
            keep = min(common_prefix(self.kv.cells[seq], history), len(history) - 1)
            keep = self.kv.keep(seq, keep)
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

    def _append(self, seq: int, tokens: list[int], output: bool | list[bool]) -> int:
        """Add tokens to the batch at seq's next positions (recorded as held); their first batch index."""
        start = self.batch.add(tokens, len(self.kv.cells[seq]), seq, output)
        self.kv.extend(seq, tokens)
        return start

    def _take(self, i: int, row: int, wants: list[tuple[int, list[int], int]], out: list[list[int]]) -> bool:
        """Append the argmax of `row` to entry i's draft tokens; True while it wants more."""
        token = int(np.argmax(logits_row(self.ctx.ctx, row, self.n_vocab)))
        if self.ends_generation(token):
            return False
        out[i].append(token)
        return len(out[i]) < wants[i][2]

    def _decode(self) -> bool:
        if self.batch.decode(self.ctx.ctx) != 0:  # full or failed: start the draft cache over
            self.kv.evict_all()
            return False
        return True

    def close(self) -> None:
        close_each(self.batch, self.ctx)
