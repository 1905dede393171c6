"""Llama-family hyper-parameters from GGUF metadata, shared by the torch and MLX engines.

Names follow the GGUF keys `{arch}.<name>`; `rope_neox` says which RoPE pairing the stored Q/K rows
expect (see the torch and MLX model files).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from localrt.errors import LocalrtError

NEOX_ROPE_ARCHS = {"qwen2", "qwen3", "qwen2moe", "phi3", "stablelm", "gptneox"}
# not "granite": its embedding, residual, attention and logit multipliers are not applied here, so a
# Granite file would give wrong logits; refused until they are (the llama.cpp backend runs it)
SUPPORTED_ARCHS = {"llama", "mistral", "qwen2", "qwen3"}


@dataclass
class LlamaConfig:
    """Hyper-parameters, named after the GGUF keys `{arch}.<name>` they come from."""

    architecture: str
    vocab_size: int
    context_length: int
    embedding_length: int  # model width
    feed_forward_length: int
    block_count: int
    attention_head_count: int
    attention_head_count_kv: int
    attention_key_length: int  # head dim
    attention_layer_norm_rms_epsilon: float = 1e-5
    rope_freq_base: float = 10000.0
    rope_dimension_count: int = 0  # rotated dims per head; 0 = all
    rope_scaling_factor: float = 1.0  # linear position scaling
    rope_neox: bool = False  # half-split pairs instead of adjacent pairs

    @property
    def windows(self) -> list[int]:
        """Each layer's sliding window in tokens, 0 for full attention (every Llama layer is full)."""
        return [0] * self.block_count

    @classmethod
    def from_gguf(cls, metadata: dict[str, Any], vocab_size: int) -> LlamaConfig:
        arch = str(metadata.get("general.architecture", "llama"))
        if arch not in SUPPORTED_ARCHS:
            raise LocalrtError(
                f"this backend does not support the {arch!r} architecture yet "
                f"(supported: {', '.join(sorted(SUPPORTED_ARCHS))})"
            )

        return cls(**llama_fields(metadata, arch, vocab_size), rope_neox=arch in NEOX_ROPE_ARCHS)


Getter = Callable[..., Any]


def metadata_getter(metadata: dict[str, Any], arch: str) -> Getter:
    """`get(key, default=None)`: the value of `{arch}.{key}`; a key missing without a default is an error."""

    def get(key: str, default: Any = None) -> Any:
        value = metadata.get(f"{arch}.{key}", default)
        if value is None:
            raise LocalrtError(f"GGUF metadata {arch}.{key} is missing")
        return value

    return get


def llama_fields(
    metadata: dict[str, Any],
    arch: str,
    vocab_size: int,
    *,
    context_length: int = 4096,
    eps: float | None = 1e-5,
) -> dict[str, Any]:
    """The `LlamaConfig` fields every family reads the same way (`rope_neox` aside), for a family's
    config to extend; `context_length` and `eps`: the defaults when the file is silent (None: required)."""
    get = metadata_getter(metadata, arch)
    n_embd, n_head = int(get("embedding_length")), int(get("attention.head_count"))
    head_dim = int(get("attention.key_length", n_embd // n_head))
    scaling = metadata.get(f"{arch}.rope.scaling.type")
    factor = float(metadata.get(f"{arch}.rope.scaling.factor", 1.0)) if scaling == "linear" else 1.0
    return {
        "architecture": arch,
        "vocab_size": vocab_size,
        "context_length": int(get("context_length", context_length)),
        "embedding_length": n_embd,
        "feed_forward_length": int(get("feed_forward_length")),
        "block_count": int(get("block_count")),
        "attention_head_count": n_head,
        "attention_head_count_kv": int(get("attention.head_count_kv", n_head)),
        "attention_key_length": head_dim,
        "attention_layer_norm_rms_epsilon": float(get("attention.layer_norm_rms_epsilon", eps)),
        "rope_freq_base": float(get("rope.freq_base", 10000.0)),
        "rope_dimension_count": int(get("rope.dimension_count", head_dim)),
        "rope_scaling_factor": factor if factor > 0 else 1.0,
    }
