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
from localrt.converters import mixes
from localrt.converters import quants
from localrt.converters import writer
from localrt.converters.arch import KV
from localrt.converters.arch import Arch
from localrt.converters.arch import find_arch
from localrt.converters.hf import ConvertError
from localrt.converters.hf import SafeTensor
from localrt.converters.hf import index_tensors
from localrt.converters.hf import read_config
from localrt.converters.hf import read_json
from localrt.converters.hf import resolve_source
from localrt.converters.tokenizer import KVMap
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
def _rope_parameters(hp: dict[str, Any]) -> dict[str, Any]:
    """transformers' single rope dict, with what llama.cpp's converter mirrors into it."""
    rope = dict(hp.get("rope_parameters") or hp.get("rope_scaling") or {})
    rope.setdefault("rope_theta", hp.get("rope_theta"))
    if "rope_type" not in rope:
        rope["rope_type"] = rope.get("type", "default")
    return rope


def hyperparameters(config: dict[str, Any], arch: Arch) -> dict[str, Any]:
    """config.json as llama.cpp's converter sees it (transformers' AutoConfig fills in class defaults)."""
    hp = dict(config)
    if isinstance(hp.get("text_config"), dict):
        hp = {**hp, **hp["text_config"]}
    for key, value in arch.defaults(hp).items():
        if hp.get(key) is None:
            hp[key] = value
    hp["rope_parameters"] = arch.rope_parameters(hp) if arch.rope_parameters else _rope_parameters(hp)
    required = ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads", "vocab_size")
    missing = [k for k in required if not isinstance(hp.get(k), int)]
    if missing:
        raise ConvertError(f"config.json lacks {', '.join(missing)}")
    return hp


def base_kv(hp: dict[str, Any], arch: Arch, file_type: int) -> KVMap:
    """TextModel.set_gguf_parameters' keys in its order, then the architecture's own (or only its own)."""
    out: KVMap = {}
    if arch.model_kv is not None:
        _set_all(out, arch.model_kv(hp, file_type))
    else:
        _set_all(out, _text_model_kv(hp, arch.name, file_type))
    _set_all(out, arch.extra_kv(hp))
    return out


def _set_all(kvs: KVMap, items: KV) -> None:
    """Set keys in order; a key set again keeps its first position (as GGUFWriter does)."""
    for key, value, kind in items:
        kvs[key] = (value, kind)


def _text_model_kv(hp: dict[str, Any], a: str, file_type: int) -> KV:
    out: KV = [
        (f"{a}.block_count", hp["num_hidden_layers"], "u32"),
        (f"{a}.context_length", hp["max_position_embeddings"], "u32"),
        (f"{a}.embedding_length", hp["hidden_size"], "u32"),
        (f"{a}.feed_forward_length", hp["intermediate_size"], "u32"),
        (f"{a}.attention.head_count", hp["num_attention_heads"], "u32"),
    ]
    if hp.get("num_key_value_heads") is not None:
        out.append((f"{a}.attention.head_count_kv", hp["num_key_value_heads"], "u32"))
    rope_all = hp["rope_parameters"]
    rope = rope_all.get("full_attention", rope_all)
    out += _rope_scaling_kv(rope, a)
    if rope.get("rope_theta") is not None:
        out.append((f"{a}.rope.freq_base", rope["rope_theta"], "f32"))
    local = (rope_all.get("sliding_attention") or {}).get("rope_theta")
    if local is not None:
        out.append((f"{a}.rope.freq_base_swa", local, "f32"))
    if hp.get("rms_norm_eps") is not None:
        out.append((f"{a}.attention.layer_norm_rms_epsilon", hp["rms_norm_eps"], "f32"))
    for keys, name in (
        (("num_local_experts", "num_experts", "n_routed_experts"), "expert_count"),
        (("num_experts_per_tok", "num_experts_per_token", "top_k_experts"), "expert_used_count"),
    ):
        value = next((hp[k] for k in keys if k in hp), None)
        if value is not None:
            out.append((f"{a}.{name}", value, "u32"))
    if hp.get("head_dim") is not None:
        out.append((f"{a}.attention.key_length", hp["head_dim"], "u32"))
        out.append((f"{a}.attention.value_length", hp["head_dim"], "u32"))
    out.append(("general.file_type", file_type, "u32"))
    return out


