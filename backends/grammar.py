"""Constrained output (`format`: "json" or a JSON schema) for every backend, by llama.cpp's grammar sampler.

The llama.cpp backend adds the grammar to its sampler chain. The torch and MLX engines sample themselves,
so `Grammar` gives them the same constraint over plain logits: `mask` sets what the grammar forbids next
to -inf, `accept` advances it by the chosen token. Both run on the model's llama.cpp vocabulary, so the
three backends accept exactly the same texts.
"""

from __future__ import annotations

import ctypes
import json
from typing import Any

import numpy as np

from localrt.backends.base import GBNF
from localrt.errors import LocalrtError

# llama_token_data: {int32 id; float logit; float p}
_TOKEN_DATA = np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)])


def grammar_for(fmt: str | dict[str, Any] | GBNF) -> str:
    """GBNF for Ollama's `format`: "json" (any JSON value) or a JSON schema object; GBNF as it is."""
    from llama_cpp.llama_grammar import JSON_GBNF
    from llama_cpp.llama_grammar import json_schema_to_gbnf

    if isinstance(fmt, GBNF):
        return fmt.text
    if fmt == "json":
        return JSON_GBNF
    if isinstance(fmt, dict):
        try:
            gbnf = json_schema_to_gbnf(json.dumps(fmt))
        except Exception as e:  # the converter raises bare exceptions on schemas it cannot express
            raise LocalrtError(f"unsupported JSON schema in format: {e}") from None
        # llama-cpp-python's converter lets raw control characters (a newline) into strings, which no
        # JSON parser accepts; its own JSON grammar and llama.cpp's converter exclude them
        return gbnf.replace(r'char ::= [^"\\] |', r'char ::= [^"\\\x7F\x00-\x1F] |')
    raise LocalrtError(f'invalid format {fmt!r}: use "json" or a JSON schema object')


def grammar_sampler(lib: Any, vocab: Any, fmt: str | dict[str, Any] | GBNF) -> Any:
    """A llama.cpp grammar sampler for `fmt` on `vocab` (the caller frees it, or hands it to a chain)."""
    sampler = lib.llama_sampler_init_grammar(vocab, grammar_for(fmt).encode("utf-8"), b"root")
    if not sampler:
        raise LocalrtError("the JSON schema could not be turned into a grammar")
    return sampler


class GrammarDeadEnd(LocalrtError):
    """The grammar allows no token of the vocabulary next. llama.cpp aborts the whole process when a
    grammar is made to accept a token it refused, so a request in this state ends with this error
    before anything is accepted."""

    def __init__(self) -> None:
        super().__init__("the grammar allows no token of this model's vocabulary at this point of the output")


class Candidates:
    """A llama_token_data_array over the whole vocabulary, refilled from a row of logits for each token
    (samplers sort and shrink it in place)."""

    def __init__(self, lib: Any, n_vocab: int) -> None:
        self.lib = lib
        self.data = np.zeros(n_vocab, dtype=_TOKEN_DATA)
        self._ids = np.arange(n_vocab, dtype=np.int32)
        self._pointer = self.data.ctypes.data_as(ctypes.POINTER(lib.llama_token_data))
        self.array = lib.llama_token_data_array(data=self._pointer, size=n_vocab, selected=-1, sorted=False)

    def apply(self, sampler: Any, logits: np.ndarray) -> None:
        """Run `sampler` (a grammar, or a whole chain) over `logits` [V]."""
        data = self.data
        data["id"] = self._ids
        data["logit"] = logits
        data["p"] = 0.0
        self.array.data = self._pointer
        self.array.size = len(data)
        self.array.selected = -1
        self.array.sorted = False
        self.lib.llama_sampler_apply(sampler, ctypes.byref(self.array))

    def selected(self) -> int:
        """The token the chain chose; GrammarDeadEnd if the grammar had ruled out every token (a chain
        then still picks one, with a logit of -inf)."""
        index = self.array.selected
        if not 0 <= index < self.array.size:
            raise GrammarDeadEnd()
        entry = self.array.data[index]
        if not np.isfinite(entry.logit):
            raise GrammarDeadEnd()
        return int(entry.id)


class Grammar:
    """One request's constraint over logits [V] (numpy); not thread-safe, like the request it serves."""

    def __init__(self, lib: Any, vocab: Any, n_vocab: int, fmt: str | dict[str, Any] | GBNF) -> None:
        self.lib = lib
        self.sampler = grammar_sampler(lib, vocab, fmt)
        self._candidates = Candidates(lib, n_vocab)

    def mask(self, logits: np.ndarray) -> np.ndarray:
        """logits [V] -> a copy with -inf on every token the grammar does not allow next (GrammarDeadEnd
        where that is every token)."""
        self._candidates.apply(self.sampler, logits)
        masked = self._candidates.data["logit"].copy()
        if not np.isfinite(masked).any():
            raise GrammarDeadEnd()
        return masked

    def accept(self, token: int) -> None:
        self.lib.llama_sampler_accept(self.sampler, token)

    def close(self) -> None:
        if self.sampler:
            self.lib.llama_sampler_free(self.sampler)
            self.sampler = None
