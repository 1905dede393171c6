"""The MLX backend: the MLX engine behind the runtime's backend protocol.

Weights come from the GGUF itself (kept quantized where MLX has an exact form); tokens come from
llama.cpp's vocab-only load of the same file, so tokenization is identical to the llama.cpp
backend's. One sequence runs at a time per model. MLX's streams belong to the thread that created
them, so every MLX call of a model (load, decode, score, embed) runs on that model's own thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import importlib.util
import time
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import numpy as np

from localrt.backends.base import (
    Capabilities,
    DoneEvent,
    Event,
    GenerateRequest,
    LoadOptions,
    ScoreResult,
    TextAssembler,
    Timings,
    TokenLogprob,
    TopLogprob,
    log_softmax,
    run_in_thread_stream,
)
from localrt.backends.grammar import Grammar
from localrt.backends.vocab import Vocab, VocabMethods
from localrt.errors import LocalrtError, OptionError

NAME = "mlx"
PIP_HINT = "pip install 'localrt[mlx]' (on Linux that installs mlx[cpu])"
KV_CACHE_TYPES = ("f16", "bf16", "f32", "q8_0")
SCORE_HEAD_ROWS = 256  # logits computed this many rows at a time (the head is n x vocab)
T = TypeVar("T")


def mlx_status() -> tuple[bool, str]:
    """Whether `import mlx.core` works here: on Linux the `mlx` package alone has no CPU library."""
    for module in ("mlx", "numpy", "llama_cpp", "gguf"):
        if importlib.util.find_spec(module) is None:
            why = "its tokenizer is llama.cpp's" if module == "llama_cpp" else "it is required"
            return False, f"{module} is not installed ({why}); {PIP_HINT}"
    try:
        import mlx.core  # noqa: F401
    except ImportError as e:
        return False, f"mlx is installed but cannot load ({e}); {PIP_HINT}"
    return True, ""


def _on_gpu() -> bool:
    import mlx.core as mx

    return mx.default_device().type == mx.DeviceType.gpu


class MLXBackend:
    name: ClassVar[str] = NAME

    @classmethod
    def availability(cls) -> tuple[bool, str]:
        return mlx_status()

    @classmethod
    def capabilities(cls) -> Capabilities:
        return Capabilities(
            chat=True,
            embedding=True,
            score=True,
            grammar=True,
            speculative=frozenset({"draft", "lookup", "self"}),
            kv_cache_types=KV_CACHE_TYPES,
            devices=("gpu",) if _on_gpu() else ("cpu",),
            parallel_slots=1,
        )

    @classmethod
    def load(cls, path: Path | str, opts: LoadOptions) -> MLXModel:
        return MLXModel(Path(path), opts)


class MLXModel(VocabMethods):
    backend_name = NAME

    def __init__(self, path: Path, opts: LoadOptions, *, self_spec_layers: int | None = None) -> None:
        t0 = time.perf_counter_ns()
        self.path, self.opts = path, opts
        self.capabilities = MLXBackend.capabilities()
        if opts.kv_cache_type not in KV_CACHE_TYPES:
            raise OptionError(
                f"kv_cache_type {opts.kv_cache_type!r} is not supported by the MLX backend "
                f"(supported: {', '.join(KV_CACHE_TYPES)})"
            )
        if not path.is_file():
            raise LocalrtError(f"model file not found: {path}")
        if opts.draft_model is not None and not Path(opts.draft_model).is_file():
            raise LocalrtError(f"draft model file not found: {opts.draft_model}")
        self._pool = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="mlx", initializer=_own_stream
        )
        self._closed = False
        self._active: set[Any] = set()
        self.vocab = Vocab(path)
        self.n_vocab = self.vocab.n_vocab
        self.bos_token_id = self.vocab.bos_token_id
        self.eos_token_ids = self.vocab.eos_token_ids
        self.add_bos = self.vocab.add_bos
        self._eog = set(self.vocab.eog_ids())
        try:
            self._call(lambda: self._load(opts, self_spec_layers))
        except BaseException:
            self._pool.shutdown()
            self.vocab.close()
            raise
        self.load_ns = time.perf_counter_ns() - t0

    def _load(self, opts: LoadOptions, self_spec_layers: int | None) -> None:
        import mlx.core as mx

        from .cache import KV_GROUP
        from .engine import VERIFY_COST_PER_DRAFT, DraftProposer, Runner
        from .gguf_load import GGUFTensors
        from .model import Transformer

        # fp16 on Apple GPUs; fp32 on the CPU, where MLX's half matmuls are slower and inexact
        self.dtype = mx.float16 if _on_gpu() else mx.float32
        self.verify_cost = VERIFY_COST_PER_DRAFT["gpu" if _on_gpu() else "cpu"]
        tensors = GGUFTensors(self.path)
        self.metadata: dict[str, str] = {
            k: str(v)
            for k, v in tensors.metadata.items()
            if not isinstance(v, (list, tuple)) and not hasattr(v, "tobytes")
        }
        self.model = Transformer(tensors, self.dtype)
        tensors.close()
        cfg = self.model.cfg
        train_ctx = cfg.context_length
        self.context_length = max(16, min(opts.num_ctx, train_ctx) if train_ctx > 0 else opts.num_ctx)
        if opts.kv_cache_type == "q8_0" and cfg.attention_key_length % KV_GROUP:
            raise OptionError(
                f"kv_cache_type q8_0 needs a head size that is a multiple of {KV_GROUP} "
                f"(this model's is {cfg.attention_key_length})"
            )
        self.runner = Runner(self.model, opts.kv_cache_type, opts.num_batch)
        # the exit must sit near the top to agree with the full model: on SmolLM2-135M the argmax of
        # 24 of 30 layers matches 26% of the time on copied text, of 27 layers 49%
        self.self_spec_layers = self_spec_layers or max(1, cfg.block_count - max(1, cfg.block_count // 10))
        kv_per_token = 2 * cfg.block_count * cfg.attention_head_count_kv * cfg.attention_key_length
        kv_bytes = {"f32": 4.0, "q8_0": 1.125}.get(opts.kv_cache_type, 2.0)
        self.memory_bytes = self.model.nbytes + int(kv_per_token * kv_bytes * self.context_length)
        self.draft: DraftProposer | None = None
        if opts.draft_model is not None:
            dt = GGUFTensors(Path(opts.draft_model))
            draft_vocab = dt.metadata.get("tokenizer.ggml.tokens")
            if draft_vocab is None or len(draft_vocab) != self.n_vocab:
                raise LocalrtError(
                    f"draft model {Path(opts.draft_model).name} does not share the model's vocabulary"
                )
            draft_model = Transformer(dt, self.dtype)
            dt.close()
            self.memory_bytes += draft_model.nbytes
            self.draft = DraftProposer(
                Runner(draft_model, opts.kv_cache_type, opts.num_batch),
                draft_model.nbytes / self.model.nbytes,
            )

    def _call(self, fn: Callable[[], T]) -> T:
        """Run fn on the model's MLX thread and wait for it (load, unload)."""
        return self._pool.submit(fn).result()

    # ---- generation -------------------------------------------------------------------------
    def _check(self, req: GenerateRequest) -> str:
        if self._closed:
            raise LocalrtError("the model was unloaded")
        mode = req.speculative
        if mode == "auto":
            mode = "draft" if self.draft is not None else "off"
        if mode not in ("off", *self.capabilities.speculative):
            raise OptionError(f"speculative mode {mode!r} is not supported by the MLX backend")
        if mode == "draft" and self.draft is None:
            raise OptionError(
                "speculative 'draft' needs a draft model: set the draft_model option (or --draft NAME)"
            )
        if req.format is not None:  # constrained: sampled token by token, drafts would skip the grammar
            mode = "off"
        if not req.prompt_tokens:
            raise LocalrtError("the prompt is empty")
        bad = [t for t in req.prompt_tokens if not 0 <= t < self.n_vocab]
        if bad:
            raise LocalrtError(f"token id {bad[0]} is outside the vocabulary (0..{self.n_vocab - 1})")
        n = len(req.prompt_tokens)
        if n >= self.context_length:
            raise LocalrtError(
                f"the prompt is {n} tokens, which does not fit the context length of "
                f"{self.context_length} tokens (raise num_ctx or shorten the input)"
            )
        return mode

    def generate(self, request: GenerateRequest) -> AsyncIterator[Event]:
        return self._stream(request)

    async def _stream(self, req: GenerateRequest) -> AsyncIterator[Event]:
        mode = self._check(req)
        # built here, so a schema it cannot express fails before any work
        grammar = (
            None
            if req.format is None
            else Grammar(self.vocab.lib, self.vocab.vocab, self.n_vocab, req.format)
        )
        self._active.add(req.cancel)
        try:
            async for event in run_in_thread_stream(
                lambda emit: self._generate(req, mode, grammar, emit), req.cancel, self._pool
            ):
                yield event
        finally:  # the worker has finished here (run_in_thread_stream waits for it)
            self._active.discard(req.cancel)
            if grammar is not None:
                grammar.close()

    def _proposer(self, mode: str) -> Any:
        from .engine import LookupProposer, SelfProposer

        if mode == "lookup":
            return LookupProposer()
        if mode == "self":
            return SelfProposer(self.runner, self.self_spec_layers)
        return self.draft if mode == "draft" else None

    def _generate(
        self, req: GenerateRequest, mode: str, grammar: Grammar | None, emit: Callable[[Event], None]
    ) -> None:
        from localrt.backends.sampler import Sampler
        from localrt.backends.speculation import DEFAULT_NUM_DRAFT

        from .engine import SpecStats, generate

        if self._closed:
            raise LocalrtError("the model was unloaded")
        start_ns = time.perf_counter_ns()
        text = TextAssembler(req.stop)
        want_lp = req.logprobs or req.top_logprobs > 0
        prompt = list(req.prompt_tokens)
        room = self.context_length - len(prompt)
        max_tokens = len(prompt) + (room if req.num_predict < 0 else min(req.num_predict, room))
        proposer = self._proposer(mode)
        spec = None
        if proposer is not None:
            spec = SpecStats(
                mode, req.num_draft or DEFAULT_NUM_DRAFT[mode], proposer.cost_per_draft + self.verify_cost
            )

        def on_token(token: int, logits: np.ndarray) -> bool:
            lp = self._logprob(logits, token, req.top_logprobs) if want_lp else None
            event, stopped = text.add(token, self.vocab.piece(token, token in req.preserve_tokens), lp)
            if event is not None:
                emit(event)
            return stopped

        if max_tokens <= len(prompt):  # num_predict 0: nothing to generate
            emit(DoneEvent("length", Timings()))
            return
        out = generate(
            self.runner,
            prompt,
            Sampler(req.sampling, self.context_length, grammar),
            max_tokens=max_tokens,
            eog=self._eog,
            on_token=on_token,
            cancelled=lambda: req.cancel.cancelled,
            proposer=proposer,
            spec=spec,
            clock=time.perf_counter_ns,
        )
        tail = text.finish()
        if tail is not None and (tail.text or tail.token_ids):
            emit(tail)
        now = time.perf_counter_ns()
        first = out.first_token_ns or now
        emit(
            DoneEvent(
                out.reason,
                Timings(  # type: ignore[arg-type]
                    prompt_eval_count=out.prompt_eval_count,
                    prompt_eval_ns=max(1, first - start_ns),
                    eval_count=out.generated,
                    eval_ns=max(1, now - first),
                    draft_count=out.drafted,
                    draft_accepted_count=out.accepted,
                ),
                stop_sequence=text.stop_sequence,
            )
        )

    def _logprob(self, logits: np.ndarray, token: int, top_n: int) -> TokenLogprob:
        lp = log_softmax(logits)
        top: list[TopLogprob] = []
        if top_n > 0:
            ids = np.argpartition(-lp, top_n)[:top_n]
            ids = ids[np.argsort(-lp[ids], kind="stable")]
            top = [TopLogprob(int(i), self.detokenize([int(i)]), float(lp[i])) for i in ids]
        return TokenLogprob(token, self.detokenize([token]), float(lp[token]), top)

    def cancel(self) -> None:
        for token in list(self._active):
            token.cancel()

    # ---- scoring and embeddings ---------------------------------------------------------------
    async def _run(self, fn: Callable[[], T]) -> T:
        """Run fn on the model's MLX thread, after the request in flight (one at a time)."""
        if self._closed:
            raise LocalrtError("the model was unloaded")
        return await asyncio.wrap_future(self._pool.submit(fn))

    async def score(self, tokens: Sequence[int], return_logits: bool = False) -> ScoreResult:
        ids = list(tokens)
        if len(ids) > self.context_length:
            raise LocalrtError(f"{len(ids)} tokens do not fit the context length of {self.context_length}")
        if any(not 0 <= t < self.n_vocab for t in ids):
            raise LocalrtError("a token id is outside the vocabulary")
        return await self._run(lambda: self._score(ids, return_logits))

    def _hidden(self, ids: list[int]) -> Any:
        """Final-normed hidden states [n, dim] of one sequence, on fresh caches (the chat's are kept)."""
        import mlx.core as mx

        from .cache import make_caches

        caches = make_caches(self.model.cfg.block_count, self.opts.kv_cache_type)
        chunks = []
        step = max(1, self.opts.num_batch)
        for s in range(0, len(ids), step):
            h = self.model.hidden(mx.array(ids[s : s + step], dtype=mx.int32), caches)
            mx.eval(h)
            chunks.append(h)
        return mx.concatenate(chunks)

    def _score(self, ids: list[int], return_logits: bool) -> ScoreResult:
        n = len(ids)
        logprobs = np.zeros(max(0, n - 1), dtype=np.float64)
        logits_out = np.zeros((max(0, n - 1), self.n_vocab), dtype=np.float32) if return_logits else None
        if n < 2:
            return ScoreResult(logprobs, logits_out)
        hidden = self._hidden(ids[:-1])  # [n-1, dim]: the last token predicts nothing scored
        targets = np.array(ids[1:])
        for s in range(0, n - 1, SCORE_HEAD_ROWS):
            e = min(s + SCORE_HEAD_ROWS, n - 1)
            rows = np.array(self.model.logits(hidden[s:e]))  # [rows, vocab]
            logprobs[s:e] = log_softmax(rows)[np.arange(e - s), targets[s:e]]
            if logits_out is not None:
                logits_out[s:e] = rows
        return ScoreResult(logprobs, logits_out)

    async def embed(self, texts: Sequence[str]) -> list[list[float]]:
        batches = []
        for text in texts:
            ids = self.tokenize(text, add_special=True)[: self.context_length]
            batches.append(ids or [self.eos_token_ids[0] if self.eos_token_ids else 0])
        return await self._run(lambda: [self._embed(ids) for ids in batches])

    def _embed(self, ids: list[int]) -> list[float]:
        # mean over tokens of the final-normed hidden states, as llama.cpp's mean pooling
        vec = np.array(self._hidden(ids)).astype(np.float64).mean(0)
        return (vec / np.linalg.norm(vec)).tolist()

    # ---- lifetime -----------------------------------------------------------------------------
    def unload(self) -> None:
        if self._closed:
            return
        self.cancel()
        self._closed = True
        self._pool.shutdown(wait=True)  # the request in flight sees its cancel and ends
        self.vocab.close()


def _own_stream() -> None:
    """Give the model's worker thread its own MLX stream (streams are per thread)."""
    import mlx.core as mx

    mx.set_default_stream(mx.new_stream(mx.default_device()))
