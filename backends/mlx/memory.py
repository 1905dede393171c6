"""The MLX backend's memory before a load: each weight as MLX keeps it (packed integers with fp32 scales
and biases per group of 32 where the type has an exact form, dense in the compute dtype otherwise, and
every matrix dense when an optimized BLAS runs the products), the KV ceiling of every slot (a sliding
layer holds its window), the prompt cache's budget, and the buffers of one step. MLX grows its caches
as sequences fill, so the KV and prompt-cache parts are ceilings, not what a fresh load holds."""

from __future__ import annotations

from pathlib import Path

from localrt.backends.base import LoadOptions
from localrt.backends.memory import MemoryEstimate
from localrt.backends.memory import ModelShape
from localrt.backends.memory import Sizing
from localrt.backends.memory import context_for
from localrt.backends.memory import draft_bytes
from localrt.backends.memory import model_shape
from localrt.store.gguf import TensorInfo

MAX_SLOTS = 16
DEFAULT_SLOTS = {"cpu": 4, "gpu": 8}  # sequences decoded together when LOCALRT_NUM_PARALLEL is unset
GROUP = 32
SCALE_BIAS_BYTES = 8  # an fp32 scale and an fp32 bias per group
# Fitted on SmolLM2-135M and Gemma 3 270M, a first load in a fresh process with every context filled:
# past the weights and the caches, growth was 61-77 MiB and 154 MiB, following the vocabulary (the
# logits of a step and the graph around them).
BUFFER_BASE = 48 << 20
BUFFER_PER_VOCAB_TOKEN = 416
EXACT_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K")


def _on_gpu() -> bool:
    import mlx.core as mx

    return mx.default_device().type == mx.DeviceType.gpu


def tensor_bytes(t: TensorInfo, dense: int, all_dense: bool) -> int:
    exact = t.ggml_type in EXACT_TYPES and len(t.shape) >= 2 and int(t.shape[0]) % GROUP == 0
    if not exact or (all_dense and t.name != "token_embd.weight"):
        return t.n_elements * dense
    bits = int(t.ggml_type[1])
    return t.n_elements * bits // 8 + t.n_elements // GROUP * SCALE_BIAS_BYTES


def weight_bytes(shape: ModelShape, dense: int, all_dense: bool) -> int:
    return sum(tensor_bytes(t, dense, all_dense) for t in shape.info.tensors)


def kv_ceiling(shape: ModelShape, opts: LoadOptions, context: int, dense: int) -> int:
    """One slot's full context: `MLXModel._load`'s count, a sliding layer holding its window and slack."""
    from .cache import SLACK

    per_layer_token = 2 * shape.n_head_kv * shape.head_dim
    kv = 1.125 if opts.kv_cache_type == "q8_0" else (4 if dense == 4 else 2)
    windowed = (
        min(context, shape.sliding_window + 2 * SLACK + opts.num_batch) if shape.sliding_window else context
    )
    held = windowed * shape.sliding_layers + context * (shape.n_layer - shape.sliding_layers)
    return int(per_layer_token * kv * held)


def estimate(path: Path, opts: LoadOptions) -> MemoryEstimate:
    from .blas import active
    from .blas import install

    install()  # whether products run on an optimized BLAS decides how weights are kept
    shape = model_shape(path)
    on_gpu = _on_gpu()
    dense = 2 if on_gpu else 4
    all_dense = active()
    context = context_for(shape, opts.num_ctx)
    slots = min(MAX_SLOTS, opts.num_parallel or DEFAULT_SLOTS["gpu" if on_gpu else "cpu"])
    # the slots' caches, and the prompt cache that keeps finished conversations up to as much again
    kv = 2 * kv_ceiling(shape, opts, context, dense) * slots
    return Sizing("mlx", context, slots).estimate(
        weights=weight_bytes(shape, dense, all_dense),
        kv=kv,
        buffers=BUFFER_BASE + BUFFER_PER_VOCAB_TOKEN * shape.n_vocab,
        draft=draft_bytes(opts, lambda draft: weight_bytes(draft, dense, all_dense)),
        device="GPU" if on_gpu else "CPU",
    )
