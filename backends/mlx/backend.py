"""The MLX backend: the MLX engine behind the runtime's backend protocol.

Weights come from the GGUF itself (kept quantized where MLX has an exact form); tokens come from
llama.cpp's vocab-only load of the same file, so tokenization is identical to the llama.cpp
backend's. Requests are decoded together by the model's batched engine (`batch.py`): up to
`parallel_slots` sequences per step, a prompt cache over finished conversations. MLX's streams belong
to the thread that created them, so every MLX call of a model (load, decode, score, embed) runs on
the engine's thread; each `generate` stream is fed from it through the event loop, where the text is
assembled.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any
from typing import TypeVar

import numpy as np

from localrt.backends.base import SPECULATION_METHODS
from localrt.backends.base import Capabilities
from localrt.backends.base import DoneEvent
from localrt.backends.base import EngineBackend
from localrt.backends.base import Event
from localrt.backends.base import GenerateRequest
from localrt.backends.base import LoadOptions
from localrt.backends.base import ModelLifetime
from localrt.backends.base import ScoreResult
from localrt.backends.base import Timings
from localrt.backends.base import loaded_context
from localrt.backends.base import modules_installed
from localrt.backends.checks import check_draft_tokens
from localrt.backends.checks import check_kv_cache_type
from localrt.backends.checks import check_model_file
from localrt.backends.checks import check_no_adapters
from localrt.backends.engine_thread import EngineModel
from localrt.backends.engine_thread import EngineStreams
from localrt.backends.engine_thread import OutputStream
from localrt.backends.grammar import Grammar
from localrt.backends.llamacpp.vocab import Vocab
from localrt.backends.llamacpp.vocab import VocabMethods
from localrt.backends.lookup import NgramProposer
from localrt.backends.outputs import SCORE_HEAD_ROWS
from localrt.backends.outputs import fill_score
from localrt.backends.speculation import SpecState
from localrt.backends.speculation import verify_cost_per_draft
from localrt.errors import OptionError

from .blas import active as blas_active
from .blas import install as install_blas
from .memory import DEFAULT_SLOTS
from .memory import MAX_SLOTS
from .memory import _on_gpu
from .memory import estimate

NAME = "mlx"
PIP_HINT = "pip install 'localrt[mlx]' (on Linux that installs mlx[cpu])"
KV_CACHE_TYPES = ("f16", "bf16", "f32", "q8_0")
T = TypeVar("T")
log = logging.getLogger(__name__)


def mlx_status() -> tuple[bool, str]:
    """Whether `import mlx.core` works here: on Linux the `mlx` package alone has no CPU library."""
    installed, why_not = modules_installed(("mlx", "numpy", "llama_cpp", "gguf"), PIP_HINT)
    if not installed:
        return False, why_not
    try:
        install_blas()  # before MLX's first import, or never (blas.py)
        import mlx.core  # noqa: F401
    except OptionError as e:
        return False, str(e)
    except ImportError as e:
        return False, f"mlx is installed but cannot load ({e}); {PIP_HINT}"
    return True, ""


def _lay_out_rows() -> None:
    """On an optimized BLAS, find the row layout that keeps batching invisible (rows.py), once."""
    from . import rows

    if rows.LAYOUT is None:
        rows.LAYOUT = rows.probe()
        if rows.LAYOUT is None:
            log.warning(
                "no row layout keeps this BLAS's products row-invariant: batching is not bit-invisible"
            )


class MLXModel(VocabMethods, EngineModel, ModelLifetime):
    backend_name = NAME

    def __init__(self, path: Path, opts: LoadOptions) -> None:
        install_blas()  # before `batch` imports MLX (blas.py)
        from .batch import BatchEngine

        self.path, self.opts = path, opts
        self.capabilities = MLXBackend.capabilities()
        check_kv_cache_type(opts.kv_cache_type, KV_CACHE_TYPES, "MLX")
        check_model_file(path)
        check_no_adapters(opts.adapters, "MLX")
        if opts.draft_model is not None:
            check_model_file(opts.draft_model, "draft model")
        self.slots = min(MAX_SLOTS, opts.num_parallel or DEFAULT_SLOTS["gpu" if _on_gpu() else "cpu"])
        self.capabilities = replace(self.capabilities, parallel_slots=self.slots)
        self._active = set()
        self._streams = EngineStreams(lambda out: out.row.id)
        self._take_vocab(Vocab.load(path))
        self._eog = set(self.vocab.eog_ids())
        # the engine's thread exists before the model: it makes every MLX array the model uses
        self.engine = BatchEngine(opts.kv_cache_type, opts.num_batch)
        self.engine.start(self._streams.route)
        self._load_or_free(lambda: self._call(lambda: self._load(opts)))

    def _load(self, opts: LoadOptions) -> None:
        import mlx.core as mx

        from .architectures import load_model
        from .cache import KV_GROUP
        from .cache import SLACK
        from .cache import kv_dtype
        from .engine import Runner
        from .gguf_load import GGUFTensors
        from .llama import Transformer
        from .prompt_cache import PromptCache

        # fp16 on Apple GPUs; fp32 on the CPU, where MLX's half matmuls are slower and inexact
        self.dtype = mx.float16 if _on_gpu() else mx.float32
        self.verify_cost = verify_cost_per_draft(_on_gpu())
        tensors = GGUFTensors(self.path)
        self.metadata: dict[str, str] = tensors.text_metadata()
        tokens = tensors.vocabulary()  # to check a draft model's against
        self.model = load_model(tensors, self.dtype)
        tensors.close()
        if blas_active():  # the quantized matmul is MLX's own kernel: only dense products reach the BLAS
            self.model.dense_weights()
            _lay_out_rows()
        cfg = self.model.cfg
        self.context_length = loaded_context(opts.num_ctx, cfg.context_length)
        if opts.kv_cache_type == "q8_0" and cfg.attention_key_length % KV_GROUP:
            raise OptionError(
                f"kv_cache_type q8_0 needs a head size that is a multiple of {KV_GROUP} "
                f"(this model's is {cfg.attention_key_length})"
            )
        # the exit must sit near the top to agree with the full model: on SmolLM2-135M the argmax of
        # 24 of 30 layers matches 26% of the time on copied text, of 27 layers 49%
        self.self_spec_layers = max(1, cfg.block_count - max(1, cfg.block_count // 10))
        kv_per_token = 2 * cfg.attention_head_count_kv * cfg.attention_key_length  # one layer's
        kv_bytes = 1.125 if opts.kv_cache_type == "q8_0" else kv_dtype(opts.kv_cache_type, self.dtype).size
        # a sliding layer's rotating cache holds its window, its slack and one chunk at most
        held = [
            min(self.context_length, w + 2 * SLACK + opts.num_batch) if w else self.context_length
            for w in self.model.windows
        ]
        context_kv = int(kv_per_token * kv_bytes * sum(held))
        self.memory_bytes = self.model.nbytes + context_kv * self.slots
        # the prompt cache keeps finished conversations' caches up to the KV of `parallel_slots` full contexts
        budget = context_kv * self.slots
        self.engine.attach(self.model, max_rows=self.slots, prompt_cache=PromptCache(budget), eog=self._eog)
        self.draft_model: Transformer | None = None
        if opts.draft_model is not None:
            dt = GGUFTensors(Path(opts.draft_model))
            check_draft_tokens(opts.draft_model, tokens, dt.vocabulary())
            draft_model = load_model(dt, self.dtype)
            dt.close()
            if blas_active():
                draft_model.dense_weights()
            self.memory_bytes += draft_model.nbytes
            self.draft_model = draft_model
        self.draft_cost = 0.0 if self.draft_model is None else self.draft_model.nbytes / self.model.nbytes
        self._new_runner = lambda m: Runner(m, opts.kv_cache_type, opts.num_batch)

    def _call(self, fn: Callable[[], T]) -> T:
        """Run fn on the engine's thread and wait for it (load)."""
        return self.engine.call(fn).result()

    # ---- generation -------------------------------------------------------------------------
    def _row(self, req: GenerateRequest, mode: str, grammar: Grammar | None) -> Any:
        """The engine row of a request: sampler, limits, its own proposer (on its own caches)."""
        from .engine import DraftModelProposer
        from .engine import SelfOnRow
        from .sampling import RowSampler

        prompt = list(req.prompt_tokens)
        room = self.context_length - len(prompt)
        max_tokens = len(prompt) + (room if req.num_predict < 0 else min(req.num_predict, room))
        row = self.engine.new_row(
            prompt,
            RowSampler(req.sampling, self.context_length, grammar),
            max_tokens,
            cancel=req.cancel,
            top_logprobs=req.top_logprobs if req.wants_logprobs else -1,
        )
        if mode == "lookup":  # the SpecState's own n-gram index proposes (backends/lookup.py)
            row.spec = SpecState.begin(mode, req.num_draft, NgramProposer.cost_per_draft, self.verify_cost)
        elif mode == "draft" and self.draft_model is not None:
            row.proposer = DraftModelProposer(self._new_runner(self.draft_model), self.draft_cost)
        elif mode == "self":  # the row's own caches, once the engine gives them
            cost = self.self_spec_layers / self.model.cfg.block_count
            row.proposer = SelfOnRow(row, self.self_spec_layers, cost)
        if row.proposer is not None:
            row.spec = SpecState.begin(mode, req.num_draft, row.proposer.cost_per_draft, self.verify_cost)
        return row

    async def generate(self, request: GenerateRequest) -> AsyncIterator[Event]:
        mode = self._check(request, self.draft_model is not None, "MLX")
        grammar = self._grammar(request)
        start_ns = time.perf_counter_ns()
        if request.num_predict == 0:  # nothing to generate
            if grammar is not None:
                grammar.close()
            yield DoneEvent("length", Timings())
            return
        row = self._row(request, mode, grammar)
        # the engine's own count has the end token; a stop string ends the answer at its tokens
        stream = OutputStream(
            self, request, lambda n: self._timings(row, start_ns, row.generated if n is None else n)
        )
        async with self._streams.open(
            self, row.id, request.cancel, lambda: row.finish is not None, grammar
        ) as queue:
            self.engine.submit(row, request.cancel)
            async for event in stream.read(queue, lambda: row.error):
                yield event

    def _timings(self, row: Any, start_ns: int, generated: int) -> Timings:
        """The done event's timings (`generated`: tokens counted, an end token included)."""
        spec = row.spec
        return Timings(
            prompt_eval_count=row.prompt_eval_count,
            eval_count=generated,
            draft_count=spec.drafted if spec is not None else 0,
            draft_accepted_count=spec.accepted if spec is not None else 0,
            cached_count=row.cached_count,
        ).set_durations(start_ns, row.first_token_ns, time.perf_counter_ns())

    # ---- scoring and embeddings ---------------------------------------------------------------
    def _hidden(self, ids: list[int]) -> Any:
        """Final-normed hidden states [n, dim] of one sequence, on fresh caches (the chat's are kept)."""
        import mlx.core as mx

        caches = self.model.make_caches(self.opts.kv_cache_type)
        chunks = []
        step = max(1, self.opts.num_batch)
        for s in range(0, len(ids), step):
            h = self.model.hidden(mx.array(ids[s : s + step], dtype=mx.int32), caches)
            mx.eval(h)
            chunks.append(h)
        return mx.concatenate(chunks)

    def _score(self, ids: list[int], result: ScoreResult) -> ScoreResult:
        n = len(ids)
        hidden = self._hidden(ids[:-1])  # [n-1, dim]: the last token predicts nothing scored
        for s in range(0, n - 1, SCORE_HEAD_ROWS):
            fill_score(result, ids, s, np.array(self.model.logits(hidden[s : s + SCORE_HEAD_ROWS])))
        return result

    def _hidden_rows(self, ids: list[int]) -> np.ndarray:
        return np.array(self._hidden(ids))


def capabilities() -> Capabilities:
    return Capabilities(
        speculative=SPECULATION_METHODS,
        kv_cache_types=KV_CACHE_TYPES,
        devices=("gpu",) if _on_gpu() else ("cpu",),
        parallel_slots=MAX_SLOTS,
    )


MLXBackend = EngineBackend(NAME, MLXModel, capabilities, availability=mlx_status, estimate=estimate)
