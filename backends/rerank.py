"""Pooled contexts for the llama.cpp backend (`PooledContext`: embeddings and reranking), and reranking:
a context with rank pooling over a reranker GGUF (bge-reranker, Jina, Qwen3-Reranker), scoring each
(query, document) pair the way llama-server's /v1/rerank does.

The pair is tokenized with the GGUF's `tokenizer.chat_template.rerank` when it has one ({query} and
{document} substituted, special tokens parsed), else as `[BOS] query [EOS] [SEP] document [EOS]` with each
special token only where the vocabulary asks for it (EOS falls back to SEP). The score is the first value
of the classification head's output for the sequence.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
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


class Reranker:
    """A rank-pooling context on a loaded llama.cpp model (`model`: llama-cpp-python's LlamaModel)."""

    def __init__(self, lib: Any, model: Any, metadata: dict[str, str], n_ctx: int, n_threads: int) -> None:
        self.lib, self.model = lib, model
        self.template = metadata.get("tokenizer.chat_template.rerank")
        # n_ctx: the loaded model's context (`base.loaded_context`: already within what it was trained for)
        self.pooled = PooledContext(
            lib, model, n_ctx, (n_threads, n_threads), lib.LLAMA_POOLING_TYPE_RANK, "rerank"
        )
        self._lock = threading.Lock()

    def pair_tokens(self, query: str, document: str) -> list[int]:
        lib, vocab = self.lib, self.model.vocab
        if self.template:
            text = self.template.replace("{query}", query).replace("{document}", document)
            return self.model.tokenize(text.encode("utf-8"), False, True)

        bos, eos, sep = lib.llama_vocab_bos(vocab), lib.llama_vocab_eos(vocab), lib.llama_vocab_sep(vocab)
        eos = eos if eos >= 0 else sep
        end = [eos] if lib.llama_vocab_get_add_eos(vocab) and eos >= 0 else []

        def segment(text: str) -> list[int]:  # a text's tokens, then the end token where the vocab adds one
            return (self.model.tokenize(text.encode("utf-8"), False, False) if text else []) + end

        out: list[int] = [bos] if lib.llama_vocab_get_add_bos(vocab) and bos >= 0 else []
        out += segment(query)
        if lib.llama_vocab_get_add_sep(vocab) and sep >= 0:
            out.append(sep)
        return out + segment(document)

    def scores(self, query: str, documents: Sequence[str]) -> tuple[list[float], int]:
        """Relevance score per document (in order) and the number of tokens evaluated."""
        out: list[float] = []
        n_tokens = 0
        with self._lock:
            for i, document in enumerate(documents):
                tokens = self.pair_tokens(query, document)
                if len(tokens) > self.pooled.n_ctx:
                    raise LocalrtError(
                        f"the query and document {i} are {len(tokens)} tokens, more than the reranker's "
                        f"context of {self.pooled.n_ctx}"
                    )
                out.append(self._score(tokens))
                n_tokens += len(tokens)
        return out, n_tokens

    def _score(self, tokens: list[int]) -> float:
        return float(self.pooled.pool(tokens, 1)[0])  # the classification head's first output

    def close(self) -> None:
        self.pooled.close()
