"""Quantize an F32/F16/BF16 GGUF to a file type: what `llama-quantize in.gguf out.gguf TYPE` writes.

For `localrt create NAME --from FILE.gguf --quantize TYPE`. Keys are copied in their order with their
types; general.quantization_version and general.file_type are set last (llama-quantize re-sets them,
which moves them to the end); tensors follow llama.cpp's order and per-tensor types, and tensors that
may not be quantized (1-D, norms) are copied byte for byte.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType
from gguf import GGUFReader
from gguf import GGUFValueType

from localrt.converters import imatrix as imatrix_io
from localrt.converters import mixes
from localrt.converters import quants
from localrt.converters import writer
from localrt.converters.hf import ConvertError

QT = GGMLQuantizationType
SOURCE_TYPES = (QT.F32, QT.F16, QT.BF16)
DROPPED = (
    "general.quantization_version",
    "general.file_type",
    "split.no",
    "split.count",
    "split.tensors.count",
)


def _raw_value(field: Any) -> tuple[Any, GGUFValueType, GGUFValueType | None]:
    """A key's value as stored (strings as bytes, numbers as Python scalars) with its GGUF types."""
    vtype = field.types[0]
    if vtype == GGUFValueType.ARRAY:
        sub = field.types[1] if len(field.types) > 1 else GGUFValueType.UINT8
        if sub == GGUFValueType.STRING:
            return [bytes(field.parts[i]) for i in field.data], vtype, sub
        return [field.parts[i].tolist()[0] for i in field.data], vtype, sub
    part = field.parts[field.data[0]]
    return (bytes(part) if vtype == GGUFValueType.STRING else part.tolist()[0]), vtype, None


def _first_int(value: Any) -> int:
    return int(value[0] if isinstance(value, list) else value)


def requantize(
    src: Path,
    dst: Path,
    file_type: str,
    threads: int = 0,
    imatrix: imatrix_io.Imatrix | None = None,
    imatrix_label: str = "",
) -> Path:
    """Write `dst` = `src` (an F32/F16/BF16 GGUF) quantized to `file_type` by llama.cpp's rules.

    With `imatrix`, the encoders llama.cpp weights use its entries (`llama-quantize --imatrix FILE`);
    `imatrix_label` is the file name recorded in quantize.imatrix.file, as llama-quantize records the
    path it was given.
    """
    file_type = mixes.parse_file_type(file_type)
    imatrix_io.check_quantized(file_type, imatrix)
    reader = GGUFReader(src)
    fields = {k: f for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    arch_field = fields.get("general.architecture")
    if arch_field is None:
        raise ConvertError(f"{src}: no general.architecture key")
    arch = bytes(arch_field.parts[arch_field.data[0]]).decode()

    def get(key: str) -> Any:
        f = fields.get(f"{arch}.{key}")
        return None if f is None else _raw_value(f)[0]

    n_layer, n_head = get("block_count"), get("attention.head_count")
    if n_layer is None or n_head is None:
        raise ConvertError(f"{src}: missing {arch}.block_count or {arch}.attention.head_count")
    n_kv = get("attention.head_count_kv")
    shape = mixes.ModelShape(
        arch,
        _first_int(n_layer),
        _first_int(n_head),
        _first_int(n_kv if n_kv is not None else n_head),
        _first_int(get("expert_count") or 0),
    )

    by_name = {t.name: t for t in reader.tensors}
    specs = [mixes.TensorSpec(t.name, tuple(int(d) for d in t.shape)) for t in reader.tensors]
    plan = mixes.plan(specs, file_type, shape, has_imatrix=imatrix is not None)
    weights = {}
    if imatrix is not None:
        quantizable = {s.name: s.shape for s in specs if mixes.allows_quantization(s)}
        weights = imatrix_io.weights_for_model(imatrix, quantizable, imatrix_label or "the imatrix")

    w = writer.new_writer(arch)
    for key, field in fields.items():
        if key == "general.architecture" or key in DROPPED:
            continue
        value, vtype, sub = _raw_value(field)
        w.add_key_value(key, value, vtype, sub)
    w.add_uint32("general.quantization_version", 2)
    w.add_uint32("general.file_type", int(mixes.FILE_TYPES[file_type][0]))
    if imatrix is not None:
        imatrix_io.add_quantize_kv(w, imatrix, imatrix_label)

    items = []
    for name in mixes.tensor_order(by_name):
        t = by_name[name]
        ne = tuple(int(d) for d in t.shape)
        spec = mixes.TensorSpec(name, ne)
        target = plan[name] if mixes.allows_quantization(spec) else t.tensor_type
        if target != t.tensor_type and t.tensor_type not in SOURCE_TYPES:
            raise ConvertError(
                f"{src}: tensor {name} is already {t.tensor_type.name}; requantizing needs an "
                "F32, F16 or BF16 GGUF"
            )
        qw = weights.get(name)
        items.append(
            (name, tuple(reversed(ne)), target, lambda t=t, q=target, qw=qw: _encode(t, q, threads, qw))
        )
    writer.write_streaming(w, Path(dst), items)
    return Path(dst)


def _encode(t: Any, qtype: QT, threads: int, qw: np.ndarray | None = None) -> np.ndarray:
    if qtype == t.tensor_type:
        return np.asarray(t.data)  # llama-quantize copies tensors whose type does not change
    data = np.asarray(t.data)
    if t.tensor_type == QT.BF16:
        values = quants.bf16_to_f32(data.view(np.uint16))
    else:
        values = data.astype(np.float32)
    ne0 = int(t.shape[0])
    if qtype == QT.F32:
        return values
    return quants.quantize(values.reshape(-1, ne0), qtype, threads=threads, imatrix=qw)
