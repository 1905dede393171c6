"""Tiny random Hugging Face checkpoints of the families beyond Llama: Gemma 3, Gemma 2, Phi-3, Qwen3-MoE,
OLMoE.

Each is a real HF model directory (config.json that transformers' AutoConfig reads, safetensors,
tokenizer files), written with numpy, so llama.cpp's converter, transformers and localrt can all
read it; no torch is needed to make one. `write_family_model(dir, family, **dims)` is the entry
point; `FAMILY_DEFAULTS` gives each family's default dimensions (rows that are multiples of 256,
for the k-quant paths). The torch and MLX engine tests can import these too.

Tokenizers: SentencePiece models trained here on a few sentences with the family's special tokens
(Gemma: <pad> <eos> <bos> <unk>, turn markers, added tokens past the trained pieces; Phi-3: Llama 2's
<unk> <s> </s> plus <|user|> <|assistant|> <|end|> ... as added tokens), and each family's chat
template. `tokenizer_json_dir` swaps in a BPE tokenizer.json without tokenizer.model.

The torch engine's tests use the second part: `tiny_hf(dir, family)` builds the model with
transformers itself (random weights and norms, `save_pretrained`) and `family_gguf` converts it with
llama.cpp's converter (then `llama_model_quantize`), for logits against transformers and llama.cpp.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from tests.fixtures_hf import CORPUS
from tests.fixtures_hf import oracle_quantize
from tests.fixtures_hf import train_sentencepiece
from tests.fixtures_hf import write_safetensors

GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% set role = 'model' if m['role'] == 'assistant' else m['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' + m['content'] | trim + '<end_of_turn>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)
PHI3_TEMPLATE = (
    "{% for m in messages %}{{ '<|' + m['role'] + '|>\n' + m['content'] + '<|end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}"
)
CHATML_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

HF_ARCH = {
    "gemma3": ("Gemma3ForCausalLM", "gemma3_text"),
    "gemma2": ("Gemma2ForCausalLM", "gemma2"),
    "phi3": ("Phi3ForCausalLM", "phi3"),
    "qwen3moe": ("Qwen3MoeForCausalLM", "qwen3_moe"),
    "olmoe": ("OlmoeForCausalLM", "olmoe"),
}
FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    # 6 layers: layers 0-4 use the sliding window, layer 5 is global (llama.cpp's default pattern)
    "gemma3": dict(hidden=256, ff=512, n_layer=6, n_head=2, n_kv=1, head_dim=128, vocab=512),
    "gemma2": dict(hidden=256, ff=512, n_layer=4, n_head=2, n_kv=1, head_dim=128, vocab=512),
    "phi3": dict(hidden=256, ff=512, n_layer=4, n_head=4, n_kv=2, head_dim=64, vocab=512),
    # SmolLM2's GPT-2-style tokenizer (49,152 tokens): llama.cpp reads Qwen3-MoE's vocabulary as BPE only
    "qwen3moe": dict(hidden=256, ff=512, n_layer=2, n_head=2, n_kv=1, head_dim=128, vocab=49152),
    # OLMoE: experts as wide as intermediate_size, q/k norms over the whole projection, n_kv = n_head
    # (llama.cpp's olmoe graph assumes it); BPE only, like Qwen3-MoE
    "olmoe": dict(hidden=256, ff=256, n_layer=2, n_head=2, n_kv=2, head_dim=128, vocab=49152),
}
BPE_FAMILIES = ("qwen3moe", "olmoe")  # llama.cpp reads their vocabulary as GPT-2 BPE only
DTYPE_NAMES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}


# ---- tokenizers -------------------------------------------------------------------------------------
def train_spm(
    out_dir: Path, vocab_size: int, ids: dict[str, int], control: list[str], dummy_prefix: bool = True
) -> None:
    """A byte-fallback BPE SentencePiece model (`tokenizer.model`) with the given special ids;
    `dummy_prefix=False` is Gemma's setting (no space added in front of the text)."""
    import sentencepiece as spm

    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS),
        model_prefix=str(out_dir / "tokenizer"),
        vocab_size=vocab_size,
        model_type="bpe",
        byte_fallback=True,
        character_coverage=1.0,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        split_digits=True,
        add_dummy_prefix=dummy_prefix,
        control_symbols=control,
        minloglevel=2,
        num_threads=1,
        **{f"{k}_id": v for k, v in ids.items()},
        **{f"{k}_piece": p for k, p in SPM_PIECES.items() if f"{k}" in ids},
    )
    (out_dir / "tokenizer.vocab").unlink()


SPM_PIECES = {"pad": "<pad>", "eos": "<eos>", "bos": "<bos>", "unk": "<unk>"}