def _rope_scaling_kv(rope: dict[str, Any], a: str) -> KV:
    kind, factor = rope.get("rope_type"), rope.get("factor")
    if kind == "linear" and factor is not None:
        return [(f"{a}.rope.scaling.type", "linear", "str"), (f"{a}.rope.scaling.factor", factor, "f32")]
    if kind in ("su", "longrope"):
        return [(f"{a}.rope.scaling.type", "longrope", "str")]
    if kind != "yarn" or factor is None:
        return []
    out: KV = [
        (f"{a}.rope.scaling.type", "yarn", "str"),
        (f"{a}.rope.scaling.factor", factor, "f32"),
        (f"{a}.rope.scaling.original_context_length", rope["original_max_position_embeddings"], "u32"),
    ]
    for src, key in (
        ("extrapolation_factor", "yarn_ext_factor"),
        ("attention_factor", "yarn_attn_factor"),
        ("beta_fast", "yarn_beta_fast"),
        ("beta_slow", "yarn_beta_slow"),
    ):
        value = rope.get(src, rope.get("attn_factor")) if src == "attention_factor" else rope.get(src)
        if value is not None:
            out.append((f"{a}.rope.scaling.{key}", value, "f32"))
    return out


def general_kv(
    w: gguf.GGUFWriter, model_dir: Path, repo_id: str | None, params: tuple[int, int, int, int]
) -> None:
    """general.type plus the model-card metadata (name, size label, license, ...) via gguf-py."""
    w.add_type(gguf.GGUFType.MODEL)
    total_params = params[0]
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
        meta.size_label = gguf.size_label(*params)
    meta.set_gguf_meta_model(w)


