"""Torch engine: GGUF dequantizers, model fidelity against llama.cpp, paged attention against dense."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
llama_cpp = pytest.importorskip("llama_cpp")

from gguf.constants import GGML_QUANT_SIZES  # noqa: E402
from gguf.constants import GGMLQuantizationType  # noqa: E402
from gguf.quants import dequantize as gguf_dequantize  # noqa: E402

from localrt.backends.base import log_softmax  # noqa: E402
from localrt.backends.torch.attention import PagedAttention  # noqa: E402
from localrt.backends.torch.attention import SeqChunk  # noqa: E402
from localrt.backends.torch.gguf_load import GGUFTensors  # noqa: E402
from localrt.backends.torch.gguf_load import dequantize  # noqa: E402
from localrt.backends.torch.kv_cache import KVCache  # noqa: E402
from localrt.backends.torch.llama import DenseCausal  # noqa: E402
from localrt.backends.torch.llama import LlamaConfig  # noqa: E402
from localrt.backends.torch.llama import Transformer  # noqa: E402
from localrt.backends.torch.llama import random_transformer  # noqa: E402
from tests.gguf_factory import write_tiny_llama  # noqa: E402

# byte offsets of the fp16 scale fields in each block (random bytes there could be NaN or inf)
F16_FIELDS = {
    "Q4_0": [0],
    "Q4_1": [0, 2],
    "Q5_0": [0],
    "Q5_1": [0, 2],
    "Q8_0": [0],
    "Q2_K": [80, 82],
    "Q3_K": [108],
    "Q4_K": [0, 2],
    "Q5_K": [0, 2],
    "Q6_K": [208],
}


@pytest.mark.parametrize("type_name", [*F16_FIELDS, "F16", "BF16", "F32"])
def test_dequantizers_match_gguf_py(type_name: str) -> None:
    qtype = GGMLQuantizationType[type_name]
    block_elems, block_bytes = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(7)
    n_blocks = 48
    if type_name in F16_FIELDS:
        raw = rng.integers(
            0, 256, (n_blocks, block_bytes), dtype=np.uint8
        )  # every bit pattern of the payload
        for offset in F16_FIELDS[type_name]:
            raw[:, offset : offset + 2] = rng.uniform(-2, 2, (n_blocks, 1)).astype(np.float16).view(np.uint8)
    else:
        values = rng.standard_normal(n_blocks * 32).astype(np.float32)
        raw = {"F16": values.astype(np.float16), "F32": values}.get(type_name)
        if raw is None:
            raw = (values.view(np.uint32) >> 16).astype(np.uint16)  # bf16 bits
        raw = raw.view(np.uint8)
    raw = raw.reshape(-1)
    n = raw.size // block_bytes * block_elems
    expected = gguf_dequantize(raw, qtype).reshape(-1)
    got = dequantize(torch.from_numpy(raw.copy()), type_name, (n,)).numpy()
    np.testing.assert_array_equal(got, expected)


def test_dequantize_keeps_torch_order() -> None:
    data = np.arange(6, dtype=np.float32)
    out = dequantize(torch.from_numpy(data.view(np.uint8).copy()), "F32", (3, 2))  # GGUF shape: ne0 = 3
    assert out.shape == (2, 3)
    assert out[1, 0] == 3


def tiny_logits_llama_cpp(path: Path, tokens: list[int]) -> np.ndarray:
    llm = llama_cpp.Llama(
        str(path), logits_all=True, n_ctx=256, n_threads=1, verbose=False, type_k=0, type_v=0
    )
    try:
        llm.eval(tokens)
        return np.array(llm.scores[: len(tokens)])
    finally:
        llm.close()


@pytest.mark.parametrize("file_type", ["F32", "Q8_0", "Q4_1"])
def test_tiny_gguf_logits_match_llama_cpp(tmp_path: Path, file_type: str) -> None:
    path = write_tiny_llama(
        tmp_path / "tiny.gguf",
        n_embd=128,
        n_head=4,
        n_head_kv=2,
        n_ff=256,
        n_layer=2,
        file_type=file_type,
        seed=3,
    )
    model = Transformer.from_gguf(GGUFTensors(path), torch.float32, "cpu")
    assert model.cfg.attention_head_count_kv == 2
    assert not model.cfg.rope_neox
    tokens = [1, *np.random.default_rng(0).integers(5, model.cfg.vocab_size, 40).tolist()]
    with torch.inference_mode():
        ours = model(torch.tensor(tokens), DenseCausal(len(tokens))).numpy()
    ref = tiny_logits_llama_cpp(path, tokens)
    # random weights give flat logits; RoPE in the wrong layout would move them by far more than this
    np.testing.assert_allclose(ours, ref, atol=0.02 if file_type == "F32" else 0.05)


def english_text() -> str:
    """Real English prose that ships with every CPython: the reference manual's topics and the license."""
    from pydoc_data.topics import topics

    # base_prefix: inside a virtual environment the license is still the base interpreter's
    license_path = (
        Path(sys.base_prefix) / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}" / "LICENSE.txt"
    )
    text = topics["specialnames"] + "\n\n" + topics["import"]
    if license_path.is_file():
        text = license_path.read_text(errors="replace") + "\n\n" + text
    return text


