"""One small table per architecture: HF names -> GGUF names, config defaults, Q/K permutation.

An `Arch` is data plus a few small hooks (keys, generated tensors, value changes);
`converters/convert.py` runs the same pipeline for all of them.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from dataclasses import field
from pathlib import Path
from typing import Any

import numpy as np

from localrt.converters.hf import ConvertError

KV = list[tuple[str, Any, str]]  # (GGUF key, value, value type: "u32", "f32", "str", "bool")


def no_kv(hp: dict[str, Any]) -> KV:
    return []


def no_tensors(hp: dict[str, Any]) -> list[tuple[str, np.ndarray]]:
    return []


def keep_rows(model_dir: Path, hp: dict[str, Any]) -> int | None:
    return None


@dataclass(frozen=True)
class Arch:
    name: str  # GGUF general.architecture
    hf_architectures: tuple[str, ...]  # config.json "architectures" values
    tensors: dict[str, str]  # HF tensor name ({bid} = layer) -> GGUF tensor name
    # config defaults of the transformers config class (llama.cpp's converter reads AutoConfig.to_dict())
    defaults: Callable[[dict[str, Any]], dict[str, Any]]
    # transformers' rope_parameters for this config (None: the single-dict form of Llama and Qwen)
    rope_parameters: Callable[[dict[str, Any]], dict[str, Any]] | None = None
    permute_qk: bool = False  # HF rotate-half Q/K rows -> GGUF's interleaved (llama) rope layout
    vocab: tuple[str, ...] = ("spm", "gpt2")  # tokenizers tried in order ("phi3": Phi-3's own SentencePiece)
    # tokenizer.ggml.add_space_prefix=False written after the special tokens of a SentencePiece vocab (Gemma)
    spm_no_space_prefix: bool = False
    # the model's keys when the architecture writes its own set instead of the shared ones: (hp, file type)
    model_kv: Callable[[dict[str, Any], int], KV] | None = None
    extra_kv: Callable[[dict[str, Any]], KV] = (
        no_kv  # keys after the shared ones (a re-set key keeps its place)
    )
    early_kv: Callable[[dict[str, Any]], KV] = (
        no_kv  # keys set before the model card's (while reading tensors)
    )
    extra_tensors: Callable[[dict[str, Any]], list[tuple[str, np.ndarray]]] = no_tensors  # written first, F32
    # torch-order shapes by GGUF base name that differ from the Llama layout (fused or expert tensors)
    shapes: Callable[[dict[str, Any]], dict[str, tuple[int, ...]]] = lambda hp: {}
    norm_shift: bool = False  # HF stores RMSNorm weights as w for (1 + w) (Gemma): the GGUF holds 1 + w
    # experts per layer of a mixture-of-experts model (its per-expert HF tensors are merged into one 3-D
    # tensor per layer and projection); None for dense models
    experts: Callable[[dict[str, Any]], int] | None = None
    # rows of token_embd to keep (Gemma 3 drops rows past the tokenizer's vocabulary), None: all
    embedding_rows: Callable[[Path, dict[str, Any]], int | None] = keep_rows
    skip: tuple[str, ...] = (".rotary_emb.inv_freq", ".attention.masked_bias", ".attention.bias")
    _patterns: list[tuple[re.Pattern[str], str]] = field(default_factory=list, compare=False, repr=False)

    def gguf_name(self, hf_name: str) -> str | None:
        """The GGUF name of an HF tensor, or None for tensors the converter drops."""
        if hf_name.endswith(self.skip):
            return None
        if not self._patterns:
            for src, dst in self.tensors.items():
                regex = re.escape(src).replace(re.escape("{bid}"), r"(?P<bid>\d+)")
                self._patterns.append((re.compile(regex + "$"), dst))
        for regex, dst in self._patterns:
            m = regex.match(hf_name)
            if m:
                return dst.format(bid=m.group("bid")) if "{bid}" in dst else dst
        raise ConvertError(
            f"tensor {hf_name!r} has no GGUF name in the {self.name} table "
            "(an unsupported variant of the architecture?)"
        )


LLAMA_LAYER = {
    "model.layers.{bid}.input_layernorm.weight": "blk.{bid}.attn_norm.weight",
    "model.layers.{bid}.self_attn.q_proj.weight": "blk.{bid}.attn_q.weight",
    "model.layers.{bid}.self_attn.k_proj.weight": "blk.{bid}.attn_k.weight",
    "model.layers.{bid}.self_attn.v_proj.weight": "blk.{bid}.attn_v.weight",
    "model.layers.{bid}.self_attn.o_proj.weight": "blk.{bid}.attn_output.weight",
    "model.layers.{bid}.post_attention_layernorm.weight": "blk.{bid}.ffn_norm.weight",
    "model.layers.{bid}.mlp.gate_proj.weight": "blk.{bid}.ffn_gate.weight",
    "model.layers.{bid}.mlp.up_proj.weight": "blk.{bid}.ffn_up.weight",
    "model.layers.{bid}.mlp.down_proj.weight": "blk.{bid}.ffn_down.weight",
}
GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def registry() -> dict[str, Arch]:
    """HF architecture name -> Arch."""
    from localrt.converters.arch import gemma2
    from localrt.converters.arch import gemma3
    from localrt.converters.arch import llama
    from localrt.converters.arch import olmoe
    from localrt.converters.arch import phi3
    from localrt.converters.arch import qwen2
    from localrt.converters.arch import qwen3
    from localrt.converters.arch import qwen3moe

    out: dict[str, Arch] = {}
    for arch in (
        llama.ARCH,
        qwen2.ARCH,
        qwen3.ARCH,
        gemma3.ARCH,
        gemma2.ARCH,
        phi3.ARCH,
        qwen3moe.ARCH,
        olmoe.ARCH,
    ):
        for hf in arch.hf_architectures:
            out[hf] = arch
    return out


VISION_HINT = (
    "localrt convert writes text models only, not the vision tower and projector: convert it with "
    "llama.cpp's convert_hf_to_gguf.py (once for the model, once with --mmproj for the projector), then "
    "`localrt create NAME --from MODEL.gguf --mmproj mmproj-MODEL.gguf`"
)


def find_arch(config: dict[str, Any]) -> Arch:
    names = config.get("architectures") or []
    if isinstance(config.get("vision_config"), dict):
        shown = ", ".join(names) or "a vision-language model"
        raise ConvertError(f"{shown} is a vision-language model; {VISION_HINT}")
    table = registry()
    for name in names:
        if name in table:
            return table[name]
    shown = ", ".join(names) if names else "none given in config.json"
    raise ConvertError(f"unsupported architecture ({shown}); supported: {', '.join(sorted(table))}")
