"""Tokenization shared by the engines that read GGUF themselves (torch, MLX).

llama.cpp's vocab-only load of the same file tokenizes and detokenizes, so token ids are identical to
the llama.cpp backend's for every pre-tokenizer variant. `VocabMethods` gives a loaded model the
protocol's token methods on top of it.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from localrt.backends.llamacpp.lib import token_piece
from localrt.errors import LocalrtError

__all__ = ["Vocab", "VocabMethods", "token_piece"]


class Vocab:
    """llama.cpp's vocab-only load of a GGUF: tokenize / detokenize exactly as the llama.cpp backend."""

    def __init__(self, path: Path) -> None:
        from llama_cpp import _internals

        from localrt.backends.llamacpp.lib import _lib

        lib = _lib()
        params = lib.llama_model_default_params()
        params.vocab_only = True
        try:
            self.model = _internals.LlamaModel(path_model=str(path), params=params, verbose=False)
        except ValueError as e:
            raise LocalrtError(f"llama.cpp could not read the vocabulary: {e}") from None
        self.lib = lib
        self.vocab = self.model.vocab
        self.n_vocab = self.model.n_vocab()
        self._pieces: dict[tuple[int, bool], bytes] = {}
        m = self.model
        bos = m.token_bos()
        self.bos_token_id: int | None = bos if bos >= 0 else None
        self.eos_token_ids = [t for t in {m.token_eos(), m.token_eot()} if t >= 0 and self.is_eog(t)]
        self.add_bos = bool(m.add_bos_token()) and self.bos_token_id is not None

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
    """The protocol's tokenize / detokenize / token_text / special_tokens over `self.vocab`."""

    vocab: Vocab
    n_vocab: int
    bos_token_id: int | None
    add_bos: bool
    _special: list[str] | None = None

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
        if not text:
            return (
                [self.bos_token_id] if add_special and self.add_bos and self.bos_token_id is not None else []
            )
        return self.vocab.model.tokenize(text.encode("utf-8"), add_special, parse_special)

    def detokenize(self, ids: Sequence[int], special: bool = False) -> str:
        return b"".join(self.vocab.piece(int(t), special) for t in ids).decode("utf-8", errors="replace")

    def token_text(self, token_id: int) -> str:
        return self.vocab.piece(token_id, True).decode("utf-8", errors="replace")

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
