"""Tiny random checkpoints of the newer families (Gemma 3, ...), built with transformers and converted
with llama.cpp's own convert_hf_to_gguf.py (+ llama_model_quantize), for the engines' logit tests.

Each function returns the HF directory (for transformers' fp32 reference) or the GGUF of a file
type; both are built once per test session into a pytest temporary directory.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.fixtures_hf import oracle_quantize, train_sentencepiece

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


PHI3_ROPE_DIMS = 32  # partial rotary: half of each 64-dim head
PHI3: dict[str, Any] = {
    "vocab_size": 512,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 1024,
    "original_max_position_embeddings": 512,
    "rms_norm_eps": 1e-5,
    "rope_parameters": {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.5,
        "original_max_position_embeddings": 512,
        "short_factor": [1.0 + 0.1 * i for i in range(PHI3_ROPE_DIMS // 2)],
        "long_factor": [2.0 + 0.5 * i for i in range(PHI3_ROPE_DIMS // 2)],
    },
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}
QWEN3MOE: dict[str, Any] = {
    "vocab_size": 512,
    "hidden_size": 256,
    "intermediate_size": 512,
    "moe_intermediate_size": 256,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "norm_topk_prob": True,  # what llama.cpp always does for this family
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0},
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def tiny_hf(out_dir: Path, family: str, seed: int = 0) -> Path:
    """A random checkpoint of `family` (gemma3, gemma2, phi3, qwen3moe) for llama.cpp's converter."""
    if family.startswith("gemma"):
        return tiny_gemma_hf(out_dir, family, seed)
    import torch
    import transformers

    if (out_dir / "config.json").is_file():
        return out_dir
    config_class, model_class, options = {
        "phi3": ("Phi3Config", "Phi3ForCausalLM", PHI3),
        "qwen3moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", QWEN3MOE),
    }[family]
    torch.manual_seed(seed)
    model = getattr(transformers, model_class)(getattr(transformers, config_class)(**options)).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(
                (1 + 0.2 * torch.randn_like(p))
                if name.endswith("norm.weight")
                else 0.05 * torch.randn_like(p)
            )
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    train_sentencepiece(out_dir, vocab_size=400)
    (out_dir / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "LlamaTokenizer",  # Phi-3's converter reads it (GPT2Tokenizer: Phi-4)
                "bos_token": "<s>",
                "eos_token": "</s>",
                "unk_token": "<unk>",
                "add_bos_token": True,
            },
            indent=2,
        )
    )
    return out_dir


# llama.cpp's converter, with Qwen3-MoE's vocabulary read from the SentencePiece model as Qwen2's
# converter does (its own BPE path accepts only the tokenizers it knows by hash; the logit tests
# need the weights, not a real vocabulary)
FAMILY_DRIVER = """
import json, sys
sys.argv = [sys.argv[1]]
sys.path.insert(0, sys.argv[0].rsplit('/', 1)[0])
import convert_hf_to_gguf as c
from conversion import qwen
qwen.Qwen3MoeModel.set_vocab = qwen.Qwen2Model.set_vocab
for model, out, outtype in json.loads(sys.stdin.read()):
    sys.argv = ['convert_hf_to_gguf.py', model, '--outfile', out, '--outtype', outtype]
    c.main()
"""


def convert_family(model_dir: Path, out: Path, outtype: str) -> None:
    import subprocess
    import sys

    from tests.fixtures_hf import llama_cpp_src

    if out.is_file():
        return
    script = llama_cpp_src() / "convert_hf_to_gguf.py"
    payload = json.dumps([[str(model_dir), str(out), outtype]])
    proc = subprocess.run(
        [sys.executable, "-c", FAMILY_DRIVER, str(script)], input=payload, capture_output=True, text=True
    )
    if proc.returncode != 0:
        raise RuntimeError(f"convert_hf_to_gguf failed:\n{proc.stderr[-3000:]}")


def family_gguf(hf_dir: Path, work: Path, file_type: str) -> Path:
    """llama.cpp's conversion of `hf_dir`: F32 directly, other types quantized from it."""
    f32 = work / "oracle-F32.gguf"
    convert_family(hf_dir, f32, "f32")
    if file_type == "F32":
        return f32
    out = work / f"oracle-{file_type}.gguf"
    if not out.is_file():
        oracle_quantize(f32, out, file_type)
    return out