def _added(entries: list[tuple[int, str, bool]]) -> dict[str, dict[str, Any]]:
    """tokenizer_config.json's added_tokens_decoder."""
    return {
        str(i): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": s,
        }
        for i, t, s in entries
    }


def gemma_tokenizer(out_dir: Path, n_pieces: int) -> dict[str, int]:
    """Gemma's layout: <pad>=0 <eos>=1 <bos>=2 <unk>=3, turn markers as control pieces, more added
    tokens past the trained pieces (one user-defined with U+2581, which llama.cpp stores as a space)."""
    ids = {"pad": 0, "eos": 1, "bos": 2, "unk": 3}
    train_spm(out_dir, n_pieces, ids, ["<start_of_turn>", "<end_of_turn>", "<mask>"], dummy_prefix=False)
    added = [
        (0, "<pad>", True),
        (1, "<eos>", True),
        (2, "<bos>", True),
        (3, "<unk>", True),
        (4, "<start_of_turn>", True),
        (5, "<end_of_turn>", True),
        (6, "<mask>", False),  # not flagged special, but looks special: llama.cpp makes it CONTROL
        (n_pieces, "<start_of_image>", True),
        (n_pieces + 1, "<unused0>", False),
        (n_pieces + 2, "\u2581\u2581", False),  # a user-defined run of two spaces
    ]
    _write_tokenizer_config(
        out_dir,
        {
            "tokenizer_class": "GemmaTokenizer",
            "bos_token": "<bos>",
            "eos_token": "<eos>",
            "pad_token": "<pad>",
            "unk_token": "<unk>",
            "add_bos_token": True,
            "add_eos_token": False,
            "chat_template": GEMMA_TEMPLATE,
            "added_tokens_decoder": _added(added),
        },
    )
    return {"bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0}


def phi3_tokenizer(out_dir: Path, n_pieces: int) -> dict[str, int]:
    """Llama 2's SentencePiece layout (<unk>=0 <s>=1 </s>=2) plus Phi-3's chat tokens added after it."""
    import sentencepiece as spm

    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS),
        model_prefix=str(out_dir / "tokenizer"),
        vocab_size=n_pieces,
        model_type="bpe",
        byte_fallback=True,
        character_coverage=1.0,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        split_digits=True,
        minloglevel=2,
        num_threads=1,
    )
    (out_dir / "tokenizer.vocab").unlink()
    names = ["<|endoftext|>", "<|assistant|>", "<|placeholder1|>", "<|end|>", "<|system|>", "<|user|>"]
    added = [(0, "<unk>", True), (1, "<s>", True), (2, "</s>", False)]
    added += [(n_pieces + i, t, t not in ("<|assistant|>", "<|user|>")) for i, t in enumerate(names)]
    (out_dir / "added_tokens.json").write_text(json.dumps({t: n_pieces + i for i, t in enumerate(names)}))
    _write_tokenizer_config(
        out_dir,
        {
            "tokenizer_class": "LlamaTokenizer",
            "bos_token": "<s>",
            "eos_token": "<|endoftext|>",
            "pad_token": "<|endoftext|>",
            "unk_token": "<unk>",
            "add_bos_token": False,
            "add_eos_token": False,
            "chat_template": PHI3_TEMPLATE,
            "added_tokens_decoder": _added(added),
        },
    )
    return {"bos_token_id": 1, "eos_token_id": n_pieces, "pad_token_id": n_pieces}


def smollm2_tokenizer_json() -> Path:
    """SmolLM2-135M-Instruct's tokenizer.json (GPT-2-style BPE with ChatML markers), from its GGUF."""
    from tests.conftest import _fetch_smollm2

    return tokenizer_json_from_gguf(_fetch_smollm2(), "smollm2-tokenizer-json", CHATML_TEMPLATE)


def bpe_tokenizer(out_dir: Path, source: Path) -> dict[str, int]:
    """A copied tokenizer.json with its tokenizer_config.json (ChatML markers <|im_start|>=1,
    <|im_end|>=2 in SmolLM2's)."""
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (source / name).is_file():
            shutil.copy(source / name, out_dir / name)
    return {"bos_token_id": 1, "eos_token_id": 2}


def _write_tokenizer_config(out_dir: Path, tc: dict[str, Any]) -> None:
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tc, indent=2, ensure_ascii=False))


