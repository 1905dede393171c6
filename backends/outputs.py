"""What a model returns besides text, written once for every local backend: token logprobs, scores
(perplexity, KL) and embeddings. numpy only, so each engine hands over host rows or vectors."""

from __future__ import annotations

import ctypes
import math
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any

import numpy as np

from localrt.backends.base import ScoreResult
from localrt.backends.base import TokenLogprob
from localrt.backends.base import TopLogprob
from localrt.backends.base import log_softmax
from localrt.errors import LocalrtError

TextOf = Callable[[Sequence[int]], str]  # token ids -> their text (the model's detokenize)
SCORE_HEAD_ROWS = 256  # scoring computes logits this many rows at a time (the head is n x vocab)


def token_logprob(
    token: int, logprob: float, top: Sequence[tuple[int, float]], text_of: TextOf
) -> TokenLogprob:
    """A sampled token's logprob and its `top` alternatives ((id, logprob), best first), with their text."""
    alternatives = [TopLogprob(i, text_of([i]), v) for i, v in top]
    return TokenLogprob(token, text_of([token]), logprob, alternatives)


def logprob_from_logits(logits: np.ndarray, token: int, top_n: int, text_of: TextOf) -> TokenLogprob:
    """The same from the raw logits row [V] the token was sampled from (log-softmax of the raw row, as
    llama-server reports it, not of the sampler's truncated distribution)."""
    return token_logprob(token, *logprob_values(logits, token, top_n), text_of)


def logprob_values(logits: np.ndarray, token: int, top_n: int) -> tuple[float, list[tuple[int, float]]]:
    """A token's logprob in the raw logits row [V] and the `top_n` best (id, logprob), best first."""
    lp = log_softmax(logits)
    top: list[tuple[int, float]] = []
    top_n = min(top_n, lp.shape[-1])
    if top_n > 0:
        ids = np.argpartition(-lp, top_n - 1)[:top_n]
        ids = ids[np.argsort(-lp[ids], kind="stable")]
        top = [(int(i), float(lp[i])) for i in ids]
    return float(lp[token]), top


def empty_score(n_tokens: int, n_vocab: int, return_logits: bool) -> ScoreResult:
    """The result `score` fills in: n-1 logprobs, and the logits rows when asked for."""
    rows = max(0, n_tokens - 1)
    logits = np.zeros((rows, n_vocab), dtype=np.float32) if return_logits else None
    return ScoreResult(np.zeros(rows, dtype=np.float64), logits)


def fill_score(result: ScoreResult, tokens: Sequence[int], start: int, rows: np.ndarray) -> None:
    """`rows` [m, V]: the logits after tokens[start .. start+m-1]; each scores the token that follows."""
    end = start + len(rows)
    targets = np.asarray(tokens[start + 1 : end + 1])
    result.logprobs[start:end] = log_softmax(rows)[np.arange(len(rows)), targets]
    if result.logits is not None:
        result.logits[start:end] = rows


def embedding_tokens(tokens: Sequence[int], max_tokens: int, eos_token_ids: Sequence[int]) -> list[int]:
    """The tokens a text is embedded from: its tokens cut to what the embedding context holds; an empty
    text is one end-of-sequence token (a pooled vector needs at least one row)."""
    return list(tokens[:max_tokens]) or [eos_token_ids[0] if eos_token_ids else 0]


def unit_vector(vector: np.ndarray) -> list[float]:
    """A pooled embedding scaled to length 1 (as Ollama returns them); a zero vector stays zero."""
    vec = np.asarray(vector, dtype=np.float64)
    norm = float(np.linalg.norm(vec))
    return (vec / norm if norm > 0 else vec).tolist()


def float_array(ptr: Any, shape: tuple[int, ...], missing: str) -> np.ndarray:
    """The floats at a pointer llama.cpp returned (a float pointer, or its address as an int), as an array
    of `shape` (a view into its buffer, valid until its next call); `missing` is the error when it
    returned none. Through a ctypes array of the right length at that address: `np.ctypeslib.as_array` on
    a pointer builds a new array type per call, about 100 us, paid per generated token on the sampling
    path."""
    if not ptr:
        raise LocalrtError(missing)
    address = ptr if isinstance(ptr, int) else ctypes.cast(ptr, ctypes.c_void_p).value
    floats = (ctypes.c_float * math.prod(shape)).from_address(address)
    return np.frombuffer(floats, dtype=np.float32).reshape(shape)
