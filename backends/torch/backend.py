"""The torch backend: the engine behind the runtime's backend protocol.

Weights come from the GGUF itself (dequantized on load); tokens come from llama.cpp's vocab-only
load of the same file, so tokenization is byte-identical to the llama.cpp backend's. Requests are
submitted to one engine thread that batches them continuously; each `generate` stream is fed from
that thread through the event loop, so no worker thread is held per request.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import threading
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from localrt.backends.base import (
    Capabilities,
    DoneEvent,
    Event,
    GenerateRequest,
    LoadOptions,
    ScoreResult,
    TextAssembler,
    TokenLogprob,
    TopLogprob,
)
from localrt.backends.grammar import Grammar
from localrt.backends.vocab import Vocab, VocabMethods
from localrt.errors import LocalrtError, OptionError

NAME = "torch"
PIP_HINT = "pip install 'localrt[torch]'"
KV_TYPES_CPU = ("f16", "bf16", "f32", "q8_0")
MAX_SEQS = 16
SCORE_HEAD_ROWS = 256  # logits computed this many rows at a time (the head is n x vocab)


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
        for module in ("torch", "numpy", "llama_cpp"):
            if importlib.util.find_spec(module) is None:
                why = "its tokenizer is llama.cpp's" if module == "llama_cpp" else "it is required"
                return False, f"{module} is not installed ({why}); {PIP_HINT}"
        return True, ""

    @classmethod
    def capabilities(cls) -> Capabilities:
        cuda = _cuda_available()
        return Capabilities(
            chat=True,
            embedding=True,
            score=True,
            grammar=True,
            speculative=frozenset({"draft", "lookup", "self"}),
            kv_cache_types=(*KV_TYPES_CPU, "fp8") if cuda else KV_TYPES_CPU,
            devices=("cpu", "cuda") if cuda else ("cpu",),
            parallel_slots=MAX_SEQS,
        )

    @classmethod
    def load(cls, path: Path | str, opts: LoadOptions) -> TorchModel:
        return TorchModel(Path(path), opts)


def _threads(opts: LoadOptions) -> int:
    if opts.num_thread > 0:
        return opts.num_thread
    try:
        available = len(os.sched_getaffinity(0))
    except AttributeError:
        available = os.cpu_count() or 1
    return available if available <= 4 else max(4, available // 2)


class TorchModel(VocabMethods):
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
        numerics: str = "default",
    ) -> None:
        """`numerics="llama.cpp"` (opt-in, CPU comparisons only): round activations and attention as
        llama.cpp's CPU kernels do (`ggml_numerics.py`); the default is plain fp32 on the dequantized weights."""
        torch = _torch()
        from .engine import Engine, EngineConfig
        from .gguf_load import GGUFTensors
        from .model import Transformer, param_bytes

        t0 = time.perf_counter_ns()
        self.path, self.opts = path, opts
        self.capabilities = TorchBackend.capabilities()
        if device is None:
            device = "cuda" if opts.num_gpu != 0 and _cuda_available() else "cpu"
        self.device = torch.device(device)
        if opts.kv_cache_type not in self.capabilities.kv_cache_types:
            raise OptionError(
                f"kv_cache_type {opts.kv_cache_type!r} is not supported by the torch backend here "
                f"(supported: {', '.join(self.capabilities.kv_cache_types)})"
            )
        if not path.is_file():
            raise LocalrtError(f"model file not found: {path}")
        if self.device.type == "cpu":
            torch.set_num_threads(_threads(opts))
        # bf16 on GPUs that have it (fp16 otherwise), fp32 on the CPU, where half matmuls are slow
        if self.device.type == "cuda":
            dtype = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        else:
            dtype = torch.float32
        self.vocab = Vocab(path)
        tensors = GGUFTensors(path)
        self.metadata: dict[str, str] = {
            k: str(v)
            for k, v in tensors.metadata.items()
            if not isinstance(v, (list, tuple)) and not hasattr(v, "tobytes")
        }
        self.model = Transformer.from_gguf(tensors, dtype, self.device)
        if numerics not in ("default", "llama.cpp"):
            raise OptionError(f"numerics {numerics!r} is not one of: default, llama.cpp")
        self.numerics = numerics
        if numerics == "llama.cpp":
            from . import ggml_numerics

            ggml_numerics.emulate(self.model, tensors)
        tensors.close()
        draft = None
        if opts.draft_model is not None:
            draft = self._load_draft(Path(opts.draft_model), dtype)
        cfg = self.model.cfg
        train_ctx = cfg.context_length
        self.context_length = max(16, min(opts.num_ctx, train_ctx) if train_ctx > 0 else opts.num_ctx)
        self.n_vocab = self.vocab.n_vocab
        self.bos_token_id = self.vocab.bos_token_id
        self.eos_token_ids = self.vocab.eos_token_ids
        self.add_bos = self.vocab.add_bos
        config = EngineConfig(
            context_length=self.context_length,
            kv_cache_type=opts.kv_cache_type,
            kv_budget_bytes=kv_budget_bytes,
            max_seqs=opts.num_parallel or MAX_SEQS,
            max_batch_tokens=max_batch_tokens or max(64, opts.num_batch),
            self_spec_layers=self_spec_layers,
            eos_token_ids=self.vocab.eog_ids(),
        )
        self.engine = Engine(self.model, config, self.device, draft_model=draft)
        self.capabilities = replace(self.capabilities, parallel_slots=config.max_seqs)
        if numerics == "llama.cpp":
            from .ggml_numerics import GGMLDenseCausal

            self.engine.dense_attention = GGMLDenseCausal  # score and embed see llama.cpp's f16 attention
        self.memory_bytes = param_bytes(self.model) + self.engine.cache.nbytes
        if draft is not None:
            self.memory_bytes += param_bytes(draft)
        self._closed = False
        self._active: set[Any] = set()
        self._lock = threading.Lock()
        self.engine.start()
        self.load_ns = time.perf_counter_ns() - t0

    def _load_draft(self, path: Path, dtype: Any) -> Any:
        from .gguf_load import GGUFTensors
        from .model import Transformer

        if not path.is_file():
            raise LocalrtError(f"draft model file not found: {path}")
        tensors = GGUFTensors(path)
        draft_vocab = tensors.metadata.get("tokenizer.ggml.tokens")
        if draft_vocab is None or len(draft_vocab) != self.vocab.n_vocab:
            raise LocalrtError(f"draft model {path.name} does not share the model's vocabulary")
        draft = Transformer.from_gguf(tensors, dtype, self.device)
        tensors.close()
        return draft

    # ---- generation -------------------------------------------------------------------------
    def _check(self, req: GenerateRequest) -> None:
        if self._closed:
            raise LocalrtError("the model was unloaded")
        mode = req.speculative
        if mode not in ("off", "auto") and mode not in self.capabilities.speculative:
            raise OptionError(f"speculative mode {mode!r} is not supported by the torch backend")
        if mode == "draft" and "draft" not in self.engine.proposers:
            raise OptionError(
                "speculative 'draft' needs a draft model: set the draft_model option (or --draft NAME)"
            )
        bad = [t for t in req.prompt_tokens if not 0 <= t < self.n_vocab]
        if bad:
            raise LocalrtError(f"token id {bad[0]} is outside the vocabulary (0..{self.n_vocab - 1})")

    def generate(self, request: GenerateRequest) -> AsyncIterator[Event]:
        return self._stream(request)

    async def _stream(self, req: GenerateRequest) -> AsyncIterator[Event]:
        self._check(req)
        mode = req.speculative
        if mode == "auto":
            mode = "draft" if "draft" in self.engine.proposers else "off"
        grammar = None
        if req.format is not None:  # constrained: sampled token by token, drafts would skip the grammar
            grammar = Grammar(self.vocab.lib, self.vocab.vocab, self.n_vocab, req.format)
            mode = "off"
        try:
            seq = self.engine.new_sequence(
                req.prompt_tokens,
                req.sampling,
                max_new=req.num_predict,
                speculative=mode,
                num_draft=req.num_draft,
                cancel=req.cancel,
                grammar=grammar,
            )
        except BaseException:
            if grammar is not None:
                grammar.close()
            raise
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Any] = asyncio.Queue()
        text = TextAssembler(req.stop)
        want_lp = req.logprobs or req.top_logprobs > 0
        start_ns = time.perf_counter_ns()

        def put(item: Any) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, item)

        def on_token(s: Any, token: int, logits: Any) -> bool:  # engine thread
            lp = self._logprob(logits, token, req.top_logprobs) if want_lp else None
            event, stopped = text.add(token, self.vocab.piece(token, token in req.preserve_tokens), lp)
            if event is not None:
                put(event)
            return stopped

        def on_finish(s: Any, reason: str) -> None:  # engine thread
            if s.error is not None:
                put(s.error)
                return
            tail = text.finish()
            if tail is not None and (tail.text or tail.token_ids):
                put(tail)
            t = s.timings
            now = time.perf_counter_ns()
            first = s.first_token_ns or now
            t.prompt_eval_count = s.prefill_fed
            t.prompt_eval_ns = max(1, first - start_ns)
            t.eval_count = s.num_generated
            t.eval_ns = max(1, now - first)
            put(DoneEvent(reason, t))  # type: ignore[arg-type]

        seq.on_token, seq.on_finish = on_token, on_finish
        self._active.add(req.cancel)
        try:
            self.engine.submit(seq)
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if isinstance(item, DoneEvent):
                    return
        finally:
            self._active.discard(req.cancel)
            if not seq.finished:
                # the consumer left early: cancel, and wait until the engine has freed the sequence
                req.cancel.cancel()
                while not seq.finished and not self._closed:
                    await asyncio.sleep(0.005)
            if grammar is not None and (seq.finished or self._closed):
                grammar.close()

    def _logprob(self, logits: Any, token: int, top_n: int) -> TokenLogprob:
        torch = _torch()
        lp = torch.log_softmax(logits.double(), -1)
        top: list[TopLogprob] = []
        if top_n > 0:
            values, ids = torch.topk(lp, top_n)
            top = [TopLogprob(int(i), self.detokenize([int(i)]), float(v)) for v, i in zip(values, ids)]
        return TokenLogprob(token, self.detokenize([token]), float(lp[token]), top)

    def cancel(self) -> None:
        for token in list(self._active):
            token.cancel()

    # ---- scoring and embeddings ---------------------------------------------------------------
    async def score(self, tokens: Sequence[int], return_logits: bool = False) -> ScoreResult:
        ids = list(tokens)
        if self._closed:
            raise LocalrtError("the model was unloaded")
        if len(ids) > self.context_length:
            raise LocalrtError(f"{len(ids)} tokens do not fit the context length of {self.context_length}")
        if any(not 0 <= t < self.n_vocab for t in ids):
            raise LocalrtError("a token id is outside the vocabulary")
        return await asyncio.wrap_future(self.engine.call(lambda: self._score(ids, return_logits)))

    def _score(self, ids: list[int], return_logits: bool) -> ScoreResult:
        torch = _torch()
        n = len(ids)
        logprobs = np.zeros(max(0, n - 1), dtype=np.float64)
        logits_out = np.zeros((max(0, n - 1), self.n_vocab), dtype=np.float32) if return_logits else None
        if n < 2:
            return ScoreResult(logprobs, logits_out)
        hidden = self.engine.hidden_states(ids)  # [n, dim]
        targets = torch.tensor(ids[1:], device=self.device)
        for s in range(0, n - 1, SCORE_HEAD_ROWS):
            e = min(s + SCORE_HEAD_ROWS, n - 1)
            rows = self.model.output(hidden[s:e]).float()  # [rows, vocab]
            lp = torch.log_softmax(rows.double(), -1)
            logprobs[s:e] = lp.gather(1, targets[s:e, None]).squeeze(1).cpu().numpy()
            if logits_out is not None:
                logits_out[s:e] = rows.cpu().numpy()
        return ScoreResult(logprobs, logits_out)

    async def embed(self, texts: Sequence[str]) -> list[list[float]]:
        if self._closed:
            raise LocalrtError("the model was unloaded")
        batches = []
        for text in texts:
            ids = self.tokenize(text, add_special=True)[: self.context_length]
            batches.append(ids or [self.eos_token_ids[0] if self.eos_token_ids else 0])
        return await asyncio.wrap_future(self.engine.call(lambda: [self._embed(ids) for ids in batches]))

    def _embed(self, ids: list[int]) -> list[float]:
        torch = _torch()
        # mean over tokens of the final-normed hidden states, as llama.cpp's mean pooling
        vec = self.engine.hidden_states(ids).double().mean(0)
        return torch.nn.functional.normalize(vec, dim=0).cpu().tolist()

    # ---- lifetime -----------------------------------------------------------------------------
    def unload(self) -> None:
        if self._closed:
            return
        self.cancel()
        self._closed = True
        self.engine.stop()
        self.vocab.model.close()
