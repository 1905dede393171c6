"""Gemma 2 (GGUF arch `gemma2`; HF `Gemma2ForCausalLM`).

llama.cpp's converter writes its own short list of keys (no RoPE base: the runtime's 10000 is
Gemma 2's), both soft-capping values and the window, stores every RMSNorm weight as 1 + w, never
writes `lm_head` (the output always shares token_embd) and uses the SentencePiece vocabulary without
the leading-space prefix.
"""

from __future__ import annotations

from typing import Any

from localrt.converters.arch import GLOBAL
from localrt.converters.arch import KV
from localrt.converters.arch import Arch
from localrt.converters.arch.gemma3 import LAYER
from localrt.converters.hf import ConvertError

QK_NORMS = ("self_attn.q_norm", "self_attn.k_norm")


def defaults(config: dict[str, Any]) -> dict[str, Any]:
    # Gemma2Config's defaults for keys config.json leaves out
    return {
        "max_position_embeddings": 8192,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "rms_norm_eps": 1e-6,
        "sliding_window": 4096,
        "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0,
    }


def model_kv(hp: dict[str, Any], file_type: int) -> KV:
    for key in ("attn_logit_softcapping", "final_logit_softcapping", "sliding_window"):
        if hp.get(key) is None:
            raise ConvertError(f"config.json sets {key} to null; llama.cpp's gemma2 needs a value")
    return [
        ("gemma2.context_length", hp["max_position_embeddings"], "u32"),
        ("gemma2.embedding_length", hp["hidden_size"], "u32"),
        ("gemma2.block_count", hp["num_hidden_layers"], "u32"),
        ("gemma2.feed_forward_length", hp["intermediate_size"], "u32"),
        ("gemma2.attention.head_count", hp["num_attention_heads"], "u32"),
        ("gemma2.attention.head_count_kv", hp["num_key_value_heads"], "u32"),
        ("gemma2.attention.layer_norm_rms_epsilon", hp["rms_norm_eps"], "f32"),
        ("gemma2.attention.key_length", hp["head_dim"], "u32"),
        ("gemma2.attention.value_length", hp["head_dim"], "u32"),
        ("general.file_type", file_type, "u32"),
        ("gemma2.attn_logit_softcapping", hp["attn_logit_softcapping"], "f32"),
        ("gemma2.final_logit_softcapping", hp["final_logit_softcapping"], "f32"),
        ("gemma2.attention.sliding_window", hp["sliding_window"], "u32"),
    ]


ARCH = Arch(
    name="gemma2",
    hf_architectures=("Gemma2ForCausalLM",),
    tensors={
        **{k: v for k, v in GLOBAL.items() if k != "lm_head.weight"},
        **{k: v for k, v in LAYER.items() if not any(n in k for n in QK_NORMS)},
    },
    defaults=defaults,
    vocab=("spm",),
    spm_no_space_prefix=True,
    model_kv=model_kv,
    norm_shift=True,
    skip=(".rotary_emb.inv_freq", ".attention.masked_bias", ".attention.bias", "lm_head.weight"),
)