# ---- tensors -------------------------------------------------------------------------------------
def permute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Per head, interleave the two halves of the rows: HF rotate-half -> GGUF adjacent-pair RoPE.

    w: (n_head * head_dim, ...) -> same shape, rows of each head reordered [0, d/2, 1, d/2+1, ...].
    """
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


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
        "post_attention_norm.weight": (h,),
        "post_ffw_norm.weight": (h,),
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


# (HF name, torch-order shape, source dtype, load()) of one tensor the converter maps to a GGUF name
Piece = tuple[str, tuple[int, ...], str, Callable[[], np.ndarray]]
EXPERT_PROJECTIONS = ("down_proj", "gate_proj", "up_proj")  # the order llama.cpp's converter emits them


class ExpertMerger:
    """Per-expert HF tensors -> one stacked (n_expert, rows, cols) tensor per layer and projection.

    llama.cpp's converter holds a layer's expert tensors until all 3 * n_expert have been read, then
    emits down, gate, up; so the merged tensors sit where the layer's last expert tensor was read.
    Checkpoints already holding 3-D `mlp.experts.gate_up_proj` / `mlp.experts.down_proj` are split
    (gate rows first) or passed through.
    """

    def __init__(self, n_expert: int) -> None:
        self.n_expert = n_expert
        self.held: dict[int, dict[str, SafeTensor]] = {}

    def add(self, hf_name: str, st: SafeTensor) -> list[Piece]:
        base = hf_name.removesuffix(".weight")
        if base.endswith("mlp.experts.down_proj"):
            return [(base + ".weight", st.shape, st.dtype, st.read)]
        if base.endswith("mlp.experts.gate_up_proj"):
            return self._split_gate_up(base.removesuffix(".gate_up_proj"), st)
        bid = next((int(p) for p in hf_name.split(".") if p.isdecimal()), None)
        if bid is None:
            raise ConvertError(f"expert tensor {hf_name} names no layer")
        layer = self.held.setdefault(bid, {})
        layer[hf_name] = st
        if len(layer) < 3 * self.n_expert:
            return []
        del self.held[bid]
        return [self._stack(bid, w, layer) for w in EXPERT_PROJECTIONS]

    def _stack(self, bid: int, w: str, layer: dict[str, SafeTensor]) -> Piece:
        names = [f"model.layers.{bid}.mlp.experts.{x}.{w}.weight" for x in range(self.n_expert)]
        missing = [n for n in names if n not in layer]
        if missing:
            raise ConvertError(f"layer {bid} lacks expert tensors {', '.join(missing[:3])}")
        parts = [layer[n] for n in names]
        shape = (self.n_expert, *parts[0].shape)
        if any(p.shape != parts[0].shape for p in parts):
            raise ConvertError(f"the experts of layer {bid} have different {w} shapes")

        def load(parts: list[SafeTensor] = parts) -> np.ndarray:
            return np.stack([p.read() for p in parts])

        return (f"model.layers.{bid}.mlp.experts.{w}.weight", shape, parts[0].dtype, load)

    @staticmethod
    def _split_gate_up(base: str, st: SafeTensor) -> list[Piece]:
        if len(st.shape) != 3 or st.shape[1] % 2:
            raise ConvertError(
                f"{base}.gate_up_proj has shape {list(st.shape)}, expected (experts, 2 * ff, hidden)"
            )
        n_ff = st.shape[1] // 2
        shape = (st.shape[0], n_ff, st.shape[2])
        return [
            (
                f"{base}.{w}.weight",
                shape,
                st.dtype,
                lambda i=i: np.ascontiguousarray(st.read()[:, i * n_ff : (i + 1) * n_ff]),
            )
            for i, w in enumerate(("gate_proj", "up_proj"))
        ]

    def check_done(self) -> None:
        left = sorted(n for layer in self.held.values() for n in layer)
        if left:
            raise ConvertError(
                f"incomplete experts (config.json says {self.n_expert} per layer): {', '.join(left[:3])}"
            )


def _pieces(arch: Arch, hp: dict[str, Any], source: dict[str, SafeTensor]) -> list[Piece]:
    """The checkpoint's tensors in llama.cpp's converter order, experts merged where the arch does."""
    merger = ExpertMerger(arch.experts(hp)) if arch.experts else None
    out: list[Piece] = []
    for hf_name, st in source.items():
        if merger is not None and "experts" in hf_name:
            out += merger.add(hf_name, st)
        else:
            out.append((hf_name, st.shape, st.dtype, st.read))
    if merger is not None:
        merger.check_done()
    return out


def qk_heads(arch: Arch, hp: dict[str, Any], hf_name: str) -> int | None:
    """The head count whose rows `permute_rows` reorders in this tensor, or None: no permutation."""
    if arch.permute_qk and hf_name.endswith(("q_proj.weight", "q_proj.bias")):
        return hp["num_attention_heads"]
    if arch.permute_qk and hf_name.endswith(("k_proj.weight", "k_proj.bias")):
        n_kv = hp.get("num_key_value_heads")
        return n_kv if n_kv is not None and n_kv != hp["num_attention_heads"] else hp["num_attention_heads"]
    return None


def value_changes(
    arch: Arch, hp: dict[str, Any], hf_name: str, load: Callable[[], np.ndarray], rows: int | None
) -> Callable[[], np.ndarray]:
    """load() with the converter's changes: Q/K permutation, Gemma's 1 + w norms, token_embd rows."""
    heads = qk_heads(arch, hp, hf_name)
    shift = arch.norm_shift and hf_name.endswith("norm.weight")
    cut = rows if "embed_tokens.weight" in hf_name else None

    def changed() -> np.ndarray:
        data = load()
        if heads:
            data = permute_rows(data, heads)
        if shift:  # in the checkpoint's precision (f16 stays f16), as the converter's torch add
            data = data + data.dtype.type(1)
        if cut is not None:
            data = data[:cut]
        return data

    return changed


def collect_tensors(
    arch: Arch, hp: dict[str, Any], source: dict[str, SafeTensor], model_dir: Path
) -> list[Tensor]:
    """Output tensors in llama.cpp's converter order, with shapes checked against the config."""
    shapes = expected_shapes(hp) | arch.shapes(hp)
    n_layer = hp["num_hidden_layers"]
    out = [Tensor(name, data.shape, "F32", lambda d=data: d) for name, data in arch.extra_tensors(hp)]
    rows = arch.embedding_rows(model_dir, hp)
    seen: dict[str, set[int]] = {}
    for hf_name, shape, dtype, load in _pieces(arch, hp, source):
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
        if want is not None and shape != want:
            raise ConvertError(f"tensor {hf_name} has shape {list(shape)}, config.json implies {list(want)}")
        if rows is not None and name == "token_embd.weight":
            shape = (min(rows, shape[0]), *shape[1:])
        out.append(Tensor(name, shape, dtype, value_changes(arch, hp, hf_name, load, rows)))
    incomplete = sorted(base for base, layers in seen.items() if len(layers) != n_layer)
    if incomplete:
        raise ConvertError(f"tensors missing for some of the {n_layer} layers: {', '.join(incomplete)}")
    names = {t.name for t in out}
    for need in ("token_embd.weight", "output_norm.weight"):
        if need not in names:
            raise ConvertError(f"the checkpoint has no tensor for {need}")
    return out


