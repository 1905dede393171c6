"""Tokenization shared by every local backend: llama.cpp's vocabulary of the GGUF.

The llama.cpp backend reads it from its loaded weights; the engines that read GGUF themselves (torch,
MLX) from llama.cpp's vocab-only load of the same file, so token ids are identical across backends for
every pre-tokenizer variant. `VocabMethods` gives a loaded model the protocol's token methods on top.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from localrt.backends.checks import check_loaded
from localrt.errors import LocalrtError

from .lib import token_piece

__all__ = ["Vocab", "VocabMethods", "token_piece"]


class Vocab:
    """The vocabulary of a llama.cpp model (llama-cpp-python's LlamaModel): pieces, BOS/EOS, end tokens."""

    def __init__(self, model: Any) -> None:
        from .lib import _lib

        self.model = model
        self.lib = _lib()
        self.vocab = self.model.vocab
        self.n_vocab = self.model.n_vocab()
        self._pieces: dict[tuple[int, bool], bytes] = {}
        m = self.model
        bos = m.token_bos()
        self.bos_token_id: int | None = bos if bos >= 0 else None
        self.eos_token_ids = [t for t in {m.token_eos(), m.token_eot()} if t >= 0 and self.is_eog(t)]
        self.add_bos = bool(m.add_bos_token()) and self.bos_token_id is not None

    @classmethod
    def load(cls, path: Path) -> Vocab:
        """llama.cpp's vocab-only load of a GGUF (no weights): tokenizes exactly as the llama.cpp backend."""
        from llama_cpp import _internals

        from .lib import _lib

        params = _lib().llama_model_default_params()
        params.vocab_only = True
        try:
            return cls(_internals.LlamaModel(path_model=str(path), params=params, verbose=False))
        except ValueError as e:
            raise LocalrtError(f"llama.cpp could not read the vocabulary: {e}") from None

    def piece(self, token: int, special: bool = False) -> bytes:
        return token_piece(self.lib, self.vocab, token, special, self._pieces)

    def is_eog(self, token: int) -> bool:
        return bool(self.lib.llama_vocab_is_eog(self.vocab, token))

    def eog_ids(self) -> tuple[int, ...]:
        """Every end-of-generation token (EOS, EOT, <|im_end|>...), or just EOS/EOT for huge vocabularies."""
        if self.n_vocab > 300_000:
            return tuple(self.eos_token_ids)
        return tuple(t for t in range(self.n_vocab) if self.is_eog(t)) or tuple(self.eos_token_ids)

    def close(self) -> None:
        self.model.close()


class VocabMethods:
    """The protocol's token attributes and tokenize / detokenize / token_text / special_tokens over
    `self.vocab`; refused once the model is unloaded (`_closed`), when the vocabulary is freed."""

    vocab: Vocab
    _closed: bool = False
    _special: list[str] | None = None

    def _take_vocab(self, vocab: Vocab) -> None:
        """The protocol's vocabulary attributes from `vocab`."""
        self.vocab = vocab
        self.n_vocab = vocab.n_vocab
        self.bos_token_id = vocab.bos_token_id
        self.eos_token_ids = vocab.eos_token_ids
        self.add_bos = vocab.add_bos

    def piece(self, token: int, special: bool = False) -> bytes:
        check_loaded(self._closed)
        return self.vocab.piece(token, special)

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
        check_loaded(self._closed)
        if not text:
            return (
                [self.bos_token_id] if add_special and self.add_bos and self.bos_token_id is not None else []
            )
        return self.vocab.model.tokenize(text.encode("utf-8"), add_special, parse_special)

    def detokenize(self, ids: Sequence[int], special: bool = False) -> str:
        return b"".join(self.piece(int(t), special) for t in ids).decode("utf-8", errors="replace")

    def token_text(self, token_id: int) -> str:
        return self.piece(token_id, True).decode("utf-8", errors="replace")

    def special_tokens(self) -> list[str]:
        if self._special is None:
            lib, vocab = self.vocab.lib, self.vocab.vocab
            mask = (
                lib.LLAMA_TOKEN_ATTR_CONTROL
                | lib.LLAMA_TOKEN_ATTR_USER_DEFINED
                | lib.LLAMA_TOKEN_ATTR_UNKNOWN
            )
            texts = {
                self.token_text(t) for t in range(self.n_vocab) if lib.llama_vocab_get_attr(vocab, t) & mask
            }
            self._special = sorted(t for t in texts if t)
        return self._special
