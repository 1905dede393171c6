"""Tiny random checkpoints of the newer families (Gemma 3, ...), built with transformers and converted
with llama.cpp's own convert_hf_to_gguf.py (+ llama_model_quantize), for the engines' logit tests.

Each function returns the HF directory (for transformers' fp32 reference) or the GGUF of a file
type; both are built once per test session into a pytest temporary directory.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.fixtures_hf import oracle_convert_many, oracle_quantize, train_sentencepiece

GEMMA3_WINDOW = 24  # not a multiple of the engine's 16-token blocks


GEMMA_COMMON: dict[str, Any] = {
    "vocab_size": 512,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 6,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    # llama.cpp scales q by 1/sqrt(head_dim); transformers by query_pre_attn_scalar^-1/2
    "query_pre_attn_scalar": 64,
    "sliding_window": GEMMA3_WINDOW,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}
GEMMA_FAMILIES: dict[str, dict[str, Any]] = {
    # six layers: five sliding, one global; separate RoPE bases
    "gemma3": {
        "rope_parameters": {
            "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        },
    },
    # alternating layers; caps small enough to bite on random weights
    "gemma2": {"attn_logit_softcapping": 1.0, "final_logit_softcapping": 2.0},
}


def tiny_gemma_hf(out_dir: Path, family: str = "gemma3", seed: int = 0, **overrides: Any) -> Path:
    """A random Gemma3ForCausalLM / Gemma2ForCausalLM (dims multiples of 256 for the k-quant paths),
    random norm weights, a SentencePiece tokenizer, saved with `save_pretrained`."""
    import torch
    import transformers

    if (out_dir / "config.json").is_file():
        return out_dir
    prefix = {"gemma3": "Gemma3", "gemma2": "Gemma2"}[family]
    config_class = getattr(transformers, f"{prefix}TextConfig" if family == "gemma3" else f"{prefix}Config")
    model_class = getattr(transformers, f"{prefix}ForCausalLM")
    options = {**GEMMA_COMMON, **GEMMA_FAMILIES[family]}
    options.update(overrides)
    torch.manual_seed(seed)
    model = model_class(config_class(**options)).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):  # Gemma's norms scale by (1 + w), w initialised to 0
                p.copy_(0.2 * torch.randn_like(p))
            else:
                p.copy_(0.05 * torch.randn_like(p))
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    train_sentencepiece(out_dir, vocab_size=400)
    (out_dir / "tokenizer_config.json").write_text(
        json.dumps(
            {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "add_bos_token": True},
            indent=2,
        )
    )
    return out_dir


def family_gguf(hf_dir: Path, work: Path, file_type: str) -> Path:
    """llama.cpp's conversion of `hf_dir`: F32 directly, other types quantized from it."""
    f32 = work / "oracle-F32.gguf"
    oracle_convert_many([(hf_dir, f32, "f32")])
    if file_type == "F32":
        return f32
    out = work / f"oracle-{file_type}.gguf"
    if not out.is_file():
        oracle_quantize(f32, out, file_type)
    return out
