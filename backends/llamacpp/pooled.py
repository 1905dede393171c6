"""Pooled contexts for the llama.cpp backend (`PooledContext`: reranking, and embeddings of encoder
models), and reranking: a context with rank pooling over a reranker GGUF (bge-reranker, Jina,
Qwen3-Reranker), scoring each (query, document) pair the way llama-server's /v1/rerank does.

The pair is tokenized with the GGUF's `tokenizer.chat_template.rerank` when it has one ({query} and
{document} substituted, special tokens parsed), else as `[BOS] query [EOS] [SEP] document [EOS]` with each
special token only where the vocabulary asks for it (EOS falls back to SEP). The score is the first value
of the classification head's output for the sequence.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from localrt.backends.base import close_each
from localrt.backends.outputs import float_array
from localrt.errors import LocalrtError

POOLING_RANK = 4  # LLAMA_POOLING_TYPE_RANK


def is_reranker(lib: Any, model_ptr: Any, metadata: dict[str, str]) -> bool:
    """A reranker GGUF: pooling type rank, or a sequence-classification head with labels (what llama.cpp's
    converter writes for BertForSequenceClassification / XLMRobertaForSequenceClassification)."""
    arch = metadata.get("general.architecture", "")
    try:
        if int(float(metadata.get(f"{arch}.pooling_type", "-1"))) == POOLING_RANK:
            return True
    except ValueError:
        pass
    return bool(lib.llama_model_cls_label(model_ptr, 0))


class PooledContext:
    """A llama.cpp context that pools each input into one output row: embeddings (the model's own
    pooling, or mean) and rerank scores (rank pooling). One sequence at a time, the whole input in one
    ubatch: a non-causal model must see all of it at once. `purpose` names it in errors."""

    def __init__(
        self, lib: Any, model: Any, n_ctx: int, threads: tuple[int, int], pooling_type: int, purpose: str
    ) -> None:
        from llama_cpp import _internals
        from llama_cpp._utils import suppress_stdout_stderr

        self.lib, self.n_ctx, self.purpose = lib, n_ctx, purpose
        params = lib.llama_context_default_params()
        params.n_ctx = params.n_batch = params.n_ubatch = n_ctx
        params.n_threads, params.n_threads_batch = threads
        params.embeddings = True
        params.pooling_type = pooling_type
        params.no_perf = True
        try:
            with suppress_stdout_stderr(disable=False):  # llama.cpp notes a pooling override on stderr
                self.ctx = _internals.LlamaContext(model=model, params=params, verbose=False)
        except ValueError as e:
            raise LocalrtError(f"llama.cpp could not create a {purpose} context: {e}") from None
        self.batch = _internals.LlamaBatch(n_tokens=n_ctx, embd=0, n_seq_max=1, verbose=False)

    def pool(self, tokens: list[int], width: int) -> np.ndarray:
        """The pooled output row of `tokens` (its first `width` values; a view into llama.cpp's buffer,
        valid until the next call)."""
        lib, ctx = self.lib, self.ctx
        self.batch.reset()
        self.batch.add_sequence(tokens, 0, True)
        ctx.kv_cache_clear()
        try:
            ctx.decode(self.batch)
        except RuntimeError as e:
            raise LocalrtError(f"llama.cpp {self.purpose} failed: {e}") from None
        ptr = lib.llama_get_embeddings_seq(ctx.ctx, 0) or lib.llama_get_embeddings_ith(ctx.ctx, -1)
        return float_array(ptr, (width,), f"llama.cpp returned no {self.purpose} output")

    def close(self) -> None:
        close_each(self.batch, self.ctx)


def rank_tokens(lib: Any, model: Any, template: str | None, query: str, document: str) -> list[int]:
    """The tokens of a (query, document) pair as the reranker reads them (`model`: llama-cpp-python's
    LlamaModel; `template`: the GGUF's `tokenizer.chat_template.rerank`, if any)."""
    vocab = model.vocab
    if template:
        text = template.replace("{query}", query).replace("{document}", document)
        return model.tokenize(text.encode("utf-8"), False, True)  # type: ignore[no-any-return]

    bos, eos, sep = lib.llama_vocab_bos(vocab), lib.llama_vocab_eos(vocab), lib.llama_vocab_sep(vocab)
    eos = eos if eos >= 0 else sep
    end = [eos] if lib.llama_vocab_get_add_eos(vocab) and eos >= 0 else []

    def segment(text: str) -> list[int]:  # a text's tokens, then the end token where the vocab adds one
        return (model.tokenize(text.encode("utf-8"), False, False) if text else []) + end

    out: list[int] = [bos] if lib.llama_vocab_get_add_bos(vocab) and bos >= 0 else []
    out += segment(query)
    if lib.llama_vocab_get_add_sep(vocab) and sep >= 0:
        out.append(sep)
    return out + segment(document)


class PooledContexts:
    """The pooled contexts of a model, made on first use on the engine's thread: rank pooling (a
    reranker's relevance score) and, for a model whose own context cannot give hidden states chunk by
    chunk (an encoder: its attention sees the whole input at once), embeddings. `apply(ctx)` puts the
    model's LoRA adapters on each (`ctx`: a raw llama_context pointer)."""

    def __init__(
        self,
        lib: Any,
        model: Any,
        embedding_pooling: int,
        n_ctx: int,
        threads: tuple[int, int],
        apply: Any = None,
    ) -> None:
        self.lib, self.model = lib, model
        self.embedding_pooling = embedding_pooling
        self.n_ctx, self.threads = n_ctx, threads
        self.apply = apply
        self._contexts: dict[str, PooledContext] = {}

    def context(self, purpose: str) -> PooledContext:
        """The "rerank" or "embedding" context."""
        pooled = self._contexts.get(purpose)
        if pooled is None:
            pooling = self.lib.LLAMA_POOLING_TYPE_RANK if purpose == "rerank" else self.embedding_pooling
            pooled = PooledContext(self.lib, self.model, self.n_ctx, self.threads, pooling, purpose)
            if self.apply is not None:
                try:
                    self.apply(pooled.ctx.ctx)
                except LocalrtError:
                    pooled.close()
                    raise
            self._contexts[purpose] = pooled
        return pooled

    def close(self) -> None:
        close_each(*self._contexts.values())
        self._contexts = {}
