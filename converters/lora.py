"""PEFT LoRA adapter -> GGUF LoRA: the file llama.cpp's `convert_lora_to_gguf.py` writes.

A PEFT folder holds `adapter_config.json` (rank, `lora_alpha`, the base model's name) and
`adapter_model.safetensors` with one `lora_A` (rank, in) and `lora_B` (out, rank) matrix per adapted
linear layer. The GGUF names each pair after the base tensor it adapts (`blk.0.attn_q.weight.lora_a`,
`.lora_b`), with the shapes PEFT stores; llama.cpp adds `scale * alpha / rank * B @ A @ x` to that
layer's output.

Keys, in llama.cpp's order: general.architecture, general.type "adapter", adapter.type "lora", the
model card (gguf-py's `Metadata`, read from the adapter's folder), adapter.lora.alpha, then
general.quantization_version. No file type and no vocabulary: an adapter borrows them from its base.

Tensors, in llama.cpp's order: tensors are read by name (as safetensors' `load_file` returns them); the
norm vectors some tools (mergekit) put in an adapter come out as they are read, the A/B pairs after
them, in the order their base tensors were first met. What the model converter does to a base tensor
is done to the pair where it is linear in the rows: Llama's Q/K row permutation applies to B (the
rows of B @ A are the rows of B); an embedding's A is transposed, as llama.cpp's `llm_build_inp_embd`
reads it. Pairs are F32, or the 16-bit out type; vectors stay F32.

The base model is needed for the architecture, the head counts (the permutation) and the layer count:
an HF model folder (`base_from_hf`), or the base GGUF's keys (`base_from_gguf`), which hold all three.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf import GGMLQuantizationType

from localrt import config
from localrt.converters import writer
from localrt.converters.arch import Arch
from localrt.converters.arch import find_arch
from localrt.converters.arch import registry
from localrt.converters.convert import Result
from localrt.converters.convert import encode
from localrt.converters.convert import hyperparameters
from localrt.converters.convert import permute_rows
from localrt.converters.convert import qk_heads
from localrt.converters.convert import value_changes
from localrt.converters.hf import ConvertError
from localrt.converters.hf import SafeTensor
from localrt.converters.hf import read_config
from localrt.converters.hf import read_json
from localrt.converters.hf import read_part

QT = GGMLQuantizationType
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# what a conversion reads of a PEFT folder: the config, the weights, the model card (gguf-py's metadata)
PEFT_FILES = (ADAPTER_CONFIG, ADAPTER_WEIGHTS, "README.md")
OUT_TYPES = {"f32": QT.F32, "f16": QT.F16, "bf16": QT.BF16}
PEFT_PREFIX = "base_model.model."
# suffix of an adapter tensor -> which matrix of the pair it is; embeddings use their own names
PAIR_SUFFIXES = {
    ".lora_A.weight": "a",
    ".lora_B.weight": "b",
    ".lora_embedding_A": "a",
    ".lora_embedding_B": "b",
}


def is_peft_dir(path: Path) -> bool:
    """A folder holding a PEFT adapter's config (its weights are checked when it is converted)."""
    return path.is_dir() and (path / ADAPTER_CONFIG).is_file()


@dataclass(frozen=True)
class LoraBase:
    """What the conversion needs of the base model."""

    arch: Arch
    n_head: int
    n_head_kv: int
    n_layer: int
    # general.name when the adapter's folder names none (llama.cpp: the base model folder's name)
    name: str

    def hp(self) -> dict[str, Any]:
        """The config fields the model converter's tensor changes read."""
        return {
            "num_attention_heads": self.n_head,
            "num_key_value_heads": self.n_head_kv,
            "num_hidden_layers": self.n_layer,
        }


def base_from_hf(model_dir: Path) -> LoraBase:
    """The base from an HF model folder's config.json (its weights are not read)."""
    config = read_config(model_dir)
    arch = find_arch(config)
    hp = hyperparameters(config, arch)
    n_head = hp["num_attention_heads"]
    return LoraBase(
        arch, n_head, hp.get("num_key_value_heads") or n_head, hp["num_hidden_layers"], model_dir.name
    )


