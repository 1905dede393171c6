"""Activations of a model over a text, collected as llama-imatrix collects them.

llama.cpp runs the model; its scheduler's eval callback (the hook llama-imatrix uses) hands over every
matrix multiplication by a `blk.*` weight whose activation batch has at least 16 rows, and every
expert multiplication (MUL_MAT_ID). For each, the squared activations are added into that weight's
per-column sums, row after row in float32 as llama-imatrix adds them, and the rows are counted (per
expert for MoE). The text is cut as llama-imatrix cuts it: tokens with BOS, chunks of `ctx` tokens
(each chunk's first token replaced by BOS when the vocabulary adds one), `max(1, 2048 // ctx)` chunks
decoded together as separate sequences; the perplexity of the second half of each chunk is measured.

The same library, the same graph and the same kernels as llama-imatrix give the same activations, so
the sums agree with llama-imatrix's to float rounding (tests/test_imatrix_oracle.py compares them).
What the sums become, an importance matrix, is the runtime's (`localrt/runtime/calibration.py`).
"""

from __future__ import annotations

import ctypes
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from dataclasses import field
from pathlib import Path
from typing import Any

import numpy as np

from localrt import config
from localrt.backends.devices import declare
from localrt.errors import LocalrtError

F32 = np.float32
N_BATCH = 2048  # llama-imatrix's default batch: 2048 // ctx chunks run side by side
MIN_ROWS = 16  # llama-imatrix skips smaller activation batches
GGML_TYPE_F32 = 0


class _Tensor(ctypes.Structure):
    """The head of ggml.h's `struct ggml_tensor` (GGML_MAX_DIMS 4, GGML_MAX_OP_PARAMS 64, GGML_MAX_SRC 10)."""


_Tensor._fields_ = [
    ("type", ctypes.c_int),
    ("buffer", ctypes.c_void_p),
    ("ne", ctypes.c_int64 * 4),
    ("nb", ctypes.c_size_t * 4),
    ("op", ctypes.c_int),
    ("op_params", ctypes.c_int32 * 16),
    ("flags", ctypes.c_int32),
    ("src", ctypes.POINTER(_Tensor) * 10),
    ("view_src", ctypes.POINTER(_Tensor)),
    ("view_offs", ctypes.c_size_t),
    ("data", ctypes.c_void_p),
    ("name", ctypes.c_char * 64),
]


def _ggml_base() -> ctypes.CDLL:
    import llama_cpp

    lib_dir = Path(llama_cpp.__file__).parent / "lib"
    found = sorted(lib_dir.glob("libggml-base.*"))
    if not found:
        raise LocalrtError(f"llama.cpp's libggml-base was not found in {lib_dir}")
    lib = ctypes.CDLL(str(found[0]))
    declare(lib.ggml_op_name, ctypes.c_char_p, ctypes.c_int)
    declare(lib.ggml_nbytes, ctypes.c_size_t, ctypes.c_void_p)
    declare(lib.ggml_backend_buffer_is_host, ctypes.c_bool, ctypes.c_void_p)
    declare(
        lib.ggml_backend_tensor_get, None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t
    )
    return lib


def _op_ids(lib: ctypes.CDLL) -> tuple[int, int]:
    """GGML_OP_MUL_MAT and GGML_OP_MUL_MAT_ID of this build, checked by name (the enum may move)."""
    for mm in range(16, 64):
        if lib.ggml_op_name(mm) == b"MUL_MAT" and lib.ggml_op_name(mm + 1) == b"MUL_MAT_ID":
            return mm, mm + 1
    raise LocalrtError("this llama.cpp build has no MUL_MAT op where expected; cannot collect an imatrix")


def weight_name(raw: bytes) -> str:
    """Strip backend decorations: 'CUDA0#blk.0.attn_k.weight#0' -> 'blk.0.attn_k.weight'."""
    name = raw.decode(errors="replace")
    if "#" in name:
        name = name.split("#", 2)[1]
    return name


