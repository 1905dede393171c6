"""Where rows sit in a product, so that an optimized BLAS gives each row what it gives that row alone.

MLX's own CPU kernels (and the wheel's reference BLAS) compute every output row on its own, so a row's
result does not depend on the batch around it. An optimized BLAS (blas.py) does not: its kernels work
on blocks of rows, and a row's last bits depend on how many rows the product has and on the row's place
in its block (OpenBLAS 0.3.21's Haswell kernel, measured: rows in full blocks of 12 agree with each
other when they sit in the first 6 places of their block; the last 6 places and a partial last block
round differently). So on that route every product lays its rows out the same way whatever the batch:
`slots` real rows in the first places of each block of `block` rows, zeros after them, the last block
full (`RowLayout`); `probe()` finds such a layout for the BLAS at hand, or says there is none.

Attention has a second dependence, on the number of keys (the products' other sides), which the
float cache removes by attending over a key count that depends only on the query's position
(`key_span`, cache.py).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

KEY_BUCKET = 64  # a query at position p attends over the first ceil((p + 1) / 64) * 64 cached keys


class RowLayout:
    """Rows i = 0..n-1 at places (i // slots) * block + i % slots; the other places hold zeros."""

    def __init__(self, block: int, slots: int) -> None:
        self.block, self.slots = block, slots
        self._index: dict[int, tuple[mx.array, mx.array]] = {}

    def _indexes(self, n: int) -> tuple[mx.array, mx.array]:
        """(for `pack`: each place's source row, n = the zero row; for `unpack`: each row's place)."""
        got = self._index.get(n)
        if got is None:
            blocks = -(-n // self.slots)
            places = np.arange(n)
            places = places // self.slots * self.block + places % self.slots
            source = np.full(blocks * self.block, n, dtype=np.int32)
            source[places] = np.arange(n)
            got = (mx.array(source), mx.array(places.astype(np.int32)))
            if len(self._index) < 4096:  # one pair per row count seen: a chunk size, a batch size
                self._index[n] = got
        return got

    def pack(self, x: mx.array) -> mx.array:
        """x [..., n, d] -> [..., blocks * block, d] (rows on the second-to-last axis)."""
        n = x.shape[-2]
        zero = mx.zeros((*x.shape[:-2], 1, x.shape[-1]), dtype=x.dtype)
        return mx.take(mx.concatenate([x, zero], axis=-2), self._indexes(n)[0], axis=-2)

    def unpack(self, y: mx.array, n: int) -> mx.array:
        return mx.take(y, self._indexes(n)[1], axis=-2)

    def pack_mask(self, seen: np.ndarray) -> mx.array:
        """A boolean mask [n, keys] laid out as its queries, the padding rows seeing every key (so no
        softmax is empty), built on the host: one array instead of a chain of small device ops."""
        n = seen.shape[0]
        blocks = -(-n // self.slots)
        out = np.ones((blocks * self.block, seen.shape[1]), dtype=bool)
        places = np.arange(n)
        out[places // self.slots * self.block + places % self.slots] = seen
        return mx.array(out)

    def matmul_t(self, x: mx.array, w: mx.array) -> mx.array:
        """x @ w.T with x's rows laid out."""
        return self.unpack(self.pack(x) @ w.T, x.shape[-2])


LAYOUT: RowLayout | None = None  # set when the backend runs on an optimized BLAS and `probe` found one

CANDIDATES = ((12, 6), (8, 4), (16, 8), (24, 12), (6, 3), (4, 2), (32, 16), (48, 24), (2, 1))


def probe(seed: int = 0) -> RowLayout | None:
    """A layout under which every row of a product equals that row alone, on this BLAS (checked bit for
    bit on random products of several row counts and widths), or None."""
    rng = np.random.default_rng(seed)
    x = mx.array(rng.standard_normal((70, 64), dtype=np.float32))
    weights = [mx.array(rng.standard_normal((n, 64), dtype=np.float32)) for n in (96, 40, 200)]
    for block, slots in CANDIDATES:
        layout = RowLayout(block, slots)
        if all(_row_invariant(layout, x, w) for w in weights):
            return layout
    return None


def _row_invariant(layout: RowLayout, x: mx.array, w: mx.array) -> bool:
    alone = mx.concatenate([layout.matmul_t(x[i : i + 1], w) for i in range(x.shape[0])])
    for start, n in ((0, 2), (0, 5), (3, 7), (0, 13), (9, 31), (0, 70)):
        if not mx.array_equal(layout.matmul_t(x[start : start + n], w), alone[start : start + n]).item():
            return False
    return True


def key_span(position: int) -> int:
    """How many cached keys the query at `position` attends over on a laid-out route (the later ones
    masked): a function of the position alone, so a prompt chunk, a speculative batch and a one-token
    step give a query the same product."""
    return (position // KEY_BUCKET + 1) * KEY_BUCKET