def tokenizer_json_dir(model_dir: Path, tokenizer_dir: Path, out_dir: Path) -> Path:
    """A copy of `model_dir` whose tokenizer is `tokenizer_dir`'s tokenizer.json (+ its config), with
    no tokenizer.model: llama.cpp then reads the vocabulary as GPT-2-style BPE."""
    shutil.copytree(model_dir, out_dir)
    for name in ("tokenizer.model", "tokenizer_config.json", "added_tokens.json", "special_tokens_map.json"):
        (out_dir / name).unlink(missing_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, out_dir / name)
    return out_dir


def tokenizer_json_from_gguf(gguf: Path, name: str, chat_template: str | None = None) -> Path:
    """A GGUF's tokenizer as tokenizer.json (no tokenizer.model), read by transformers and cached
    under the test cache as `name`. From the Gemma 3 270M GGUF this is Gemma 3's own vocabulary of
    262,144 tokens, what a tokenizer.json-only Gemma 3 checkpoint carries (llama.cpp knows its
    pre-tokenizer fingerprint); from SmolLM2's, a small GPT-2-style one."""
    from transformers import AutoTokenizer

    from tests.fixtures_hf import CACHE

    target = CACHE / name
    if (target / "tokenizer.json").is_file():
        return target
    tmp = target.with_name(target.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(tmp)
    if chat_template is not None:
        tc = json.loads((tmp / "tokenizer_config.json").read_text())
        tc["chat_template"] = chat_template
        (tmp / "tokenizer_config.json").write_text(json.dumps(tc, indent=2))
    tmp.rename(target)
    return target


# ---- weights -----------------------------------------------------------------------------------------
def _normal(rng: np.random.Generator, shape: tuple[int, ...], scale: float) -> np.ndarray:
    return rng.standard_normal(shape) * scale


def _norm(rng: np.random.Generator, n: int, shifted: bool) -> np.ndarray:
    """An RMSNorm weight: Gemma stores w for a scale of (1 + w), the others the scale itself."""
    return rng.standard_normal(n) * 0.05 + (0.0 if shifted else 1.0)


def _attention(
    rng: np.random.Generator, p: str, d: dict[str, Any], qk_norm: bool, shifted: bool, whole: bool = False
) -> dict:
    """q/k/v/o projections; `qk_norm`: RMS norm weights per head (or, `whole`, over the projection)."""
    h, hd, nh, nkv = d["hidden"], d["head_dim"], d["n_head"], d["n_kv"]
    t = {
        p + "self_attn.q_proj.weight": _normal(rng, (nh * hd, h), 0.05),
        p + "self_attn.k_proj.weight": _normal(rng, (nkv * hd, h), 0.05),
        p + "self_attn.v_proj.weight": _normal(rng, (nkv * hd, h), 0.05),
        p + "self_attn.o_proj.weight": _normal(rng, (h, nh * hd), 0.05),
    }
    if qk_norm:
        t[p + "self_attn.q_norm.weight"] = _norm(rng, hd * nh if whole else hd, shifted)
        t[p + "self_attn.k_norm.weight"] = _norm(rng, hd * nkv if whole else hd, shifted)
    return t


def _mlp(rng: np.random.Generator, p: str, h: int, ff: int) -> dict:
    return {
        p + "mlp.gate_proj.weight": _normal(rng, (ff, h), 0.05),
        p + "mlp.up_proj.weight": _normal(rng, (ff, h), 0.05),
        p + "mlp.down_proj.weight": _normal(rng, (h, ff), 0.05),
    }


def _layer(rng: np.random.Generator, family: str, i: int, d: dict[str, Any]) -> dict[str, np.ndarray]:
    p, h = f"model.layers.{i}.", d["hidden"]
    gemma = family.startswith("gemma")
    t = {
        p + "input_layernorm.weight": _norm(rng, h, gemma),
        p + "post_attention_layernorm.weight": _norm(rng, h, gemma),
    }
    if gemma:
        t |= _attention(rng, p, d, qk_norm=family == "gemma3", shifted=True) | _mlp(rng, p, h, d["ff"])
        t[p + "pre_feedforward_layernorm.weight"] = _norm(rng, h, True)
        t[p + "post_feedforward_layernorm.weight"] = _norm(rng, h, True)
    elif family == "phi3":
        qkv = _attention(rng, p, d, qk_norm=False, shifted=False)
        t[p + "self_attn.qkv_proj.weight"] = np.concatenate(
            [qkv.pop(p + f"self_attn.{k}_proj.weight") for k in "qkv"]
        )
        t |= qkv
        mlp = _mlp(rng, p, h, d["ff"])
        t[p + "mlp.gate_up_proj.weight"] = np.concatenate(
            [mlp[p + "mlp.gate_proj.weight"], mlp[p + "mlp.up_proj.weight"]]
        )
        t[p + "mlp.down_proj.weight"] = mlp[p + "mlp.down_proj.weight"]
    else:  # qwen3moe, olmoe
        whole = family == "olmoe"
        t |= _attention(rng, p, d, qk_norm=True, shifted=False, whole=whole) | _experts(rng, p, d)
    return t


def _experts(rng: np.random.Generator, p: str, d: dict[str, Any]) -> dict[str, np.ndarray]:
    h, ff, n = d["hidden"], d["moe_ff"], d["n_expert"]
    t = {p + "mlp.gate.weight": _normal(rng, (n, h), 0.1)}
    gate = _normal(rng, (n, ff, h), 0.05)
    up = _normal(rng, (n, ff, h), 0.05)
    down = _normal(rng, (n, h, ff), 0.05)
    if d.get("experts_3d"):  # transformers 5's in-memory layout: gate rows then up rows, per expert
        t[p + "mlp.experts.gate_up_proj"] = np.concatenate([gate, up], axis=1)
        t[p + "mlp.experts.down_proj"] = down
        return t
    for e in range(n):
        t[p + f"mlp.experts.{e}.gate_proj.weight"] = gate[e]
        t[p + f"mlp.experts.{e}.up_proj.weight"] = up[e]
        t[p + f"mlp.experts.{e}.down_proj.weight"] = down[e]
    return t


def _write_weights(out_dir: Path, t: dict[str, np.ndarray], dtype: str, shards: int) -> None:
    if shards == 1:
        write_safetensors(out_dir / "model.safetensors", t, dtype)
        return
    names, weight_map = sorted(t), {}
    for s in range(shards):
        part = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        chunk = {n: t[n] for n in names[s::shards]}
        write_safetensors(out_dir / part, chunk, dtype)
        weight_map |= dict.fromkeys(chunk, part)
    (out_dir / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )


# ---- config.json ---------------------------------------------------------------------------------------
def _config(family: str, d: dict[str, Any], dtype: str, special: dict[str, int]) -> dict[str, Any]:
    arch, model_type = HF_ARCH[family]
    c: dict[str, Any] = {
        "architectures": [arch],
        "model_type": model_type,
        "hidden_size": d["hidden"],
        "intermediate_size": d["ff"],
        "num_hidden_layers": d["n_layer"],
        "num_attention_heads": d["n_head"],
        "num_key_value_heads": d["n_kv"],
        "vocab_size": d["vocab"],
        "max_position_embeddings": d.get("context", 2048),
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": d["tied"],
        "torch_dtype": DTYPE_NAMES[dtype],
        **special,
    }
    if family not in ("phi3", "olmoe"):  # OlmoeConfig has no head_dim (hidden / heads)
        c["head_dim"] = d["head_dim"]
    if family.startswith("gemma"):
        c |= {
            "hidden_activation": "gelu_pytorch_tanh",
            "query_pre_attn_scalar": d["head_dim"],  # llama.cpp scales by 1/sqrt(head_dim)
            "sliding_window": d.get("sliding_window", 64),
        }
    if family == "gemma3":
        c |= {"rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0, "sliding_window_pattern": 6}
        if d.get("rope_scaling"):
            c["rope_scaling"] = d["rope_scaling"]
    elif family == "gemma2":
        c |= {"rope_theta": 10_000.0, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}
    elif family == "phi3":
        c |= _phi3_rope(d)
    elif family == "olmoe":
        c |= {
            "rope_theta": 10_000.0,
            "num_experts": d["n_expert"],
            "num_experts_per_tok": d["n_expert_used"],
            "norm_topk_prob": False,
            "hidden_act": "silu",
        }
    else:
        c |= {
            "rope_theta": 1_000_000.0,
            "num_experts": d["n_expert"],
            "num_experts_per_tok": d["n_expert_used"],
            "moe_intermediate_size": d["moe_ff"],
            "norm_topk_prob": True,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
        }
    return c


def _phi3_rope(d: dict[str, Any]) -> dict[str, Any]:
    c: dict[str, Any] = {
        "rope_theta": 10_000.0,
        "original_max_position_embeddings": d.get("original_context", d.get("context", 2048)),
        "sliding_window": d.get("sliding_window"),
        "hidden_act": "silu",
    }
    if d.get("partial_rotary_factor"):
        c["partial_rotary_factor"] = d["partial_rotary_factor"]
    if d.get("longrope"):
        half = int(d.get("partial_rotary_factor", 1.0) * d["hidden"]) // d["n_head"] // 2
        rng = np.random.default_rng(7)
        c["rope_scaling"] = {
            "type": "longrope",
            "long_factor": [round(float(x), 6) for x in 1.0 + rng.random(half) * 20],
            "short_factor": [round(float(x), 6) for x in 1.0 + rng.random(half) * 0.2],
        }
    return c


def write_family_model(
    out_dir: Path,
    family: str,
    dtype: str = "F32",
    shards: int = 1,
    seed: int = 0,
    tied: bool | None = None,
    tokenizer: Path | None = None,
    **dims: Any,
) -> Path:
    """A random-weight checkpoint of `family` ("gemma3", "gemma2", "phi3", "qwen3moe", "olmoe").

    `dims` override FAMILY_DEFAULTS (hidden, ff, n_layer, n_head, n_kv, head_dim, vocab) and set the
    family's options: sliding_window, context (max_position_embeddings), rope_scaling (gemma3);
    longrope, partial_rotary_factor, original_context (phi3); n_expert, n_expert_used, moe_ff,
    experts_3d (qwen3moe: 3-D expert tensors instead of one per expert); olmoe's experts are `ff` wide.
    `tokenizer`: for qwen3moe and olmoe, a directory with the tokenizer.json to use (default: SmolLM2's).
    """
    d: dict[str, Any] = {**FAMILY_DEFAULTS[family], **dims}
    d.setdefault("n_expert", 4)
    d.setdefault("n_expert_used", 2)
    d.setdefault("moe_ff", d["ff"] if family == "olmoe" else 256)
    # Gemma ties the output to the embedding; Phi-3 has its own lm_head (so has Qwen3-30B-A3B, but the
    # tiny one ties it: one 49,152-row matrix instead of two)
    d["tied"] = family != "phi3" if tied is None else tied
    out_dir.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    h = d["hidden"]
    t: dict[str, np.ndarray] = {
        "model.embed_tokens.weight": _normal(rng, (d["vocab"], h), 0.02),
        "model.norm.weight": _norm(rng, h, family.startswith("gemma")),
    }
    if not d["tied"] and family != "gemma2":
        t["lm_head.weight"] = _normal(rng, (d["vocab"], h), 0.02)
    for i in range(d["n_layer"]):
        t |= _layer(rng, family, i, d)
    _write_weights(out_dir, t, dtype, shards)
    n_pieces = min(d["vocab"] - 16, 400)
    if family in BPE_FAMILIES:
        special = bpe_tokenizer(out_dir, tokenizer or smollm2_tokenizer_json())
    else:
        special = {"phi3": phi3_tokenizer}.get(family, gemma_tokenizer)(out_dir, n_pieces)
    (out_dir / "config.json").write_text(json.dumps(_config(family, d, dtype, special), indent=2))
    (out_dir / "generation_config.json").write_text(
        json.dumps({k: v for k, v in special.items() if k != "pad_token_id"} | {"do_sample": False})
    )
    return out_dir


# ---- the torch engine's tests: checkpoints built with transformers, converted by llama.cpp ----------
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
OLMOE: dict[str, Any] = {
    "vocab_size": 512,
    "hidden_size": 256,
    "intermediate_size": 256,  # each expert's width
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "norm_topk_prob": False,  # what llama.cpp always does for this family
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,  # llama.cpp's olmoe graph norms K over n_embd: n_kv = n_head
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-5,  # llama.cpp's converter writes 1e-5 whatever the config says
    "rope_parameters": {"rope_type": "default", "rope_theta": 10_000.0},
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}


def tiny_hf(out_dir: Path, family: str, seed: int = 0) -> Path:
    """A random checkpoint of `family` (gemma3, gemma2, phi3, qwen3moe, olmoe) for llama.cpp's converter."""
    if family.startswith("gemma"):
        return tiny_gemma_hf(out_dir, family, seed)
    import torch
    import transformers

    if (out_dir / "config.json").is_file():
        return out_dir
    config_class, model_class, options = {
        "phi3": ("Phi3Config", "Phi3ForCausalLM", PHI3),
        "qwen3moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", QWEN3MOE),
        "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", OLMOE),
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


# llama.cpp's converter, with Qwen3-MoE's and OLMoE's vocabulary read from the SentencePiece model as Qwen2's
# converter does (its own BPE path accepts only the tokenizers it knows by hash; the logit tests
# need the weights, not a real vocabulary)
FAMILY_DRIVER = """
import json, sys
sys.argv = [sys.argv[1]]
sys.path.insert(0, sys.argv[0].rsplit('/', 1)[0])
import convert_hf_to_gguf as c
from conversion import olmo, qwen
qwen.Qwen3MoeModel.set_vocab = qwen.Qwen2Model.set_vocab
olmo.OlmoeModel.set_vocab = qwen.Qwen2Model.set_vocab
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
