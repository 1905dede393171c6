"""Qwen3-MoE (GGUF arch `qwen3moe`; HF `Qwen3MoeForCausalLM`): Qwen3's attention, a routed MoE MLP.

The router (`mlp.gate`) becomes `ffn_gate_inp` (kept F32 by both the converter and llama-quantize).
Per-expert HF tensors (`mlp.experts.{e}.{gate,up,down}_proj`) are stacked expert-major into GGUF's
3-D `ffn_{gate,up,down}_exps`; checkpoints already stored 3-D (`mlp.experts.gate_up_proj`,
`mlp.experts.down_proj`, as transformers 5 keeps them in memory) are split or passed through.
"""

from __future__ import annotations

from typing import Any

from localrt.converters.arch import GLOBAL
from localrt.converters.arch import KV
from localrt.converters.arch import LLAMA_LAYER
from localrt.converters.arch import Arch
from localrt.converters.arch.qwen3 import QK_NORMS

MOE = {
    "model.layers.{bid}.mlp.gate.weight": "blk.{bid}.ffn_gate_inp.weight",
    "model.layers.{bid}.mlp.experts.gate_proj.weight": "blk.{bid}.ffn_gate_exps.weight",
    "model.layers.{bid}.mlp.experts.up_proj.weight": "blk.{bid}.ffn_up_exps.weight",
    "model.layers.{bid}.mlp.experts.down_proj.weight": "blk.{bid}.ffn_down_exps.weight",
}
ATTENTION = {k: v for k, v in LLAMA_LAYER.items() if ".mlp." not in k}


def defaults(config: dict[str, Any]) -> dict[str, Any]:
    # Qwen3MoeConfig's defaults for keys config.json leaves out (it has no head_dim default)
    return {
        "max_position_embeddings": 32768,
        "num_key_value_heads": 4,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "moe_intermediate_size": 768,
        "num_experts_per_tok": 8,
        "num_experts": 128,
    }


def n_experts(hp: dict[str, Any]) -> int:
    """Experts per layer: transformers 5 reports Qwen3-MoE's `num_experts` as `num_local_experts`."""
    return int(hp.get("num_local_experts") or hp["num_experts"])


def extra_kv(hp: dict[str, Any]) -> KV:
    return [("qwen3moe.expert_feed_forward_length", hp["moe_intermediate_size"], "u32")]


def shapes(hp: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    h, ff, n = hp["hidden_size"], hp["moe_intermediate_size"], n_experts(hp)
    return {
        "ffn_gate_inp.weight": (n, h),
        "ffn_gate_exps.weight": (n, ff, h),
        "ffn_up_exps.weight": (n, ff, h),
        "ffn_down_exps.weight": (n, h, ff),
    }


ARCH = Arch(
    name="qwen3moe",
    hf_architectures=("Qwen3MoeForCausalLM",),
    tensors={**GLOBAL, **ATTENTION, **QK_NORMS, **MOE},
    defaults=defaults,
    vocab=("spm", "gpt2"),
    extra_kv=extra_kv,
    shapes=shapes,
    experts=n_experts,
)
