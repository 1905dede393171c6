"""The llama.cpp backend adapter: the protocol of backends/base.py over one batched context (step.py).

Generation requests become jobs of the step loop; scoring runs as exclusive work between its steps;
embeddings have a small context of their own. Tokenizing reads only the weights' vocabulary.
"""

from __future__ import annotations

import asyncio
import dataclasses
import sys
import threading
import time
from collections.abc import AsyncIterator
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from localrt import config
from localrt.backends.base import IMAGE_TOKEN
from localrt.backends.base import Capabilities
from localrt.backends.base import EngineBackend
from localrt.backends.base import Event
from localrt.backends.base import GenerateRequest
from localrt.backends.base import LoadOptions
from localrt.backends.base import ModelLifetime
from localrt.backends.base import ScoreResult
from localrt.backends.base import Timings
from localrt.backends.base import close_each
from localrt.backends.base import loaded_context
from localrt.backends.checks import check_draft_vocabulary
from localrt.backends.checks import check_loaded
from localrt.backends.checks import check_prompt
from localrt.backends.checks import check_prompt_fits
from localrt.backends.checks import check_scored
from localrt.backends.checks import check_speculative
from localrt.backends.engine_thread import EngineStreams
from localrt.backends.engine_thread import OutputStream
from localrt.backends.mtmd import MediaPrompt  # images through libmtmd
from localrt.backends.mtmd import Projector  # images through libmtmd
from localrt.backends.outputs import embedding_tokens
from localrt.backends.outputs import empty_score
from localrt.backends.outputs import fill_score
from localrt.backends.outputs import float_array
from localrt.backends.outputs import unit_vector
from localrt.backends.rerank import PooledContext
from localrt.backends.rerank import Reranker  # rank pooling
from localrt.backends.rerank import is_reranker  # rank pooling
from localrt.backends.speculation import verify_cost_per_draft
from localrt.errors import LocalrtError

from .admission import copy_threshold
from .lib import KV_TYPES
from .lib import Batch
from .lib import LoraAdapters
from .lib import SharedWeights
from .lib import _lib
from .lib import check_kv_options
from .lib import context_params
from .lib import create_context
from .lib import default_threads
from .lib import gpu_offload_supported
from .lib import load_model
from .memory import estimate
from .memory import kv_bytes_per_token
from .memory import parallel_for
from .sequences import EXACT_ROWS
from .sequences import PROMPT_WORK
from .sequences import DraftContext
from .sequences import ExternalChunk
from .sequences import Job
from .sequences import PromptItem
from .step import BatchedContext
from .vocab import Vocab
from .vocab import VocabMethods

NAME = "llama.cpp"


