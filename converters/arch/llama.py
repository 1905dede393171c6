"""Llama family: Llama 2/3, SmolLM2, TinyLlama, Mistral (GGUF arch `llama`).

HF stores Q/K rows for rotate-half RoPE; llama.cpp's `llama` arch rotates adjacent pairs, so the
converter permutes q_proj/k_proj rows per head (see `permute_qk` in convert.py).
"""

from __future__ import annotations

from typing import Any

from localrt.converters.arch import GLOBAL, KV, LLAMA_LAYER, Arch


def defaults(config: dict[str, Any]) -> dict[str, Any]:
    # what LlamaConfig / MistralConfig fill in when config.json leaves a key out
    mistral = "MistralForCausalLM" in (config.get("architectures") or [])
    heads = config.get("num_attention_heads", 32)
    return {
        "max_position_embeddings": 131072 if mistral else 2048,
        "num_key_value_heads": 8 if mistral else heads,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "head_dim": config.get("hidden_size", 4096) // heads,
    }


def extra_kv(hp: dict[str, Any]) -> KV:
    rope_dim = hp.get("head_dim") or hp["hidden_size"] // hp["num_attention_heads"]
    return [("llama.vocab_size", hp["vocab_size"], "u32"), ("llama.rope.dimension_count", rope_dim, "u32")]


ARCH = Arch(
    name="llama",
    hf_architectures=("LlamaForCausalLM", "MistralForCausalLM"),
    tensors={**GLOBAL, **LLAMA_LAYER},
    defaults=defaults,
    permute_qk=True,
    vocab=("spm", "gpt2"),
    extra_kv=extra_kv,
)