@dataclass
class Collector:
    """Sums of squared activations per weight, accumulated as llama-imatrix's collect_imatrix does."""

    chunk_size: int
    lib: ctypes.CDLL
    sums: dict[str, np.ndarray] = field(default_factory=dict)  # (n_mat, ne0) float32
    counts: dict[str, np.ndarray] = field(default_factory=dict)  # (n_mat,) int64
    last_chunk: int = 0
    error: BaseException | None = None

    def __post_init__(self) -> None:
        self.mul_mat, self.mul_mat_id = _op_ids(self.lib)

    def callback(self, t_ptr: int, ask: bool, _user: Any) -> bool:
        try:
            t = ctypes.cast(t_ptr, ctypes.POINTER(_Tensor)).contents
            if ask:
                return self._wanted(t)
            if t.op == self.mul_mat_id:
                self._collect_experts(t)
            else:
                self._collect_dense(t)
            return True
        except BaseException as e:  # never unwind through C: stop the graph and report afterwards
            self.error = e
            return False

    def _wanted(self, t: _Tensor) -> bool:
        if t.op == self.mul_mat_id:
            return True
        if t.op != self.mul_mat:
            return False
        src1 = t.src[1].contents
        if src1.ne[1] < MIN_ROWS or src1.type != GGML_TYPE_F32:
            return False
        return weight_name(t.src[0].contents.name).startswith("blk.")

    def _read(self, t: _Tensor, dtype: Any) -> np.ndarray:
        """The tensor's bytes as a flat array (copied from device memory when not on the host)."""
        ptr = ctypes.addressof(t)
        n = self.lib.ggml_nbytes(ptr)
        if t.buffer and not self.lib.ggml_backend_buffer_is_host(t.buffer):
            buf = np.empty(n, np.uint8)
            self.lib.ggml_backend_tensor_get(ptr, buf.ctypes.data, 0, n)
            return buf.view(dtype)
        return np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(t.data)).view(dtype)

    def _rows(self, src1: _Tensor) -> np.ndarray:
        """src1 as a strided [ne3, ne2, ne1, ne0] float32 view."""
        flat = self._read(src1, np.uint8)
        shape = tuple(int(src1.ne[i]) for i in (3, 2, 1, 0))
        strides = tuple(int(src1.nb[i]) for i in (3, 2, 1, 0))
        return np.lib.stride_tricks.as_strided(flat.view(F32), shape=shape, strides=strides)

    def _entry(self, name: str, ne0: int, n_mat: int) -> tuple[np.ndarray, np.ndarray]:
        if name not in self.sums:
            self.sums[name] = np.zeros((n_mat, ne0), F32)
            self.counts[name] = np.zeros(n_mat, np.int64)
        sums = self.sums[name]
        if sums.shape != (n_mat, ne0):
            raise LocalrtError(f"inconsistent activation size for {name}: {sums.shape} vs {(n_mat, ne0)}")
        return sums, self.counts[name]

    def _collect_dense(self, t: _Tensor) -> None:
        src0, src1 = t.src[0].contents, t.src[1].contents
        name = weight_name(src0.name)
        ne02, ne03 = int(src0.ne[2]), int(src0.ne[3])
        n_mat = ne02 * ne03
        sums, counts = self._entry(name, int(src1.ne[0]), n_mat)
        x = self._rows(src1)
        for i3 in range(x.shape[0]):
            for i2 in range(x.shape[1]):
                m = (i3 % ne03) * ne02 + (i2 % ne02)
                sums[m] = _accumulate(sums[m], x[i3, i2])
        if not np.isfinite(sums).all():
            raise LocalrtError(f"non-finite activations in {name}")
        counts += (x.shape[0] * x.shape[1] * x.shape[2]) // n_mat
        self._advance(counts)

    def _collect_experts(self, t: _Tensor) -> None:
        src0, src1, ids_t = t.src[0].contents, t.src[1].contents, t.src[2].contents
        name = weight_name(src0.name)
        n_as = int(src0.ne[2])
        sums, counts = self._entry(name, int(src1.ne[0]), n_as)
        x = self._rows(src1)[0]  # [n_tokens, ne1, ne0]
        raw = self._read(ids_t, np.uint8)
        n_ids, n_tokens = int(ids_t.ne[0]), int(ids_t.ne[1])
        ids = np.lib.stride_tricks.as_strided(
            raw.view(np.int32), shape=(n_ids, n_tokens), strides=(int(ids_t.nb[0]), int(ids_t.nb[1]))
        )
        # llama-imatrix walks idx (outer) then token (inner): that is the order each expert's sum sees
        order_ex = ids.reshape(-1)
        if order_ex.min(initial=0) < 0 or order_ex.max(initial=0) >= n_as:
            raise LocalrtError(f"expert id out of range in {name}")
        idx = np.repeat(np.arange(n_ids), n_tokens)
        tok = np.tile(np.arange(n_tokens), n_ids)
        rows = x[tok, idx % x.shape[1]]
        for ex in np.unique(order_ex):
            sel = order_ex == ex
            sums[ex] = _accumulate(sums[ex], rows[sel])
            counts[ex] += int(sel.sum())
            if not np.isfinite(sums[ex]).all():
                raise LocalrtError(f"non-finite activations in {name}")
        self._advance(counts)

    def _advance(self, counts: np.ndarray) -> None:
        self.last_chunk = max(self.last_chunk, int(counts.max()) // self.chunk_size)


def _accumulate(acc: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """acc + rows[0]^2 + rows[1]^2 + ... left to right in float32 (numpy adds an outer axis in order)."""
    stacked = np.empty((len(rows) + 1, acc.shape[0]), F32)
    stacked[0] = acc
    np.multiply(rows, rows, out=stacked[1:])
    return np.add.reduce(stacked, axis=0)


@dataclass
class Activations:
    """What one run over the text collected: per weight, the sums of squared activations (n_mat, ne0)
    and the rows counted (n_mat,), with the chunking that produced them and the text's perplexity."""

    sums: dict[str, np.ndarray]
    counts: dict[str, np.ndarray]
    chunk_count: int
    chunk_size: int
    perplexity: float
    ppl_error: float
    tokens: int
    chunks: int
    seconds: float


def collect(
    model_path: Path,
    text: str,
    ctx: int = 512,
    chunks: int = -1,
    threads: int = 0,
    progress: Callable[[int, int, float], None] | None = None,
) -> Activations:
    """Run `model_path` over `text` in chunks of `ctx` and collect its activations."""
    import llama_cpp

    if ctx < 8:
        raise LocalrtError("--ctx must be at least 8")
    if text.endswith("\n"):
        text = text[:-1]  # llama.cpp's -f drops one trailing newline
    lib = _ggml_base()
    from llama_cpp import _logger

    _logger.set_verbose(config.debug())  # llama.cpp's errors only
    llama_cpp.llama_backend_init()
    mparams = llama_cpp.llama_model_default_params()
    model = llama_cpp.llama_model_load_from_file(str(model_path).encode(), mparams)
    if not model:
        raise LocalrtError(f"llama.cpp could not load {model_path}")
    try:
        return _run(llama_cpp, lib, model, text, ctx, chunks, threads, progress)
    finally:
        llama_cpp.llama_model_free(model)


def _tokenize(llama_cpp: Any, vocab: Any, text: str) -> list[int]:
    raw = text.encode()
    cap = len(raw) + 16
    buf = (llama_cpp.llama_token * cap)()
    n = llama_cpp.llama_tokenize(vocab, raw, len(raw), buf, cap, True, False)
    if n < 0:
        cap = -n
        buf = (llama_cpp.llama_token * cap)()
        n = llama_cpp.llama_tokenize(vocab, raw, len(raw), buf, cap, True, False)
    return list(buf[:n])


def _run(
    llama_cpp: Any,
    lib: ctypes.CDLL,
    model: Any,
    text: str,
    ctx: int,
    chunks: int,
    threads: int,
    progress: Callable[[int, int, float], None] | None,
) -> Activations:
    vocab = llama_cpp.llama_model_get_vocab(model)
    tokens = _tokenize(llama_cpp, vocab, text)
    if len(tokens) < 2 * ctx:
        raise LocalrtError(
            f"the text tokenizes to {len(tokens)} tokens; an imatrix with --ctx {ctx} needs at least {2 * ctx}"
        )
    n_chunk = len(tokens) // ctx if chunks < 0 else min(chunks, len(tokens) // ctx)
    n_seq = max(1, N_BATCH // ctx)
    n_batch = min(N_BATCH, n_seq * ctx)
    collector = Collector(ctx, lib)
    cb = llama_cpp.ggml_backend_sched_eval_callback(collector.callback)
    cparams = llama_cpp.llama_context_default_params()
    cparams.n_ctx = n_seq * ctx
    cparams.n_batch = n_batch
    cparams.n_seq_max = n_seq
    cparams.n_threads = cparams.n_threads_batch = threads or os.cpu_count() or 1
    cparams.cb_eval = cb
    cparams.cb_eval_user_data = None
    lctx = llama_cpp.llama_init_from_model(model, cparams)
    if not lctx:
        raise LocalrtError("llama.cpp could not create a context for the imatrix run")
    batch = llama_cpp.llama_batch_init(n_batch, 0, n_seq)
    start = time.monotonic()
    ppl = _Perplexity(llama_cpp.llama_vocab_n_tokens(vocab))
    try:
        add_bos = llama_cpp.llama_vocab_get_add_bos(vocab)
        bos = llama_cpp.llama_vocab_bos(vocab)
        for i in range(0, n_chunk, n_seq):
            n_seq_batch = min(n_seq, n_chunk - i)
            llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(lctx), True)
            logits = _decode_group(llama_cpp, lctx, batch, tokens, i, n_seq_batch, ctx, n_batch, add_bos, bos)
            if collector.error is not None:
                raise collector.error
            for seq in range(n_seq_batch):
                first = (i + seq) * ctx
                ppl.add(logits[seq], tokens[first : first + ctx])
            if progress:
                progress(i + n_seq_batch, n_chunk, time.monotonic() - start)
    finally:
        llama_cpp.llama_batch_free(batch)
        llama_cpp.llama_free(lctx)
    value, err = ppl.estimate()
    return Activations(
        sums=collector.sums,
        counts=collector.counts,
        chunk_count=collector.last_chunk,
        chunk_size=ctx,
        perplexity=value,
        ppl_error=err,
        tokens=n_chunk * ctx,
        chunks=n_chunk,
        seconds=time.monotonic() - start,
    )


def _decode_group(
    llama_cpp: Any,
    lctx: Any,
    batch: Any,
    tokens: list[int],
    i: int,
    n_seq_batch: int,
    ctx: int,
    n_batch: int,
    add_bos: bool,
    bos: int,
) -> list[np.ndarray]:
    """Decode chunks i .. i+n_seq_batch-1 as sequences 0.. (in batches of n_batch positions); their logits."""
    n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(llama_cpp.llama_get_model(lctx)))
    out: list[list[np.ndarray]] = [[] for _ in range(n_seq_batch)]
    for j in range(math.ceil(ctx / n_batch)):
        size = min(ctx - j * n_batch, n_batch)
        k = 0
        for seq in range(n_seq_batch):
            base = (i + seq) * ctx + j * n_batch
            for p in range(size):
                tok = bos if (add_bos and j == 0 and p == 0) else tokens[base + p]
                batch.token[k] = tok
                batch.pos[k] = j * n_batch + p
                batch.n_seq_id[k] = 1
                batch.seq_id[k][0] = seq
                batch.logits[k] = True
                k += 1
        batch.n_tokens = k
        if llama_cpp.llama_decode(lctx, batch) != 0:
            raise LocalrtError("llama.cpp failed to evaluate a chunk")
        ptr = llama_cpp.llama_get_logits(lctx)
        flat = np.ctypeslib.as_array(ptr, shape=(k * n_vocab,)).reshape(k, n_vocab)
        for seq in range(n_seq_batch):
            out[seq].append(flat[seq * size : (seq + 1) * size].copy())
    return [np.concatenate(parts) for parts in out]


class _Perplexity:
    """llama-imatrix's estimate: the second half of each chunk, in double precision."""

    def __init__(self, n_vocab: int) -> None:
        self.n_vocab = n_vocab
        self.nll = self.nll2 = 0.0
        self.count = 0

    def add(self, logits: np.ndarray, chunk: list[int]) -> None:
        n = len(chunk)
        first = n // 2
        lg = logits[first : n - 1].astype(np.float64)
        lg -= lg.max(axis=1, keepdims=True)
        logp = lg[np.arange(len(lg)), np.asarray(chunk[first + 1 : n])] - np.log(np.exp(lg).sum(axis=1))
        self.nll -= float(logp.sum())
        self.nll2 += float((logp * logp).sum())
        self.count += len(lg)

    def estimate(self) -> tuple[float, float]:
        if not self.count:
            return float("nan"), float("nan")
        nll, nll2 = self.nll / self.count, self.nll2 / self.count
        var = nll2 - nll * nll
        ppl = math.exp(nll)
        err = math.sqrt(var / (self.count - 1)) * ppl if var > 0 and self.count > 1 else float("nan")
        return ppl, err