@pytest.fixture(scope="module")
def smollm2(smollm2_gguf: Path) -> Transformer:
    return Transformer.from_gguf(GGUFTensors(smollm2_gguf), torch.float32, "cpu")


def llama_cpp_logits(path: Path, tokens: list[int], n_batch: int = 512) -> np.ndarray:
    """llama.cpp's logits for every position, its defaults otherwise (f16 KV, no flash attention)."""
    threads = int(os.environ.get("LOCALRT_TEST_THREADS", "1"))
    llm = llama_cpp.Llama(
        str(path),
        logits_all=True,
        n_ctx=len(tokens) + 8,
        n_batch=n_batch,
        n_ubatch=n_batch,
        n_threads=threads,
        verbose=False,
    )
    try:
        llm.eval(tokens)
        return np.array(llm.scores[: len(tokens)])
    finally:
        llm.close()


def english_tokens(path: Path, n_tokens: int) -> list[int]:
    vocab = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    return vocab.tokenize(english_text().encode())[:n_tokens]


def compare(ours: np.ndarray, ref: np.ndarray, tokens: list[int]) -> dict[str, float]:
    """Teacher-forced top-1 agreement, perplexities, and llama.cpp's top-1/top-2 margin where they differ."""
    targets = np.array(tokens[1:])
    rows = np.arange(len(targets))
    differ = ours.argmax(-1) != ref.argmax(-1)
    top2 = np.sort(ref, -1)[:, -2:]
    margins = (top2[:, 1] - top2[:, 0])[differ]
    return {
        "top1": float(1 - differ.mean()),
        "ppl_ours": float(np.exp(-log_softmax(ours[:-1])[rows, targets].mean())),
        "ppl_ref": float(np.exp(-log_softmax(ref[:-1])[rows, targets].mean())),
        "max_margin": float(margins.max()) if margins.size else 0.0,
    }


def fidelity(model: Transformer, path: Path, n_tokens: int) -> dict[str, float]:
    tokens = english_tokens(path, n_tokens)
    with torch.inference_mode():
        ours = model(torch.tensor(tokens), DenseCausal(len(tokens))).numpy()
    return compare(ours, llama_cpp_logits(path, tokens), tokens)


def test_smollm2_teacher_forced_fidelity(smollm2: Transformer, smollm2_gguf: Path) -> None:
    """Top-1 and perplexity against llama.cpp over 512 tokens of English.

    llama.cpp is not a fixed point itself: it rounds activations to 8 bits before every quantized
    dot product, and which way a value near a rounding boundary goes depends on summation order, so
    its own logits at batch size 512 and 1 disagree on 2-4% of top-1 tokens for this model. The
    torch engine equals an fp32 dequantized reference (transformers' GGUF loader) to 3e-4. So the
    bar is llama.cpp's own batch-to-batch agreement, every disagreement a near-tie for llama.cpp,
    and perplexity within 1%.
    """
    got = fidelity(smollm2, smollm2_gguf, 512)
    assert got["top1"] >= 0.95, got
    assert got["max_margin"] < 1.0, got  # a near-tie in llama.cpp's own logits, never a clear choice
    assert abs(got["ppl_ours"] / got["ppl_ref"] - 1) < 0.01, got