def base_from_gguf(metadata: Mapping[str, Any], peft_dir: Path) -> LoraBase:
    """The base from a model GGUF's keys: general.architecture and its head and block counts.

    The fallback general.name is the last part of the base the adapter's config names (the folder
    name llama.cpp falls back to when that base is a local folder), else the GGUF's general.name.
    """
    arch_name = metadata.get("general.architecture")
    arch = next((a for a in registry().values() if a.name == arch_name), None)
    if arch is None:
        supported = ", ".join(sorted({a.name for a in registry().values()}))
        raise ConvertError(f"a LoRA for a {arch_name!r} base cannot be converted; supported: {supported}")
    counts = {}
    for key in ("attention.head_count", "attention.head_count_kv", "block_count"):
        value = metadata.get(f"{arch_name}.{key}")
        if key != "attention.head_count_kv" and not isinstance(value, int):
            raise ConvertError(f"the base GGUF has no {arch_name}.{key}")
        counts[key] = value
    n_head = counts["attention.head_count"]
    n_kv = counts["attention.head_count_kv"]
    named = read_lora_config(peft_dir).get("base_model_name_or_path")
    name = Path(named).name if isinstance(named, str) and named else None
    name = name or metadata.get("general.name") or peft_dir.name
    return LoraBase(arch, n_head, n_kv if isinstance(n_kv, int) else n_head, counts["block_count"], str(name))


def base_from_config(peft_dir: Path, lora_config: dict[str, Any]) -> LoraBase:
    """The base the adapter's config names (`base_model_name_or_path`): a local folder, else the
    config.json of that Hugging Face repo (downloaded alone)."""
    named = lora_config.get("base_model_name_or_path")
    if not isinstance(named, str) or not named:
        raise ConvertError(
            f"{peft_dir.name}/{ADAPTER_CONFIG} names no base_model_name_or_path: give the base model"
        )
    local = Path(named).expanduser()
    if local.is_dir():
        return base_from_hf(local)
    if named.count("/") != 1 or named.startswith((".", "/")):
        raise ConvertError(f"the adapter's base model {named}: no such folder (and not an HF repo id)")
    try:
        from huggingface_hub import hf_hub_download

        path = hf_hub_download(named, "config.json", endpoint=config.hf_endpoint())
    except Exception as e:  # network, auth, missing repo: one line for the user
        raise ConvertError(f"cannot download the config of the adapter's base model {named}: {e}") from None
    return base_from_hf(Path(path).parent)


def read_lora_config(peft_dir: Path) -> dict[str, Any]:
    try:
        lora_config = read_json(peft_dir / ADAPTER_CONFIG)
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ConvertError(f"{peft_dir.name}/{ADAPTER_CONFIG}: not readable JSON: {e}") from None
    if lora_config is None:
        raise ConvertError(f"{peft_dir.name} has no {ADAPTER_CONFIG} (is it a PEFT adapter folder?)")
    kind = lora_config.get("peft_type", "LORA")
    if kind != "LORA":
        raise ConvertError(f"{peft_dir.name} is a PEFT {kind} adapter; only LoRA adapters convert")
    if lora_config.get("use_dora"):
        raise ConvertError(f"{peft_dir.name} is a DoRA adapter; llama.cpp applies plain LoRA only")
    if lora_config.get("alpha_pattern"):
        raise ConvertError(
            f"{peft_dir.name} sets lora_alpha per module (alpha_pattern); a GGUF LoRA holds one alpha"
        )
    if not isinstance(lora_config.get("lora_alpha"), int | float):
        raise ConvertError(f"{peft_dir.name}/{ADAPTER_CONFIG} has no lora_alpha")
    if lora_config.get("invocation_string") and not lora_config.get("alora_invocation_tokens"):
        raise ConvertError(
            f"{peft_dir.name} is an activated LoRA given by invocation_string; its "
            "alora_invocation_tokens are needed (tokenizing the string needs the base's tokenizer)"
        )
    return lora_config


