"""The MLX backend: the MLX engine behind the runtime's backend protocol.

Weights come from the GGUF itself (kept quantized where MLX has an exact form); tokens come from
llama.cpp's vocab-only load of the same file, so tokenization is identical to the llama.cpp
backend's. Requests (generation, scores and embeddings alike) are run together by the model's batched
engine (`engine.py`): up to `parallel_slots` sequences per step, a prompt cache over finished
conversations. MLX's streams belong to the thread that created them, so every MLX call of a model
(load, decode, score, embed) runs on the engine's thread; each stream is fed from it through the event
loop, where the text is assembled.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TypeVar

from localrt.backends.base import SPECULATION_METHODS
from localrt.backends.base import Capabilities
from localrt.backends.base import EngineBackend
from localrt.backends.base import GenerateRequest
from localrt.backends.base import LoadOptions
from localrt.backends.base import ModelLifetime
from localrt.backends.base import loaded_context
from localrt.backends.base import modules_installed
from localrt.backends.checks import check_draft_tokens
from localrt.backends.checks import check_kv_cache_type
from localrt.backends.checks import check_model_file
from localrt.backends.checks import check_no_adapters
from localrt.backends.engine import EngineModel
from localrt.backends.engine import EngineRequest
from localrt.backends.engine import EngineStreams
from localrt.backends.llamacpp.vocab import Vocab
from localrt.backends.llamacpp.vocab import VocabMethods
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
        from .engine import Engine

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
        self._streams = EngineStreams()
        self._take_vocab(Vocab.load(path))
        self._eog = set(self.vocab.eog_ids())
        # the engine's thread exists before the model: it makes every MLX array the model uses
        self.engine = Engine(opts.kv_cache_type, opts.num_batch)
        self.engine.start(self._streams.route)
        self._load_or_free(lambda: self._call(lambda: self._load(opts)))

    def _load(self, opts: LoadOptions) -> None:
        import mlx.core as mx

        from .architectures import load_model
        from .cache import KV_GROUP
        from .cache import SLACK
        from .cache import kv_dtype
        from .engine import Speculation
        from .gguf_load import GGUFTensors
        from .llama import Transformer
        from .prompt_cache import PromptCache

        # fp16 on Apple GPUs; fp32 on the CPU, where MLX's half matmuls are slower and inexact
        self.dtype = mx.float16 if _on_gpu() else mx.float32
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
        self_spec_layers = max(1, cfg.block_count - max(1, cfg.block_count // 10))
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
        draft_cost = 0.0 if self.draft_model is None else self.draft_model.nbytes / self.model.nbytes
        speculation = Speculation(
            self.draft_model, draft_cost, self_spec_layers, verify_cost_per_draft(_on_gpu())
        )
        self.engine.attach(
            self.model,
            max_rows=self.slots,
            prompt_cache=PromptCache(budget),
            eog=self._eog,
            context_length=self.context_length,
            speculation=speculation,
        )

    def _call(self, fn: Callable[[], T]) -> T:
        """Run fn on the engine's thread and wait for it (load)."""
        return self.engine.call(fn).result()

    # ---- generation -------------------------------------------------------------------------
    async def _prepare(self, request: GenerateRequest) -> EngineRequest:
        method = self._check(request, self.draft_model is not None, "MLX")
        grammar = self._grammar(request)
        return EngineRequest(request, method=method, grammar=grammar, resources=[grammar] if grammar else [])


def capabilities() -> Capabilities:
    return Capabilities(
        speculative=SPECULATION_METHODS,
        kv_cache_types=KV_CACHE_TYPES,
        devices=("gpu",) if _on_gpu() else ("cpu",),
        parallel_slots=MAX_SLOTS,
    )


MLXBackend = EngineBackend(NAME, MLXModel, capabilities, availability=mlx_status, estimate=estimate)
