"""The llama.cpp backend's memory before a load: the file (llama.cpp maps it and touches every weight),
the KV cache, and the compute and output buffers, which grow with the vocabulary (the logits rows).

The KV cache is one pool of cells the sequences share (`pool_cells`: one context per sequence where the
memory allows, at least one context), whose sliding-window layers keep only each sequence's window and
a batch; under batch invariance it is a stream of a whole context per sequence, padded to 256 as
llama.cpp pads each stream, sliding layers included.
"""

from __future__ import annotations

import re
from pathlib import Path

from localrt import config
from localrt.backends.base import LoadOptions
from localrt.backends.devices import compute_devices
from localrt.backends.devices import gpu_room
from localrt.backends.memory import HeaderNumbers
from localrt.backends.memory import MemoryEstimate
from localrt.backends.memory import ModelShape
from localrt.backends.memory import Sizing
from localrt.backends.memory import available_memory
from localrt.backends.memory import context_for
from localrt.backends.memory import draft_bytes
from localrt.backends.memory import file_size
from localrt.backends.memory import model_shape
from localrt.backends.memory import padded

# bytes a cache cell takes per element, by KV type (the quantized types with their block scales)
KV_BYTES = {"f32": 4.0, "f16": 2.0, "bf16": 2.0, "q8_0": 1.0625, "q4_0": 0.5625}

# Fitted on SmolLM2-135M (49k tokens) and Gemma 3 270M (262k tokens), a first load in a fresh process:
# resident growth past the file and the KV cache was 33 MiB and 81 MiB (llama.cpp's own start-up
# included; a later load in the same process adds 7 MiB and 21 MiB).
BUFFER_BASE = 22 << 20
BUFFER_PER_VOCAB_TOKEN = 224
AUTO_MIN_PARALLEL = 4  # LOCALRT_NUM_PARALLEL=auto: at least this many sequences where they fit
AUTO_MAX_PARALLEL = 8
AUTO_MEMORY_SHARE = 0.25  # of the available memory, for the KV cache of the auto sequences


def kv_bytes_per_token(metadata: dict[str, str], kv_type: str) -> int:
    num = HeaderNumbers(metadata)
    # a type llama.cpp lacks is refused by the load itself, naming the types it has; size it as f16
    per_element = KV_BYTES.get(kv_type, KV_BYTES["f16"])
    return int(2 * num("block_count") * num.n_head_kv() * num.head_dim() * per_element)


def auto_parallel(per_sequence: int, budget: int) -> int:
    """LOCALRT_NUM_PARALLEL=auto: as many sequences as the budget holds, AUTO_MIN..AUTO_MAX, else what fits."""
    if per_sequence <= 0 or budget <= 0:
        return AUTO_MIN_PARALLEL
    fit = budget // per_sequence
    if fit < AUTO_MIN_PARALLEL:
        return max(1, fit)
    return min(AUTO_MAX_PARALLEL, fit)


def parallel_for(per_sequence: int, num_parallel: int) -> int:
    """The sequences a load gets: the setting, or what the auto rule gives on this machine now."""
    if num_parallel > 0:
        return num_parallel
    return auto_parallel(per_sequence, int(available_memory() * AUTO_MEMORY_SHARE))


def step_tokens(num_batch: int, context: int, parallel: int) -> int:
    """Batch rows a step (llama.cpp's n_batch and n_ubatch): num_batch, within the context, and at least
    two a sequence (a token and a draft)."""
    return max(parallel * 2, min(num_batch, context))


def pool_cells(kv_pool: int, context: int, parallel: int) -> int:
    """The cells of the KV pool the sequences of a load share (padded as llama.cpp pads it): `kv_pool`
    (0: a whole context per sequence), at least one context, at most one per sequence."""
    most = context * parallel
    return padded(max(context, min(kv_pool or most, most)))


def kv_bytes(shape: ModelShape, opts: LoadOptions, context: int, parallel: int) -> int:
    """The KV cache's bytes: in a pool, its cells on the full-attention layers and, on the sliding ones,
    each sequence's window and a batch (llama.cpp's size for them when they do not keep the whole
    context); a whole context per sequence under batch invariance."""
    per_token = kv_bytes_per_token(shape.text_metadata, opts.kv_cache_type)
    if opts.batch_invariant:
        return per_token * padded(context) * parallel
    pool = pool_cells(opts.kv_pool, context, parallel)
    per_layer = per_token // max(1, shape.n_layer)
    sliding = shape.sliding_layers if shape.sliding_window else 0
    window = padded(
        min(pool, shape.sliding_window * parallel + step_tokens(opts.num_batch, context, parallel))
    )
    return per_layer * ((shape.n_layer - sliding) * pool + sliding * window)