def parameter_counts(tensors: list[Tensor]) -> tuple[int, int, int, int]:
    """(total, shared, per-expert, experts) as gguf-py counts them for the size label ("8x1.2B")."""
    total = shared = expert = expert_sum = n_expert_tensors = 0
    for t in tensors:
        size = int(np.prod(t.shape, dtype=np.int64))
        if "_exps." in t.name and len(t.shape) >= 3:
            count = t.shape[0]
            expert += size // count
            expert_sum += count
            n_expert_tensors += 1
        else:
            shared += size
        total += size
    return total, shared, expert, expert_sum // n_expert_tensors if n_expert_tensors else 0


def stored_as_float32(name: str, ndim: int) -> bool:
    """The converter keeps 1-D tensors, norms, MoE routers and non-weights in F32 whatever the outtype."""
    return (
        ndim <= 1 or name.endswith(("_norm.weight", ".ffn_gate_inp.weight")) or not name.endswith(".weight")
    )


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
    tensors = collect_tensors(arch, hp, index_tensors(model_dir), model_dir)
    threads = threads or os.cpu_count() or 1

    float_type = FLOAT_FILE_TYPES.get(file_type)
    itype = float_type if float_type is not None else auto_intermediate(tensors)
    stage_ftype = int(
        mixes.FILE_TYPES[file_type][0]
        if float_type is not None
        else (gguf.LlamaFileType.MOSTLY_BF16 if itype == QT.BF16 else gguf.LlamaFileType.MOSTLY_F16)
    )

    w = writer.new_writer(arch.name)
    for key, value, kind in arch.early_kv(hp):  # set while llama.cpp's converter reads the tensors
        writer.add_kv(w, key, value, kind)
    general_kv(w, model_dir, repo_id, parameter_counts(tensors))
    kvs = base_kv(hp, arch, stage_ftype)
    kvs["general.quantization_version"] = (gguf.GGML_QUANT_VERSION, "u32")
    kvs |= vocab_kv(model_dir, hp, arch.vocab, arch.name, arch.spm_no_space_prefix)
    for key, (value, kind) in kvs.items():
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
            arch.experts(hp) if arch.experts else 0,
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
