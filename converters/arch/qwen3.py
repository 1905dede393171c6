"""Qwen3 (GGUF arch `qwen3`): Qwen2's layout without biases, plus RMS norms on Q and K per head."""

from __future__ import annotations

from typing import Any

from localrt.converters.arch import GLOBAL
from localrt.converters.arch import LLAMA_LAYER
from localrt.converters.arch import Arch

QK_NORMS = {
    "model.layers.{bid}.self_attn.q_norm.weight": "blk.{bid}.attn_q_norm.weight",
    "model.layers.{bid}.self_attn.k_norm.weight": "blk.{bid}.attn_k_norm.weight",
}


def defaults(config: dict[str, Any]) -> dict[str, Any]:
    # Qwen3Config's defaults (head_dim is explicit there, 128 unless given)
    return {
        "max_position_embeddings": 32768,
        "num_key_value_heads": 32,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "head_dim": 128,
    }


ARCH = Arch(
    name="qwen3",
    hf_architectures=("Qwen3ForCausalLM",),
    tensors={**GLOBAL, **LLAMA_LAYER, **QK_NORMS},
    defaults=defaults,
    vocab=("spm", "gpt2"),
)
