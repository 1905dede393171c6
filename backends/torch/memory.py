"""The torch engine's memory before a load: each weight as the engine keeps it (`quantized.py`'s int4
planes and int8 rows on the CPU, dense elsewhere), the paged KV pool as the engine sizes it, and the
buffers of one step."""

from __future__ import annotations

from pathlib import Path

from localrt import config
from localrt.backends.base import LoadOptions
from localrt.backends.memory import MemoryEstimate
from localrt.backends.memory import ModelShape
from localrt.backends.memory import Sizing
from localrt.backends.memory import context_for
from localrt.backends.memory import draft_bytes
from localrt.backends.memory import model_shape
from localrt.store.gguf import TensorInfo

MAX_SEQS = 16
CPU_PARALLEL = 4  # sequences decoded together on the CPU when LOCALRT_NUM_PARALLEL is unset
# bytes per weight of each kept form: 4-bit integers with bf16 scales and zeros per group of 32; two
# such planes; two planes with scales per sub-block of 16; int8 (one fp32 scale per row added below)
KEPT_BYTES = {"int4": 0.625, "int4x2": 1.25, "int4x2/16": 1.5, "int8": 1.0}
# Fitted on SmolLM2-135M and Gemma 3 270M, a first load in a fresh process with every context filled:
# past the kept weights and the KV pool, growth was 0.63 x the weights (the dequantized copies the
# planes are built from, which the allocator keeps) plus 200 MiB of torch's own start-up (thread
# pools, kernels). A later load in the same process holds less: the estimate errs on the safe side.
RUNTIME_BASE = 200 << 20
LOAD_SHARE = 0.63


def _cuda_available() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:  # not installed, or no working CUDA runtime
        return False


def _cuda_room() -> int | None:
    """The CUDA device's free memory less LOCALRT_GPU_OVERHEAD, or None where it cannot be asked."""
    try:
        import torch

        free, _ = torch.cuda.mem_get_info()
    except Exception:  # no working CUDA runtime
        return None
    return max(0, int(free) - config.gpu_overhead())


def _device(opts: LoadOptions) -> str:
    return "cuda" if opts.num_gpu != 0 and _cuda_available() else "cpu"


def _numerics(opts: LoadOptions, device: str) -> str:
    if opts.numerics in ("auto", "quantized"):
        return "quantized" if device == "cpu" else "dequantized"
    return opts.numerics


def tensor_bytes(t: TensorInfo, quantized: bool, dense: int) -> int:
    """One tensor as the engine holds it; the embedding table keeps its stored rows (read per token)."""
    if t.name == "token_embd.weight" and quantized:
        return t.n_bytes
    if len(t.shape) < 2 or not quantized:
        return t.n_elements * dense
    from .quantized import kind_of

    kind = kind_of(t)
    if kind == "dense":
        return t.n_elements * 4
    rows = t.n_elements // max(1, int(t.shape[0]))
    return int(t.n_elements * KEPT_BYTES[kind]) + (4 * rows if kind == "int8" else 0)


def weight_bytes(shape: ModelShape, quantized: bool, dense: int) -> int:
    tensors = shape.info.tensors
    total = sum(tensor_bytes(t, quantized, dense) for t in tensors)
    if quantized and not any(t.name == "output.weight" for t in tensors):
        # a tied head: the embedding table again, as a matrix the head multiplies by
        total += sum(
            tensor_bytes(_as_matrix(t), quantized, dense) for t in tensors if t.name == "token_embd.weight"
        )
    return total


def _as_matrix(t: TensorInfo) -> TensorInfo:
    from dataclasses import replace

    return replace(t, name="output.weight")


def kv_bytes(shape: ModelShape, opts: LoadOptions, context: int, parallel: int) -> int:
    from .kv_cache import BLOCK_SIZE
    from .kv_cache import KVCache
    from .sliding import window_pool_blocks

    sliding = shape.sliding_layers
    per_block, per_window_block = (
        KVCache.bytes_per_block(n, shape.n_head_kv, shape.head_dim, opts.kv_cache_type, BLOCK_SIZE)
        for n in (shape.n_layer - sliding, sliding)
    )
    context_blocks = -(-context // BLOCK_SIZE)
    window_blocks = 0
    if sliding:
        window_blocks = window_pool_blocks(
            shape.sliding_window, parallel, max(64, opts.num_batch), context_blocks * parallel, BLOCK_SIZE
        )
    return per_block * context_blocks * parallel + per_window_block * window_blocks


def estimate(path: Path, opts: LoadOptions) -> MemoryEstimate:
    shape = model_shape(path)
    device = _device(opts)
    numerics = _numerics(opts, device)
    dense = 2 if device == "cuda" and numerics == "dequantized" else 4
    context = context_for(shape, opts.num_ctx)
    parallel = opts.num_parallel or (CPU_PARALLEL if device == "cpu" else MAX_SEQS)
    quantized = numerics == "quantized"
    weights = weight_bytes(shape, quantized, dense)
    kv = kv_bytes(shape, opts, context, parallel)
    draft = draft_bytes(opts, lambda draft: weight_bytes(draft, quantized, dense))
    # on CUDA the weights and the KV cache live on the device; the buffers stay on the host
    on_gpu = device == "cuda"
    return Sizing("torch", context, parallel).estimate(
        weights=weights,
        kv=kv,
        buffers=RUNTIME_BASE + int(LOAD_SHARE * weights),
        draft=draft,
        device="GPU" if on_gpu else "CPU",
        gpu=weights + kv + draft if on_gpu else 0,
        gpu_free=_cuda_room() if on_gpu else None,
    )