@pytest.mark.timeout(3600)
@pytest.mark.parametrize(
    "file_type",
    [pytest.param("Q4_1", marks=pytest.mark.oracle), pytest.param("Q4_K_M", marks=pytest.mark.slow)],
)
def test_smollm2_fidelity_2k_tokens(file_type: str, smollm2_file: Callable[[str], Path]) -> None:
    """2,048 tokens, teacher-forced, against llama.cpp's batched logits. The top-1 bar is llama.cpp's
    agreement with itself (batched prefill vs token-by-token decoding, same file and machine), every
    disagreement must be a near-tie for llama.cpp. Perplexity: within 1% with the opt-in llama.cpp
    numerics; the default fp32 numerics skip llama.cpp's 8-bit activation rounding, which costs
    llama.cpp 1.3% perplexity on the Q4_K_M conversion, so there the default gets 1.5%."""
    from localrt.backends.torch import ggml_numerics

    path = smollm2_file(file_type)
    tensors = GGUFTensors(path)
    model = Transformer.from_gguf(tensors, torch.float32, "cpu")
    tokens = english_tokens(path, 2048)
    assert len(tokens) == 2048
    ref = llama_cpp_logits(path, tokens, n_batch=512)
    with torch.inference_mode():
        ours = model(torch.tensor(tokens), DenseCausal(len(tokens))).numpy()
        ggml_numerics.emulate(model, tensors)
        emulated = model(torch.tensor(tokens), ggml_numerics.GGMLDenseCausal(len(tokens))).numpy()
    got, emu = compare(ours, ref, tokens), compare(emulated, ref, tokens)
    decoded = compare(llama_cpp_logits(path, tokens, n_batch=1), ref, tokens)
    print(
        f"\n{file_type}: top-1 vs llama.cpp {got['top1']:.4f}, emulated {emu['top1']:.4f}, llama.cpp n_batch 1 "
        f"vs 512 {decoded['top1']:.4f}; ppl {got['ppl_ours']:.4f}, emulated {emu['ppl_ours']:.4f}, llama.cpp "
        f"{got['ppl_ref']:.4f}; largest llama.cpp margin where we differ {got['max_margin']:.3f}"
    )
    assert got["top1"] >= decoded["top1"] - 0.002, (got, decoded)
    assert emu["top1"] >= decoded["top1"] - 0.01, (emu, decoded)
    assert got["top1"] >= 0.95, got
    assert got["max_margin"] < 1.0, got
    assert abs(emu["ppl_ours"] / emu["ppl_ref"] - 1) < 0.01, emu
    assert abs(got["ppl_ours"] / got["ppl_ref"] - 1) < (0.01 if file_type == "Q4_1" else 0.015), got


@pytest.mark.oracle
def test_smollm2_equals_fp32_reference(smollm2: Transformer, smollm2_gguf: Path) -> None:
    """transformers' own GGUF loader (dequantize, un-permute Q/K, fp32 Llama): the same logits."""
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name, torch_dtype=torch.float32
    )
    vocab = llama_cpp.Llama(str(smollm2_gguf), vocab_only=True, verbose=False)
    tokens = vocab.tokenize(english_text().encode())[:512]
    with torch.inference_mode():
        ref = hf(torch.tensor([tokens])).logits[0]
        ours = smollm2(torch.tensor(tokens), DenseCausal(len(tokens)))
    assert (ours.argmax(-1) == ref.argmax(-1)).all()
    torch.testing.assert_close(ours, ref, atol=2e-3, rtol=0)


def test_neox_rope_pairs_halves() -> None:
    cfg = LlamaConfig("qwen2", 16, 64, 32, 64, 1, 2, 2, 16, rope_neox=True)
    normal = LlamaConfig("llama", 16, 64, 32, 64, 1, 2, 2, 16)
    from localrt.backends.torch.llama import Rotary

    x = torch.randn(3, 2, 16)
    pos = torch.tensor([0, 1, 5])
    halves = torch.cat([torch.arange(0, 16, 2), torch.arange(1, 16, 2)])  # pair (2i, 2i+1) -> (i, i+8)
    torch.testing.assert_close(Rotary(cfg)(x[..., halves], pos), Rotary(normal)(x, pos)[..., halves])
    torch.testing.assert_close(Rotary(cfg)(x, pos)[0], x[0])  # position 0 is the identity