class LlamaCppModel(VocabMethods, ModelLifetime):
    backend_name = NAME

    def __init__(self, path: Path, opts: LoadOptions) -> None:
        check_kv_options(opts)
        self.path, self.opts = path, opts
        self.lib = _lib()
        # another model on the same file (another adapter set) shares its weights: its own contexts over them
        self.weights = SharedWeights.acquire(path, opts, self)
        self.model, self.on_gpu = self.weights.model, self.weights.on_gpu
        self.adapters: LoraAdapters | None = None
        self.engine: BatchedContext | None = None
        self._draft_model: Any = None
        self._embed: PooledContext | None = None
        self._embed_lock = threading.Lock()
        self._projector: Projector | None = None
        self._reranker: Reranker | None = None
        self._closed = False
        self._active = set()
        self._own_bytes = 0  # what this model holds beside the weights (KV cache, adapters, draft, projector)
        self._load_or_free(lambda: self._setup(opts))

    @property
    def memory_bytes(self) -> int:
        """Its own memory, and the weights where it is the first of the models sharing them (once in `ps`)."""
        return self._own_bytes + (self.weights.size if self.weights.counts(self) else 0)

    @property
    def shared_weights(self) -> object:
        """What identifies its weights in this process: models with the same one share them."""
        return self.weights

    def _setup(self, opts: LoadOptions) -> None:
        m = self.model
        self.adapters = LoraAdapters(m, opts.adapters)  # over the weights, before any context
        self._take_vocab(Vocab(m))
        self.metadata: dict[str, str] = m.metadata()
        self.context_length = loaded_context(opts.num_ctx, m.n_ctx_train())
        per_token = kv_bytes_per_token(self.metadata, opts.kv_cache_type)
        n_par = parallel_for(per_token * self.context_length, opts.num_parallel)
        self.n_parallel = min(n_par, self.lib.llama_max_parallel_sequences())
        n_seq_max = self.n_parallel  # idle sequences stay cached in the ids no request is using
        self.threads = opts.num_thread or default_threads()
        step_tokens = max(self.n_parallel * 2, min(opts.num_batch, self.context_length))
        n_ctx = -(-self.context_length // 256) * 256 * n_seq_max  # llama.cpp pads each stream to 256
        params = context_params(opts, n_ctx, step_tokens, n_seq_max, self.threads)
        self.ctx_params = params
        ctx = create_context(m, params)
        try:
            self.adapters.apply(ctx.ctx)
        except LocalrtError:
            ctx.close()
            raise
        draft = self._load_draft(Path(opts.draft_model), params) if opts.draft_model is not None else None
        self.engine = BatchedContext(
            m,
            ctx,
            n_parallel=self.n_parallel,
            n_seq_max=n_seq_max,
            n_ctx_seq=self.context_length,
            step_tokens=step_tokens,
            draft=draft,
            verify_cost=verify_cost_per_draft(self.on_gpu),
            copy_min=copy_threshold(per_token * self.context_length, int(m.size())),
            adapters=self.adapters if self.adapters.handles else None,
            prefill_rows=step_tokens if config.fast_prefill() or self.on_gpu else EXACT_ROWS,
            prompt_work=None if self.on_gpu else PROMPT_WORK,
        )
        self._streams = EngineStreams(lambda out: out.job.id)
        self.engine.start(self._streams.route)
        if opts.projector is not None:
            self._projector = Projector(
                Path(opts.projector),
                m.model,
                n_threads=self.threads,
                use_gpu=self.on_gpu,
                flash_attn=opts.flash_attn,
            )
        self.capabilities = replace(
            LlamaCppBackend.capabilities(),
            parallel_slots=self.n_parallel,
            vision=self._projector is not None,
            rerank=is_reranker(self.lib, m.model, self.metadata),
        )
        kv = per_token * self.context_length * self.n_parallel
        self._own_bytes = kv + (int(self._draft_model.size()) if self._draft_model else 0)
        self._own_bytes += sum(Path(p).stat().st_size for p in opts.adapters)
        if self._projector is not None:
            self._own_bytes += self._projector.size
        if opts.embedding:
            self._embed_context()

    def _load_draft(self, path: Path, params: Any) -> DraftContext:
        """The draft model's weights and one context with the target's parameters, so the same seq ids and
        batch size (same vocabulary required)."""
        model, _ = load_model(path, self.opts)
        self._draft_model = model
        draft_vocab = Vocab(model)
        check_draft_vocabulary(
            path,
            self.n_vocab,
            draft_vocab.n_vocab,
            lambda t: self.piece(t, True),
            lambda t: draft_vocab.piece(t, True),
        )
        return DraftContext(model, create_context(model, params), params.n_seq_max, params.n_batch)

    # -- generation --
    async def generate(self, request: GenerateRequest) -> AsyncIterator[Event]:
        self._check_request(request)
        # an image's preprocessing is heavy: off the event loop (its encoding runs on the step thread)
        media = await asyncio.to_thread(self._expand_images, request) if request.images else None
        try:
            prompt = self._media_items(media) if media is not None else list(request.prompt_tokens)
            job = Job(request, prompt=prompt, lora=self._lora(request))
            async with self._streams.open(self, job.id, request.cancel, job.finished.is_set, None) as queue:
                self._require_engine().submit(job, request.cancel)
                stream = OutputStream(self, request, lambda generated: _end_timings(job, generated))
                async for event in stream.read(queue, lambda: job.error):
                    yield event
        finally:
            if media is not None:
                media.close()  # after the job: its chunks are evaluated on the step thread

    def prompt_logits(self, req: GenerateRequest) -> np.ndarray:
        """The logits after the prompt (images included), evaluated as generate evaluates it."""
        self._check_request(req)
        media = self._expand_images(req)  # None without images
        try:
            prompt = self._media_items(media) if media is not None else list(req.prompt_tokens)
            job = Job(replace(req, num_predict=1), prompt=prompt, capture=True, lora=self._lora(req))
            self._require_engine().submit(job)
            job.finished.wait()
        finally:
            if media is not None:
                media.close()
        if job.error is not None:
            raise job.error
        assert job.logits is not None
        return job.logits

    # ---- images (backends/mtmd.py) and rerank (backends/rerank.py) ----
    def _expand_images(self, req: GenerateRequest) -> MediaPrompt | None:
        if not req.images or self._projector is None:
            return None
        media = self._projector.expand(req.prompt_tokens, req.images)
        try:
            check_prompt_fits(
                len(media.cells), self.context_length, what="prompt with its images", fix="send fewer images"
            )
            if not isinstance(media.cells[-1], int):
                raise LocalrtError("the prompt must end with text after its last image")
            if media.position_gaps():
                raise LocalrtError(
                    "images on M-RoPE vision models are not supported by the batched llama.cpp backend yet"
                )
        except LocalrtError:
            media.close()
            raise
        return media

    def _media_items(self, media: MediaPrompt) -> list[PromptItem]:
        """Text tokens as they are, each image chunk as an ExternalChunk the step thread evaluates."""
        projector = self._projector
        assert projector is not None
        n_batch = self.ctx_params.n_batch
        items: list[PromptItem] = []
        starts = {span.start: span for span in media.spans}
        i = 0
        while i < len(media.cells):
            span = starts.get(i)
            if span is None:
                items.append(media.cells[i])  # type: ignore[arg-type]
                i += 1
                continue

            def evaluate(ctx: Any, seq: int, pos: int, chunk: Any = span.chunk) -> int:
                return projector.eval_image(ctx, chunk, pos, seq, n_batch)

            items.append(ExternalChunk(list(media.cells[i : i + span.n_tokens]), evaluate))
            i += span.n_tokens
        return items

    async def rerank(self, query: str, documents: Sequence[str]) -> tuple[list[float], int]:
        """Relevance scores of documents for query (in order) and the tokens evaluated."""
        if not self.capabilities.rerank:
            raise LocalrtError("this model is not a reranker (its GGUF has no rank pooling)")
        documents = list(documents)
        return await self._require_engine().job(lambda: self._rerank_now(query, documents))

    def _rerank_now(self, query: str, documents: list[str]) -> tuple[list[float], int]:
        with self._embed_lock:
            check_loaded(self._closed)
            if self._reranker is None:
                reranker = Reranker(self.lib, self.model, self.metadata, self.context_length, self.threads)
                self._with_adapters(reranker.pooled)
                self._reranker = reranker
            return self._reranker.scores(query, documents)

    def cancel(self) -> None:
        engine = self.engine
        if engine is None:
            return
        for job in engine.jobs():
            job.req.cancel.cancel()

    def _require_engine(self) -> BatchedContext:
        check_loaded(self._closed or self.engine is None)
        assert self.engine is not None
        return self.engine

    def _check_request(self, req: GenerateRequest) -> None:
        self._require_engine()
        check_speculative(req.speculative, self.capabilities.speculative, self._draft_model is not None, NAME)
        if req.images and self._projector is None:
            raise LocalrtError("this model has no projector loaded, so it does not support images")
        check_prompt(
            req.prompt_tokens, self.context_length, self.n_vocab, (IMAGE_TOKEN,) if req.images else ()
        )
        self._lora(req)

    def _lora(self, req: GenerateRequest) -> tuple[float, ...]:
        """The request's LoRA scale set (the step loop batches only jobs of equal sets); () without
        adapters."""
        adapters = self.adapters
        if adapters is None or not adapters.handles:
            if req.lora:
                raise LocalrtError("lora: this model has no LoRA adapters (ADAPTER) to scale")
            return ()
        return adapters.scales_for(req.lora)

    # -- scoring --
    async def score(self, tokens: Sequence[int], return_logits: bool = False) -> ScoreResult:
        return await asyncio.to_thread(self._score_blocking, list(tokens), return_logits)

    def _score_blocking(self, tokens: list[int], return_logits: bool) -> ScoreResult:
        n = len(tokens)
        check_scored(tokens, self.context_length, self.n_vocab)
        result = empty_score(n, self.n_vocab, return_logits)
        if n < 2:
            return result
        engine = self._require_engine()

        def run(ctx: Any, seq: int) -> None:
            batch = Batch(EXACT_ROWS)  # the rows a prompt's chunk has in generation: the same logits
            try:
                for start in range(0, n, batch.capacity):
                    chunk = tokens[start : start + batch.capacity]
                    batch.clear()
                    batch.add(chunk, start, seq, True)
                    engine.decode_exclusive(batch)
                    self._take_scores(ctx, tokens, start, len(chunk), result)
            finally:
                batch.close()

        engine.run_task(run)
        return result

    def _take_scores(self, ctx: Any, tokens: list[int], start: int, count: int, result: ScoreResult) -> None:
        """The chunk's logits rows (tokens[start : start+count]) into the result; the last token scores nothing."""
        block = float_array(
            self.lib.llama_get_logits(ctx), (count, self.n_vocab), "llama.cpp returned no logits to score"
        )
        for s in range(0, count, 64):  # bounded temporaries
            first = start + s
            last = min(first + min(64, count - s), len(tokens) - 1)
            if last <= first:
                break
            fill_score(result, tokens, first, block[s : s + last - first])

    # -- embeddings --
    def _embed_context(self) -> PooledContext:
        if self._embed is None:
            arch = self.metadata.get("general.architecture", "")
            # chat models declare no pooling; mean pooling is what Ollama uses for them
            declared = f"{arch}.pooling_type" in self.metadata
            pooling = (
                self.lib.LLAMA_POOLING_TYPE_UNSPECIFIED if declared else self.lib.LLAMA_POOLING_TYPE_MEAN
            )
            threads = (self.ctx_params.n_threads, self.ctx_params.n_threads_batch)
            n_ctx = min(self.context_length, 8192)
            pooled = PooledContext(self.lib, self.model, n_ctx, threads, pooling, "embedding")
            self._with_adapters(pooled)
            self._embed = pooled
        return self._embed

    def _with_adapters(self, pooled: PooledContext) -> None:
        """The model's LoRA adapters on a pooled context too: embeddings and scores come from the
        adapted weights, as generation does."""
        if self.adapters is None:
            return
        try:
            self.adapters.apply(pooled.ctx.ctx)
        except LocalrtError:
            pooled.close()
            raise

    async def embed(self, texts: Sequence[str]) -> list[list[float]]:
        texts = list(texts)
        return await self._require_engine().job(lambda: self._embed_now(texts))

    def _embed_now(self, texts: list[str]) -> list[list[float]]:
        with self._embed_lock:
            check_loaded(self._closed)
            pooled = self._embed_context()
            n_embd = self.model.n_embd()
            vectors = []
            for text in texts:
                tokens = embedding_tokens(self.tokenize, text, pooled.n_ctx, self.eos_token_ids)
                vectors.append(unit_vector(pooled.pool(tokens, n_embd)))
            return vectors

    # -- lifetime --
    def _free(self) -> None:
        self._closed = True
        if self.engine is not None:
            self.engine.stop()  # running requests end with the step in flight
            close_each(self.engine.batch, self.engine.ctx, self.engine.draft)
        with self._embed_lock:
            # the embedding, projector and rerank contexts sit on the weights, so they go first
            close_each(self._embed, self._projector, self._reranker)
            self._embed = self._projector = self._reranker = None
        # the adapters after every context that applies them, before the weights they sit on
        close_each(self.adapters, self._draft_model)
        self.adapters = None
        self.weights.release(self)


def _end_timings(job: Job, generated: int | None) -> Timings:
    """A job's done-event timings: the step thread's when it ended the job; else the reader ends it at a
    stop string after `generated` tokens, and the cancel that follows keeps its sequence cached."""
    if generated is None:
        return job.timings
    job.stopped_by_text = True
    timings = dataclasses.replace(job.timings, eval_count=generated)
    timings.eval_ns = max(1, time.perf_counter_ns() - job.t_prompt)
    return timings


def capabilities() -> Capabilities:
    """The GPU devices appear where the library was built with offload (Metal on macOS)."""
    devices: tuple[str, ...] = ("cpu",)
    if gpu_offload_supported():
        devices = ("cpu", "metal") if sys.platform == "darwin" else ("cpu", "gpu")
    return Capabilities(
        speculative=frozenset({"draft", "lookup"}),
        kv_cache_types=tuple(KV_TYPES),
        devices=devices,
        parallel_slots=1,
        context_shift=True,
    )


LlamaCppBackend = EngineBackend(NAME, LlamaCppModel, capabilities, estimate=estimate, shares_weights=True)
