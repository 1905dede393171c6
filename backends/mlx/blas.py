"""An optimized BLAS under MLX's CPU matrix products (opt-in: `LOCALRT_MLX_BLAS=openblas` or a path).

The `mlx[cpu]` wheel for Linux carries the reference BLAS, whose `cblas_sgemm` is a plain loop: a
product over M rows costs M times one row (measured: 0.44 ms per row of a 1536x576 fp32 product at any
M), and MLX's own CPU quantized matmul is no better (0.61 ms per row). So on Linux a batch of 8 decodes
at about the single-stream rate. MLX resolves `cblas_sgemm` by name at load time, and a library already
in the process's global symbol scope wins over the wheel's own, so loading OpenBLAS with `RTLD_GLOBAL`
before `mlx.core` is imported puts it under every fp32 `matmul` (8 rows then cost about one: 0.28 ms vs
0.26 ms on the same product). The backend then keeps the weights dense in the compute dtype
(`Transformer.dense_weights`), since the quantized matmul is MLX's own kernel, which BLAS never sees.

Why it is opt-in:
- OpenBLAS's per-row results depend on the product's shape (the number of rows, a row's place in the
  kernel's blocks), so batching and speculation are no longer bit-invisible on this route: each row
  is as accurate, but the tokens can differ from the ones it gives alone at near-ties.
- the global symbol scope is the process's: torch calls `sgemm_` through its PLT, so a torch model
  loaded in the same process would also run its fp32 products on this library.
- dense fp32 weights take about 8x the memory of 4-bit ones.

It has to happen before MLX is imported: `install()` runs at the backend's first touch of MLX
(`mlx_status`, a model's load); when something imported MLX earlier, it logs why and does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sys

from localrt import config
from localrt.errors import OptionError

ENV = "LOCALRT_MLX_BLAS"
log = logging.getLogger(__name__)
_installed: str | None = None  # the library's path once loaded
_tried = False


def install() -> str | None:
    """Load the BLAS that `LOCALRT_MLX_BLAS` names under MLX (once per process); its path, or None."""
    global _installed, _tried
    if not _tried:  # an error is raised again at the next call
        _installed = _load(config.mlx_blas())
        _tried = True
    return _installed


def _load(spec: str) -> str | None:
    if not spec or spec.lower() in ("0", "off", "no", "reference"):
        return None
    path = spec if os.sep in spec else ctypes.util.find_library(spec)
    if path is None:
        raise OptionError(
            f"{ENV}={spec}: no library by that name (give a path, e.g. /usr/lib/.../libopenblas.so.0)"
        )
    if "mlx.core" in sys.modules:
        log.warning(
            "%s=%s ignored: MLX was imported before the backend could put the library under it", ENV, spec
        )
        return None
    try:
        lib = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    except OSError as e:
        raise OptionError(f"{ENV}={spec}: cannot load {path} ({e})") from None
    if not hasattr(lib, "cblas_sgemm"):
        raise OptionError(f"{ENV}={spec}: {path} has no cblas_sgemm")
    # one thread: MLX's CPU stream is one thread, and a pool per product would fight the other engines
    for name in ("openblas_set_num_threads", "bli_thread_set_num_threads", "MKL_Set_Num_Threads"):
        if hasattr(lib, name):
            getattr(lib, name)(1)
            break
    return path


def active() -> bool:
    """Whether MLX's fp32 products run on the library `install` loaded."""
    return _installed is not None
