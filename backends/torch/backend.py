"""The torch backend: the engine behind the runtime's backend protocol.

Weights come from the GGUF itself: on the CPU kept quantized by default (`quantized.py`, torch's
int4/int8 weight-only kernels; float tensors load dense), dequantized with the load option `numerics`
("dequantized", "exact") and on CUDA (no kept-quantized path there yet); tokens come from llama.cpp's
vocab-only load of the same file, so tokenization is byte-identical to the llama.cpp backend's. Requests
(generation, scores and embeddings alike) are submitted to one engine thread that batches them
continuously (`engine.EngineModel`); each stream is fed from that thread through the event loop, so no
worker thread is held per request.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path
from typing import Any

from localrt.backends.base import NUMERICS
from localrt.backends.base import SPECULATION_METHODS
from localrt.backends.base import Capabilities
from localrt.backends.base import EngineBackend
from localrt.backends.base import GenerateRequest
from localrt.backends.base import LoadOptions
from localrt.backends.base import ModelLifetime
from localrt.backends.base import loaded_context
from localrt.backends.checks import check_draft_tokens
from localrt.backends.checks import check_kv_cache_type
from localrt.backends.checks import check_model_file
from localrt.backends.checks import check_no_adapters
from localrt.backends.engine import EngineModel
from localrt.backends.engine import EngineRequest
from localrt.backends.engine import EngineStreams
from localrt.backends.engine_thread import on_a_thread_of_its_own
from localrt.backends.llamacpp.lib import default_threads
from localrt.backends.llamacpp.vocab import Vocab
from localrt.backends.llamacpp.vocab import VocabMethods
from localrt.errors import OptionError

from .memory import CPU_PARALLEL
from .memory import MAX_SEQS
from .memory import _cuda_available
from .memory import estimate

NAME = "torch"
KV_TYPES_CPU = ("f16", "bf16", "f32", "q8_0")
log = logging.getLogger("localrt.backends.torch")


class TorchModel(VocabMethods, EngineModel, ModelLifetime):
    backend_name = NAME

    def __init__(
        self,
        path: Path,
        opts: LoadOptions,
        *,
        device: str | None = None,
        numerics: str | None = None,
    ) -> None:
        """`device` (None: CUDA when there is one and `opts.num_gpu` is not 0, else the CPU).
        `numerics` (None: the load option `opts.numerics`): "auto" is "quantized" on the CPU and
        "dequantized" on CUDA; "quantized" keeps the weights quantized on the CPU (`quantized.py`: a
        fraction of the dense weights' memory, measured in benchmarks/README.md; float tensors stay
        dense; on CUDA it is "dequantized"); "dequantized" is plain fp32 on the
        dequantized weights on the CPU (the file's exact function; bf16 on CUDA); "exact" is fp32
        everywhere; "llama.cpp" (CPU comparisons only) is fp32 rounded as llama.cpp's CPU kernels
        round activations and attention (`ggml_numerics.py`). `self.numerics` is what was applied:
        "dequantized" when no tensor of the file could stay quantized."""
        # Built on a thread of its own that ends when the model is built. libgomp keeps one pool of
        # workers per thread that ever ran a parallel torch op, and once more OpenMP threads exist
        # than CPUs it cuts their spinning to a few hundred turns, so every parallel region of the
        # engine thread would wait for its workers to wake (benchmarks/README.md). A loader thread
        # that exits takes its pool with it.
        check_no_adapters(opts.adapters, NAME)  # before any weight is read
        on_a_thread_of_its_own(lambda: self._load(path, opts, device, numerics), "localrt-torch-load")

    def _load(self, path: Path, opts: LoadOptions, device: str | None, numerics: str | None) -> None:
        import torch

        from .architectures import settle
        from .engine import Engine
        from .engine import EngineConfig
        from .gguf_load import GGUFTensors

        self.path, self.opts = path, opts
        self.capabilities = TorchBackend.capabilities()
        if device is None:
            device = "cuda" if opts.num_gpu != 0 and _cuda_available() else "cpu"
        self.device = torch.device(device)
        check_kv_cache_type(opts.kv_cache_type, self.capabilities.kv_cache_types, NAME)
        check_model_file(path)
        numerics = opts.numerics if numerics is None else numerics
        if numerics not in NUMERICS:
            raise OptionError(f"numerics {numerics!r} is not one of: {', '.join(NUMERICS)}")
        if self.device.type == "cpu":
            torch.set_num_threads(opts.num_thread or default_threads())
        if numerics in ("auto", "quantized"):  # no kept-quantized path on CUDA yet
            numerics = "quantized" if self.device.type == "cpu" else "dequantized"
        # bf16 on GPUs that have it (fp16 otherwise), fp32 on the CPU, where half matmuls are slow
        if self.device.type == "cuda" and numerics == "dequantized":
            dtype = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        else:
            dtype = torch.float32
        self.numerics = numerics
        self._take_vocab(Vocab.load(path))
        tensors = GGUFTensors(path)
        self.metadata: dict[str, str] = tensors.text_metadata()
        self._tokens = tensors.vocabulary()  # to check a draft model's against
        self.model, self.numerics, kept = self._build(tensors, dtype)
        if kept:
            log.info("%s: numerics %s; weights %s", path.name, self.numerics, kept)
        if numerics == "llama.cpp":
            from . import ggml_numerics

            ggml_numerics.emulate(self.model, tensors)  # the attention's rounding: `self.engine.runner`
        tensors.close()
        draft = None
        if opts.draft_model is not None:
            draft = self._load_draft(Path(opts.draft_model), dtype)
        self.context_length = loaded_context(opts.num_ctx, self.model.cfg.context_length)
        if hasattr(self.model, "fit_context"):  # Phi-3's LongRoPE factors depend on the context length
            self.model.fit_context(self.context_length)
        for model in (self.model, draft):
            if model is not None:
                settle(model)
        config = EngineConfig(
            context_length=self.context_length,
            kv_cache_type=opts.kv_cache_type,
            max_seqs=opts.num_parallel or (CPU_PARALLEL if self.device.type == "cpu" else MAX_SEQS),
            max_batch_tokens=max(64, opts.num_batch),
            eos_token_ids=self.vocab.eog_ids(),
        )
        self.engine = Engine(self.model, config, self.device, draft_model=draft)
        self.engine.runner.fp16_attention = numerics == "llama.cpp"
        self.capabilities = replace(self.capabilities, parallel_slots=config.max_seqs)
        self.memory_bytes = self.engine.weight_bytes() + self.engine.cache.nbytes
        self._active = set()
        self._streams = EngineStreams()
        self.engine.start(self._streams.route)

    def weight_bytes(self) -> int:
        """Resident bytes of the weights (model and draft), as `localrt ps` reports them."""
        return self.engine.weight_bytes()

    def _build(self, tensors: Any, dtype: Any) -> tuple[Any, str, str]:
        """(the model with this load's numerics, the numerics applied, which tensors were kept how):
        "quantized" becomes "dequantized" when no tensor could stay quantized (a float file)."""
        from . import quantized
        from .architectures import load_model

        if self.numerics != "quantized":
            return load_model(tensors, dtype, self.device), self.numerics, ""
        modules = quantized.QuantizedModules(tensors, dtype)
        model = load_model(tensors, dtype, self.device, modules=modules)
        dense = all(label.startswith("dense") for label in modules.counts)
        return model, "dequantized" if dense else "quantized", modules.kept()

    def _load_draft(self, path: Path, dtype: Any) -> Any:
        from .gguf_load import GGUFTensors

        check_model_file(path, "draft model")
        tensors = GGUFTensors(path)
        try:
            check_draft_tokens(path, self._tokens, tensors.vocabulary())
            return self._build(tensors, dtype)[0]
        finally:
            tensors.close()

    # ---- generation -------------------------------------------------------------------------
    async def _prepare(self, request: GenerateRequest) -> EngineRequest:
        method = self._check(request, "draft" in self.engine.proposers, NAME)
        grammar = self._grammar(request)
        return EngineRequest(request, method=method, grammar=grammar, resources=[grammar] if grammar else [])


def capabilities() -> Capabilities:
    """fp8 KV and the CUDA device where torch sees a GPU."""
    cuda = _cuda_available()
    return Capabilities(
        speculative=SPECULATION_METHODS,
        kv_cache_types=(*KV_TYPES_CPU, "fp8") if cuda else KV_TYPES_CPU,
        devices=("cpu", "cuda") if cuda else ("cpu",),
        parallel_slots=MAX_SEQS,
    )


TorchBackend = EngineBackend(NAME, TorchModel, capabilities, estimate=estimate)
