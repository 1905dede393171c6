"""File types (Q4_K_M, ...) -> the ggml type of every tensor, by llama.cpp's rules.

Mirrors `llama_tensor_get_type` (src/llama-quant.cpp) for dense models, with or without an importance
matrix:
which tensors may be quantized at all, the per-file-type promotions of attn_v / ffn_down /
attn_output, the output and token-embedding types, and the fallback to a 32-block type (or F16)
when a row length is not a multiple of 256. Tensors are visited in llama.cpp's order (`tensor_order`),
because the attn_v / ffn_down counters follow that order.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from collections.abc import Sequence
from dataclasses import dataclass

from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType
from gguf import LlamaFileType

from localrt.errors import LocalrtError

QT = GGMLQuantizationType
FT = LlamaFileType

# file type name -> (llama ftype, default tensor type)
FILE_TYPES: dict[str, tuple[LlamaFileType, QT]] = {
    "F32": (FT.ALL_F32, QT.F32),
    "F16": (FT.MOSTLY_F16, QT.F16),
    "BF16": (FT.MOSTLY_BF16, QT.BF16),
    "Q8_0": (FT.MOSTLY_Q8_0, QT.Q8_0),
    "Q4_0": (FT.MOSTLY_Q4_0, QT.Q4_0),
    "Q4_1": (FT.MOSTLY_Q4_1, QT.Q4_1),
    "Q5_0": (FT.MOSTLY_Q5_0, QT.Q5_0),
    "Q5_1": (FT.MOSTLY_Q5_1, QT.Q5_1),
    "Q2_K": (FT.MOSTLY_Q2_K, QT.Q2_K),
    "Q3_K_S": (FT.MOSTLY_Q3_K_S, QT.Q3_K),
    "Q3_K_M": (FT.MOSTLY_Q3_K_M, QT.Q3_K),
    "Q3_K_L": (FT.MOSTLY_Q3_K_L, QT.Q3_K),
    "Q4_K_S": (FT.MOSTLY_Q4_K_S, QT.Q4_K),
    "Q4_K_M": (FT.MOSTLY_Q4_K_M, QT.Q4_K),
    "Q5_K_S": (FT.MOSTLY_Q5_K_S, QT.Q5_K),
    "Q5_K_M": (FT.MOSTLY_Q5_K_M, QT.Q5_K),
    "Q6_K": (FT.MOSTLY_Q6_K, QT.Q6_K),
    "IQ4_NL": (FT.MOSTLY_IQ4_NL, QT.IQ4_NL),
    "IQ4_XS": (FT.MOSTLY_IQ4_XS, QT.IQ4_XS),
}
# llama.cpp's lower IQ file types: not implemented here (their encoders need grids and searches not ported)
NOT_DONE = (
    "IQ1_S",
    "IQ1_M",
    "IQ2_XXS",
    "IQ2_XS",
    "IQ2_S",
    "IQ2_M",
    "IQ3_XXS",
    "IQ3_XS",
    "IQ3_S",
    "IQ3_M",
    "Q2_K_S",
)
# common spellings users type
ALIASES = {"Q3_K": "Q3_K_M", "Q4_K": "Q4_K_M", "Q5_K": "Q5_K_M", "FP16": "F16", "FP32": "F32"}
FLOAT_TYPES = (QT.F32, QT.F16, QT.BF16)

# a 256-block type whose row length does not divide -> a 32-block type (V26 tensor_type_fallback)
FALLBACK = {
    QT.Q2_K: QT.Q4_0,
    QT.Q3_K: QT.Q4_0,
    QT.Q4_K: QT.Q5_0,
    QT.Q5_K: QT.Q5_1,
    QT.Q6_K: QT.Q8_0,
    QT.IQ4_XS: QT.IQ4_NL,
}


class MixError(LocalrtError, ValueError):
    """An unknown file type name."""


def parse_file_type(text: str) -> str:
    """Normalize a user's type name ('q4_k_m' -> 'Q4_K_M'); raises MixError listing the valid ones."""
    name = text.strip().upper().replace("-", "_")
    name = ALIASES.get(name, name)
    if name in NOT_DONE:
        raise MixError(
            f"quantization type {name} is not supported yet; choose one of: {', '.join(FILE_TYPES)}"
        )
    if name not in FILE_TYPES:
        raise MixError(f"unknown quantization type {text!r}; choose one of: {', '.join(FILE_TYPES)}")
    return name


