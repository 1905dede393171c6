"""Small GGUF files for tests.

Two kinds:
- `write_tiny_llama`: a real, random-weight Llama model written with gguf-py's `GGUFWriter`,
  small enough to load in llama.cpp in milliseconds (a SentencePiece-style vocab with byte tokens).
- `build_gguf`: raw bytes assembled field by field, so a test can put any value (a wrong length,
  an absurd count, an unknown type) exactly where it wants it.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from collections.abc import Iterable
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf.constants import GGML_QUANT_SIZES
from gguf.constants import GGMLQuantizationType

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# llama.cpp's LLAMA_FTYPE for the file types the factory can write (gguf-py quantizes these in numpy).
FILE_TYPES: dict[str, tuple[int, GGMLQuantizationType]] = {
    "F32": (0, GGMLQuantizationType.F32),
    "F16": (1, GGMLQuantizationType.F16),
    "Q4_0": (2, GGMLQuantizationType.Q4_0),
    "Q4_1": (3, GGMLQuantizationType.Q4_1),
    "Q8_0": (7, GGMLQuantizationType.Q8_0),
    "Q5_0": (8, GGMLQuantizationType.Q5_0),
    "Q5_1": (9, GGMLQuantizationType.Q5_1),
    "BF16": (32, GGMLQuantizationType.BF16),
}

# SentencePiece token types (llama.cpp's llama_token_type).
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = 1, 2, 3, 4, 5, 6

_WORDS = (
    "the of and to in is that it for was on are as with his they be at one have this from or had by "
    "hot word but what some we can out other were all there when up use your how said an each she "
    "which do their time if will way about many then them write would like so these her long make "
    "thing see him two has look more day could go come did number sound no most people my over know "
    "water than call first who may down side been now find sky blue why hello world"
).split()


def tiny_spm_vocab(
    n_vocab: int | None = None, extra_specials: Sequence[tuple[str, int]] = ()
) -> tuple[list[str], list[float], list[int]]:
    """A SentencePiece-style vocab: <unk> <s> </s>, ChatML markers, 256 byte tokens, letters, words.

    `extra_specials`: (text, token type) pairs added after the ChatML markers, e.g. a family's
    `<think>` (user-defined, as Qwen3's) or harmony's `<|channel|>` (control, as gpt-oss's)."""
    tokens = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
    types = [TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_CONTROL, TOKEN_CONTROL, TOKEN_CONTROL]
    for text, kind in extra_specials:
        tokens.append(text)
        types.append(kind)
    tokens += [f"<0x{byte:02X}>" for byte in range(256)]
    types += [TOKEN_BYTE] * 256
    pieces = ["\u2581"] + [chr(c) for c in range(ord("a"), ord("z") + 1)]
    pieces += [chr(c) for c in range(ord("A"), ord("Z") + 1)] + list("0123456789.,!?'")
    # Every prefix of every word, so SentencePiece's pairwise merges can build the whole word.
    for word in _WORDS:
        for end in range(1, len(word) + 1):
            piece = "\u2581" + word[:end]
            if piece not in pieces:
                pieces.append(piece)
    tokens += pieces
    types += [TOKEN_NORMAL] * len(pieces)
    if n_vocab is not None:
        if n_vocab < len(tokens):
            raise ValueError(f"n_vocab must be at least {len(tokens)}")
        padding = n_vocab - len(tokens)
        tokens += [f"<unused{i}>" for i in range(padding)]
        types += [TOKEN_UNUSED] * padding
    # SentencePiece scores: higher merges first; specials and bytes score 0.
    scores = [0.0 if t != TOKEN_NORMAL else -float(i) for i, t in enumerate(types)]
    return tokens, scores, types


@dataclass(frozen=True)
class LlamaShape:
    n_vocab: int
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    n_ff: int


def add_llama_hparams(writer: gguf.GGUFWriter, shape: LlamaShape, context_length: int) -> None:
    """The hyperparameter keys of a Llama of `shape` (RoPE base 10000, RMS eps 1e-5)."""
    writer.add_context_length(context_length)
    writer.add_embedding_length(shape.n_embd)
    writer.add_block_count(shape.n_layer)
    writer.add_feed_forward_length(shape.n_ff)
    writer.add_head_count(shape.n_head)
    writer.add_head_count_kv(shape.n_head_kv)
    writer.add_rope_dimension_count(shape.n_embd // shape.n_head)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)


def add_llama_tensors(
    writer: gguf.GGUFWriter, shape: LlamaShape, weight: Callable[[str, int, int], None]
) -> None:
    """Every tensor of a Llama of `shape`, in llama.cpp's order: the matrices through `weight(name,
    rows, cols)` (which draws and encodes them), the norms as ones in f32."""

    def norm(name: str) -> None:
        writer.add_tensor(name, np.ones(shape.n_embd, dtype=np.float32))

    n_embd, head_dim = shape.n_embd, shape.n_embd // shape.n_head
    weight("token_embd.weight", shape.n_vocab, n_embd)
    for layer in range(shape.n_layer):
        prefix = f"blk.{layer}"
        norm(f"{prefix}.attn_norm.weight")
        weight(f"{prefix}.attn_q.weight", shape.n_head * head_dim, n_embd)
        weight(f"{prefix}.attn_k.weight", shape.n_head_kv * head_dim, n_embd)
        weight(f"{prefix}.attn_v.weight", shape.n_head_kv * head_dim, n_embd)
        weight(f"{prefix}.attn_output.weight", n_embd, shape.n_head * head_dim)
        norm(f"{prefix}.ffn_norm.weight")
        weight(f"{prefix}.ffn_gate.weight", shape.n_ff, n_embd)
        weight(f"{prefix}.ffn_up.weight", shape.n_ff, n_embd)
        weight(f"{prefix}.ffn_down.weight", n_embd, shape.n_ff)
    norm("output_norm.weight")
    weight("output.weight", shape.n_vocab, n_embd)


def write_tiny_llama(
    path: str | Path,
    *,
    n_embd: int = 64,
    n_layer: int = 2,
    n_head: int = 4,
    n_head_kv: int = 2,
    n_ff: int = 128,
    n_vocab: int | None = None,
    context_length: int = 256,
    chat_template: str | None = CHATML_TEMPLATE,
    file_type: str = "F32",
    seed: int = 0,
    extra_specials: Sequence[tuple[str, int]] = (),
) -> Path:
    """Write a random-weight Llama GGUF that llama.cpp loads and runs; returns its path."""
    path = Path(path)
    ftype_id, weight_type = FILE_TYPES[file_type]
    tokens, scores, token_types = tiny_spm_vocab(n_vocab, extra_specials)
    n_vocab = len(tokens)
    rng = np.random.default_rng(seed)

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny-llama")
    writer.add_license("apache-2.0")
    writer.add_file_type(ftype_id)
    shape = LlamaShape(n_vocab, n_embd, n_layer, n_head, n_head_kv, n_ff)
    add_llama_hparams(writer, shape, context_length)
    writer.add_vocab_size(n_vocab)
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(token_types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    if chat_template is not None:
        writer.add_chat_template(chat_template)

    def weight(name: str, rows: int, cols: int) -> None:
        # numpy (rows, cols) is GGUF shape [cols, rows]: ne[0] is the contiguous input dim.
        data = (rng.standard_normal((rows, cols)) * 0.02).astype(np.float32)
        if weight_type == GGMLQuantizationType.F32:
            writer.add_tensor(name, data)
        elif weight_type == GGMLQuantizationType.F16:
            writer.add_tensor(name, data.astype(np.float16))
        else:
            writer.add_tensor(name, gguf.quants.quantize(data, weight_type), raw_dtype=weight_type)

    add_llama_tensors(writer, shape, weight)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def tiny_llama_bytes(tmp_dir: str | Path, **kwargs: Any) -> bytes:
    """The bytes of `write_tiny_llama(tmp_dir / "tiny.gguf", **kwargs)`."""
    return write_tiny_llama(Path(tmp_dir) / "tiny.gguf", **kwargs).read_bytes()


# ------------------------------------------------------------------------------------------------
# Raw builder: every field is written as given, valid or not.

UINT8, INT8, UINT16, INT16, UINT32, INT32, FLOAT32, BOOL, STRING, ARRAY, UINT64, INT64, FLOAT64 = range(13)
_SCALAR_FORMATS = {
    UINT8: "<B",
    INT8: "<b",
    UINT16: "<H",
    INT16: "<h",
    UINT32: "<I",
    INT32: "<i",
    FLOAT32: "<f",
    BOOL: "<B",
    UINT64: "<Q",
    INT64: "<q",
    FLOAT64: "<d",
}


def encode_string(text: str | bytes, *, length: int | None = None) -> bytes:
    """u64 length + bytes; `length` overrides the written length (for lying headers)."""
    raw = text.encode("utf-8") if isinstance(text, str) else text
    return struct.pack("<Q", len(raw) if length is None else length) + raw


def encode_value(type_id: int, value: Any) -> bytes:
    """A value of GGUF type `type_id`; an ARRAY value is `(element_type, items)` and may nest."""
    if type_id == STRING:
        return encode_string(value)
    if type_id == ARRAY:
        element_type, items = value
        items = list(items)
        return struct.pack("<IQ", element_type, len(items)) + b"".join(
            encode_value(element_type, item) for item in items
        )
    return struct.pack(_SCALAR_FORMATS[type_id], value)


@dataclass
class RawTensor:
    name: str | bytes
    dims: Sequence[int]
    type_id: int = 0  # F32
    offset: int | None = None  # None: laid out after the previous tensor, aligned

    def n_bytes(self) -> int:
        block_size, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(self.type_id)]
        n_elements = 1
        for dim in self.dims:
            n_elements *= dim
        return n_elements // block_size * type_size


def build_gguf(
    kv: Iterable[tuple[str | bytes, int, Any]] = (),
    tensors: Sequence[RawTensor] = (),
    *,
    magic: bytes = b"GGUF",
    version: int = 3,
    n_kv: int | None = None,
    n_tensors: int | None = None,
    alignment: int = 32,
    data: bytes | None = None,
    raw_kv: bytes = b"",
) -> bytes:
    """Assemble a GGUF file. `kv` items are `(key, type, value)`; `raw_kv` is appended verbatim.

    Counts default to the real ones; tensor data defaults to zeros covering every tensor.
    `alignment` only lays out the data section: add a `general.alignment` KV to declare it.
    """
    kv = list(kv)
    body = (
        b"".join(
            encode_string(key) + struct.pack("<I", type_id) + encode_value(type_id, value)
            for key, type_id, value in kv
        )
        + raw_kv
    )
    offsets: list[int] = []
    data_end = 0
    for tensor in tensors:
        offset = tensor.offset
        if offset is None:
            offset = -(-data_end // alignment) * alignment
        offsets.append(offset)
        try:
            data_end = max(data_end, offset + tensor.n_bytes())
        except (KeyError, ValueError):
            pass  # an unknown type: the test supplies its own data
    infos = b"".join(
        encode_string(tensor.name)
        + struct.pack("<I", len(tensor.dims))
        + b"".join(struct.pack("<q", dim) for dim in tensor.dims)
        + struct.pack("<IQ", tensor.type_id, offset)
        for tensor, offset in zip(tensors, offsets, strict=True)
    )
    header = magic + struct.pack("<I", version)
    header += struct.pack(
        "<QQ", len(tensors) if n_tensors is None else n_tensors, len(kv) if n_kv is None else n_kv
    )
    header += body + infos
    if data is None:
        if not tensors:
            return header
        data = bytes(data_end)
    padding = bytes(-len(header) % alignment)
    return header + padding + data


def small_valid_gguf() -> bytes:
    """A few hundred bytes touching every section: strings, arrays (nested too), two tensors."""
    kv = [
        ("general.architecture", STRING, "llama"),
        ("general.alignment", UINT32, 16),
        ("llama.context_length", UINT32, 128),
        ("tokenizer.ggml.tokens", ARRAY, (STRING, ["<s>", "a", "bc"])),
        ("tokenizer.ggml.scores", ARRAY, (FLOAT32, [0.0, -1.0, -2.0])),
        ("nested", ARRAY, (ARRAY, [(UINT16, [1, 2]), (BOOL, [1])])),
    ]
    tensors = [RawTensor("token_embd.weight", [32, 3], 8), RawTensor("output_norm.weight", [32], 0)]
    return build_gguf(kv, tensors, alignment=16)


def write_random_model(
    path: str | Path,
    *,
    arch: str = "llama",
    n_vocab: int = 96,
    n_embd: int = 64,
    n_layer: int = 2,
    n_head: int = 4,
    n_head_kv: int = 2,
    n_ff: int = 128,
    context_length: int = 512,
    weight_type: str = "F32",
    tied: bool = False,
    seed: int = 0,
) -> Path:
    """A random Llama/Qwen2-architecture GGUF for the engines that read GGUF themselves (torch, MLX).

    Any ggml type the project's converter encodes (k-quants too); tokens are placeholders, so the
    file is for engine-level tests, not for llama.cpp. Qwen2 gets q/k/v biases (and neox RoPE).
    """
    from localrt.converters.quants import quantize

    path = Path(path)
    qtype = GGMLQuantizationType[weight_type]
    rng = np.random.default_rng(seed)
    head_dim = n_embd // n_head
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_context_length(context_length)
    writer.add_embedding_length(n_embd)
    writer.add_block_count(n_layer)
    writer.add_feed_forward_length(n_ff)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_head_kv)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"<t{i}>" for i in range(n_vocab)])

    def weight(name: str, rows: int, cols: int, scale: float = 0.08) -> None:
        data = (rng.standard_normal((rows, cols)) * scale).astype(np.float32)
        if qtype == GGMLQuantizationType.F32:
            writer.add_tensor(name, data)
        else:
            writer.add_tensor(name, quantize(data, qtype), raw_dtype=qtype)

    def vector(name: str, n: int, base: float = 0.0, scale: float = 0.1) -> None:
        writer.add_tensor(name, (base + rng.standard_normal(n) * scale).astype(np.float32))

    weight("token_embd.weight", n_vocab, n_embd, 0.5)
    for layer in range(n_layer):
        p = f"blk.{layer}"
        vector(f"{p}.attn_norm.weight", n_embd, 1.0)
        weight(f"{p}.attn_q.weight", n_head * head_dim, n_embd)
        weight(f"{p}.attn_k.weight", n_head_kv * head_dim, n_embd)
        weight(f"{p}.attn_v.weight", n_head_kv * head_dim, n_embd)
        if arch == "qwen2":
            vector(f"{p}.attn_q.bias", n_head * head_dim)
            vector(f"{p}.attn_k.bias", n_head_kv * head_dim)
            vector(f"{p}.attn_v.bias", n_head_kv * head_dim)
        weight(f"{p}.attn_output.weight", n_embd, n_head * head_dim)
        vector(f"{p}.ffn_norm.weight", n_embd, 1.0)
        weight(f"{p}.ffn_gate.weight", n_ff, n_embd)
        weight(f"{p}.ffn_up.weight", n_ff, n_embd)
        weight(f"{p}.ffn_down.weight", n_embd, n_ff)
    vector("output_norm.weight", n_embd, 1.0)
    if not tied:
        weight("output.weight", n_vocab, n_embd, 0.5)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