_BLOCK = re.compile(r"blk\.(\d+)\.")


def _sizing(path: Path, opts: LoadOptions) -> tuple[ModelShape, int, Sizing]:
    """The header, the KV cache's bytes and the settings llama.cpp would load the model with."""
    shape = model_shape(path)
    context = context_for(shape, opts.num_ctx)
    per_token = kv_bytes_per_token(shape.text_metadata, opts.kv_cache_type)
    parallel = parallel_for(per_token * context, opts.num_parallel)
    pool = 0 if opts.batch_invariant else pool_cells(opts.kv_pool, context, parallel)
    return shape, kv_bytes(shape, opts, context, parallel), Sizing("llama.cpp", context, parallel, pool)


def layer_bytes(path: Path, opts: LoadOptions) -> tuple[list[int], int, int]:
    """(each block's bytes on a GPU: its weights and its share of the KV cache, the output layer's
    bytes, the compute buffers')."""
    shape, kv, _ = _sizing(path, opts)
    n_layer = max(1, shape.n_layer)
    kv_per_block = kv // n_layer
    blocks, output = [kv_per_block] * n_layer, 0
    for t in shape.info.tensors:
        m = _BLOCK.match(t.name)
        if m is not None and int(m[1]) < n_layer:
            blocks[int(m[1])] += t.n_bytes
        elif t.name.startswith("output"):
            output += t.n_bytes
    return blocks, output, BUFFER_BASE + BUFFER_PER_VOCAB_TOKEN * shape.n_vocab


def gpu_layers(path: Path, opts: LoadOptions, room: int) -> int:
    """`n_gpu_layers` for "as many layers as fit" in `room` bytes of GPU memory. llama.cpp puts the last
    n blocks on the GPU, each with its weights and its share of the KV cache, and the output layer too
    once n passes the block count; the compute buffers are set aside first. 0 when not one block fits."""
    blocks, output, buffers = layer_bytes(path, opts)
    left = room - buffers
    placed = 0
    for block in reversed(blocks):
        if block > left:
            return placed
        left -= block
        placed += 1
    return placed + 1 if output <= left else placed


def gpu_bytes(path: Path, opts: LoadOptions, layers: int) -> int:
    """What `layers` offloaded layers take on the GPU: the last blocks, the output layer once `layers`
    passes the block count, and the compute buffers (none when nothing is offloaded)."""
    if layers <= 0:
        return 0
    blocks, output, buffers = layer_bytes(path, opts)
    placed = blocks[len(blocks) - min(layers, len(blocks)) :]
    return buffers + sum(placed) + (output if layers > len(blocks) else 0)


def estimate(path: Path, opts: LoadOptions, room: int | None | bool = True) -> MemoryEstimate:
    """The estimate, with the GPU's part for the GPUs' free memory now (`room` True), or for `room` bytes
    of GPU memory (None: no GPU)."""
    shape, kv, sizing = _sizing(path, opts)

    def draft_size(draft: ModelShape) -> int:  # the draft gets a context with the target's parameters
        return file_size(opts.draft_model) + kv_bytes(draft, opts, sizing.context, sizing.parallel)

    if room is True:
        room = gpu_room(compute_devices(), config.gpu_overhead()) if opts.num_gpu != 0 else None
    layers = gpu = gpu_kv = 0
    buffers = BUFFER_BASE + BUFFER_PER_VOCAB_TOKEN * shape.n_vocab
    if room is None:
        device = "CPU"
    else:  # the layers llama.cpp would get on the GPUs as asked, of the blocks and the output layer
        layers = min(gpu_layers(path, opts, room) if opts.num_gpu < 0 else opts.num_gpu, shape.n_layer + 1)
        device = f"GPU: {layers} of {shape.n_layer + 1} layers"
        gpu = gpu_bytes(path, opts, layers)
        gpu_kv = kv // max(1, shape.n_layer) * min(layers, shape.n_layer)
    return sizing.estimate(
        device=device,
        weights=file_size(path),
        kv=kv,
        buffers=buffers,
        projector=file_size(opts.projector),
        draft=draft_bytes(opts, draft_size),
        gpu=gpu,
        gpu_free=room,
        gpu_weights=max(0, gpu - gpu_kv - buffers) if layers > 0 else 0,
    )
