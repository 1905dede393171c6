"""The torch backend: the engine behind the runtime's backend protocol.

Weights come from the GGUF itself: on the CPU kept quantized by default (`quantized.py`, torch's
int4/int8 weight-only kernels; float tensors load dense), dequantized with the load option `numerics`
("dequantized", "exact") and on CUDA (no kept-quantized path there yet); tokens come from llama.cpp's vocab-only
load of the same file, so tokenization is byte-identical to the llama.cpp backend's. Requests are
submitted to one engine thread that batches them continuously; each `generate` stream is fed from
that thread through the event loop, so no worker thread is held per request.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, ClassVar

from localrt.backends.base import (
    NUMERICS,
    Capabilities,
    DoneEvent,
    Event,
    GenerateRequest,
    LoadOptions,
    ModelLifetime,
    ScoreResult,
    TextAssembler,
    TokenLogprob,
    loaded_context,
    modules_installed,
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
from localrt.backends.llamacpp.lib import default_threads
from localrt.backends.llamacpp.vocab import Vocab, VocabMethods
from localrt.backends.outputs import embedding_tokens, empty_score, token_logprob, unit_vector
from localrt.backends.speculation import speculative_method
from localrt.errors import OptionError

NAME = "torch"
PIP_HINT = "pip install 'localrt[torch]'"
KV_TYPES_CPU = ("f16", "bf16", "f32", "q8_0")
MAX_SEQS = 16
CPU_PARALLEL = 4  # sequences decoded together on the CPU when LOCALRT_NUM_PARALLEL is unset
SCORE_HEAD_ROWS = 256  # logits computed this many rows at a time (the head is n x vocab)
log = logging.getLogger("localrt.backends.torch")


def _torch() -> Any:
    import torch

    return torch


def _cuda_available() -> bool:
    try:
        return bool(_torch().cuda.is_available())
    except Exception:
        return False


class TorchBackend:
    name: ClassVar[str] = NAME

    @classmethod
    def availability(cls) -> tuple[bool, str]:
        return modules_installed(("torch", "numpy", "llama_cpp"), PIP_HINT)

    @classmethod
    def capabilities(cls) -> Capabilities:
        cuda = _cuda_available()
        return Capabilities(
            grammar=True,
            speculative=frozenset({"draft", "lookup", "self"}),
            kv_cache_types=(*KV_TYPES_CPU, "fp8") if cuda else KV_TYPES_CPU,
            devices=("cpu", "cuda") if cuda else ("cpu",),
            parallel_slots=MAX_SEQS,
        )

    @classmethod
    def load(cls, path: Path | str, opts: LoadOptions) -> TorchModel:
        return TorchModel(Path(path), opts)


class TorchModel(VocabMethods, ModelLifetime):
    backend_name = NAME

    def __init__(
        self,
        path: Path,
        opts: LoadOptions,
        *,
        kv_budget_bytes: int | None = None,
        max_batch_tokens: int | None = None,
        self_spec_layers: int | None = None,
        device: str | None = None,
        numerics: str | None = None,
    ) -> None:
        """`numerics` (None: the load option `opts.numerics`): "auto" is "quantized" on the CPU and
        "dequantized" on CUDA; "quantized" keeps the weights quantized on the CPU (`quantized.py`:
        about 1.3x the file instead of 5.6x, top-1 98.2% against exact on SmolLM2 Q4_1; float
        tensors stay dense; on CUDA it is "dequantized"); "dequantized" is plain fp32 on the
        dequantized weights on the CPU (the file's exact function; bf16 on CUDA); "exact" is fp32
        everywhere; "llama.cpp" (CPU comparisons only) is fp32 rounded as llama.cpp's CPU kernels
        round activations and attention (`ggml_numerics.py`). `self.numerics` is what was applied:
        "dequantized" when no tensor of the file could stay quantized."""
        torch = _torch()
        from .engine import Engine, EngineConfig
        from .gguf_load import GGUFTensors

        t0 = time.perf_counter_ns()
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

            ggml_numerics.emulate(self.model, tensors)
        tensors.close()
        draft = None
        if opts.draft_model is not None:
            draft = self._load_draft(Path(opts.draft_model), dtype)
        self.context_length = loaded_context(opts.num_ctx, self.model.cfg.context_length)
        config = EngineConfig(
            context_length=self.context_length,
            kv_cache_type=opts.kv_cache_type,
            kv_budget_bytes=kv_budget_bytes,
            max_seqs=opts.num_parallel or (CPU_PARALLEL if self.device.type == "cpu" else MAX_SEQS),
            max_batch_tokens=max_batch_tokens or max(64, opts.num_batch),
            self_spec_layers=self_spec_layers,
            eos_token_ids=self.vocab.eog_ids(),
        )
        self.engine = Engine(self.model, config, self.device, draft_model=draft)
        self.capabilities = replace(self.capabilities, parallel_slots=config.max_seqs)
        if numerics == "llama.cpp":
            from .ggml_numerics import GGMLDenseCausal

            self.engine.dense_attention = GGMLDenseCausal  # score and embed see llama.cpp's f16 attention
        if self.numerics == "quantized":
            from .attention import StoredKVCausal

            # score and embed in the paged path's arithmetic: its logprobs, not nearby ones
            cache = self.engine.cache
            self.engine.dense_attention = lambda n, device: StoredKVCausal(cache, n, device)
        self.memory_bytes = self.engine.weight_bytes() + self.engine.cache.nbytes
        self._active = set()
        self._lock = threading.Lock()
        self._queues: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Queue[Any]]] = {}
        self.engine.start(self._route)
        self.load_ns = time.perf_counter_ns() - t0

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
            draft_tokens = tensors.vocabulary()
            check_draft_vocabulary(
                path, len(self._tokens), len(draft_tokens), self._tokens.__getitem__, draft_tokens.__getitem__
            )
            return self._build(tensors, dtype)[0]
        finally:
            tensors.close()

    # ---- generation -------------------------------------------------------------------------
    def _check(self, req: GenerateRequest) -> None:
        check_loaded(self._closed)
        has_draft = "draft" in self.engine.proposers
        check_speculative(req.speculative, self.capabilities.speculative, has_draft, NAME)
        check_prompt(req.prompt_tokens, self.context_length, self.n_vocab)

    def generate(self, request: GenerateRequest) -> AsyncIterator[Event]:
        return self._stream(request)

    def _sequence(self, req: GenerateRequest) -> tuple[Any, Grammar | None]:
        """The engine sequence for a request (and its grammar, which the stream closes)."""
        mode = speculative_method(
            req.speculative,
            has_draft_model="draft" in self.engine.proposers,
            constrained=req.format is not None,
        )
        grammar = None
        if req.format is not None:
            grammar = Grammar(self.vocab.lib, self.vocab.vocab, self.n_vocab, req.format)
        want_lp = req.logprobs or req.top_logprobs > 0
        try:
            seq = self.engine.new_sequence(
                req.prompt_tokens,
                req.sampling,
                max_new=req.num_predict,
                speculative=mode,
                num_draft=req.num_draft,
                cancel=req.cancel,
                grammar=grammar,
                top_logprobs=req.top_logprobs if want_lp else -1,
            )
        except BaseException:
            if grammar is not None:
                grammar.close()
            raise
        return seq, grammar

    def _route(self, outputs: list[Any]) -> None:
        """The engine thread's sink: each output to its request's queue, nothing else done here."""
        with self._lock:
            targets = [(self._queues.get(out.seq.seq_id), out) for out in outputs]
        for target, out in targets:
            if target is not None:
                loop, queue = target
                loop.call_soon_threadsafe(queue.put_nowait, out)

    async def _stream(self, req: GenerateRequest) -> AsyncIterator[Event]:
        self._check(req)
        seq, grammar = self._sequence(req)
        queue: asyncio.Queue[Any] = asyncio.Queue()
        with self._lock:
            self._queues[seq.seq_id] = (asyncio.get_running_loop(), queue)
        stream = _Stream(self, seq, TextAssembler(req.stop), req.preserve_tokens)
        self._active.add(req.cancel)
        try:
            self.engine.submit(seq)
            while not stream.done:
                for event in stream.events(
                    await queue.get()
                ):  # detokenize and stop strings: here, not the engine
                    yield event
        finally:
            self._active.discard(req.cancel)
            with self._lock:
                self._queues.pop(seq.seq_id, None)
            if not seq.finished:
                # the consumer left early or a stop string matched: cancel, and wait until the engine
                # has freed the sequence
                req.cancel.cancel()
                while not seq.finished and not self._closed:
                    await asyncio.sleep(0.005)
            if grammar is not None and (seq.finished or self._closed):
                grammar.close()

    def _logprob(self, token: int, logprob: float, top: list[tuple[int, float]]) -> TokenLogprob:
        return token_logprob(token, logprob, top, self.detokenize)

    # ---- scoring and embeddings ---------------------------------------------------------------
    async def score(self, tokens: Sequence[int], return_logits: bool = False) -> ScoreResult:
        ids = list(tokens)
        check_loaded(self._closed)
        check_scored(ids, self.context_length, self.n_vocab)
        return await asyncio.wrap_future(self.engine.call(lambda: self._score(ids, return_logits)))

    def _score(self, ids: list[int], return_logits: bool) -> ScoreResult:
        torch = _torch()
        n = len(ids)
        result = empty_score(n, self.n_vocab, return_logits)
        if n < 2:
            return result
        hidden = self.engine.hidden_states(ids)  # [n, dim]
        targets = torch.tensor(ids[1:], device=self.device)
        # log-softmax and gather on the device: only the chosen logprobs cross to the host
        for s in range(0, n - 1, SCORE_HEAD_ROWS):
            e = min(s + SCORE_HEAD_ROWS, n - 1)
            rows = self.model.output(hidden[s:e]).float()  # [rows, vocab]
            lp = torch.log_softmax(rows.double(), -1)
            result.logprobs[s:e] = lp.gather(1, targets[s:e, None]).squeeze(1).cpu().numpy()
            if result.logits is not None:
                result.logits[s:e] = rows.cpu().numpy()
        return result

    async def embed(self, texts: Sequence[str]) -> list[list[float]]:
        check_loaded(self._closed)
        batches = [embedding_tokens(self.tokenize, t, self.context_length, self.eos_token_ids) for t in texts]
        return await asyncio.wrap_future(self.engine.call(lambda: [self._embed(ids) for ids in batches]))

    def _embed(self, ids: list[int]) -> list[float]:
        # mean over tokens of the final-normed hidden states, as llama.cpp's mean pooling
        return unit_vector(self.engine.hidden_states(ids).double().mean(0).cpu().numpy())

    # ---- lifetime -----------------------------------------------------------------------------
    def _free(self) -> None:
        self.engine.stop()
        self.vocab.model.close()


class _Stream:
    """One request's engine outputs -> protocol events, on the event loop (text, stop strings, timings)."""

    def __init__(self, model: TorchModel, seq: Any, text: TextAssembler, preserve: frozenset[int]) -> None:
        self.model, self.seq, self.text = model, seq, text
        self.preserve = preserve  # special tokens whose text stays in the output (thinking markers)
        self.start_ns = time.perf_counter_ns()
        self.generated = 0
        self.done = False

    def events(self, out: Any) -> list[Event]:
        events: list[Event] = []
        for j, token in enumerate(out.tokens):
            self.generated += 1
            lp = out.logprob[j]
            logprob = None if lp is None else self.model._logprob(token, lp, out.top[j])
            event, stopped = self.text.add(
                token, self.model.vocab.piece(token, token in self.preserve), logprob
            )
            if event is not None:
                events.append(event)
            if stopped:  # a stop string: the rest of the step's tokens are not the answer
                return [*events, *self._finish("stop", ended=False)]
        if out.finish is not None:
            if self.seq.error is not None:
                raise self.seq.error
            events.extend(self._finish(out.finish, ended=True))
        return events

    def _finish(self, reason: str, ended: bool) -> list[Event]:
        """The tail text and the done event; `ended`: the engine finished the sequence (else a stop string)."""
        self.done = True
        events: list[Event] = []
        tail = self.text.finish()
        if tail is not None:
            events.append(tail)
        s = self.seq
        t = s.timings.set_durations(self.start_ns, s.first_token_ns, time.perf_counter_ns())
        t.prompt_eval_count = s.prefill_fed
        t.eval_count = s.num_generated if ended else self.generated  # the engine's count has the end token
        events.append(DoneEvent(reason, t, stop_sequence=self.text.stop_sequence))  # type: ignore[arg-type]
        return events
