"""Gemma 3 text models (GGUF arch `gemma3`; HF `Gemma3ForCausalLM`, model_type `gemma3_text`).

What llama.cpp's converter does differently from Llama: every RMSNorm weight is stored as 1 + w (HF
keeps w and computes x * (1 + w)), no Q/K permutation (NEOX RoPE), separate RoPE bases for global and
sliding-window layers (`rope.freq_base`, `rope.freq_base_swa`), the window size as a key (the pattern
is llama.cpp's default of one global layer in six), token_embd cut to the tokenizer's vocabulary, and
a SentencePiece vocabulary without the leading-space prefix.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from localrt.converters.arch import GLOBAL
from localrt.converters.arch import KV
from localrt.converters.arch import LLAMA_LAYER
from localrt.converters.arch import Arch
from localrt.converters.hf import ConvertError

NORMS = {
    "model.layers.{bid}.post_attention_layernorm.weight": "blk.{bid}.post_attention_norm.weight",
    "model.layers.{bid}.pre_feedforward_layernorm.weight": "blk.{bid}.ffn_norm.weight",
    "model.layers.{bid}.post_feedforward_layernorm.weight": "blk.{bid}.post_ffw_norm.weight",
    "model.layers.{bid}.self_attn.q_norm.weight": "blk.{bid}.attn_q_norm.weight",
    "model.layers.{bid}.self_attn.k_norm.weight": "blk.{bid}.attn_k_norm.weight",
}
LAYER = {k: v for k, v in LLAMA_LAYER.items() if "post_attention_layernorm" not in k} | NORMS


def defaults(config: dict[str, Any]) -> dict[str, Any]:
    # Gemma3TextConfig's defaults for keys config.json leaves out
    return {
        "max_position_embeddings": 131072,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "rms_norm_eps": 1e-6,
        "sliding_window": 4096,
    }


def rope_parameters(hp: dict[str, Any]) -> dict[str, Any]:
    """transformers' nested form: one dict for global layers, one for sliding-window layers."""
    given = hp.get("rope_parameters")
    rope: dict[str, Any] = (
        {k: dict(v) if isinstance(v, dict) else v for k, v in given.items()}
        if isinstance(given, dict)
        else {"sliding_attention": {"rope_type": "default"}, "full_attention": {"rope_type": "default"}}
    )
    if isinstance(hp.get("rope_scaling"), dict) and isinstance(rope.get("full_attention"), dict):
        rope["full_attention"].update(hp["rope_scaling"])
    for kind, key, theta in (
        ("full_attention", "rope_theta", 1_000_000.0),
        ("sliding_attention", "rope_local_base_freq", 10_000.0),
    ):
        if rope.get(kind) is None:
            rope[kind] = {"rope_type": "default"}
        rope[kind].setdefault("rope_theta", hp.get(key, theta))
        rope[kind].setdefault("rope_type", rope[kind].get("type", "default"))
        if rope[kind]["rope_type"] in ("llama3", "yarn", "longrope"):
            rope[kind].setdefault("original_max_position_embeddings", hp["max_position_embeddings"])
    return rope


def extra_kv(hp: dict[str, Any]) -> KV:
    """Gemma3Model's keys after the shared ones: re-set keys keep their place, new ones follow."""
    full = hp["rope_parameters"].get("full_attention", hp["rope_parameters"])
    out: KV = [
        ("gemma3.context_length", hp["max_position_embeddings"], "u32"),
        ("gemma3.attention.head_count", hp["num_attention_heads"], "u32"),
        ("gemma3.attention.layer_norm_rms_epsilon", hp["rms_norm_eps"], "f32"),
        ("gemma3.attention.key_length", hp["head_dim"], "u32"),
        ("gemma3.attention.value_length", hp["head_dim"], "u32"),
        ("gemma3.rope.freq_base", full.get("rope_theta", 1_000_000.0), "f32"),
    ]
    if hp.get("final_logit_softcapping"):
        out.append(("gemma3.final_logit_softcapping", hp["final_logit_softcapping"], "f32"))
    if hp.get("sliding_window_pattern") != 1:
        if hp.get("sliding_window") is None:
            raise ConvertError("config.json sets sliding_window to null; llama.cpp's gemma3 needs a window")
        out.append(("gemma3.attention.sliding_window", hp["sliding_window"], "u32"))
    out.append(("gemma3.attention.head_count_kv", hp["num_key_value_heads"], "u32"))
    return out


def embedding_rows(model_dir: Path, hp: dict[str, Any]) -> int:
    """The vocabulary the tokenizer defines: rows of token_embd beyond it are dropped."""
    if (model_dir / "tokenizer.model").is_file():
        return int(hp["vocab_size"])  # the SentencePiece list is padded to vocab_size
    tj = json.loads((model_dir / "tokenizer.json").read_text(encoding="utf-8"))
    return len(tj["model"]["vocab"]) + len(tj.get("added_tokens") or [])


ARCH = Arch(
    name="gemma3",
    hf_architectures=("Gemma3ForCausalLM",),
    tensors={**GLOBAL, **LAYER},
    defaults=defaults,
    rope_parameters=rope_parameters,
    vocab=("spm", "gpt2"),
    spm_no_space_prefix=True,
    extra_kv=extra_kv,
    norm_shift=True,
    embedding_rows=embedding_rows,
)
