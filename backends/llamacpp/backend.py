"""The llama.cpp backend adapter: the protocol of backends/base.py over the engine (engine.py).

Generation, scores and embeddings are requests of the engine, batched together (`engine.EngineModel`);
reranking too, on a pooled context of the engine. Tokenizing reads only the weights' vocabulary.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from localrt.backends.base import IMAGE_TOKEN
from localrt.backends.base import Capabilities
from localrt.backends.base import EngineBackend
from localrt.backends.base import GenerateRequest
from localrt.backends.base import LoadOptions
from localrt.backends.base import ModelLifetime
from localrt.backends.base import loaded_context
from localrt.backends.checks import check_draft_vocabulary
from localrt.backends.checks import check_loaded
from localrt.backends.checks import check_prompt
from localrt.backends.checks import check_prompt_fits
from localrt.backends.checks import check_speculative
from localrt.backends.engine import EngineModel
from localrt.backends.engine import EngineRequest
from localrt.backends.engine import EngineStreams
from localrt.backends.memory import model_shape
from localrt.backends.memory import padded
from localrt.backends.speculation import speculative_method
from localrt.backends.speculation import verify_cost_per_draft
from localrt.errors import LocalrtError

from .draft import DraftContext
from .engine import Engine
from .kv import RAM_CACHE_BYTES
from .kv import KVRecord
from .lib import KV_TYPES
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
from .memory import kv_bytes
from .memory import kv_bytes_per_token
from .memory import parallel_for
from .memory import pool_cells
from .memory import step_tokens
from .mtmd import MediaPrompt
from .mtmd import Projector
from .pooled import POOLING_RANK
from .pooled import PooledContexts
from .pooled import is_reranker
from .pooled import rank_tokens
from .runner import Runner
from .scheduler import Scheduler
from .scheduler import copy_threshold
from .sequences import EXACT_ROWS
from .sequences import MAX_VERIFY
from .sequences import PROMPT_WORK
from .sequences import TILED_ROWS
from .sequences import ExternalChunk
from .sequences import PromptItem
from .vocab import Vocab
from .vocab import VocabMethods

# a model's declared pooling (`{arch}.pooling_type`) -> how the engine pools an embedding's hidden rows;
# none declared (a chat model): the mean, as Ollama does; NONE: the last row, as llama.cpp gives then
IN_BATCH_POOLING = {None: "mean", 0: "last", 1: "mean", 2: "cls", 3: "last"}

NAME = "llama.cpp"


class LlamaCppModel(VocabMethods, EngineModel, ModelLifetime):
    backend_name = NAME

    def __init__(self, path: Path, opts: LoadOptions) -> None:
        check_kv_options(opts)
        self.path, self.opts = path, opts
        self.lib = _lib()
        # another model on the same file (another adapter set) shares its weights: its own contexts over them
        self.weights = SharedWeights.acquire(path, opts, self)
        self.model, self.on_gpu = self.weights.model, self.weights.on_gpu
        self.adapters: LoraAdapters | None = None
        self.engine: Engine | None = None  # type: ignore[assignment]
        self._draft_model: Any = None
        self._projector: Projector | None = None
        self._closed = False
        self._active = set()
        self._streams = EngineStreams()
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
        step = step_tokens(opts.num_batch, self.context_length, self.n_parallel)
        invariant = opts.batch_invariant
        # one pool the sequences share, or for batch invariance a stream of a whole context per sequence
        # (padded to 256 as llama.cpp pads each stream)
        self.pool = 0 if invariant else pool_cells(opts.kv_pool, self.context_length, self.n_parallel)
        n_ctx = self.pool or padded(self.context_length) * n_seq_max
        params = context_params(opts, n_ctx, step, n_seq_max, self.threads, unified=not invariant)
        if self._declared_pooling() is not None:
            # hidden states per row when a step embeds (`llama_set_embeddings`): the engine pools them
            # itself, chunk by chunk, where llama.cpp would pool only the rows of one micro-batch
            params.pooling_type = self.lib.LLAMA_POOLING_TYPE_NONE
        self.ctx_params = params
        ctx = create_context(m, params)
        try:
            self.adapters.apply(ctx.ctx)
        except LocalrtError:
            ctx.close()
            raise
        adapters = self.adapters if self.adapters.handles else None
        runner = Runner(m, ctx, step, adapters)
        # in a pool the sliding-window layers keep only their window (lib.context_params)
        n_swa = 0 if invariant else int(self.lib.llama_model_n_swa(m.model))
        scheduler = Scheduler(
            KVRecord(ctx, n_seq_max, RAM_CACHE_BYTES, pool=self.pool, n_swa=n_swa),
            n_parallel=self.n_parallel,
            n_seq_max=n_seq_max,
            n_ctx_seq=self.context_length,
            step_tokens=step,
            # a sequence's prompt rows per step: EXACT_ROWS keeps batching invisible on the CPU's kernels
            # (sequences.py); a GPU's kernels, which that cap was not made for, take every row that fits
            prefill_rows=EXACT_ROWS if invariant and not self.on_gpu else step,
            # a GPU's kernels batch prompt rows for little more than one costs, where PROMPT_WORK was not
            # estimated: every prompt that fits
            prompt_work=None if self.on_gpu else PROMPT_WORK,
            # in a pool a copied prefix is shared, not copied: any is worth it
            copy_min=1 if self.pool else copy_threshold(per_token * self.context_length, int(m.size())),
            last_row_apart=not invariant,
        )
        try:
            draft = self._load_draft(Path(opts.draft_model), params) if opts.draft_model is not None else None
        except BaseException:
            runner.close()
            raise
        self.engine = Engine(
            runner,
            scheduler,
            draft=draft,
            verify_cost=verify_cost_per_draft(self.on_gpu),
            # batch invariance keeps a sequence's rows under the tiled kernel's (sequences.py)
            verify_rows=MAX_VERIFY if invariant else TILED_ROWS,
            # the CPU's attention kernel runs tiled from this many rows of one KV stream (the shared pool)
            tile_rows=TILED_ROWS if self.pool and not self.on_gpu else 0,
            pooling=self._in_batch_pooling(ctx),
            pooled=self._pooled_contexts(),
        )
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
        kv = kv_bytes(model_shape(self.path), opts, self.context_length, self.n_parallel)
        self._own_bytes = kv + (int(self._draft_model.size()) if self._draft_model else 0)
        self._own_bytes += sum(Path(p).stat().st_size for p in opts.adapters)
        if self._projector is not None:
            self._own_bytes += self._projector.size

    def _declared_pooling(self) -> int | None:
        arch = self.metadata.get("general.architecture", "")
        value = self.metadata.get(f"{arch}.pooling_type")
        try:
            return None if value is None else int(float(value))
        except ValueError:
            return None

    def _in_batch_pooling(self, ctx: Any) -> str | None:
        """How an embedding pools in the model's own batch; None where it cannot: an encoder (its attention
        is not causal, or it keeps no KV memory, so it needs the whole input at once) or rank pooling."""
        causal = bool(self.lib.llama_get_causal_attn(ctx.ctx)) and bool(self.lib.llama_get_memory(ctx.ctx))
        declared = self._declared_pooling()
        if not causal or declared not in IN_BATCH_POOLING:
            return None
        return IN_BATCH_POOLING[declared]

    def _pooled_contexts(self) -> PooledContexts:
        lib = self.lib
        # the model's own pooling where it declares one (an encoder's), else the mean, as Ollama does
        declared = self._declared_pooling() not in (None, POOLING_RANK)
        pooling = lib.LLAMA_POOLING_TYPE_UNSPECIFIED if declared else lib.LLAMA_POOLING_TYPE_MEAN
        threads = (self.ctx_params.n_threads, self.ctx_params.n_threads_batch)
        # embeddings and scores come from the adapted weights, as generation does
        apply = self.adapters.apply if self.adapters is not None and self.adapters.handles else None
        return PooledContexts(lib, self.model, pooling, self.context_length, threads, apply)

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
        n_swa = int(self.lib.llama_model_n_swa(model.model)) if params.kv_unified else 0
        return DraftContext(model, create_context(model, params), params.n_seq_max, params.n_batch, n_swa)

    # -- generation --
    async def _prepare(self, request: GenerateRequest) -> EngineRequest:
        self._check_request(request)
        method = speculative_method(
            request.speculative,
            has_draft_model=self._draft_model is not None,
            constrained=request.format is not None,
        )
        if not request.images:
            return EngineRequest(request, method=method)
        # an image's preprocessing is heavy: off the event loop (its encoding runs on the step thread)
        media = await asyncio.to_thread(self._expand_images, request)
        if media is None:
            return EngineRequest(request, method=method)
        try:
            prompt = self._media_items(media)
        except BaseException:
            media.close()
            raise
        return EngineRequest(request, method=method, prompt=prompt, resources=[media])

    # ---- images (mtmd.py) and rerank (pooled.py) ----
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

    def rank_tokens(self, query: str, document: str) -> list[int]:
        """A (query, document) pair's tokens as the reranker reads them."""
        template = self.metadata.get("tokenizer.chat_template.rerank")
        return rank_tokens(self.lib, self.model, template, query, document)

    async def rerank(self, query: str, documents: Sequence[str]) -> tuple[list[float], int]:
        """Relevance scores of documents for query (in order) and the tokens evaluated."""
        check_loaded(self._closed)
        if not self.capabilities.rerank:
            raise LocalrtError("this model is not a reranker (its GGUF has no rank pooling)")
        pairs = [self.rank_tokens(query, document) for document in documents]
        for i, tokens in enumerate(pairs):
            if len(tokens) > self.context_length:
                raise LocalrtError(
                    f"the query and document {i} are {len(tokens)} tokens, more than the reranker's "
                    f"context of {self.context_length}"
                )
        requests = [EngineRequest(GenerateRequest(tokens), "rank") for tokens in pairs]
        scores = await asyncio.gather(*(self._answer(r) for r in requests))
        return [float(s) for s in scores], sum(len(t) for t in pairs)

    def _check_request(self, req: GenerateRequest) -> None:
        check_loaded(self._closed or self.engine is None)
        check_speculative(req.speculative, self.capabilities.speculative, self._draft_model is not None, NAME)
        if req.images and self._projector is None:
            raise LocalrtError("this model has no projector loaded, so it does not support images")
        check_prompt(
            req.prompt_tokens, self.context_length, self.n_vocab, (IMAGE_TOKEN,) if req.images else ()
        )
        self._lora(req)

    def _lora(self, req: GenerateRequest) -> tuple[float, ...]:
        """The request's LoRA scale set (the engine batches only sequences of equal sets); () without
        adapters."""
        adapters = self.adapters
        if adapters is None or not adapters.handles:
            if req.lora:
                raise LocalrtError("lora: this model has no LoRA adapters (ADAPTER) to scale")
            return ()
        return adapters.scales_for(req.lora)

    # -- lifetime --
    def _free(self) -> None:
        self._closed = True
        if self.engine is not None:
            self.engine.stop()  # running requests end with the step in flight
            self.engine.close()  # its contexts sit on the weights, so they go first
        if self._projector is not None:
            self._projector.close()
            self._projector = None
        # the adapters after every context that applies them, before the weights they sit on
        if self.adapters is not None:
            self.adapters.close()
        if self._draft_model is not None:
            self._draft_model.close()
        self.adapters = None
        self.weights.release(self)


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