def alpha(lora_config: dict[str, Any], ranks: set[int]) -> float:
    """adapter.lora.alpha: llama.cpp scales by alpha / rank. A rank-stabilized LoRA scales by
    alpha / sqrt(rank), which that formula gives for alpha * sqrt(rank) when all ranks are equal."""
    value = float(lora_config["lora_alpha"])
    if not lora_config.get("use_rslora"):
        return value
    if len(ranks) != 1:
        raise ConvertError("a rank-stabilized LoRA (use_rslora) of several ranks has no single GGUF alpha")
    return value * math.sqrt(next(iter(ranks)))


# ---- tensors -------------------------------------------------------------------------------------
@dataclass
class LoraTensor:
    name: str  # GGUF name
    shape: tuple[int, ...]  # numpy order
    load: Callable[[], np.ndarray]

    @property
    def is_vector(self) -> bool:
        return len(self.shape) <= 1 or self.name.endswith("_norm.weight")


def split_name(name: str) -> tuple[str, str | None]:
    """(the base model's HF tensor name, "a" / "b" / None for a tensor that is no LoRA matrix)."""
    base = name.replace(PEFT_PREFIX, "")
    for suffix, which in PAIR_SUFFIXES.items():
        if suffix in base:
            return base.replace(suffix, ".weight"), which
    return base, None


def gguf_name(base: LoraBase, hf_name: str) -> str:
    """The base tensor's GGUF name, checked to be one the adapter may change."""
    if base.arch.experts is not None and "experts" in hf_name:
        raise ConvertError(f"{hf_name}: a LoRA on a mixture-of-experts layer's experts is not supported")
    name = base.arch.gguf_name(hf_name)
    if name is None:
        raise ConvertError(f"{hf_name} is not a tensor the {base.arch.name} model converter writes")
    parts = name.split(".")
    if parts[0] == "blk" and int(parts[1]) >= base.n_layer:
        raise ConvertError(f"{hf_name} is for layer {parts[1]}, but the base model has {base.n_layer} layers")
    return name


def _pair(base: LoraBase, hf_name: str, a: SafeTensor, b: SafeTensor) -> tuple[LoraTensor, LoraTensor]:
    name = gguf_name(base, hf_name)
    if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1]:
        raise ConvertError(
            f"{hf_name}: lora_A {list(a.shape)} and lora_B {list(b.shape)} are not a (rank, in) and "
            "(out, rank) pair"
        )
    heads = qk_heads(base.arch, base.hp(), hf_name)
    if name == "token_embd.weight":  # llama.cpp reads an embedding's A transposed
        lora_a = LoraTensor(name + ".lora_a", a.shape[::-1], lambda: a.read().T)
    else:
        lora_a = LoraTensor(name + ".lora_a", a.shape, a.read)
    if heads and b.shape[0] % (2 * heads):
        raise ConvertError(f"{hf_name}: lora_B has {b.shape[0]} rows, not a multiple of 2 x {heads} heads")
    load_b = (lambda: permute_rows(b.read(), heads)) if heads else b.read
    return lora_a, LoraTensor(name + ".lora_b", b.shape, load_b)


def collect(base: LoraBase, source: dict[str, SafeTensor]) -> list[LoraTensor]:
    """The adapter's GGUF tensors in llama.cpp's order (vectors first, then the pairs)."""
    vectors: list[LoraTensor] = []
    pairs: dict[str, dict[str, SafeTensor]] = {}
    for name, st in source.items():
        hf_name, which = split_name(name)
        if which is not None:
            pairs.setdefault(hf_name, {})[which] = st
        elif ".base_layer.weight" in name:
            continue
        elif "_layernorm" in name or ".norm" in name:
            target = gguf_name(base, hf_name)
            vectors.append(
                LoraTensor(target, st.shape, value_changes(base.arch, base.hp(), hf_name, st.read, None))
            )
        else:
            raise ConvertError(
                f"adapter tensor {name} is not a lora_A or lora_B matrix (embedding rows added in "
                "fine-tuning, or modules_to_save, cannot go into a GGUF LoRA)"
            )
    out = vectors
    for hf_name, pair in pairs.items():
        missing = {"a": "lora_A", "b": "lora_B"}
        lost = [missing[k] for k in missing if k not in pair]
        if lost:
            raise ConvertError(f"the adapter has no {lost[0]} for {hf_name}")
        out += _pair(base, hf_name, pair["a"], pair["b"])
    if not any(t.name.endswith(".lora_a") for t in out):
        raise ConvertError("the adapter holds no lora_A / lora_B pairs")
    return out


