"""llama.cpp backend on llama-cpp-python's low-level API (model, context, batch, sampler chain).

We drive the decode loop ourselves rather than `Llama.create_completion` so that we control
prompt-prefix reuse, speculative verification (several positions in one batch, then a KV rollback)
and per-token logprobs. Parallel slots (LOCALRT_NUM_PARALLEL, default 1) share one set of weights; each
slot is a context of its own holding one sequence, and a request takes the free slot whose cache already
holds the longest prefix of its prompt, so a conversation keeps its prefix reuse while others run.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from localrt.backends.base import (
    IMAGE_TOKEN,
    CancelToken,
    Capabilities,
    DoneEvent,
    Event,
    GenerateRequest,
    LoadOptions,
    SamplingParams,
    ScoreResult,
    TextAssembler,
    Timings,
    TokenLogprob,
    TopLogprob,
    log_softmax,
    run_in_thread_stream,
)
from localrt.backends.grammar import grammar_sampler
from localrt.backends.lookup import LookupIndex
from localrt.backends.mtmd import MediaPrompt, Projector  # issue 19: images through libmtmd
from localrt.backends.rerank import Reranker, is_reranker  # issue 19: rank pooling
from localrt.backends.vocab import token_piece
from localrt.errors import LocalrtError, OptionError

NAME = "llama.cpp"
PIP_HINT = "pip install 'localrt[llama]'  (or: pip install llama-cpp-python)"
KV_TYPES = {"f32": 0, "f16": 1, "q4_0": 2, "q8_0": 8, "bf16": 30}
QUANTIZED_KV = {"q4_0", "q8_0"}
DEFAULT_NUM_DRAFT = {"draft": 4, "lookup": 8}
MAX_VERIFY_BATCH = 48  # longest first: longer matches predict better

_init_lock = threading.Lock()
_initialized = False


def _lib() -> Any:
    """Import llama_cpp once, quietly (only errors reach stderr), and initialise the ggml backend."""
    global _initialized
    import llama_cpp

    with _init_lock:
        if not _initialized:
            from llama_cpp import _logger

            _logger.set_verbose(False)
            llama_cpp.llama_backend_init()
            _initialized = True
    return llama_cpp


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


class LlamaCppBackend:
    name: ClassVar[str] = NAME

    @classmethod
    def availability(cls) -> tuple[bool, str]:
        if importlib.util.find_spec("llama_cpp") is None:
            return False, f"llama-cpp-python is not installed; {PIP_HINT}"
        return True, ""

    @classmethod
    def capabilities(cls) -> Capabilities:
        devices: tuple[str, ...] = ("cpu",)
        if gpu_offload_supported():
            devices = ("cpu", "metal") if sys.platform == "darwin" else ("cpu", "gpu")
        return Capabilities(
            chat=True,
            embedding=True,
            score=True,
            grammar=True,
            speculative=frozenset({"draft", "lookup"}),
            kv_cache_types=tuple(KV_TYPES),
            devices=devices,
            parallel_slots=1,
        )

    @classmethod
    def load(cls, path: Path | str, opts: LoadOptions) -> LlamaCppModel:
        return LlamaCppModel(Path(path), opts)


# ---- one model + one context, used for the target and for a draft model ------------------------
class _Runner:
    """A llama.cpp model with one context and a record of the tokens its KV cache holds."""

    def __init__(
        self, path: Path, opts: LoadOptions, n_ctx: int | None = None, share_model_of: _Runner | None = None
    ) -> None:
        llama_cpp = _lib()
        from llama_cpp import _internals

        self.lib = llama_cpp
        if opts.kv_cache_type not in KV_TYPES:
            raise OptionError(
                f"kv_cache_type {opts.kv_cache_type!r} is not supported by the llama.cpp backend "
                f"(supported: {', '.join(KV_TYPES)})"
            )
        # parallel slots: one set of weights, one context (KV cache) per slot
        self.owns_model = share_model_of is None
        if share_model_of is not None:
            self.model = share_model_of.model
            self.on_gpu = share_model_of.on_gpu
        else:
            model_params = llama_cpp.llama_model_default_params()
            use_gpu = gpu_offload_supported()
            n_gpu = opts.num_gpu if use_gpu else 0
            model_params.n_gpu_layers = 0x7FFFFFFF if n_gpu < 0 else n_gpu
            self.on_gpu = use_gpu and n_gpu != 0
            if not path.is_file():
                raise LocalrtError(f"model file not found: {path}")
            try:
                self.model = _internals.LlamaModel(path_model=str(path), params=model_params, verbose=False)
            except ValueError as e:
                raise LocalrtError(f"llama.cpp could not load the model: {e}") from None
        self.vocab = self.model.vocab
        self.n_vocab = self.model.n_vocab()
        self.n_ctx_train = self.model.n_ctx_train()
        want_ctx = n_ctx or opts.num_ctx
        self.n_ctx = max(16, min(want_ctx, self.n_ctx_train) if self.n_ctx_train > 0 else want_ctx)
        self.n_batch = max(1, min(opts.num_batch, self.n_ctx))
        threads = opts.num_thread or default_threads()
        ctx_params = llama_cpp.llama_context_default_params()
        ctx_params.n_ctx = self.n_ctx
        ctx_params.n_batch = self.n_batch
        ctx_params.n_ubatch = self.n_batch
        ctx_params.n_threads = threads
        ctx_params.n_threads_batch = threads if opts.num_thread else max(threads, os.cpu_count() or 1)
        ctx_params.type_k = KV_TYPES[opts.kv_cache_type]
        ctx_params.type_v = KV_TYPES[opts.kv_cache_type]
        flash = opts.flash_attn
        if flash is False and opts.kv_cache_type in QUANTIZED_KV:
            raise OptionError(f"kv_cache_type {opts.kv_cache_type} needs flash attention")
        # Auto turns flash attention on wherever the device supports it (CPU included). Besides speed, it
        # makes a position's logits independent of the batch it was decoded in, so prefix reuse and
        # speculative verification give exactly the logits of plain one-token decoding.
        ctx_params.flash_attn_type = {
            None: llama_cpp.LLAMA_FLASH_ATTN_TYPE_AUTO,
            True: llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED,
            False: llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED,
        }[flash]
        ctx_params.no_perf = True
        self.threads = threads
        self.ctx_params = ctx_params
        try:
            self.ctx = _internals.LlamaContext(model=self.model, params=ctx_params, verbose=False)
        except ValueError as e:
            if self.owns_model:
                self.model.close()
            raise LocalrtError(f"llama.cpp could not create a context of {self.n_ctx} tokens: {e}") from None
        self.batch = _internals.LlamaBatch(n_tokens=self.n_batch, embd=0, n_seq_max=1, verbose=False)
        self.evaluated: list[Any] = []  # exactly the cells in the KV cache: token ids, mtmd ImageCells
        # mtmd: (cell count after an image, positions it did not advance): nonzero for M-RoPE images only
        self.pos_gaps: list[tuple[int, int]] = []
        self._piece_cache: dict[tuple[int, bool], bytes] = (
            share_model_of._piece_cache if share_model_of else {}
        )

    # -- KV cache bookkeeping --
    def common_prefix(self, tokens: Sequence[int]) -> int:
        n = 0
        for a, b in zip(self.evaluated, tokens):
            if a != b:
                break
            n += 1
        return n

    # mtmd: positions differ from cell counts after an image of an M-RoPE model
    def position(self, n: int) -> int:
        return n - sum(gap for end, gap in self.pos_gaps if end <= n)

    def truncate(self, n: int) -> None:
        if n < len(self.evaluated):
            if not self.ctx.kv_cache_seq_rm(0, self.position(n), -1):
                # a model whose memory cannot drop a tail (recurrent): start over
                self.ctx.kv_cache_clear()
                n = 0
            del self.evaluated[n:]
            self.pos_gaps = [(end, gap) for end, gap in self.pos_gaps if end <= n]

    def decode(
        self,
        tokens: Sequence[int],
        all_logits: bool = False,
        on_chunk: Callable[[int, int], None] | None = None,
    ) -> None:
        """Append tokens to the sequence. Logits: the last position, or every position of the batch."""
        if len(self.evaluated) + len(tokens) > self.n_ctx:
            raise LocalrtError(f"context length of {self.n_ctx} tokens exceeded")
        n_past = self.position(len(self.evaluated))
        for start in range(0, len(tokens), self.n_batch):
            chunk = tokens[start : start + self.n_batch]
            self.batch.set_batch(batch=chunk, n_past=n_past + start, logits_all=all_logits)
            try:
                self.ctx.decode(self.batch)
            except RuntimeError as e:
                raise LocalrtError(f"llama.cpp decode failed: {e}") from None
            self.evaluated.extend(chunk)
            if on_chunk is not None:
                on_chunk(start, len(chunk))

    def logits_row(self, row: int) -> np.ndarray:
        ptr = self.lib.llama_get_logits_ith(self.ctx.ctx, row)
        if not ptr:
            raise LocalrtError(f"llama.cpp has no logits for batch row {row}")
        return np.ctypeslib.as_array(ptr, shape=(self.n_vocab,))

    # -- vocabulary --
    def piece(self, token: int, special: bool = False) -> bytes:
        return token_piece(self.lib, self.vocab, token, special, self._piece_cache)

    def is_eog(self, token: int) -> bool:
        return bool(self.lib.llama_vocab_is_eog(self.vocab, token))

    def close(self) -> None:
        owned = getattr(self, "model", None) if getattr(self, "owns_model", True) else None
        for obj in (getattr(self, "batch", None), getattr(self, "ctx", None), owned):
            if obj is not None:
                obj.close()


# ---- speculative proposers ---------------------------------------------------------------------
LookupProposer = LookupIndex  # the llama.cpp loop proposes from one history


class DraftProposer:
    """A small model with the same vocabulary drafts k tokens greedily."""

    def __init__(self, runner: _Runner) -> None:
        self.runner = runner

    def propose(self, history: Sequence[int], k: int) -> list[int]:
        r = self.runner
        if len(history) + k >= r.n_ctx:
            return []
        keep = r.common_prefix(history)
        if keep >= len(history):
            keep = len(history) - 1  # re-evaluate the last token to get fresh logits
        r.truncate(keep)
        r.decode(history[keep:])
        out: list[int] = []
        for i in range(k):
            token = int(np.argmax(r.logits_row(-1)))
            if r.is_eog(token):
                break
            out.append(token)
            if i < k - 1:
                r.decode([token])
        return out


# ---- the loaded model ----------------------------------------------------------------------------
@dataclass
class _Slot:
    """One context of a loaded model, serving one request at a time."""

    runner: _Runner
    draft: _Runner | None = None  # its own draft context, when speculating with a draft model
    busy: bool = False
    last_used: float = 0.0


class LlamaCppModel:
    backend_name = NAME

    def __init__(self, path: Path, opts: LoadOptions) -> None:
        t0 = time.perf_counter_ns()
        self.path = path
        self.opts = opts
        self.capabilities = LlamaCppBackend.capabilities()
        self._main = _Runner(path, opts)
        self._slots = [_Slot(self._main)]
        try:
            for _ in range(max(1, opts.num_parallel) - 1):
                self._slots.append(_Slot(_Runner(path, opts, share_model_of=self._main)))
        except BaseException:
            self._close_runners([s.runner for s in self._slots])
            raise
        self.capabilities = replace(self.capabilities, parallel_slots=len(self._slots))
        self._free = threading.Condition()  # guards the slots' busy flags and _closed
        self._closed = False
        self._embed_lock = threading.Lock()
        self._active: set[CancelToken] = set()
        self._embed_ctx: Any = None
        self._embed_batch: Any = None
        self._special: list[str] | None = None
        m = self._main
        self.lib = m.lib
        self.context_length = m.n_ctx
        self.n_vocab = m.n_vocab
        self.metadata: dict[str, str] = m.model.metadata()
        bos = m.model.token_bos()
        self.bos_token_id: int | None = bos if bos >= 0 else None
        self.eos_token_ids = [t for t in {m.model.token_eos(), m.model.token_eot()} if t >= 0 and m.is_eog(t)]
        self.add_bos = bool(m.model.add_bos_token()) and self.bos_token_id is not None
        if opts.draft_model is not None:
            try:
                self._load_drafts(Path(opts.draft_model))
            except BaseException:
                self._close_runners([r for s in self._slots for r in (s.draft, s.runner) if r is not None])
                raise
        if opts.embedding:
            self._ensure_embed_ctx()
        # ---- issue 19: projector (images) and rank pooling (rerank) ----
        self._projector: Projector | None = None
        self._reranker: Reranker | None = None
        if opts.projector is not None:
            try:
                self._projector = Projector(
                    Path(opts.projector),
                    m.model.model,
                    n_threads=m.threads,
                    use_gpu=m.on_gpu,
                    flash_attn=opts.flash_attn,
                )
            except BaseException:
                self._close_runners([r for s in self._slots for r in (s.draft, s.runner) if r is not None])
                raise
        self.capabilities = replace(
            self.capabilities,
            vision=self._projector is not None,
            rerank=is_reranker(self.lib, m.model.model, self.metadata),
        )
        # ---- end issue 19 ----
        self.memory_bytes = self._estimate_memory()
        self.on_gpu = m.on_gpu
        self.load_ns = time.perf_counter_ns() - t0

    def _load_drafts(self, path: Path) -> None:
        """One draft context per slot, all on one copy of the draft's weights."""
        first = _Runner(path, self.opts, n_ctx=self.context_length)
        main = self._main
        same_vocab = first.n_vocab == main.n_vocab and all(
            first.piece(t, True) == main.piece(t, True)
            for t in range(0, main.n_vocab, max(1, main.n_vocab // 97))
        )
        if not same_vocab:
            first.close()
            raise LocalrtError(f"draft model {path.name} does not share the model's vocabulary")
        self._slots[0].draft = first
        for slot in self._slots[1:]:
            slot.draft = _Runner(path, self.opts, n_ctx=self.context_length, share_model_of=first)

    @staticmethod
    def _close_runners(runners: Sequence[_Runner]) -> None:
        # contexts that borrow weights go first, the runners owning the weights last
        for runner in sorted(runners, key=lambda r: r.owns_model):
            runner.close()

    # -- slots --
    def _take_slot(self, prompt: Sequence[int] | None, cancel: CancelToken | None = None) -> _Slot | None:
        """Wait for a free slot: the one whose cache `prompt` extends most, else the least recently used.

        None when `cancel` fires while waiting.
        """
        with self._free:
            while True:
                if self._closed:
                    raise LocalrtError("the model was unloaded")
                if cancel is not None and cancel.cancelled:
                    return None
                free = [s for s in self._slots if not s.busy]
                if free:
                    break
                self._free.wait(0.05)  # wake up now and then to notice a cancellation
            # reuse a slot whose cache the prompt mostly extends (kept minus discarded tokens > 0); taking
            # one whose cache it mostly discards would throw away another conversation's prefix for a few
            # shared tokens: then the least recently used (empty slots first)
            gains = [
                2 * s.runner.common_prefix(prompt) - len(s.runner.evaluated) if prompt else 0 for s in free
            ]
            best = max(range(len(free)), key=gains.__getitem__)
            slot = free[best] if gains[best] > 0 else min(free, key=lambda s: s.last_used)
            slot.busy = True
            return slot

    def _give_back(self, slot: _Slot) -> None:
        with self._free:
            slot.busy = False
            slot.last_used = time.monotonic()
            self._free.notify_all()

    def _estimate_memory(self) -> int:
        md, arch = self.metadata, self.metadata.get("general.architecture", "llama")

        def num(key: str, default: int) -> int:
            try:
                return int(float(md.get(f"{arch}.{key}", default)))
            except ValueError:
                return default

        n_layer, n_embd = num("block_count", 0), num("embedding_length", 0)
        n_head = max(1, num("attention.head_count", 1))
        n_head_kv = num("attention.head_count_kv", n_head)
        head_dim = num("attention.key_length", n_embd // n_head)
        bytes_per = {"f32": 4, "f16": 2, "bf16": 2, "q8_0": 1.0625, "q4_0": 0.5625}[self.opts.kv_cache_type]
        kv = int(2 * n_layer * self.context_length * n_head_kv * head_dim * bytes_per) * len(self._slots)
        total = int(self._main.model.size()) + kv
        if getattr(self, "_projector", None) is not None:
            total += self._projector.size  # issue 19
        draft = self._slots[0].draft
        if draft is not None:
            total += int(draft.model.size())
        return total

    # -- tokens --
    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
        if not text:
            return (
                [self.bos_token_id] if add_special and self.add_bos and self.bos_token_id is not None else []
            )
        return self._main.model.tokenize(text.encode("utf-8"), add_special, parse_special)

    def detokenize(self, ids: Sequence[int], special: bool = False) -> str:
        data = b"".join(self._main.piece(int(t), special) for t in ids)
        return data.decode("utf-8", errors="replace")

    def token_text(self, token_id: int) -> str:
        return self._main.piece(token_id, True).decode("utf-8", errors="replace")

    def special_tokens(self) -> list[str]:
        """Texts that tokenizing with parse_special=True turns into control / user-defined tokens."""
        if self._special is None:
            lib, vocab = self.lib, self._main.vocab
            mask = (
                lib.LLAMA_TOKEN_ATTR_CONTROL
                | lib.LLAMA_TOKEN_ATTR_USER_DEFINED
                | lib.LLAMA_TOKEN_ATTR_UNKNOWN
            )
            texts = set()
            for token in range(self.n_vocab):
                if lib.llama_vocab_get_attr(vocab, token) & mask:
                    text = self.token_text(token)
                    if text:
                        texts.add(text)
            self._special = sorted(texts)
        return self._special

    # -- generation --
    def generate(self, request: GenerateRequest) -> AsyncIterator[Event]:
        self._check_request(request)
        return run_in_thread_stream(lambda emit: self._generate_blocking(request, emit), request.cancel)

    def cancel(self) -> None:
        for token in list(self._active):
            token.cancel()

    def _check_request(self, req: GenerateRequest) -> None:
        mode = req.speculative
        if mode not in ("off", "auto") and mode not in self.capabilities.speculative:
            raise OptionError(
                f"speculative mode {mode!r} is not supported by the llama.cpp backend "
                f"(supported: off, auto, {', '.join(sorted(self.capabilities.speculative))})"
            )
        if mode == "draft" and self._slots[0].draft is None:
            raise OptionError(
                "speculative 'draft' needs a draft model: set the draft_model option (or --draft NAME)"
            )
        if req.images and self._projector is None:  # issue 19
            raise LocalrtError("this model has no projector loaded, so it does not support images")
        if not req.prompt_tokens:
            raise LocalrtError("the prompt is empty")
        if len(req.prompt_tokens) >= self.context_length:
            raise LocalrtError(
                f"the prompt is {len(req.prompt_tokens)} tokens, which does not fit the context length of "
                f"{self.context_length} tokens (raise num_ctx or shorten the input)"
            )
        bad = [
            t
            for t in req.prompt_tokens
            if not 0 <= t < self.n_vocab and not (req.images and t == IMAGE_TOKEN)
        ]
        if bad:
            raise LocalrtError(f"token id {bad[0]} is outside the vocabulary (0..{self.n_vocab - 1})")

    def _make_sampler(
        self, sp: SamplingParams, fmt: str | dict[str, Any] | None, prompt: Sequence[int]
    ) -> Any:
        from llama_cpp import _internals

        lib, m = self.lib, self._main
        chain = _internals.LlamaSampler()
        last_n = sp.penalty_window(m.n_ctx)
        if last_n > 0:
            chain.add_penalties(
                m.n_vocab, last_n, sp.repeat_penalty, sp.frequency_penalty, sp.presence_penalty
            )
            # llama-server counts the prompt in the penalty window too; the grammar (added after) must not
            for token in prompt[-last_n:]:
                chain.accept(token)
        if fmt is not None:
            try:
                sampler = grammar_sampler(lib, m.vocab, fmt)
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
                chain.add_mirostat(m.n_vocab, seed, sp.mirostat_tau, sp.mirostat_eta, 100)
            else:
                chain.add_mirostat_v2(seed, sp.mirostat_tau, sp.mirostat_eta)
        else:
            if sp.top_k > 0:
                chain.add_top_k(sp.top_k)
            if sp.typical_p < 1.0:
                chain.add_typical(sp.typical_p, 1)
            if sp.top_p < 1.0:
                chain.add_top_p(sp.top_p, 1)
            if sp.min_p > 0.0:
                chain.add_min_p(sp.min_p, 1)
            chain.add_temp(sp.temperature)
            chain.add_dist(seed)
        return chain

    def _logprob(self, runner: _Runner, row: int, token: int, top_n: int) -> TokenLogprob:
        logits = runner.logits_row(row)
        lp = log_softmax(logits)
        top: list[TopLogprob] = []
        if top_n > 0:
            ids = np.argpartition(-lp, top_n - 1)[:top_n]
            ids = ids[np.argsort(-lp[ids])]
            top = [TopLogprob(int(i), self.detokenize([int(i)]), float(lp[i])) for i in ids]
        return TokenLogprob(token, self.detokenize([token]), float(lp[token]), top)

    def _generate_blocking(self, req: GenerateRequest, emit: Callable[[Event], None]) -> None:
        self._active.add(req.cancel)
        media = None
        try:
            media = self._expand_images(req)  # issue 19: None without images
            slot = self._take_slot(media.cells if media else req.prompt_tokens, req.cancel)
            if slot is None:
                emit(DoneEvent("cancel", Timings()))
                return
            try:
                self._generate_on(slot, req, emit, media)
            finally:
                self._give_back(slot)
        finally:
            self._active.discard(req.cancel)
            if media is not None:
                media.close()

    # ---- issue 19: images (backends/mtmd.py) and rerank (backends/rerank.py) ----
    def _expand_images(self, req: GenerateRequest) -> MediaPrompt | None:
        if not req.images or self._projector is None:
            return None
        media = self._projector.expand(req.prompt_tokens, req.images)
        if len(media.cells) >= self.context_length:
            media.close()
            raise LocalrtError(
                f"the prompt with its images is {len(media.cells)} tokens, which does not fit the context "
                f"length of {self.context_length} tokens (raise num_ctx or send fewer images)"
            )
        if not isinstance(media.cells[-1], int):
            media.close()
            raise LocalrtError("the prompt must end with text after its last image")
        return media

    @staticmethod
    def _eval_prompt(m: _Runner, prompt: list[Any], media: MediaPrompt | None, timings: Timings) -> int:
        """Evaluate only what the KV cache does not hold yet (at least one token, for logits); returns
        the number of cells kept."""
        keep = min(m.common_prefix(prompt), len(prompt) - 1)
        if media is not None:  # issue 19: never cut inside an image
            keep = media.cut(keep)
        m.truncate(keep)
        keep = len(m.evaluated)
        if media is not None:  # issue 19: the kept cells (and their gaps) are the same in both prompts
            m.pos_gaps = media.position_gaps()
        # The last prompt token always goes alone: a repeated prompt re-evaluates exactly that token, and
        # large batches take other kernels than one-token decodes, so this keeps repeats bit-identical.
        if len(prompt) - 1 > keep:
            if media is not None:  # issue 19: text runs through m.decode, images through libmtmd
                timings.prompt_image_tokens = media.evaluate(
                    m.ctx.ctx, 0, keep, len(prompt) - 1, m.n_batch, m.decode, m.evaluated.extend
                )
            else:
                m.decode(prompt[keep:-1])
        m.decode(prompt[-1:])
        return keep

    async def rerank(self, query: str, documents: Sequence[str]) -> tuple[list[float], int]:
        """Relevance scores of documents for query (in order) and the tokens evaluated."""
        import asyncio

        if not self.capabilities.rerank:
            raise LocalrtError("this model is not a reranker (its GGUF has no rank pooling)")
        return await asyncio.to_thread(self._rerank_blocking, query, list(documents))

    def _rerank_blocking(self, query: str, documents: list[str]) -> tuple[list[float], int]:
        with self._embed_lock:
            if self._closed:
                raise LocalrtError("the model was unloaded")
            if self._reranker is None:
                m = self._main
                self._reranker = Reranker(self.lib, m.model, self.metadata, m.n_ctx, m.threads)
            return self._reranker.scores(query, documents)

    # ---- end issue 19 ----

    def _generate_on(
        self,
        slot: _Slot,
        req: GenerateRequest,
        emit: Callable[[Event], None],
        media: MediaPrompt | None = None,
    ) -> None:
        m = slot.runner
        if m.ctx is None or m.ctx.ctx is None:
            raise LocalrtError("the model was unloaded")
        timings = Timings()
        prompt: list[Any] = media.cells if media is not None else list(req.prompt_tokens)  # issue 19
        n_ctx = m.n_ctx
        if req.cancel.cancelled:
            emit(DoneEvent("cancel", timings))
            return

        # prompt: evaluate only what the KV cache does not hold yet (at least one token, for logits)
        t0 = time.perf_counter_ns()
        keep = self._eval_prompt(m, prompt, media, timings)
        t1 = time.perf_counter_ns()
        timings.prompt_eval_count = len(prompt) - keep
        timings.prompt_eval_ns = t1 - t0

        room = n_ctx - len(prompt)
        max_new = room if req.num_predict < 0 else min(req.num_predict, room)
        mode = req.speculative
        if mode == "auto":
            mode = "draft" if slot.draft is not None else "off"
        if media is not None:  # issue 19: the proposers see text only; a prompt with images goes unspeculated
            mode = "off"
        proposer: LookupProposer | DraftProposer | None = None
        if mode == "lookup":
            proposer = LookupProposer()
        elif mode == "draft" and slot.draft is not None:
            proposer = DraftProposer(slot.draft)
        # verification batches stay under 64 positions: below that, llama.cpp's CPU kernels give each
        # position exactly the logits of a one-token decode (flash attention on), so greedy output holds
        k_max = min(req.num_draft or DEFAULT_NUM_DRAFT.get(mode, 0), MAX_VERIFY_BATCH - 1)
        k = k_max  # adapted below: a CPU pays for every drafted position, so draft less after misses

        sampler = self._make_sampler(
            req.sampling, req.format, media.text_tokens if media is not None else prompt
        )
        text = TextAssembler(req.stop)
        want_lp = req.logprobs or req.top_logprobs > 0
        history = list(prompt)  # prompt + every sampled token
        rows = [-1]  # logits rows of the last decode to sample from
        drafts: list[int] = []
        finish = "length"
        n_gen = 0
        try:
            while n_gen < max_new:
                accepted, done = 0, False
                for j, row in enumerate(rows):
                    if req.cancel.cancelled:
                        finish, done = "cancel", True
                        break
                    token = sampler.sample(m.ctx, row)
                    n_gen += 1
                    history.append(token)
                    if m.is_eog(token):
                        finish, done = "stop", True
                        break
                    lp = self._logprob(m, row, token, req.top_logprobs) if want_lp else None
                    event, stopped = text.add(token, m.piece(token, token in req.preserve_tokens), lp)
                    if event is not None:
                        emit(event)
                    if stopped:
                        finish, done = "stop", True
                        break
                    if n_gen >= max_new:
                        done = True
                        break
                    if j < len(drafts) and token == drafts[j]:
                        accepted += 1
                        continue
                    break
                if drafts:
                    timings.draft_accepted_count += accepted
                    m.truncate(len(m.evaluated) - (len(drafts) - accepted))  # roll back rejected drafts
                    k = min(k_max, 2 * k) if accepted == len(drafts) else max(1, accepted + 1)
                if done:
                    break
                drafts = []
                if proposer is not None and k > 0:
                    budget = min(k, max_new - n_gen - 1, n_ctx - len(m.evaluated) - 2)
                    if budget > 0:
                        drafts = proposer.propose(history, budget)
                timings.draft_count += len(drafts)
                m.decode([history[-1], *drafts], all_logits=bool(drafts))
                rows = list(range(len(drafts) + 1)) if drafts else [-1]
        finally:
            sampler.close()
        tail = text.finish()
        if tail is not None and (tail.text or tail.token_ids):
            emit(tail)
        timings.eval_count = n_gen
        timings.eval_ns = time.perf_counter_ns() - t1
        emit(DoneEvent(finish, timings))  # type: ignore[arg-type]

    # -- scoring --
    async def score(self, tokens: Sequence[int], return_logits: bool = False) -> ScoreResult:
        import asyncio

        return await asyncio.to_thread(self._score_blocking, list(tokens), return_logits)

    def _score_blocking(self, tokens: list[int], return_logits: bool) -> ScoreResult:
        n = len(tokens)
        if n > self.context_length:
            raise LocalrtError(f"{n} tokens do not fit the context length of {self.context_length}")
        if any(not 0 <= t < self.n_vocab for t in tokens):
            raise LocalrtError("a token id is outside the vocabulary")
        logprobs = np.zeros(max(0, n - 1), dtype=np.float64)
        logits_out = np.zeros((max(0, n - 1), self.n_vocab), dtype=np.float32) if return_logits else None
        if n < 2:
            return ScoreResult(logprobs, logits_out)
        slot = self._take_slot(None)
        assert slot is not None
        m = slot.runner
        try:
            m.truncate(0)

            def take(start: int, count: int) -> None:
                ptr = self.lib.llama_get_logits(m.ctx.ctx)
                block = np.ctypeslib.as_array(ptr, shape=(count, self.n_vocab))
                for s in range(0, count, 64):  # bounded temporaries
                    rows = block[s : s + 64]
                    first = start + s
                    last = min(first + len(rows), n - 1)
                    if last <= first:
                        break
                    rows = rows[: last - first]
                    lp = log_softmax(rows)
                    logprobs[first:last] = lp[np.arange(last - first), tokens[first + 1 : last + 1]]
                    if logits_out is not None:
                        logits_out[first:last] = rows

            m.decode(tokens, all_logits=True, on_chunk=take)
        finally:
            self._give_back(slot)
        return ScoreResult(logprobs, logits_out)

    # -- embeddings --
    def _ensure_embed_ctx(self) -> None:
        if self._embed_ctx is not None:
            return
        from llama_cpp import _internals

        lib, m = self.lib, self._main
        params = lib.llama_context_default_params()
        n = min(m.n_ctx, 8192)
        params.n_ctx = params.n_batch = params.n_ubatch = n
        params.n_threads = m.ctx_params.n_threads
        params.n_threads_batch = m.ctx_params.n_threads_batch
        params.embeddings = True
        arch = self.metadata.get("general.architecture", "")
        # chat models declare no pooling; mean pooling is what Ollama uses for them
        params.pooling_type = (
            lib.LLAMA_POOLING_TYPE_UNSPECIFIED
            if f"{arch}.pooling_type" in self.metadata
            else lib.LLAMA_POOLING_TYPE_MEAN
        )
        params.no_perf = True
        from llama_cpp._utils import suppress_stdout_stderr

        with suppress_stdout_stderr(disable=False):  # llama.cpp notes the pooling override on stderr
            self._embed_ctx = _internals.LlamaContext(model=m.model, params=params, verbose=False)
        self._embed_batch = _internals.LlamaBatch(n_tokens=n, embd=0, n_seq_max=1, verbose=False)
        self._embed_n = n

    async def embed(self, texts: Sequence[str]) -> list[list[float]]:
        import asyncio

        return await asyncio.to_thread(self._embed_blocking, list(texts))

    def _embed_blocking(self, texts: list[str]) -> list[list[float]]:
        with self._embed_lock:
            if self._closed:
                raise LocalrtError("the model was unloaded")
            self._ensure_embed_ctx()
            ctx, batch, lib = self._embed_ctx, self._embed_batch, self.lib
            n_embd = self._main.model.n_embd()
            out: list[list[float]] = []
            for text in texts:
                tokens = self.tokenize(text, add_special=True)[: self._embed_n]
                if not tokens:
                    tokens = [self.eos_token_ids[0] if self.eos_token_ids else 0]
                batch.reset()
                batch.add_sequence(tokens, 0, True)
                ctx.kv_cache_clear()
                try:
                    ctx.decode(batch)
                except RuntimeError as e:
                    raise LocalrtError(f"llama.cpp embedding failed: {e}") from None
                ptr = lib.llama_get_embeddings_seq(ctx.ctx, 0)
                if not ptr:
                    ptr = lib.llama_get_embeddings_ith(ctx.ctx, -1)
                vec = np.ctypeslib.as_array(ptr, shape=(n_embd,)).astype(np.float64)
                norm = float(np.linalg.norm(vec))
                out.append((vec / norm if norm > 0 else vec).tolist())
            return out

    # -- lifetime --
    def unload(self) -> None:
        self.cancel()
        with self._free:
            if self._closed:
                return
            self._closed = True
            while any(s.busy for s in self._slots):  # running requests end at their next token
                self._free.wait(0.05)
        with self._embed_lock:
            for obj in (self._embed_batch, self._embed_ctx):
                if obj is not None:
                    obj.close()
            self._embed_ctx = self._embed_batch = None
        # issue 19: the projector and the rerank context sit on the weights, so they go first
        for extra in (self._projector, self._reranker):
            if extra is not None:
                extra.close()
        self._projector = self._reranker = None
        self._close_runners([r for s in self._slots for r in (s.draft, s.runner) if r is not None])
