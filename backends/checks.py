"""Request checks written once: every local backend refuses the same bad request with the same words.

The runtime validated the options already (`localrt/runtime/options.py`); what is left here depends on
the loaded model: its context length, its vocabulary, its draft model and the speculation methods its
engine has. Every check raises a `LocalrtError` (the API's 400) or an `OptionError` naming the reason.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Collection
from collections.abc import Hashable
from collections.abc import Mapping
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from typing import TypeVar

from localrt.errors import LocalrtError
from localrt.errors import OptionError


class AdaptersUnsupported(LocalrtError):
    status = 501  # the model is fine; this engine does not run LoRA adapters yet


def check_no_adapters(adapters: Sequence[Path], backend: str) -> None:
    """A model with LoRA adapters (ADAPTER) loads only where they are applied: on llama.cpp."""
    if adapters:
        raise AdaptersUnsupported(
            f"this model has LoRA adapters (ADAPTER), which the {backend} backend does not apply: "
            "load it with the llama.cpp backend (option backend llama.cpp)"
        )


def check_loaded(closed: bool) -> None:
    """A request to a model that was unloaded (or is being unloaded) is refused."""
    if closed:
        raise LocalrtError("the model was unloaded")


def check_model_file(path: Path | str, what: str = "model") -> None:
    """A weights file to load is there (the store hands over paths; a file can vanish under it)."""
    if not Path(path).is_file():
        raise LocalrtError(f"{what} file not found: {path}")


def check_kv_cache_type(kv_cache_type: str, supported: Sequence[str], backend: str) -> None:
    """The KV cache type is one this engine stores."""
    if kv_cache_type not in supported:
        raise OptionError(
            f"kv_cache_type {kv_cache_type!r} is not supported by the {backend} backend "
            f"(supported: {', '.join(supported)})"
        )


def check_token_ids(tokens: Sequence[int], n_vocab: int, allowed: Collection[int] = ()) -> None:
    """Every id names a vocabulary entry (`allowed`: placeholders the backend expands, as images)."""
    bad = next((t for t in tokens if not 0 <= t < n_vocab and t not in allowed), None)
    if bad is not None:
        raise LocalrtError(f"token id {bad} is outside the vocabulary (0..{n_vocab - 1})")


def check_prompt_fits(n_tokens: int, context_length: int, *, what: str = "prompt", fix: str = "") -> None:
    """A prompt leaves room for at least one generated token in the context."""
    if n_tokens >= context_length:
        raise LocalrtError(
            f"the {what} is {n_tokens} tokens, which does not fit the context length of "
            f"{context_length} tokens (raise num_ctx or {fix or 'shorten the input'})"
        )


def check_prompt(
    tokens: Sequence[int], context_length: int, n_vocab: int, allowed: Collection[int] = ()
) -> None:
    """A prompt to generate from: not empty, fits the context, ids in the vocabulary."""
    if not tokens:
        raise LocalrtError("the prompt is empty")
    check_prompt_fits(len(tokens), context_length)
    check_token_ids(tokens, n_vocab, allowed)


def check_scored(tokens: Sequence[int], context_length: int, n_vocab: int) -> None:
    """Tokens to score (perplexity, KL): the whole sequence fits the context, ids in the vocabulary."""
    if len(tokens) > context_length:
        raise LocalrtError(f"{len(tokens)} tokens do not fit the context length of {context_length}")
    check_token_ids(tokens, n_vocab)


def check_speculative(mode: str, supported: Collection[str], has_draft_model: bool, backend: str) -> None:
    """The speculation method is one this engine has; "draft" needs a draft model loaded with the model."""
    if mode not in ("off", "auto") and mode not in supported:
        raise OptionError(
            f"speculative mode {mode!r} is not supported by the {backend} backend "
            f"(supported: off, auto, {', '.join(sorted(supported))})"
        )
    if mode == "draft" and not has_draft_model:
        raise OptionError(
            "speculative 'draft' needs a draft model: set the draft_model option (or --draft NAME)"
        )


def check_draft_vocabulary(
    draft: Path | str,
    n_vocab: int,
    draft_n_vocab: int,
    entry: Callable[[int], Hashable],
    draft_entry: Callable[[int], Hashable],
) -> None:
    """A draft model's token ids mean what the model's mean: same size, and the same entry at 97
    ids spread over the vocabulary (a full comparison costs a second for large vocabularies)."""
    step = max(1, n_vocab // 97)
    same = draft_n_vocab == n_vocab and all(entry(t) == draft_entry(t) for t in range(0, n_vocab, step))
    if not same:
        raise LocalrtError(f"draft model {Path(draft).name} does not share the model's vocabulary")


def check_draft_tokens(
    draft: Path | str, tokens: Sequence[Hashable], draft_tokens: Sequence[Hashable]
) -> None:
    """`check_draft_vocabulary` over two files' token lists (`tokenizer.ggml.tokens`: torch, MLX)."""
    check_draft_vocabulary(
        draft, len(tokens), len(draft_tokens), tokens.__getitem__, draft_tokens.__getitem__
    )


M = TypeVar("M")


def model_for_architecture(metadata: Mapping[str, Any], models: Mapping[str, M], backend: str) -> M:
    """The model class an engine builds for the file's `general.architecture`, or a refusal naming the
    architecture, what this engine runs instead and the backend that runs it."""
    arch = str(metadata.get("general.architecture", "llama"))
    cls = models.get(arch)
    if cls is None:
        raise LocalrtError(
            f"the {backend} backend does not support the {arch!r} architecture yet "
            f"(supported: {', '.join(sorted(models))}); the llama.cpp backend runs it"
        )
    return cls
