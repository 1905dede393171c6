"""llama.cpp through llama-cpp-python's ctypes layer: loading, context parameters, a multi-sequence batch,
the sampler chain and the vocabulary helpers. Nothing here holds request state; `sequences.py` and
`step.py` do."""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from localrt import config
from localrt.backends.base import LoadOptions
from localrt.backends.base import SamplingParams
from localrt.backends.checks import check_kv_cache_type
from localrt.backends.checks import check_model_file
from localrt.backends.devices import compute_devices
from localrt.backends.devices import gpu_room
from localrt.backends.grammar import Candidates
from localrt.backends.grammar import grammar_sampler
from localrt.backends.outputs import float_array
from localrt.errors import LocalrtError
from localrt.errors import OptionError

from .memory import gpu_layers

KV_TYPES = {"f32": 0, "f16": 1, "q4_0": 2, "q8_0": 8, "bf16": 30}
QUANTIZED_KV = {"q4_0", "q8_0"}

_init_lock = threading.Lock()
_ready: Any = None  # llama_cpp once initialised: the sampling path asks for it per token, past the lock
_logits_at: Any = None  # llama_get_logits_ith returning the row's address as an int (`logits_row`)


def _lib() -> Any:
    """Import llama_cpp once, quietly (only errors reach stderr), and initialise the ggml backend."""
    global _ready, _logits_at
    if _ready is not None:
        return _ready
    import llama_cpp

    with _init_lock:
        if _ready is None:
            from llama_cpp import _logger

            _logger.set_verbose(False)
            llama_cpp.llama_backend_init()
            _logits_at = _returning_address(llama_cpp.llama_get_logits_ith)
            _ready = llama_cpp
    return llama_cpp


def _returning_address(fn: Any) -> Any:
    """The same C function bound again with a `void *` result, which ctypes hands back as an int."""
    prototype = ctypes.CFUNCTYPE(ctypes.c_void_p, *fn.argtypes)
    return prototype(ctypes.cast(fn, ctypes.c_void_p).value)


