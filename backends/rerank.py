"""Reranking for the llama.cpp backend: a context with rank pooling over a reranker GGUF (bge-reranker,
Jina, Qwen3-Reranker), scoring each (query, document) pair the way llama-server's /v1/rerank does.

The pair is tokenized with the GGUF's `tokenizer.chat_template.rerank` when it has one ({query} and
{document} substituted, special tokens parsed), else as `[BOS] query [EOS] [SEP] document [EOS]` with each
special token only where the vocabulary asks for it (EOS falls back to SEP). The score is the first value
of the classification head's output for the sequence.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

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


class Reranker:
    """A rank-pooling context on a loaded llama.cpp model (`model`: llama-cpp-python's LlamaModel)."""

    def __init__(self, lib: Any, model: Any, metadata: dict[str, str], n_ctx: int, n_threads: int) -> None:
        from llama_cpp import _internals

        self.lib, self.model = lib, model
        self.template = metadata.get("tokenizer.chat_template.rerank")
        train = model.n_ctx_train()
        self.n_ctx = max(16, min(n_ctx, train) if train > 0 else n_ctx)
        params = lib.llama_context_default_params()
        # a non-causal reranker must see the whole pair in one ubatch
        params.n_ctx = params.n_batch = params.n_ubatch = self.n_ctx
        params.n_threads = params.n_threads_batch = n_threads
        params.embeddings = True
        params.pooling_type = lib.LLAMA_POOLING_TYPE_RANK
        params.no_perf = True
        from llama_cpp._utils import suppress_stdout_stderr

        try:
            with suppress_stdout_stderr(disable=False):  # llama.cpp notes the pooling override on stderr
                self.ctx = _internals.LlamaContext(model=model, params=params, verbose=False)
        except ValueError as e:
            raise LocalrtError(f"llama.cpp could not create a rerank context: {e}") from None
        self.batch = _internals.LlamaBatch(n_tokens=self.n_ctx, embd=0, n_seq_max=1, verbose=False)
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
                if len(tokens) > self.n_ctx:
                    raise LocalrtError(
                        f"the query and document {i} are {len(tokens)} tokens, more than the reranker's "
                        f"context of {self.n_ctx}"
                    )
                out.append(self._score(tokens))
                n_tokens += len(tokens)
        return out, n_tokens

    def _score(self, tokens: list[int]) -> float:
        lib, ctx = self.lib, self.ctx
        self.batch.reset()
        self.batch.add_sequence(tokens, 0, True)
        ctx.kv_cache_clear()
        try:
            ctx.decode(self.batch)
        except RuntimeError as e:
            raise LocalrtError(f"llama.cpp rerank failed: {e}") from None
        ptr = lib.llama_get_embeddings_seq(ctx.ctx, 0)
        if not ptr:
            ptr = lib.llama_get_embeddings_ith(ctx.ctx, -1)
        if not ptr:
            raise LocalrtError("llama.cpp returned no rerank score")
        return float(ptr[0])

    def close(self) -> None:
        for obj in (getattr(self, "batch", None), getattr(self, "ctx", None)):
            if obj is not None:
                obj.close()
