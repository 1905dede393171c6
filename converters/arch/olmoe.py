"""OLMoE (GGUF arch `olmoe`; HF `OlmoeForCausalLM`): Llama-style attention with RMS norms on the whole
Q and K projections (one weight of n_head * head_dim, not per head), and a routed MoE MLP whose experts
are `intermediate_size` wide.

llama.cpp's converter (OlmoeModel) writes TextModel's keys and then forces the RMS epsilon to 1e-5
(the key keeps its first place); it does not permute Q/K (neox RoPE) and reads the vocabulary as
GPT-2 BPE only. Experts are stacked expert-major as for Qwen3-MoE.
"""

from __future__ import annotations

from typing import Any

from localrt.converters.arch import GLOBAL
from localrt.converters.arch import KV
from localrt.converters.arch import Arch
from localrt.converters.arch.qwen3 import QK_NORMS
from localrt.converters.arch.qwen3moe import ATTENTION
from localrt.converters.arch.qwen3moe import MOE
from localrt.converters.arch.qwen3moe import n_experts


def defaults(config: dict[str, Any]) -> dict[str, Any]:
    # OlmoeConfig's defaults for keys config.json leaves out (no head_dim: key_length is not written)
    return {
        "max_position_embeddings": 4096,
        "num_key_value_heads": config.get("num_attention_heads"),
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "num_experts_per_tok": 8,
        "num_experts": 64,
    }


def extra_kv(hp: dict[str, Any]) -> KV:
    return [("olmoe.attention.layer_norm_rms_epsilon", 1e-5, "f32")]


def shapes(hp: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    h, ff, n = hp["hidden_size"], hp["intermediate_size"], n_experts(hp)
    nh = hp["num_attention_heads"]
    nkv = hp.get("num_key_value_heads") or nh
    hd = hp.get("head_dim") or h // nh
    return {
        "attn_q_norm.weight": (nh * hd,),  # over the whole projection, not per head
        "attn_k_norm.weight": (nkv * hd,),
        "ffn_gate_inp.weight": (n, h),
        "ffn_gate_exps.weight": (n, ff, h),
        "ffn_up_exps.weight": (n, ff, h),
        "ffn_down_exps.weight": (n, h, ff),
    }


ARCH = Arch(
    name="olmoe",
    hf_architectures=("OlmoeForCausalLM",),
    tensors={**GLOBAL, **ATTENTION, **QK_NORMS, **MOE},
    defaults=defaults,
    vocab=("gpt2",),
    extra_kv=extra_kv,
    shapes=shapes,
    experts=n_experts,
)