@dataclass(frozen=True)
class ModelShape:
    """The hyperparameters the rules look at."""

    arch: str  # GGUF architecture name ("llama", "qwen2", ...)
    n_layer: int
    n_head: int
    n_head_kv: int
    n_expert: int = 0


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]  # ggml order: ne0 (row length) first


def _layer(name: str) -> int:
    m = re.match(r"blk\.(\d+)\.", name)
    return int(m.group(1)) if m else -1


def tensor_order(names: Iterable[str]) -> list[str]:
    """llama.cpp's weights_map order (weight_name_comparer): by layer (-1 first), then by name bytes."""
    return sorted(names, key=lambda n: (_layer(n), n.encode()))


def allows_quantization(t: TensorSpec) -> bool:
    """tensor_allows_quantization for the tensors of the supported text architectures."""
    if _n_dims(t.shape) < 2:
        return False
    name = t.name
    if not name.endswith("weight") or "_norm.weight" in name:
        return False
    blocked = (
        "ffn_gate_inp.weight",
        "altup",
        "laurel",
        "per_layer_model_proj",
        "ssm_conv1d",
        "attn_rel_b.weight",
        "position_embd",
        "token_types",
        ".rel_pos",
    )
    return not any(b in name for b in blocked)


def _n_dims(shape: Sequence[int]) -> int:
    """ggml_n_dims: trailing dimensions of size 1 do not count."""
    n = len(shape)
    while n > 1 and shape[n - 1] == 1:
        n -= 1
    return n


def _category(name: str) -> str:
    if name == "output.weight":
        return "output"
    if name in ("token_embd.weight", "per_layer_token_embd.weight"):
        return "token_embd"
    for key, cat in (
        ("attn_qkv.weight", "attn_v"),
        ("attn_kv_b.weight", "attn_v"),
        ("attn_v.weight", "attn_v"),
        ("attn_k.weight", "attn_k"),
        ("attn_q.weight", "attn_q"),
        ("attn_output.weight", "attn_output"),
        ("ffn_up", "ffn_up"),
        ("ffn_gate", "ffn_gate"),
        ("ffn_down", "ffn_down"),
    ):
        if key in name:
            return cat
    return "other"


def _use_more_bits(i: int, n: int) -> bool:
    # C integer division; (i - n/8) % 3 with C's truncating modulo
    d = i - n // 8
    return i < n // 8 or i >= 7 * n // 8 or (d - int(d / 3) * 3) == 2


@dataclass
class _State:
    """What the per-tensor rules look at besides the tensor: the file type, the model, the counters."""

    ftype: LlamaFileType
    default: QT
    model: ModelShape
    tied: bool
    n_attn_v: int
    has_imatrix: bool
    i_attn_v: int = 0
    i_ffn_down: int = 0

    @property
    def n_gqa(self) -> int:
        return self.model.n_head // self.model.n_head_kv if self.model.n_head_kv else 0

    @property
    def is_70b(self) -> bool:
        m = self.model
        return m.n_layer == 80 and (m.arch == "qwen2" or (m.arch == "llama" and m.n_head != m.n_head_kv))


def plan(
    tensors: Sequence[TensorSpec], file_type: str, model: ModelShape, has_imatrix: bool = False
) -> dict[str, QT]:
    """Target type per tensor for `file_type`, given each tensor's current type is float.

    1-D tensors and norms keep F32 (what llama.cpp's converter writes for them). A row that fits no
    block size of the mix ends as F16, as llama.cpp does. `has_imatrix`: an importance matrix is given
    (llama.cpp then changes the ffn_down rules of the Q4_0/Q5_0 and IQ4 files).
    """
    ftype, default = FILE_TYPES[file_type]
    names = tensor_order(t.name for t in tensors)
    by_name = {t.name: t for t in tensors}
    st = _State(
        ftype,
        default,
        model,
        tied="output.weight" not in by_name,
        n_attn_v=sum(1 for n in names if _category(n) == "attn_v"),
        has_imatrix=has_imatrix,
    )
    out: dict[str, QT] = {}
    for name in names:
        t = by_name[name]
        if not allows_quantization(t):
            out[name] = QT.F32
        elif default in FLOAT_TYPES:
            out[name] = default
        else:
            out[name] = fallback(t, _tensor_type(st, t))
    return out


