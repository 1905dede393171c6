"""The record of what each seq id holds in a llama.cpp context's KV memory (`KVRecord`), changed together
with the memory, and the RAM cache of idle sequences' states (llama-server's --cache-ram): a conversation
coming back after its sequence went to another request is restored, not evaluated again.
"""

from __future__ import annotations

import ctypes
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

from localrt.backends.base import longest_prefix

from .lib import _lib

# RAM for the states of idle sequences that lost their cells to another request
RAM_CACHE_BYTES = 512 << 20


@dataclass
class SavedSeq:
    """An evicted idle sequence: its cells, its KV state as llama_state_seq_get_data wrote it, and the
    LoRA scale set the state was computed under."""

    cells: list[Hashable]
    data: Any  # a ctypes uint8 array
    lora: tuple[float, ...] = ()


class KVRecord:
    """The cells each seq id of a context (`ctx`: llama-cpp-python's LlamaContext) holds, and the LoRA
    scale set they were computed under: KV made under one set is not reused for a request under another
    (the same tokens give other keys and values). Every method changes llama.cpp's memory
    (`llama_memory_*`) and the record together."""

    def __init__(self, ctx: Any, n_seq_max: int, ram_cache_bytes: int = 0) -> None:
        self.lib = _lib()
        self.ctx = ctx
        self.mem = self.lib.llama_get_memory(ctx.ctx)
        self.cells: list[list[Hashable]] = [[] for _ in range(n_seq_max)]
        self.cell_lora: list[tuple[float, ...]] = [() for _ in range(n_seq_max)]
        self.ram_cache_bytes = ram_cache_bytes
        self.saved: list[SavedSeq] = []  # evicted idle sequences' states, least recently saved first

    def cut(self, seq: int, n: int) -> bool:
        """Drop seq's cells from the n-th on; False when the memory cannot cut a sequence partway."""
        del self.cells[seq][n:]
        return bool(self.lib.llama_memory_seq_rm(self.mem, seq, n, -1))

    def keep(self, seq: int, n: int) -> int:
        """Keep seq's first n cells; how many are kept: none when the memory cannot cut a sequence
        partway (it is cleared then)."""
        if self.cut(seq, n):
            return n
        self.evict(seq)
        return 0

    def evict(self, seq: int) -> None:
        self.lib.llama_memory_seq_rm(self.mem, seq, -1, -1)
        self.cells[seq] = []
        self.cell_lora[seq] = ()

    def evict_all(self) -> None:
        self.lib.llama_memory_clear(self.mem, True)
        self.cells = [[] for _ in self.cells]
        self.cell_lora = [() for _ in self.cell_lora]

    def copy(self, src: int, dst: int) -> None:
        """dst holds what src holds: each sequence has a KV stream of its own, so the whole stream is copied."""
        self.lib.llama_memory_seq_cp(self.mem, src, dst, -1, -1)
        self.cells[dst] = list(self.cells[src])
        self.cell_lora[dst] = self.cell_lora[src]

    def best_prefix(self, cells: list[Hashable], lora: tuple[float, ...]) -> tuple[int, int]:
        """The seq id holding the longest start of `cells` made under `lora`, and its length."""
        held = ((seq, held) for seq, held in enumerate(self.cells) if self.cell_lora[seq] == lora)
        return longest_prefix(held, cells, -1)

    # ---- the RAM cache: states of idle sequences that lost their cells ---------------------------
    def save(self, seq: int) -> None:
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

    def best_saved(self, cells: list[Hashable], lora: tuple[float, ...]) -> tuple[SavedSeq | None, int]:
        return longest_prefix(((s, s.cells) for s in self.saved if s.lora == lora), cells, None)

    def restore(self, saved: SavedSeq, seq: int) -> bool:
        """Load a saved state into seq (whatever it held is saved or dropped first); False if llama.cpp
        refused it (seq is then empty)."""
        # taken out first: saving seq's current state may drop the oldest states, this one among them
        self.saved.remove(saved)
        if self.cells[seq]:
            self.save(seq)
        self.evict(seq)
        if int(self.lib.llama_state_seq_set_data(self.ctx.ctx, saved.data, len(saved.data), seq)) == 0:
            self.evict(seq)
            return False
        self.cells[seq] = list(saved.cells)
        self.cell_lora[seq] = saved.lora
        return True