def default_threads() -> int:
    """Decode is memory-bound: past a few cores, hyper-threads only add contention."""
    try:
        available = len(os.sched_getaffinity(0))
    except AttributeError:  # macOS
        available = os.cpu_count() or 1
    return available if available <= 4 else max(4, available // 2)


def gpu_offload_supported() -> bool:
    try:
        return bool(_lib().llama_supports_gpu_offload())
    except Exception:
        return False


ALL_LAYERS = 0x7FFFFFFF  # n_gpu_layers past any block count: every block and the output layer


def fitted_gpu_layers(path: Path, opts: LoadOptions) -> int:
    room = gpu_room(compute_devices(), config.gpu_overhead())
    return ALL_LAYERS if room is None else gpu_layers(path, opts, room)


def check_kv_options(opts: LoadOptions) -> None:
    check_kv_cache_type(opts.kv_cache_type, list(KV_TYPES), "llama.cpp")
    if opts.flash_attn is False and opts.kv_cache_type in QUANTIZED_KV:
        raise OptionError(f"kv_cache_type {opts.kv_cache_type} needs flash attention")


def load_model(path: Path, opts: LoadOptions) -> tuple[Any, bool]:
    """The weights (an `_internals.LlamaModel`) and whether layers went to a GPU."""
    from llama_cpp import _internals

    lib = _lib()
    params = lib.llama_model_default_params()
    use_gpu = gpu_offload_supported()
    n_gpu = opts.num_gpu if use_gpu else 0
    if n_gpu < 0:  # as many layers as fit (every layer where the GPUs do not say what is free)
        n_gpu = fitted_gpu_layers(path, opts)
    params.n_gpu_layers = n_gpu
    check_model_file(path)
    try:
        model = _internals.LlamaModel(path_model=str(path), params=params, verbose=False)
    except ValueError as e:
        raise LocalrtError(f"llama.cpp could not load the model: {e}") from None
    return model, use_gpu and n_gpu != 0


class SharedWeights:
    """A GGUF's weights, loaded once in the process for every model that runs on them (models made from one
    base with different LoRA adapters). Each holder makes its own contexts and adapters over them, and the
    weights are freed when the last holder releases them. The first holder still holding them is the one
    whose memory counts them (`counts`), so `ps` adds them up once."""

    _lock = threading.Lock()
    _loaded: dict[tuple[str, int], SharedWeights] = {}
    _loading: dict[tuple[str, int], threading.Lock] = {}

    def __init__(self, key: tuple[str, int], model: Any, on_gpu: bool) -> None:
        self.key, self.model, self.on_gpu = key, model, on_gpu
        self.size = int(model.size())
        self.holders: list[object] = []

    @classmethod
    def acquire(cls, path: Path, opts: LoadOptions, holder: object) -> SharedWeights:
        """The weights of `path` with `opts`' GPU layers, loaded now or already loaded, held by `holder`."""
        key = (str(Path(path).resolve()), opts.num_gpu)
        with cls._lock:
            loading = cls._loading.setdefault(key, threading.Lock())
        with loading:  # one load per file at a time; loads of other files go on meanwhile
            with cls._lock:  # found and held in one step: a release cannot free it in between
                weights = cls._loaded.get(key)
                if weights is not None:
                    weights.holders.append(holder)
                    return weights
            model, on_gpu = load_model(path, opts)
            weights = cls(key, model, on_gpu)
            with cls._lock:
                cls._loaded[key] = weights
                weights.holders.append(holder)
        return weights

    def counts(self, holder: object) -> bool:
        """Whether `holder`'s memory includes the weights: the earliest holder still holding them."""
        with self._lock:
            return bool(self.holders) and self.holders[0] is holder

    def release(self, holder: object) -> None:
        """`holder` is done with the weights (its contexts and adapters closed); the last one frees them."""
        with self._lock:
            if holder in self.holders:
                self.holders.remove(holder)
            if self.holders:
                return
            if self._loaded.get(self.key) is self:
                del self._loaded[self.key]
        self.model.close()


def context_params(
    opts: LoadOptions, n_ctx: int, step_tokens: int, n_seq_max: int, threads: int, *, unified: bool
) -> Any:
    """A batched context's parameters: `n_ctx` cells over `n_seq_max` sequences, up to `step_tokens`
    batch rows a step; `unified`: one pool of cells the sequences share, else a stream each."""
    p = _lib().llama_context_default_params()
    p.n_ctx = n_ctx
    # one micro-batch per step: its rows share one pass over the weights (under batch invariance each
    # sequence brings at most EXACT_ROWS of them: see sequences.py)
    p.n_batch = p.n_ubatch = step_tokens
    p.n_seq_max = n_seq_max
    # One pool (llama-server's default), whose memory does not multiply with the sequences, and whose
    # sliding-window layers keep each sequence's window and a batch, not the whole context. Batch
    # invariance takes a stream of cells per sequence, sliding layers whole: the CPU flash-attention kernel
    # walks a sequence's cells in cell order, and in a shared pool (or a sliding window's ring) a
    # sequence's later tokens land in holes left behind, which changes its rounding.
    p.kv_unified = unified
    p.swa_full = not unified
    p.n_threads = threads
    p.n_threads_batch = threads if opts.num_thread else max(threads, os.cpu_count() or 1)
    p.type_k = p.type_v = KV_TYPES[opts.kv_cache_type]
    # Auto turns flash attention on wherever the device supports it (CPU included). Besides speed, a
    # position's logits then depend only on its own sequence's cells, not on the other rows of the batch.
    p.flash_attn_type = flash_attn_type(opts.flash_attn)
    p.no_perf = True
    return p


def flash_attn_type(flash_attn: bool | None) -> int:
    """LoadOptions.flash_attn as llama.cpp's `flash_attn_type` (text contexts and libmtmd's alike)."""
    lib = _lib()
    return {
        None: lib.LLAMA_FLASH_ATTN_TYPE_AUTO,
        True: lib.LLAMA_FLASH_ATTN_TYPE_ENABLED,
        False: lib.LLAMA_FLASH_ATTN_TYPE_DISABLED,
    }[flash_attn]


def create_context(model: Any, params: Any) -> Any:
    from llama_cpp import _internals

    try:
        return _internals.LlamaContext(model=model, params=params, verbose=False)
    except ValueError as e:
        raise LocalrtError(f"llama.cpp could not create a context of {params.n_ctx} tokens: {e}") from None


class LoraAdapters:
    """LoRA adapter GGUFs loaded over a model's weights (`model`: an `_internals.LlamaModel`), applied at
    scale 1.0 in their order to each context made on those weights, as llama-server's `--lora` does; a
    request may ask for other scales (`scales_for`), which the step loop sets on its context (`apply`).
    They must be closed before the model, after the contexts that use them."""

    def __init__(self, model: Any, paths: Sequence[Path]) -> None:
        self.lib = _lib()
        self.handles: list[Any] = []
        for path in paths:
            check_model_file(path, "adapter")
            handle = self.lib.llama_adapter_lora_init(model.model, str(path).encode())
            if not handle:
                self.close()
                raise LocalrtError(
                    f"llama.cpp could not load the LoRA adapter {path.name}: it is not an adapter for these "
                    "weights (another architecture or shape)"
                )
            self.handles.append(handle)
        n = len(self.handles)
        self._array = (self.lib.llama_adapter_lora_p_ctypes * n)(*self.handles)
        self.default: tuple[float, ...] = (1.0,) * n

    def scales_for(self, scales: Sequence[float] | None) -> tuple[float, ...]:
        """A request's scale set (None: the default, every adapter at 1.0); one scale per adapter."""
        if scales is None:
            return self.default
        if len(scales) != len(self.handles):
            raise LocalrtError(
                f"lora: {len(scales)} scales for a model with {len(self.handles)} LoRA adapters"
            )
        return tuple(float(s) for s in scales)

    def apply(self, ctx: Any, scales: Sequence[float] | None = None) -> None:
        """Set the adapters on a context (`ctx`: a raw llama_context pointer) at `scales` (None: the
        default); nothing without adapters. llama.cpp compares with what the context has and does nothing
        when equal; a change makes its next decode reserve the compute graph again."""
        if not self.handles:
            return
        values = (ctypes.c_float * len(self.handles))(*self.scales_for(scales))
        if self.lib.llama_set_adapters_lora(ctx, self._array, len(self.handles), values) != 0:
            raise LocalrtError("llama.cpp could not apply the LoRA adapters to a context")

    def close(self) -> None:
        for handle in self.handles:
            self.lib.llama_adapter_lora_free(handle)
        self.handles = []


class Batch:
    """A `llama_batch` of up to `capacity` entries, each one token of one sequence at one position."""

    def __init__(self, capacity: int) -> None:
        self.lib = _lib()
        self.capacity = capacity
        self.raw = self.lib.llama_batch_init(capacity, 0, 1)
        self.tokens = np.ctypeslib.as_array(self.raw.token, shape=(capacity,))
        self.pos = np.ctypeslib.as_array(self.raw.pos, shape=(capacity,))
        self.n_seq_id = np.ctypeslib.as_array(self.raw.n_seq_id, shape=(capacity,))
        self.logits = np.ctypeslib.as_array(self.raw.logits, shape=(capacity,))
        self.n_seq_id[:] = 1
        self._seq_rows = [self.raw.seq_id[i] for i in range(capacity)]
        self.n = 0

    def clear(self) -> None:
        self.n = 0

    @property
    def room(self) -> int:
        return self.capacity - self.n

    def add(self, tokens: Sequence[int], pos0: int, seq_id: int, output: bool | Sequence[bool]) -> int:
        """Append tokens at positions pos0.. of seq_id; returns the batch index of the first one."""
        start, count = self.n, len(tokens)
        end = start + count
        if end > self.capacity:
            raise LocalrtError("llama.cpp batch overflow")
        if count == 1:  # a decode row: item writes, not a numpy slice assignment (several per token)
            self.tokens[start], self.pos[start] = tokens[0], pos0
            self.logits[start] = output if isinstance(output, bool) else output[0]
            self._seq_rows[start][0] = seq_id
        else:
            self.tokens[start:end] = tokens
            self.pos[start:end] = np.arange(pos0, pos0 + count, dtype=np.int32)
            self.logits[start:end] = output if not isinstance(output, bool) else int(output)
            for i in range(start, end):
                self._seq_rows[i][0] = seq_id
        self.n = end
        return start

    def decode(self, ctx: Any) -> int:
        self.raw.n_tokens = self.n
        return int(self.lib.llama_decode(ctx, self.raw))

    def close(self) -> None:
        if self.raw is not None:
            self.lib.llama_batch_free(self.raw)
            self.raw = None


class EndTokens:
    """llama.cpp's end-of-generation test of a vocabulary (`vocab`: a llama_vocab pointer), asked once
    per token and remembered: a dictionary lookup per generated token, not a call into C through ctypes."""

    def __init__(self, vocab: Any) -> None:
        self.lib, self.vocab = _lib(), vocab
        self._ends: dict[int, bool] = {}

    def __call__(self, token: int) -> bool:
        end = self._ends.get(token)
        if end is None:
            end = self._ends[token] = bool(self.lib.llama_vocab_is_eog(self.vocab, token))
        return end


def logits_row(ctx: Any, row: int, n_vocab: int) -> np.ndarray:
    """Batch row `row`'s logits, a view into llama.cpp's buffer until the next decode. Read once per
    generated token right after a decode has pushed the interpreter's objects out of the caches, so it
    touches few of them: the row's address as an int, not a float pointer to cast (benchmarks/README.md,
    "Measurements once kept in code comments")."""
    return float_array(_logits_at(ctx, row), (n_vocab,), f"llama.cpp has no logits for batch row {row}")


def make_sampler(
    model: Any, n_ctx: int, sp: SamplingParams, fmt: str | dict[str, Any] | None, prompt: Sequence[int]
) -> Any:
    """llama.cpp's sampler chain for one request: penalties, grammar, then greedy / mirostat / top-k.. dist."""
    from llama_cpp import _internals

    lib = _lib()
    n_vocab = model.n_vocab()
    last_n = sp.penalty_window(n_ctx)
    if sp.greedy and last_n <= 0 and fmt is None:
        return ArgmaxSampler(n_vocab)
    chain = _internals.LlamaSampler()
    if last_n > 0:
        chain.add_penalties(n_vocab, last_n, sp.repeat_penalty, sp.frequency_penalty, sp.presence_penalty)
        # llama-server counts the prompt in the penalty window too; the grammar (added after) must not
        for token in prompt[-last_n:]:
            chain.accept(token)
    if fmt is not None:
        try:
            sampler = grammar_sampler(lib, model.vocab, fmt)
        except LocalrtError:
            chain.close()
            raise
        lib.llama_sampler_chain_add(chain.sampler, sampler)
    seed = lib.LLAMA_DEFAULT_SEED if sp.seed < 0 else sp.seed & 0xFFFFFFFF
    if sp.greedy:
        chain.add_greedy()
    elif sp.mirostat in (1, 2):
        chain.add_temp(sp.temperature)
        if sp.mirostat == 1:
            chain.add_mirostat(n_vocab, seed, sp.mirostat_tau, sp.mirostat_eta, 100)
        else:
            chain.add_mirostat_v2(seed, sp.mirostat_tau, sp.mirostat_eta)
    else:
        _add_truncations(chain, sp)
        chain.add_temp(sp.temperature)
        chain.add_dist(seed)
    return GrammarChain(chain, lib, n_vocab) if fmt is not None else chain


def _add_truncations(chain: Any, sp: SamplingParams) -> None:
    if sp.top_k > 0:
        chain.add_top_k(sp.top_k)
    if sp.typical_p < 1.0:
        chain.add_typical(sp.typical_p, 1)
    if sp.top_p < 1.0:
        chain.add_top_p(sp.top_p, 1)
    if sp.min_p > 0.0:
        chain.add_min_p(sp.min_p, 1)


class GrammarChain:
    """A chain holding a grammar, applied and accepted in two calls (llama_sampler_sample makes both in
    one): when the grammar allows no token at all the chain still picks one, and llama.cpp aborts the
    process on accepting it, so that pick ends the request instead (GrammarDeadEnd)."""

    def __init__(self, chain: Any, lib: Any, n_vocab: int) -> None:
        self.chain = chain
        self.lib = lib
        self.n_vocab = n_vocab
        self.candidates = Candidates(lib, n_vocab)

    def pick(self, ctx: Any, row: int) -> int:
        self.candidates.apply(self.chain.sampler, logits_row(ctx, row, self.n_vocab))
        token = self.candidates.selected()
        self.lib.llama_sampler_accept(self.chain.sampler, token)
        return token

    def close(self) -> None:
        self.chain.close()


class ArgmaxSampler:
    """A plain greedy request's sampler (no penalties, no grammar): the first highest logit of the row, the
    token llama.cpp's greedy sampler picks, without the chain building its candidate array (a copy of the
    whole vocabulary's logits per token)."""

    def __init__(self, n_vocab: int) -> None:
        self.n_vocab = n_vocab
        # views by the row's address: llama.cpp keeps its logits buffer from decode to decode, and a view
        # made once skips the ctypes and numpy calls of making one per token (their cost is in
        # benchmarks/README.md); any address llama.cpp hands back holds a whole row of its buffer
        self._views: dict[int, np.ndarray] = {}

    def pick(self, ctx: Any, row: int) -> int:
        address = _logits_at(ctx, row)
        view = self._views.get(address)
        if view is None:
            if len(self._views) >= 64:  # the buffer moved, or rows of many sizes of step: start again
                self._views.clear()
            view = self._views[address] = logits_row(ctx, row, self.n_vocab)
        return int(view.argmax())

    def close(self) -> None:
        pass  # nothing is held


def sample(chain: Any, ctx: Any, row: int) -> int:
    """Draw from batch row `row` (the chain accepts the token, advancing its grammar and penalties)."""
    if isinstance(chain, (ArgmaxSampler, GrammarChain)):
        return chain.pick(ctx, row)
    return int(_lib().llama_sampler_sample(chain.sampler, ctx, row))


def token_piece(
    lib: Any, vocab: Any, token: int, special: bool, cache: dict[tuple[int, bool], bytes]
) -> bytes:
    """A token's bytes (a piece may be part of a UTF-8 character), memoized in `cache`."""
    key = (token, special)
    cached = cache.get(key)
    if cached is not None:
        return cached
    buf = ctypes.create_string_buffer(256)  # per call: several threads (slots, engines) read pieces at once
    n = lib.llama_token_to_piece(vocab, token, buf, len(buf), 0, special)
    if n < 0:
        buf = ctypes.create_string_buffer(-n)
        n = lib.llama_token_to_piece(vocab, token, buf, len(buf), 0, special)
    out = buf.raw[:n]
    cache[key] = out
    return out