def parameter_counts(tensors: list[LoraTensor]) -> tuple[int, int, int, int]:
    """gguf-py's count for the model card: a pair counts as the full (out, in) delta it stands for,
    and the total is negated to say it is not the adapter's own size."""
    total = 0
    last_a: LoraTensor | None = None
    for t in tensors:
        if t.name.endswith(".lora_a"):
            last_a = t
            continue
        shape = t.shape
        if t.name.endswith(".lora_b") and last_a is not None:
            shape = (*shape[:-1], last_a.shape[-1])
        total += int(np.prod(shape, dtype=np.int64))
    return (-total if last_a is not None else total), total, 0, 0


# ---- the conversion ------------------------------------------------------------------------------
def convert_lora(peft_dir: Path, out: Path, base: LoraBase | None = None, outtype: str = "f32") -> Result:
    """Convert the PEFT adapter in `peft_dir` to a GGUF LoRA at `out`.

    `base`: the base model (None: the folder or HF repo the adapter's config names); `outtype`: f32
    (llama.cpp's default for adapters), f16 or bf16, the type of the A/B matrices.
    """
    start = time.monotonic()
    qtype = OUT_TYPES.get(outtype.lower())
    if qtype is None:
        raise ConvertError(f"unknown LoRA out type {outtype!r}; supported: {', '.join(OUT_TYPES)}")
    peft_dir = Path(peft_dir)
    lora_config = read_lora_config(peft_dir)
    weights = peft_dir / ADAPTER_WEIGHTS
    if not weights.is_file():
        raise ConvertError(f"{peft_dir.name} has no {ADAPTER_WEIGHTS} (only safetensors adapters convert)")
    if base is None:
        base = base_from_config(peft_dir, lora_config)
    tensors = collect(base, read_part(weights))

    w = writer.new_writer(base.arch.name)
    w.add_type(gguf.GGUFType.ADAPTER)
    w.add_string(gguf.Keys.Adapter.TYPE, "lora")
    counts = parameter_counts(tensors)
    meta = gguf.Metadata.load(None, peft_dir, None, counts[0])
    if meta.name is None:
        meta.name = base.name
    if meta.size_label is None and counts[0] > 0:
        meta.size_label = gguf.size_label(*counts)
    meta.set_gguf_meta_model(w)
    ranks = {t.shape[-1] for t in tensors if t.name.endswith(".lora_b")}
    w.add_float32(gguf.Keys.Adapter.LORA_ALPHA, alpha(lora_config, ranks))
    invocation = lora_config.get("alora_invocation_tokens")
    if invocation:
        w.add_key_value(
            gguf.Keys.Adapter.ALORA_INVOCATION_TOKENS,
            [int(t) for t in invocation],
            gguf.GGUFValueType.ARRAY,
            gguf.GGUFValueType.UINT32,
        )
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)

    plan = []
    for t in tensors:
        q = QT.F32 if t.is_vector else qtype
        plan.append((t.name, t.shape, q, lambda t=t, q=q: encode(t.load(), q, threads=1)))
    out = Path(out)
    if out.parent and not out.parent.exists():
        raise ConvertError(f"output directory {out.parent} does not exist")
    writer.write_streaming(w, out, plan)
    total = sum(writer.nbytes(q, s) for _, s, q, _ in plan)
    return Result(out, qtype.name, len(plan), total, time.monotonic() - start)