@pytest.mark.parametrize("kv_type", ["f32", "f16", "bf16", "q8_0", "fp8"])
def test_paged_attention_equals_dense(kv_type: str) -> None:
    cfg = LlamaConfig("llama", 64, 256, 64, 128, 2, 4, 2, 16)
    model = random_transformer(cfg, seed=1)
    rng = np.random.default_rng(0)
    lengths = [37, 5, 16, 60]
    prompts = [rng.integers(0, 64, n).tolist() for n in lengths]
    cache = KVCache(2, 64, 2, 16, kv_type, torch.float32, "cpu")
    ids = rng.permutation(64).tolist()  # scattered block ids
    tables = [[ids.pop() for _ in range(-(-n // 16))] for n in lengths]
    with torch.inference_mode():
        dense = [model(torch.tensor(p), DenseCausal(len(p))) for p in prompts]
        # all prompts in one step but in uneven pieces: first a prefix chunk, then the rest + a decode row
        split = [n // 2 for n in lengths]
        chunks = [SeqChunk(s, s, t) for s, t in zip(split, tables)]
        model(
            torch.tensor([x for p, s in zip(prompts, split) for x in p[:s]]),
            PagedAttention(cache, chunks, "cpu"),
        )
        chunks = [SeqChunk(n - s, n, t) for n, s, t in zip(lengths, split, tables)]
        paged = model(
            torch.tensor([x for p, s in zip(prompts, split) for x in p[s:]]),
            PagedAttention(cache, chunks, "cpu"),
        )
    start = 0
    tol = {"f32": 1e-4, "f16": 5e-3, "bf16": 5e-2, "q8_0": 5e-2, "fp8": 0.15}[kv_type]
    for d, n, s in zip(dense, lengths, split):
        torch.testing.assert_close(paged[start : start + n - s], d[s:], atol=tol, rtol=0)
        start += n - s


def write_kquant_llama(path: Path, mix: dict[str, str], seed: int = 0, dequantized: bool = False) -> Path:
    """A tiny Llama whose weights are random k-quant blocks (any payload bits with finite scales are a
    valid block), typed per tensor like a Q4_K_M file: `mix` maps a name fragment to a ggml type.
    `dequantized` writes the same weights as F32 (gguf-py's dequantizer) instead."""
    import gguf

    from tests.gguf_factory import tiny_spm_vocab

    n_embd, n_ff, n_head, n_kv, n_layer = 256, 512, 4, 2, 2
    tokens, scores, types = tiny_spm_vocab()
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(256)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    w.add_rope_dimension_count(n_embd // n_head)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)

    def weight(name: str, rows: int, cols: int) -> None:
        type_name = next((t for frag, t in mix.items() if frag in name), "Q4_K")
        qtype = GGMLQuantizationType[type_name]
        block_elems, block_bytes = GGML_QUANT_SIZES[qtype]
        n_blocks = rows * cols // block_elems
        raw = rng.integers(0, 256, (n_blocks, block_bytes), dtype=np.uint8)
        for offset in F16_FIELDS[type_name]:  # small scales keep activations in range
            raw[:, offset : offset + 2] = (
                rng.uniform(0.00005, 0.0004, (n_blocks, 1)).astype(np.float16).view(np.uint8)
            )
        if dequantized:
            w.add_tensor(name, gguf_dequantize(raw.reshape(-1), qtype).reshape(rows, cols))
        else:
            w.add_tensor(name, raw.reshape(rows, cols // block_elems * block_bytes), raw_dtype=qtype)

    weight("token_embd.weight", len(tokens), n_embd)
    for i in range(n_layer):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(n_embd, dtype=np.float32))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(n_embd, dtype=np.float32))
        for name, rows, cols in [
            ("attn_q", n_embd, n_embd),
            ("attn_k", n_embd // 2, n_embd),
            ("attn_v", n_embd // 2, n_embd),
            ("attn_output", n_embd, n_embd),
            ("ffn_gate", n_ff, n_embd),
            ("ffn_up", n_ff, n_embd),
            ("ffn_down", n_embd, n_ff),
        ]:
            weight(f"blk.{i}.{name}.weight", rows, cols)
    w.add_tensor("output_norm.weight", np.ones(n_embd, dtype=np.float32))
    weight("output.weight", len(tokens), n_embd)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize(
    "mix",
    [
        {
            "attn_v": "Q6_K",
            "ffn_down": "Q6_K",
            "output": "Q6_K",
        },  # Q4_K_M's layout: Q4_K, Q6_K where it matters
        {"attn": "Q3_K", "ffn_gate": "Q2_K", "ffn_up": "Q5_K", "token_embd": "Q6_K"},
    ],
    ids=["Q4_K_M", "Q2_K-Q6_K"],
)
def test_kquant_gguf_logits_match_llama_cpp(tmp_path: Path, mix: dict[str, str]) -> None:
    """Against llama.cpp on the same weights stored as F32: equal. Against llama.cpp on the k-quant file:
    close, not equal, because llama.cpp quantizes activations to 8 bits for k-quant dot products (on these
    random weights that alone moves its own logits by as much as 20%, F32 file vs k-quant file)."""
    quantized = write_kquant_llama(tmp_path / "kquant.gguf", mix)
    model = Transformer.from_gguf(GGUFTensors(quantized), torch.float32, "cpu")
    tokens = [1, *np.random.default_rng(1).integers(5, model.cfg.vocab_size, 60).tolist()]
    with torch.inference_mode():
        ours = model(torch.tensor(tokens), DenseCausal(len(tokens))).numpy()
    dense_ref = tiny_logits_llama_cpp(
        write_kquant_llama(tmp_path / "f32.gguf", mix, dequantized=True), tokens
    )
    np.testing.assert_allclose(ours, dense_ref, atol=0.01)
    quant_ref = tiny_logits_llama_cpp(quantized, tokens)
    assert np.corrcoef(ours.ravel(), quant_ref.ravel())[0, 1] > 0.99


# ---- llama.cpp's CPU rounding, emulated (backends/torch/ggml_numerics.py, opt-in) -----------------
@pytest.mark.parametrize("file_type", ["Q8_0", "Q4_1", "Q4_K_M"])
def test_ggml_activation_rounding_reproduces_llama_cpp(tmp_path: Path, file_type: str) -> None:
    """With activations rounded to each weight's vec_dot_type (Q8_0, Q8_1 with its fp16 block sum,
    Q8_K), our logits equal llama.cpp's (f32 KV) to float32 summation order; without, they differ by
    the 8-bit activation noise. Summation order still matters now and then: a value that lands within
    an ulp of a rounding boundary goes either way, and the flip carries on through the later layers,
    so the claim is "exact on most short sequences", never on none for the plain path."""
    from localrt.backends.torch import ggml_numerics

    if file_type == "Q4_K_M":
        path = write_kquant_llama(
            tmp_path / "m.gguf", {"attn_v": "Q6_K", "ffn_down": "Q6_K", "output": "Q6_K"}
        )
    else:
        path = write_tiny_llama(
            tmp_path / "m.gguf",
            n_embd=128,
            n_head=4,
            n_head_kv=2,
            n_ff=256,
            n_layer=2,
            file_type=file_type,
            seed=3,
        )
    tensors = GGUFTensors(path)
    model = Transformer.from_gguf(tensors, torch.float32, "cpu")
    exact = {"plain": 0, "emulated": 0}
    for seed in range(4):
        tokens = [1, *np.random.default_rng(seed).integers(5, model.cfg.vocab_size, 16).tolist()]
        ref = tiny_logits_llama_cpp(path, tokens)
        with torch.inference_mode():
            plain = model(torch.tensor(tokens), DenseCausal(len(tokens))).numpy()
            handles = ggml_numerics.emulate(model, tensors)
            emulated = model(torch.tensor(tokens), DenseCausal(len(tokens))).numpy()
            for h in handles:
                h.remove()
            restored = model(torch.tensor(tokens), DenseCausal(len(tokens))).numpy()
        np.testing.assert_array_equal(restored, plain)  # removing the hooks restores the default numerics
        exact["plain"] += int(np.abs(plain - ref).max() < 1e-4)
        exact["emulated"] += int(np.abs(emulated - ref).max() < 1e-4)
    assert exact["plain"] == 0, exact
    assert exact["emulated"] >= 2, exact


def test_ggml_attention_rounding_is_closer_to_llama_cpp_f16_kv(tmp_path: Path) -> None:
    """llama.cpp's default f16 KV cache without flash attention rounds K, V, Q and the softmax weights
    to fp16; `GGMLDenseCausal` does the same, and lands closer to it than fp32 attention does."""
    from localrt.backends.torch.ggml_numerics import GGMLDenseCausal

    path = write_tiny_llama(
        tmp_path / "f32.gguf", n_embd=128, n_head=4, n_head_kv=2, n_ff=256, n_layer=2, file_type="F32", seed=3
    )
    model = Transformer.from_gguf(GGUFTensors(path), torch.float32, "cpu")
    tokens = [1, *np.random.default_rng(0).integers(5, model.cfg.vocab_size, 40).tolist()]
    llm = llama_cpp.Llama(str(path), logits_all=True, n_ctx=256, n_threads=1, verbose=False)  # f16 KV default
    try:
        llm.eval(tokens)
        ref = np.array(llm.scores[: len(tokens)])
    finally:
        llm.close()
    with torch.inference_mode():
        fp32 = model(torch.tensor(tokens), DenseCausal(len(tokens))).numpy()
        fp16 = model(torch.tensor(tokens), GGMLDenseCausal(len(tokens))).numpy()
    assert np.abs(fp16 - ref).max() < np.abs(fp32 - ref).max() / 2
