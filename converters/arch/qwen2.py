"""Qwen2 / Qwen2.5 (GGUF arch `qwen2`): NEOX RoPE (no Q/K permutation), q/k/v biases kept in F32."""

from __future__ import annotations

from typing import Any

from localrt.converters.arch import GLOBAL
from localrt.converters.arch import LLAMA_LAYER
from localrt.converters.arch import Arch

BIASES = {
    "model.layers.{bid}.self_attn.q_proj.bias": "blk.{bid}.attn_q.bias",
    "model.layers.{bid}.self_attn.k_proj.bias": "blk.{bid}.attn_k.bias",
    "model.layers.{bid}.self_attn.v_proj.bias": "blk.{bid}.attn_v.bias",
}


def defaults(config: dict[str, Any]) -> dict[str, Any]:
    # Qwen2Config's defaults for keys config.json leaves out
    return {
        "max_position_embeddings": 32768,
        "num_key_value_heads": 32,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
    }


ARCH = Arch(
    name="qwen2",
    hf_architectures=("Qwen2ForCausalLM",),
    tensors={**GLOBAL, **LLAMA_LAYER, **BIASES},
    defaults=defaults,
    vocab=("spm", "gpt2"),
)
