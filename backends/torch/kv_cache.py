"""Paged KV memory: a pool of fixed-size blocks (metadata) and the tensors that hold them (data).

A block holds `block_size` consecutive tokens of one sequence, for every layer and KV head; the same
block id indexes every layer's tensor. Sequences own lists of block ids (block tables) that grow a
block at a time, so nothing reserves `max_len` up front and the waste is under one block per sequence.
Blocks are shared read-only through reference counts (prefix caching); a block whose count drops to
zero either returns to the free list or, when it holds a cached prefix, waits in an LRU list until
it is reused by a cache hit or evicted by an allocation.
"""

from __future__ import annotations

from collections import OrderedDict
from collections import deque
from collections.abc import Callable
from collections.abc import Iterable

import torch

from localrt.errors import LocalrtError
from localrt.errors import OptionError

BLOCK_SIZE = 16

# KV cache type -> storage dtype. Quantized types keep one float32 scale per (token, head).
KV_STORAGE: dict[str, torch.dtype] = {
    "f32": torch.float32,
    "f16": torch.float16,
    "bf16": torch.bfloat16,
    "q8_0": torch.int8,  # int8 with per-head scales (llama.cpp's name for 8-bit KV)
    "int8": torch.int8,
    "fp8": torch.float8_e4m3fn,
}
QUANTIZED_KV = {"q8_0", "int8", "fp8"}
FP8_MAX = 448.0  # largest finite float8_e4m3fn


class OutOfBlocks(LocalrtError):
    """The pool has no free or evictable block left; the scheduler preempts and retries."""


