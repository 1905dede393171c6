"""The record of what each seq id holds in a llama.cpp context's KV memory (`KVRecord`), changed together
with the memory, and the RAM cache of idle sequences' states (llama-server's --cache-ram): a conversation
coming back after its sequence went to another request is restored, not evaluated again.

The memory is one pool of cells that every seq id draws from (llama.cpp's unified KV cache, as
llama-server's default), or, for batch invariance, a stream of cells per seq id. In a pool a copied prefix
is shared, not copied (the cells get a second seq id), and the record counts the cells in use, so that
the scheduler admits a request only when there is room for it.
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

    def __init__(
        self, ctx: Any, n_seq_max: int, ram_cache_bytes: int = 0, *, pool: int = 0, n_swa: int = 0
    ) -> None:
        self.lib = _lib()
        self.ctx = ctx
        self.mem = self.lib.llama_get_memory(ctx.ctx)
        self.cells: list[list[Hashable]] = [[] for _ in range(n_seq_max)]
        self.cell_lora: list[tuple[float, ...]] = [() for _ in range(n_seq_max)]
        self.ram_cache_bytes = ram_cache_bytes
        self.saved: list[SavedSeq] = []  # evicted idle sequences' states, least recently saved first
        # the cells of the pool every seq id shares (0: a stream of cells per seq id, nothing counted)
        self.pool = pool
        # sliding-window layers that keep only their window (plus a batch): a kept prefix is usable only
        # while they still hold the window before its end (0: they keep everything)
        self.n_swa = n_swa
        # in a pool, the pool cell each held cell takes (an id): a copied prefix shares its source's
        self.slots: list[list[int]] = [[] for _ in range(n_seq_max)]
        self._refs: dict[int, int] = {}
        self._next_slot = 0

    @property
    def used(self) -> int:
        """Pool cells in use (shared ones once); 0 without a pool."""
        return len(self._refs)

    @property
    def free(self) -> int:
        """Pool cells no seq id holds."""
        return self.pool - len(self._refs)

    def extend(self, seq: int, items: list[Hashable]) -> None:
        """seq holds these cells too, after the ones it holds (written by the next decode)."""
        self.cells[seq].extend(items)
        if self.pool:
            new = range(self._next_slot, self._next_slot + len(items))
            self._next_slot += len(items)
            self.slots[seq].extend(new)
            self._refs.update(dict.fromkeys(new, 1))

    def _drop_slots(self, seq: int, n: int) -> None:
        if not self.pool:
            return
        refs = self._refs
        for slot in self.slots[seq][n:]:
            left = refs[slot] - 1
            if left:
                refs[slot] = left
            else:
                del refs[slot]
        del self.slots[seq][n:]

    def cut(self, seq: int, n: int) -> bool:
        """Drop seq's cells from the n-th on; False when the memory cannot cut a sequence partway."""
        del self.cells[seq][n:]
        self._drop_slots(seq, n)
        return bool(self.lib.llama_memory_seq_rm(self.mem, seq, n, -1))

    def keep(self, seq: int, n: int) -> int:
        """Keep seq's first n cells; how many are kept: none when the memory cannot cut a sequence
        partway, or when its sliding-window layers no longer hold the window before the n-th cell (it is
        cleared then)."""
        if self.cut(seq, n) and (n == 0 or self._window_held(seq, n)):
            return n
        self.evict(seq)
        return 0

    def _window_held(self, seq: int, n: int) -> bool:
        """The sliding-window layers hold the cells a token at position n attends to (llama-server's
        test before it reuses a slot's cache: the first position they hold is at most n - window)."""
        if not self.n_swa:
            return True
        return int(self.lib.llama_memory_seq_pos_min(self.mem, seq)) <= max(0, n - self.n_swa)

    def evict(self, seq: int) -> None:
        self.lib.llama_memory_seq_rm(self.mem, seq, -1, -1)
        self.cells[seq] = []
        self._drop_slots(seq, 0)
        self.cell_lora[seq] = ()

    def evict_all(self) -> None:
        self.lib.llama_memory_clear(self.mem, True)
        self.cells = [[] for _ in self.cells]
        self.slots = [[] for _ in self.slots]
        self._refs.clear()
        self.cell_lora = [() for _ in self.cell_lora]

    def copy(self, src: int, dst: int) -> None:
        """dst holds what src holds: in a pool the cells are shared (nothing is copied); with a stream per
        seq id, the whole stream is copied."""
        self.evict(dst)  # in a pool, what dst held would stay beside the shared cells
        self.lib.llama_memory_seq_cp(self.mem, src, dst, -1, -1)
        self.cells[dst] = list(self.cells[src])
        self.cell_lora[dst] = self.cell_lora[src]
        if self.pool:
            self.slots[dst] = list(self.slots[src])
            for slot in self.slots[dst]:
                self._refs[slot] += 1

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
        self.cell_lora[seq] = saved.lora
        self.extend(seq, list(saved.cells))
        return True
