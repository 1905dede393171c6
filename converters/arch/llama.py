"""Llama family: Llama 2/3, SmolLM2, TinyLlama, Mistral (GGUF arch `llama`).

HF stores Q/K rows for rotate-half RoPE; llama.cpp's `llama` arch rotates adjacent pairs, so the
converter permutes q_proj/k_proj rows per head (see `permute_qk` in convert.py).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from localrt.converters.arch import GLOBAL
from localrt.converters.arch import KV
from localrt.converters.arch import LLAMA_LAYER
from localrt.converters.arch import Arch


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


def llama3_rope_factors(hp: dict[str, Any]) -> np.ndarray:
    """rope_freqs.weight for rope_type llama3: per-frequency divisors of the rotary base frequencies.

    llama.cpp's converter evaluates this in torch float32; torch's pow can differ from numpy's by an
    ulp, so torch is used when it is installed (the 1-D tensor then matches exactly), numpy otherwise.
    """
    rope = hp["rope_parameters"]
    base = rope.get("rope_theta", 10000.0)
    dim = hp.get("head_dim") or hp["hidden_size"] // hp["num_attention_heads"]
    factor = rope.get("factor", 8.0)
    low, high = rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    old = rope.get("original_max_position_embeddings", 8192)
    try:
        import torch

        freqs: Any = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    except ImportError:
        f32 = np.float32
        freqs = f32(1.0) / (f32(base) ** (np.arange(0, dim, 2, dtype=f32) / f32(dim)))
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq  # float32 (a 0-d tensor or a numpy scalar)
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(float(factor))
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(float(1 / ((1 - smooth) / factor + smooth)))
    return np.array(out, dtype=np.float32)


def extra_tensors(hp: dict[str, Any]) -> list[tuple[str, np.ndarray]]:
    """Llama 3.1+ rope scaling: the converter writes the frequency divisors as a tensor."""
    if str(hp["rope_parameters"].get("rope_type", "")).lower() != "llama3":
        return []
    return [("rope_freqs.weight", llama3_rope_factors(hp))]


ARCH = Arch(
    name="llama",
    hf_architectures=("LlamaForCausalLM", "MistralForCausalLM"),
    tensors={**GLOBAL, **LLAMA_LAYER},
    defaults=defaults,
    permute_qk=True,
    vocab=("spm", "gpt2"),
    extra_kv=extra_kv,
    extra_tensors=extra_tensors,
)