class BlockPool:
    """Block ids, reference counts, a free list and an LRU list of unreferenced cached blocks."""

    def __init__(self, num_blocks: int, block_size: int = BLOCK_SIZE) -> None:
        if num_blocks < 1:
            raise OptionError("the KV cache budget is too small for a single block")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_count = [0] * num_blocks
        self.cached = [False] * num_blocks  # set by the prefix cache
        self._free: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # oldest first
        self.on_evict: Callable[[int], None] | None = None  # the prefix cache forgets the block

    @property
    def num_free(self) -> int:
        """Blocks an allocation can take now (evictable cached blocks included)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    def allocate(self) -> int:
        if self._free:
            block = self._free.popleft()
        elif self._evictable:
            block, _ = self._evictable.popitem(last=False)  # least recently freed
            self.cached[block] = False
            if self.on_evict is not None:
                self.on_evict(block)
        else:
            raise OutOfBlocks("out of KV cache blocks")
        self.ref_count[block] = 1
        return block

    def allocate_many(self, n: int) -> list[int]:
        if n > self.num_free:
            raise OutOfBlocks(f"need {n} KV cache blocks, {self.num_free} free")
        return [self.allocate() for _ in range(n)]

    def retain(self, block: int) -> None:
        """One more owner; a cached block with no owner leaves the eviction list."""
        if self.ref_count[block] == 0:
            if block not in self._evictable:
                raise LocalrtError(f"block {block} is free, it cannot be shared")
            del self._evictable[block]
        self.ref_count[block] += 1

    def release(self, block: int) -> None:
        count = self.ref_count[block] - 1
        if count < 0:
            raise LocalrtError(f"block {block} released more often than taken")
        self.ref_count[block] = count
        if count == 0:
            if self.cached[block]:
                self._evictable[block] = None  # most recently used end
            else:
                self._free.appendleft(block)  # plain blocks are reused first

    def release_all(self, blocks: Iterable[int]) -> None:
        # tail first: the last blocks of a sequence are the least likely to be hit again, so they
        # become the oldest entries of the LRU list and are evicted first
        for block in reversed(list(blocks)):
            self.release(block)

    def check(self) -> None:
        """Invariants (tests): every block is free, evictable or referenced, exactly once."""
        free, evictable = set(self._free), set(self._evictable)
        assert len(free) == len(self._free) and not free & evictable
        for b in range(self.num_blocks):
            referenced = self.ref_count[b] > 0
            assert referenced + (b in free) + (b in evictable) == 1, f"block {b}"
            assert b not in evictable or self.cached[b]


class KVCache:
    """Per-layer K and V tensors [num_blocks, block_size, n_kv_heads, head_dim] (+ scales if quantized).

    Sliding-window layers (`windowed`) have tensors of their own size, `window_blocks`, indexed by a
    second pool's block ids: a sequence holds only its window's blocks there (`scheduler.Sequence.
    window_table`), while the global layers keep every block of the context.
    """

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        n_kv_heads: int,
        head_dim: int,
        kv_type: str,
        compute_dtype: torch.dtype,
        device: torch.device | str,
        block_size: int = BLOCK_SIZE,
        windowed: list[bool] | None = None,
        window_blocks: int = 0,
    ) -> None:
        if kv_type not in KV_STORAGE:
            raise OptionError(
                f"kv_cache_type {kv_type!r} is not supported by the torch backend "
                f"(supported: {', '.join(KV_STORAGE)})"
            )
        self.kv_type = kv_type
        self.storage = KV_STORAGE[kv_type]
        self.quantized = kv_type in QUANTIZED_KV
        self.compute_dtype = compute_dtype
        self._exact_in_compute = self.storage == compute_dtype or (
            compute_dtype == torch.float32 and self.storage in (torch.float16, torch.bfloat16)
        )
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.windowed = list(windowed) if windowed is not None else [False] * num_layers
        self.window_blocks = window_blocks
        shapes = [
            (window_blocks if w else num_blocks, block_size, n_kv_heads, head_dim) for w in self.windowed
        ]
        # a layer's K and V are the two contiguous halves of one tensor: a step writes and gathers both
        # in one op each (about 7 us a layer less at batch 1 on the CPU)
        self.kv = [torch.zeros((2, *shape), dtype=self.storage, device=device) for shape in shapes]
        self.k = [kv[0] for kv in self.kv]
        self.v = [kv[1] for kv in self.kv]
        self.k_scale: list[torch.Tensor] = []
        self.v_scale: list[torch.Tensor] = []
        if self.quantized:
            self.k_scale = [torch.ones(shape[:3], device=device) for shape in shapes]
            self.v_scale = [torch.ones(shape[:3], device=device) for shape in shapes]

    @staticmethod
    def bytes_per_block(
        num_layers: int, n_kv_heads: int, head_dim: int, kv_type: str, block_size: int = BLOCK_SIZE
    ) -> int:
        # a type this engine lacks is refused by the load, naming the types it has; size it as f16
        elem = torch.empty(0, dtype=KV_STORAGE.get(kv_type, torch.float16)).element_size()
        per_token = n_kv_heads * head_dim * elem + (n_kv_heads * 4 if kv_type in QUANTIZED_KV else 0)
        return 2 * num_layers * block_size * per_token

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v, *self.k_scale, *self.v_scale))

    def _quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, Hkv, D] -> (values [N, Hkv, D] in storage dtype, scales [N, Hkv])."""
        amax = x.float().abs().amax(dim=-1).clamp(min=1e-8)
        if self.storage == torch.int8:
            scale = amax / 127.0
            q = torch.round(x.float() / scale.unsqueeze(-1)).clamp(-127, 127).to(torch.int8)
        else:
            scale = amax / FP8_MAX
            q = (x.float() / scale.unsqueeze(-1)).to(self.storage)
        return q, scale

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        """k, v [N, Hkv, D] go to flat slots (block * block_size + offset)."""
        if not self.quantized:
            kv = self.kv[layer]
            kv.view(2, -1, *kv.shape[3:]).index_copy_(1, slots, torch.stack([k, v]).to(self.storage))
            return
        for cache, scales, x in ((self.k, self.k_scale, k), (self.v, self.v_scale, v)):
            flat = cache[layer].view(-1, *cache[layer].shape[2:])  # [num_blocks * block_size, Hkv, D]
            q, scale = self._quantize(x)
            if q.dtype == torch.float8_e4m3fn:  # index kernels lack fp8: move the bytes
                flat, q = flat.view(torch.uint8), q.view(torch.uint8)
            flat.index_copy_(0, slots, q)
            scales[layer].view(-1, scale.shape[-1]).index_copy_(0, slots, scale)

    def gather(
        self, layer: int, tables: torch.Tensor, wider: torch.dtype | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """tables [B, n_blocks] -> k, v [B, n_blocks * block_size, Hkv, D] in the compute dtype, or
        in `wider` (a dtype holding every compute-dtype value exactly), converted once: the values
        are those of the compute dtype's gather either way."""
        # a store whose values the compute dtype holds exactly (f16 or bf16 under f32) widens in one
        # copy; otherwise (quantized: scaled in the compute dtype) the compute dtype's rounding first
        target = wider if wider is not None and self._exact_in_compute else self.compute_dtype
        b, n_blocks = tables.shape
        flat = tables.reshape(-1)  # index_select of whole blocks, ~3x faster than store[tables]
        if not self.quantized:  # K and V in one copy
            kv = self.kv[layer].index_select(1, flat).to(target)
            if wider is not None and target != wider:
                kv = kv.to(wider)
            k, v = kv.view(2, b, n_blocks * self.block_size, *kv.shape[3:]).unbind(0)
            return k, v
        out = []
        for cache, scales in ((self.k, self.k_scale), (self.v, self.v_scale)):
            store = cache[layer]
            if store.dtype == torch.float8_e4m3fn:  # index kernels lack fp8: move the bytes
                x = store.view(torch.uint8).index_select(0, flat).view(store.dtype)
            else:
                x = store.index_select(0, flat)  # [B * n_blocks, block_size, Hkv, D]
            x = x.to(target) * scales[layer].index_select(0, flat).unsqueeze(-1).to(self.compute_dtype)
            if wider is not None:
                x = x.to(wider)
            out.append(
                x.view(b, n_blocks * self.block_size, *x.shape[2:])
            )  # [B, n_blocks * block_size, Hkv, D]
        return out[0], out[1]

    def copy_block(self, src: int, dst: int, windowed: bool = False) -> None:
        """Copy-on-write for a partially filled cached block (of the sliding layers' pool if `windowed`)."""
        for tensors in (self.k, self.v, self.k_scale, self.v_scale):
            for t, w in zip(tensors, self.windowed):
                if w == windowed:
                    raw = t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t
                    raw[dst].copy_(raw[src])


def num_blocks_for(budget_bytes: int, bytes_per_block: int) -> int:
    return max(1, budget_bytes // bytes_per_block)


def blocks_needed(n_tokens: int, block_size: int = BLOCK_SIZE) -> int:
    return -(-n_tokens // block_size)