def _tensor_type(st: _State, t: TensorSpec) -> QT:
    """llama_tensor_get_type_impl for one quantizable tensor (counters advance as llama.cpp's do)."""
    cat = _category(t.name)
    if cat == "output" or (st.tied and cat == "token_embd"):
        if t.shape[0] % GGML_QUANT_SIZES[st.default][0] != 0:
            return QT.Q8_0
        return st.default if st.default == QT.Q8_0 else QT.Q6_K
    if cat == "attn_v":
        new = _attn_v_type(st)
        st.i_attn_v += 1
        return new
    if cat == "attn_k":
        return QT.Q8_0 if st.model.n_expert == 8 else st.default
    if cat == "ffn_down":
        i = _layer(t.name) if st.model.n_expert > 1 else st.i_ffn_down
        st.i_ffn_down += 1
        return _ffn_down_type(st, i, st.model.n_layer)
    if cat == "attn_output":
        return _attn_output_type(st)
    return st.default  # untied token_embd, attn_q, ffn_gate/up: the default for these file types


def _attn_v_type(st: _State) -> QT:
    ftype, new, i = st.ftype, st.default, st.i_attn_v
    if ftype == FT.MOSTLY_Q2_K:
        new = QT.Q4_K if st.n_gqa >= 4 else QT.Q3_K
    elif ftype == FT.MOSTLY_Q3_K_M:
        new = QT.Q5_K if i < 2 else QT.Q4_K
    elif ftype == FT.MOSTLY_Q3_K_L:
        new = QT.Q5_K
    elif ftype in (FT.MOSTLY_IQ4_NL, FT.MOSTLY_IQ4_XS) and st.n_gqa >= 4:
        new = QT.Q5_K
    elif ftype in (FT.MOSTLY_Q4_K_M, FT.MOSTLY_Q5_K_M) and _use_more_bits(i, st.n_attn_v):
        new = QT.Q6_K
    elif ftype == FT.MOSTLY_Q4_K_S and i < 4:
        new = QT.Q5_K
    if st.is_70b and new in (QT.Q3_K, QT.Q4_K):
        new = QT.Q5_K  # 8 heads share attn_v in 70B models: more bits are cheap there
    if st.model.n_expert == 8:
        new = QT.Q8_0
    return new


def _ffn_down_type(st: _State, i: int, n: int) -> QT:
    ftype = st.ftype
    if ftype == FT.MOSTLY_Q2_K:
        return QT.Q3_K
    if ftype == FT.MOSTLY_Q3_K_M:
        return QT.Q5_K if i < n // 16 else QT.Q4_K
    if ftype == FT.MOSTLY_Q3_K_L:
        return QT.Q5_K
    if ftype == FT.MOSTLY_Q4_K_M:
        return QT.Q6_K if _use_more_bits(i, n) else st.default
    if ftype in (FT.MOSTLY_IQ4_NL, FT.MOSTLY_IQ4_XS) and i < n // 8 and not st.has_imatrix:
        return QT.Q5_K
    if ftype == FT.MOSTLY_Q5_K_M and _use_more_bits(i, n):
        return QT.Q6_K
    if ftype == FT.MOSTLY_Q4_K_S and i < n // 8:
        return QT.Q5_K
    if ftype in (FT.MOSTLY_Q4_0, FT.MOSTLY_Q5_0) and st.has_imatrix and i < n // 8:
        # llama.cpp guards the first ffn_down layers only when weighting, so plain files stay as they were
        return QT.Q4_1 if ftype == FT.MOSTLY_Q4_0 else QT.Q5_1
    return st.default


def _attn_output_type(st: _State) -> QT:
    ftype = st.ftype
    if st.model.n_expert == 8:
        bumped = (
            FT.MOSTLY_Q2_K,
            FT.MOSTLY_Q3_K_S,
            FT.MOSTLY_Q3_K_M,
            FT.MOSTLY_IQ4_NL,
            FT.MOSTLY_Q4_K_S,
            FT.MOSTLY_Q4_K_M,
            FT.MOSTLY_IQ4_XS,
        )
        return QT.Q5_K if ftype in bumped else st.default
    return {FT.MOSTLY_Q2_K: QT.Q3_K, FT.MOSTLY_Q3_K_M: QT.Q4_K, FT.MOSTLY_Q3_K_L: QT.Q5_K}.get(
        ftype, st.default
    )


def fallback(t: TensorSpec, qtype: QT) -> QT:
    """tensor_type_fallback: a type whose block does not divide the row length gets a smaller block."""
    ncols = t.shape[0]
    block = GGML_QUANT_SIZES[qtype][0]
    if ncols % block == 0:
        return qtype
    new = FALLBACK.get(qtype, qtype)
    if ncols % GGML_QUANT_SIZES[new][0] != 0:
        new = QT.F16  # llama.cpp's last resort for rows that are not a multiple of 32
    return new
