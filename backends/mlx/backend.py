"""The MLX backend: the MLX engine behind the runtime's backend protocol.

Weights come from the GGUF itself (kept quantized where MLX has an exact form); tokens come from
llama.cpp's vocab-only load of the same file, so tokenization is identical to the llama.cpp
backend's. One sequence runs at a time per model. MLX's streams belong to the thread that created
them, so every MLX call of a model (load, decode, score, embed) runs on that model's own thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
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
    ModelLifetime,
    ScoreResult,
    TextAssembler,
    Timings,
    loaded_context,
    modules_installed,
    run_in_thread_stream,
)
from localrt.backends.checks import (
    check_draft_vocabulary,
    check_kv_cache_type,
    check_loaded,
    check_model_file,
    check_prompt,
    check_scored,
    check_speculative,
)
from localrt.backends.grammar import Grammar
from localrt.backends.llamacpp.vocab import Vocab, VocabMethods
from localrt.backends.outputs import (
    embedding_tokens,
    empty_score,
    fill_score,
    logprob_from_logits,
    unit_vector,
)
from localrt.backends.speculation import VERIFY_COST_PER_DRAFT, speculative_method
from localrt.errors import OptionError

NAME = "mlx"
PIP_HINT = "pip install 'localrt[mlx]' (on Linux that installs mlx[cpu])"
KV_CACHE_TYPES = ("f16", "bf16", "f32", "q8_0")
SCORE_HEAD_ROWS = 256  # logits computed this many rows at a time (the head is n x vocab)
T = TypeVar("T")


def mlx_status() -> tuple[bool, str]:
    """Whether `import mlx.core` works here: on Linux the `mlx` package alone has no CPU library."""
    installed, why_not = modules_installed(("mlx", "numpy", "llama_cpp", "gguf"), PIP_HINT)
    if not installed:
        return False, why_not
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
            grammar=True,
            speculative=frozenset({"draft", "lookup", "self"}),
            kv_cache_types=KV_CACHE_TYPES,
            devices=("gpu",) if _on_gpu() else ("cpu",),
            parallel_slots=1,
        )

    @classmethod
    def load(cls, path: Path | str, opts: LoadOptions) -> MLXModel:
        return MLXModel(Path(path), opts)


class MLXModel(VocabMethods, ModelLifetime):
    backend_name = NAME

    def __init__(self, path: Path, opts: LoadOptions, *, self_spec_layers: int | None = None) -> None:
        t0 = time.perf_counter_ns()
        self.path, self.opts = path, opts
        self.capabilities = MLXBackend.capabilities()
        check_kv_cache_type(opts.kv_cache_type, KV_CACHE_TYPES, "MLX")
        check_model_file(path)
        if opts.draft_model is not None:
            check_model_file(opts.draft_model, "draft model")
        self._pool = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="mlx", initializer=_own_stream
        )
        self._active = set()
        self._take_vocab(Vocab.load(path))
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
        from .engine import DraftProposer, Runner
        from .gguf_load import GGUFTensors
        from .model import Transformer

        # fp16 on Apple GPUs; fp32 on the CPU, where MLX's half matmuls are slower and inexact
        self.dtype = mx.float16 if _on_gpu() else mx.float32
        self.verify_cost = VERIFY_COST_PER_DRAFT["gpu" if _on_gpu() else "cpu"]
        tensors = GGUFTensors(self.path)
        self.metadata: dict[str, str] = tensors.text_metadata()
        tokens = tensors.vocabulary()  # to check a draft model's against
        self.model = Transformer(tensors, self.dtype)
        tensors.close()
        cfg = self.model.cfg
        self.context_length = loaded_context(opts.num_ctx, cfg.context_length)
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
            draft_tokens = dt.vocabulary()
            check_draft_vocabulary(
                opts.draft_model, len(tokens), len(draft_tokens), tokens.__getitem__, draft_tokens.__getitem__
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
        """Refuses what this model cannot run; returns the speculation method the request runs."""
        check_loaded(self._closed)
        check_speculative(req.speculative, self.capabilities.speculative, self.draft is not None, "MLX")
        check_prompt(req.prompt_tokens, self.context_length, self.n_vocab)
        return speculative_method(
            req.speculative, has_draft_model=self.draft is not None, constrained=req.format is not None
        )

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
        from localrt.backends.speculation import DEFAULT_NUM_DRAFT, SpecState

        from .engine import generate

        check_loaded(self._closed)
        start_ns = time.perf_counter_ns()
        text = TextAssembler(req.stop)
        want_lp = req.logprobs or req.top_logprobs > 0
        prompt = list(req.prompt_tokens)
        room = self.context_length - len(prompt)
        max_tokens = len(prompt) + (room if req.num_predict < 0 else min(req.num_predict, room))
        proposer = self._proposer(mode)
        spec = None
        if proposer is not None:
            spec = SpecState(
                mode, req.num_draft or DEFAULT_NUM_DRAFT[mode], proposer.cost_per_draft + self.verify_cost
            )

        def on_token(token: int, logits: np.ndarray) -> bool:
            lp = logprob_from_logits(logits, token, req.top_logprobs, self.detokenize) if want_lp else None
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
        if tail is not None:
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
            )
        )

    # ---- scoring and embeddings ---------------------------------------------------------------
    async def _run(self, fn: Callable[[], T]) -> T:
        """Run fn on the model's MLX thread, after the request in flight (one at a time)."""
        check_loaded(self._closed)
        return await asyncio.wrap_future(self._pool.submit(fn))

    async def score(self, tokens: Sequence[int], return_logits: bool = False) -> ScoreResult:
        ids = list(tokens)
        check_scored(ids, self.context_length, self.n_vocab)
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
        result = empty_score(n, self.n_vocab, return_logits)
        if n < 2:
            return result
        hidden = self._hidden(ids[:-1])  # [n-1, dim]: the last token predicts nothing scored
        for s in range(0, n - 1, SCORE_HEAD_ROWS):
            fill_score(result, ids, s, np.array(self.model.logits(hidden[s : s + SCORE_HEAD_ROWS])))
        return result

    async def embed(self, texts: Sequence[str]) -> list[list[float]]:
        batches = [embedding_tokens(self.tokenize, t, self.context_length, self.eos_token_ids) for t in texts]
        return await self._run(lambda: [self._embed(ids) for ids in batches])

    def _embed(self, ids: list[int]) -> list[float]:
        # mean over tokens of the final-normed hidden states, as llama.cpp's mean pooling
        return unit_vector(np.array(self._hidden(ids)).astype(np.float64).mean(0))

    # ---- lifetime -----------------------------------------------------------------------------
    def _free(self) -> None:
        self._pool.shutdown(wait=True)  # the request in flight sees its cancel and ends
        self.vocab.close()


def _own_stream() -> None:
    """Give the model's worker thread its own MLX stream (streams are per thread)."""
    import mlx.core as mx

    mx.set_default_stream(mx.new_stream(mx.default_device()))
