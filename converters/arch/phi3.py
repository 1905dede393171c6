"""Phi-3 / Phi-3.5 / Phi-4 (GGUF arch `phi3`; HF `Phi3ForCausalLM`).

The HF checkpoint's fused tensors stay fused: `qkv_proj` (Q rows, then K, then V) becomes
`attn_qkv` and `gate_up_proj` (gate rows, then up) becomes `ffn_up`; no Q/K permutation (NEOX RoPE).
llama.cpp's converter writes its own list of keys: the rotary dimensions from
`partial_rotary_factor`, the pre-training context, and for LongRoPE checkpoints the attention factor
plus the two per-frequency factor tensors (`rope_factors_long`, `rope_factors_short`).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from localrt.converters.arch import GLOBAL
from localrt.converters.arch import KV
from localrt.converters.arch import Arch
from localrt.converters.hf import ConvertError

LAYER = {
    "model.layers.{bid}.input_layernorm.weight": "blk.{bid}.attn_norm.weight",
    "model.layers.{bid}.self_attn.qkv_proj.weight": "blk.{bid}.attn_qkv.weight",
    "model.layers.{bid}.self_attn.o_proj.weight": "blk.{bid}.attn_output.weight",
    "model.layers.{bid}.post_attention_layernorm.weight": "blk.{bid}.ffn_norm.weight",
    "model.layers.{bid}.mlp.gate_up_proj.weight": "blk.{bid}.ffn_up.weight",
    "model.layers.{bid}.mlp.down_proj.weight": "blk.{bid}.ffn_down.weight",
}


def defaults(config: dict[str, Any]) -> dict[str, Any]:
    # Phi3Config's defaults for keys config.json leaves out
    return {
        "max_position_embeddings": 4096,
        "original_max_position_embeddings": 4096,
        "num_key_value_heads": config.get("num_attention_heads", 32),
        "rms_norm_eps": 1e-5,
    }


def rope_parameters(hp: dict[str, Any]) -> dict[str, Any]:
    """transformers' single dict: rope_scaling (or rope_parameters) with theta and rotary fraction."""
    given = hp.get("rope_scaling") or hp.get("rope_parameters")
    rope: dict[str, Any] = dict(given) if isinstance(given, dict) else {}
    rope.setdefault("rope_theta", hp.get("rope_theta", 10_000.0))
    rope.setdefault("partial_rotary_factor", hp.get("partial_rotary_factor", 1.0))
    rope.setdefault("rope_type", rope.get("type", "default"))
    if rope["rope_type"] in ("llama3", "yarn", "longrope"):
        rope["original_max_position_embeddings"] = hp["original_max_position_embeddings"]
    if rope["rope_type"] in ("su", "yarn"):
        rope["rope_type"] = "longrope"  # transformers' name for both
    rope.setdefault("original_max_position_embeddings", hp["original_max_position_embeddings"])
    return rope


def rope_dims(hp: dict[str, Any]) -> int:
    fraction = hp["rope_parameters"].get("partial_rotary_factor", 1.0)
    return int(fraction * hp["hidden_size"]) // hp["num_attention_heads"]


def model_kv(hp: dict[str, Any], file_type: int) -> KV:
    rope = hp["rope_parameters"]
    return [
        ("phi3.context_length", hp["max_position_embeddings"], "u32"),
        ("phi3.rope.scaling.original_context_length", rope["original_max_position_embeddings"], "u32"),
        ("phi3.embedding_length", hp["hidden_size"], "u32"),
        ("phi3.feed_forward_length", hp["intermediate_size"], "u32"),
        ("phi3.block_count", hp["num_hidden_layers"], "u32"),
        ("phi3.attention.head_count", hp["num_attention_heads"], "u32"),
        ("phi3.attention.head_count_kv", hp["num_key_value_heads"], "u32"),
        ("phi3.attention.layer_norm_rms_epsilon", hp["rms_norm_eps"], "f32"),
        ("phi3.rope.dimension_count", rope_dims(hp), "u32"),
        ("phi3.rope.freq_base", rope["rope_theta"], "f32"),
        ("general.file_type", file_type, "u32"),
        # 0 (no window) is how llama.cpp's converter marks Phi-4
        ("phi3.attention.sliding_window", hp.get("sliding_window") or 0, "u32"),
    ]


def long_rope(hp: dict[str, Any]) -> tuple[float, np.ndarray, np.ndarray] | None:
    """(attention factor, long factors, short factors) of a LongRoPE checkpoint, None without factors."""
    rope = hp["rope_parameters"]
    if not rope.get("long_factor"):
        return None
    orig = rope["original_max_position_embeddings"]
    scale = hp["max_position_embeddings"] / orig
    kind = str(rope.get("rope_type", "")).lower()
    if kind in ("su", "longrope"):
        attn_factor = math.sqrt(1 + math.log(scale) / math.log(orig)) if scale > 1.0 else 1.0
    elif kind == "yarn":
        attn_factor = 0.1 * math.log(scale) + 1.0 if scale > 1.0 else 1.0
    else:
        raise ConvertError(f"rope scaling type {kind!r} with long_factor is not supported")
    long, short = rope.get("long_factor"), rope.get("short_factor")
    if short is None or len(long) != len(short) or len(long) != rope_dims(hp) / 2:
        raise ConvertError(
            f"rope long_factor and short_factor must both have {rope_dims(hp) // 2} values "
            f"(half the rotary dimensions)"
        )
    return attn_factor, np.array(long, dtype=np.float32), np.array(short, dtype=np.float32)


def early_kv(hp: dict[str, Any]) -> KV:
    found = long_rope(hp)
    return [] if found is None else [("phi3.rope.scaling.attn_factor", found[0], "f32")]


def extra_tensors(hp: dict[str, Any]) -> list[tuple[str, np.ndarray]]:
    found = long_rope(hp)
    return (
        []
        if found is None
        else [("rope_factors_long.weight", found[1]), ("rope_factors_short.weight", found[2])]
    )


def shapes(hp: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    h, ff = hp["hidden_size"], hp["intermediate_size"]
    nh, nkv = hp["num_attention_heads"], hp["num_key_value_heads"]
    hd = h // nh
    return {"attn_qkv.weight": ((nh + 2 * nkv) * hd, h), "ffn_up.weight": (2 * ff, h)}


ARCH = Arch(
    name="phi3",
    hf_architectures=("Phi3ForCausalLM",),
    tensors={**GLOBAL, **LAYER},
    defaults=defaults,
    rope_parameters=rope_parameters,
    vocab=("phi3",),
    model_kv=model_kv,
    early_kv=early_kv,
    extra_tensors=extra_tensors,
    shapes=shapes,
)
