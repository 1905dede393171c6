"""HF checkpoint -> GGUF: the pipeline behind `localrt convert`.

The result is the file llama.cpp itself would make from the same checkpoint:
- F32 / F16 / BF16: what `convert_hf_to_gguf.py --outtype f32|f16|bf16` writes (same keys in the same
  order, same tensors in the same order, same bytes);
- every other type: what `convert_hf_to_gguf.py` (outtype auto) followed by `llama-quantize` writes. The
  quantizers read the values of that intermediate 16-bit file (bf16 checkpoints stay bf16, f16 and f32
  checkpoints are rounded to f16), tensors are ordered by layer then name, and
  general.quantization_version / general.file_type move to the end of the keys, as llama-quantize does.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf import GGMLQuantizationType

from localrt.converters import imatrix as imatrix_io
from localrt.converters import mixes, quants, writer
from localrt.converters.arch import Arch, find_arch
from localrt.converters.hf import (
    ConvertError,
    SafeTensor,
    index_tensors,
    read_config,
    read_json,
    resolve_source,
)
from localrt.converters.tokenizer import vocab_kv

QT = GGMLQuantizationType
FLOAT_FILE_TYPES = {"F32": QT.F32, "F16": QT.F16, "BF16": QT.BF16}


@dataclass
class Tensor:
    """One output tensor before encoding."""

    name: str  # GGUF name
    shape: tuple[int, ...]  # numpy order (rows first); GGUF's ne0 is shape[-1]
    src_dtype: str  # "F32" / "F16" / "BF16"
    load: Callable[[], np.ndarray]  # float32 or float16 values, already permuted

    @property
    def ndim(self) -> int:
        return len(self.shape)


# ---- hyperparameters ---------------------------------------------------------------------------
def hyperparameters(config: dict[str, Any], arch: Arch) -> dict[str, Any]:
    """config.json as llama.cpp's converter sees it (transformers' AutoConfig fills in class defaults)."""
    hp = dict(config)
    if isinstance(hp.get("text_config"), dict):
        hp = {**hp, **hp["text_config"]}
    for key, value in arch.defaults(hp).items():
        if hp.get(key) is None:
            hp[key] = value
    rope = dict(hp.get("rope_parameters") or hp.get("rope_scaling") or {})
    rope.setdefault("rope_theta", hp.get("rope_theta"))
    if "rope_type" not in rope:
        rope["rope_type"] = rope.get("type", "default")
    hp["rope_parameters"] = rope
    required = ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads", "vocab_size")
    missing = [k for k in required if not isinstance(hp.get(k), int)]
    if missing:
        raise ConvertError(f"config.json lacks {', '.join(missing)}")
    return hp


def base_kv(w: gguf.GGUFWriter, hp: dict[str, Any], arch: Arch, file_type: int) -> None:
    """TextModel.set_gguf_parameters' keys, in its order, then the architecture's own."""
    a = arch.name
    w.add_uint32(f"{a}.block_count", hp["num_hidden_layers"])
    w.add_uint32(f"{a}.context_length", hp["max_position_embeddings"])
    w.add_uint32(f"{a}.embedding_length", hp["hidden_size"])
    w.add_uint32(f"{a}.feed_forward_length", hp["intermediate_size"])
    w.add_uint32(f"{a}.attention.head_count", hp["num_attention_heads"])
    if hp.get("num_key_value_heads") is not None:
        w.add_uint32(f"{a}.attention.head_count_kv", hp["num_key_value_heads"])
    rope = hp["rope_parameters"]
    kind, factor = rope.get("rope_type"), rope.get("factor")
    if kind == "linear" and factor is not None:
        w.add_string(f"{a}.rope.scaling.type", "linear")
        w.add_float32(f"{a}.rope.scaling.factor", factor)
    elif kind == "yarn" and factor is not None:
        w.add_string(f"{a}.rope.scaling.type", "yarn")
        w.add_float32(f"{a}.rope.scaling.factor", factor)
        w.add_uint32(f"{a}.rope.scaling.original_context_length", rope["original_max_position_embeddings"])
        for src, key in (
            ("extrapolation_factor", "yarn_ext_factor"),
            ("attention_factor", "yarn_attn_factor"),
            ("beta_fast", "yarn_beta_fast"),
            ("beta_slow", "yarn_beta_slow"),
        ):
            value = rope.get(src, rope.get("attn_factor")) if src == "attention_factor" else rope.get(src)
            if value is not None:
                w.add_float32(f"{a}.rope.scaling.{key}", value)
    elif kind in ("su", "longrope"):
        w.add_string(f"{a}.rope.scaling.type", "longrope")
    if rope.get("rope_theta") is not None:
        w.add_float32(f"{a}.rope.freq_base", rope["rope_theta"])
    if hp.get("rms_norm_eps") is not None:
        w.add_float32(f"{a}.attention.layer_norm_rms_epsilon", hp["rms_norm_eps"])
    if hp.get("head_dim") is not None:
        w.add_uint32(f"{a}.attention.key_length", hp["head_dim"])
        w.add_uint32(f"{a}.attention.value_length", hp["head_dim"])
    w.add_uint32("general.file_type", file_type)
    for key, value, kind_ in arch.extra_kv(hp):
        writer.add_kv(w, key, value, kind_)


def general_kv(w: gguf.GGUFWriter, model_dir: Path, repo_id: str | None, total_params: int) -> None:
    """general.type plus the model-card metadata (name, size label, license, ...) via gguf-py."""
    w.add_type(gguf.GGUFType.MODEL)
    meta = gguf.Metadata.load(None, model_dir, None, total_params)
    gen = read_json(model_dir / "generation_config.json") or {}
    # llama.cpp's gguf-py also reads HF's name for the repeat penalty
    meta.sampling_penalty_repeat = gen.get(
        "penalty_repeat", gen.get("repetition_penalty", meta.sampling_penalty_repeat)
    )
    if repo_id:
        meta.name = repo_id
    if meta.name is None:
        meta.name = model_dir.name
    if meta.size_label is None and total_params > 0:
        meta.size_label = gguf.size_label(total_params, total_params, 0, 0)
    meta.set_gguf_meta_model(w)


# ---- tensors -------------------------------------------------------------------------------------
def permute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Per head, interleave the two halves of the rows: HF rotate-half -> GGUF adjacent-pair RoPE.

    w: (n_head * head_dim, ...) -> same shape, rows of each head reordered [0, d/2, 1, d/2+1, ...].
    """
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_rope_factors(hp: dict[str, Any]) -> np.ndarray:
    """rope_freqs.weight for rope_type llama3: per-frequency divisors of the rotary base frequencies.

    llama.cpp's converter evaluates this in torch float32; torch's pow can differ from numpy's by an
    ulp, so torch is used when it is installed (the 1-D tensor then matches exactly), numpy otherwise.
    """
    rope = hp["rope_parameters"]
    base = rope.get("rope_theta", 10000.0)
    dim = hp.get("head_dim") or hp["hidden_size"] // hp["num_attention_heads"]
    factor = rope.get("factor", 8.0)
    low, high = rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    old = rope.get("original_max_position_embeddings", 8192)
    try:
        import torch

        freqs: Any = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    except ImportError:
        f32 = np.float32
        freqs = f32(1.0) / (f32(base) ** (np.arange(0, dim, 2, dtype=f32) / f32(dim)))
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq  # float32 (a 0-d tensor or a numpy scalar)
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(float(factor))
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(float(1 / ((1 - smooth) / factor + smooth)))
    return np.array(out, dtype=np.float32)


def expected_shapes(hp: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Torch-order shapes the config implies, by GGUF base name (blk.N. stripped)."""
    h, ff, v = hp["hidden_size"], hp["intermediate_size"], hp["vocab_size"]
    nh, nkv = hp["num_attention_heads"], hp.get("num_key_value_heads") or hp["num_attention_heads"]
    hd = hp.get("head_dim") or h // nh
    return {
        "token_embd.weight": (v, h),
        "output.weight": (v, h),
        "output_norm.weight": (h,),
        "attn_norm.weight": (h,),
        "ffn_norm.weight": (h,),
        "attn_q.weight": (nh * hd, h),
        "attn_k.weight": (nkv * hd, h),
        "attn_v.weight": (nkv * hd, h),
        "attn_output.weight": (h, nh * hd),
        "ffn_gate.weight": (ff, h),
        "ffn_up.weight": (ff, h),
        "ffn_down.weight": (h, ff),
        "attn_q.bias": (nh * hd,),
        "attn_k.bias": (nkv * hd,),
        "attn_v.bias": (nkv * hd,),
        "attn_q_norm.weight": (hd,),
        "attn_k_norm.weight": (hd,),
    }


def collect_tensors(arch: Arch, hp: dict[str, Any], source: dict[str, SafeTensor]) -> list[Tensor]:
    """Output tensors in llama.cpp's converter order, with shapes checked against the config."""
    shapes = expected_shapes(hp)
    n_layer = hp["num_hidden_layers"]
    n_head, n_kv = hp["num_attention_heads"], hp.get("num_key_value_heads")
    out: list[Tensor] = []
    if arch.name == "llama" and str(hp["rope_parameters"].get("rope_type", "")).lower() == "llama3":
        factors = llama3_rope_factors(hp)
        out.append(Tensor("rope_freqs.weight", factors.shape, "F32", lambda f=factors: f))
    seen: dict[str, set[int]] = {}
    for hf_name, st in source.items():
        name = arch.gguf_name(hf_name)
        if name is None:
            continue
        parts = name.split(".")
        base = ".".join(parts[2:]) if parts[0] == "blk" else name
        if parts[0] == "blk":
            layer = int(parts[1])
            if layer >= n_layer:
                raise ConvertError(
                    f"tensor {hf_name} is for layer {layer}, but config.json has {n_layer} layers"
                )
            seen.setdefault(base, set()).add(layer)
        want = shapes.get(base)
        if want is not None and st.shape != want:
            raise ConvertError(
                f"tensor {hf_name} has shape {list(st.shape)}, config.json implies {list(want)}"
            )
        heads = None
        if arch.permute_qk and hf_name.endswith(("q_proj.weight", "q_proj.bias")):
            heads = n_head
        elif arch.permute_qk and hf_name.endswith(("k_proj.weight", "k_proj.bias")):
            heads = n_kv if n_kv is not None and n_kv != n_head else n_head

        def load(st: SafeTensor = st, heads: int | None = heads) -> np.ndarray:
            data = st.read()
            return permute_rows(data, heads) if heads else data

        out.append(Tensor(name, st.shape, st.dtype, load))
    incomplete = sorted(base for base, layers in seen.items() if len(layers) != n_layer)
    if incomplete:
        raise ConvertError(f"tensors missing for some of the {n_layer} layers: {', '.join(incomplete)}")
    names = {t.name for t in out}
    for need in ("token_embd.weight", "output_norm.weight"):
        if need not in names:
            raise ConvertError(f"the checkpoint has no tensor for {need}")
    return out


def stored_as_float32(name: str, ndim: int) -> bool:
    """The converter keeps 1-D tensors, norms and non-weights in F32 whatever the outtype."""
    return ndim <= 1 or name.endswith("_norm.weight") or not name.endswith(".weight")


def auto_intermediate(tensors: list[Tensor]) -> QT:
    """--outtype auto: BF16 if the first matrix is bf16, else F16."""
    for t in tensors:
        if t.ndim >= 2 and t.src_dtype in ("BF16", "F16"):
            return QT.BF16 if t.src_dtype == "BF16" else QT.F16
    return QT.F16


def encode(values: np.ndarray, qtype: QT, threads: int, imatrix: np.ndarray | None = None) -> np.ndarray:
    values = np.asarray(values)
    if qtype == QT.F32:
        return values.astype(np.float32, copy=False)
    return quants.quantize(values.astype(np.float32, copy=False), qtype, threads=threads, imatrix=imatrix)


def _imatrix_weights(
    imatrix: imatrix_io.Imatrix | None, specs: list[mixes.TensorSpec], label: str
) -> dict[str, np.ndarray]:
    """The importance weights of the tensors llama-quantize would quantize (checked against the model)."""
    if imatrix is None:
        return {}
    quantizable = {s.name: s.shape for s in specs if mixes.allows_quantization(s)}
    return imatrix_io.weights_for_model(imatrix, quantizable, label or "the imatrix")


def as_intermediate(values: np.ndarray, itype: QT) -> np.ndarray:
    """Round to the intermediate 16-bit type and back to float32 (what llama-quantize reads)."""
    values = values.astype(np.float32, copy=False)
    if itype == QT.F16:
        return values.astype(np.float16).astype(np.float32)
    if itype == QT.BF16:
        return quants.bf16_to_f32(quants.to_bf16(values))
    return values


# ---- the pipeline --------------------------------------------------------------------------------
@dataclass
class Result:
    path: Path
    file_type: str
    n_tensors: int
    nbytes: int
    seconds: float


def convert(
    src: str | Path,
    out: Path,
    quant: str = "Q4_K_M",
    threads: int = 0,
    progress: Callable[[str, int, int], None] | None = None,
    imatrix: imatrix_io.Imatrix | None = None,
    imatrix_label: str = "",
) -> Result:
    """Convert an HF model directory (or repo id) to a GGUF of file type `quant` at `out`.

    `imatrix` weights the quantization as `llama-quantize --imatrix imatrix_label` does.
    """
    start = time.monotonic()
    file_type = mixes.parse_file_type(quant)
    imatrix_io.check_quantized(file_type, imatrix)
    model_dir, repo_id = resolve_source(str(src))
    config = read_config(model_dir)
    arch = find_arch(config)
    hp = hyperparameters(config, arch)
    tensors = collect_tensors(arch, hp, index_tensors(model_dir))
    total_params = sum(int(np.prod(t.shape, dtype=np.int64)) for t in tensors)
    threads = threads or os.cpu_count() or 1

    float_type = FLOAT_FILE_TYPES.get(file_type)
    itype = float_type if float_type is not None else auto_intermediate(tensors)
    stage_ftype = int(
        mixes.FILE_TYPES[file_type][0]
        if float_type is not None
        else (gguf.LlamaFileType.MOSTLY_BF16 if itype == QT.BF16 else gguf.LlamaFileType.MOSTLY_F16)
    )

    w = writer.new_writer(arch.name)
    general_kv(w, model_dir, repo_id, total_params)
    base_kv(w, hp, arch, stage_ftype)
    w.add_uint32("general.quantization_version", gguf.GGML_QUANT_VERSION)
    for key, (value, kind) in vocab_kv(model_dir, hp, arch.vocab, arch.name).items():
        writer.add_kv(w, key, value, kind)

    plan: list[tuple[str, tuple[int, ...], QT, Callable[[], np.ndarray]]] = []
    if float_type is not None:
        # convert_hf_to_gguf order and types
        for t in tensors:
            qtype = QT.F32 if stored_as_float32(t.name, t.ndim) else float_type
            plan.append((t.name, t.shape, qtype, lambda t=t, q=qtype: encode(t.load(), q, threads)))
    else:
        by_name = {t.name: t for t in tensors}
        specs = [mixes.TensorSpec(t.name, tuple(reversed(t.shape))) for t in tensors]
        shape = mixes.ModelShape(
            arch.name,
            hp["num_hidden_layers"],
            hp["num_attention_heads"],
            hp.get("num_key_value_heads") or hp["num_attention_heads"],
        )
        types = mixes.plan(specs, file_type, shape, has_imatrix=imatrix is not None)
        weights = _imatrix_weights(imatrix, specs, imatrix_label)
        for name in mixes.tensor_order(types):
            t = by_name[name]
            # tensors llama-quantize leaves alone keep the intermediate file's type (F32 for 1-D)
            stage = QT.F32 if stored_as_float32(t.name, t.ndim) else itype
            quantizable = mixes.allows_quantization(mixes.TensorSpec(name, tuple(reversed(t.shape))))
            qtype = types[name] if quantizable else stage
            qw = weights.get(name)
            plan.append(
                (
                    name,
                    t.shape,
                    qtype,
                    lambda t=t, q=qtype, s=stage, qw=qw: encode(as_intermediate(t.load(), s), q, threads, qw),
                )
            )
        writer.move_to_end(w, "general.quantization_version")
        writer.set_at_end(w, "general.file_type", int(mixes.FILE_TYPES[file_type][0]), "u32")
        if imatrix is not None:
            imatrix_io.add_quantize_kv(w, imatrix, imatrix_label)

    total = sum(writer.nbytes(q, s) for _, s, q, _ in plan)
    done = 0

    def on_tensor(name: str, n: int) -> None:
        nonlocal done
        done += n
        if progress:
            progress(name, done, total)

    out = Path(out)
    if out.parent and not out.parent.exists():
        raise ConvertError(f"output directory {out.parent} does not exist")
    writer.write_streaming(w, out, plan, on_tensor)
    return Result(out, file_type, len(plan), total, time.monotonic() - start)
