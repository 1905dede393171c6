"""The MLX engine's numerics: GGUF blocks repacked into MLX's quantized layout without loss, the model
against the torch engine's dequantized reference, and the KV caches (growth, trim, 8-bit, chunked
prefill, prefix reuse)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")

from gguf import GGMLQuantizationType as QT  # noqa: E402
from gguf.quants import dequantize as gguf_dequantize  # noqa: E402

from localrt.backends.base import SamplingParams  # noqa: E402
from localrt.backends.mlx.cache import STEP  # noqa: E402
from localrt.backends.mlx.cache import make_caches  # noqa: E402
from localrt.backends.mlx.engine import Engine  # noqa: E402
from localrt.backends.mlx.gguf_load import EXACT  # noqa: E402
from localrt.backends.mlx.gguf_load import GGUFTensors  # noqa: E402
from localrt.backends.mlx.gguf_load import QuantizedWeight  # noqa: E402
from localrt.backends.mlx.gguf_load import repack  # noqa: E402
from localrt.backends.mlx.llama import Transformer  # noqa: E402
from localrt.backends.mlx.prompt_cache import PromptCache  # noqa: E402
from localrt.backends.mlx.sampling import RowSampler  # noqa: E402
from localrt.converters.quants import bf16_to_f32  # noqa: E402
from localrt.converters.quants import quantize  # noqa: E402
from tests.gguf_factory import write_random_model  # noqa: E402

EXACT_TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K"]


def test_every_exact_type_is_covered() -> None:
    assert sorted(EXACT) == sorted(EXACT_TYPES)


@pytest.mark.parametrize("qtype", EXACT_TYPES)
def test_repack_dequantizes_exactly_like_ggml(qtype: str) -> None:
    rng = np.random.default_rng(3)
    w = (rng.standard_normal((48, 512)) * rng.uniform(0.01, 2.0, (48, 1))).astype(np.float32)
    w[5, :256] += 3.0  # one k-quant super-block with a large offset (non-zero mins)
    raw = quantize(w, QT[qtype]).reshape(-1).view(np.uint8)
    reference = gguf_dequantize(raw, QT[qtype]).reshape(48, 512)
    qw = repack(raw, qtype, (512, 48))
    assert qw.shape == (48, 512)
    assert qw.group_size == 32
    assert qw.bits == {"Q8_0": 8, "Q5_0": 5, "Q5_1": 5, "Q5_K": 5}.get(qtype, 4)
    np.testing.assert_array_equal(np.array(qw.dequantize()), reference)  # bit for bit
    # and the quantized matmul runs on the packed weights
    x = rng.standard_normal((3, 512)).astype(np.float32)
    y = mx.quantized_matmul(
        mx.array(x), qw.weight, qw.scales, qw.biases, transpose=True, group_size=32, bits=qw.bits
    )
    np.testing.assert_allclose(np.array(y), x @ reference.T, rtol=1e-4, atol=1e-3)


def _write_types(path: Path, types: list[str]) -> dict[str, np.ndarray]:
    import gguf

    rng = np.random.default_rng(5)
    writer = gguf.GGUFWriter(str(path), "llama")
    refs = {}
    for t in types:
        data = rng.standard_normal((16, 256)).astype(np.float32)
        if t == "F32":
            writer.add_tensor(t, data)
            refs[t] = data
            continue
        raw = quantize(data, QT[t])  # f16 / bf16 bits / block bytes
        writer.add_tensor(t, raw, raw_dtype=QT[t])
        if t == "F16":
            refs[t] = raw.astype(np.float32)
        elif t == "BF16":
            refs[t] = bf16_to_f32(raw)
        else:
            refs[t] = gguf_dequantize(raw.reshape(-1).view(np.uint8), QT[t]).reshape(16, 256)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return refs


def test_gguf_file_types_load_quantized_or_dense(tmp_path: Path) -> None:
    types = [*EXACT_TYPES, "Q6_K", "Q3_K", "Q2_K", "F16", "BF16", "F32"]
    refs = _write_types(tmp_path / "types.gguf", types)
    tensors = GGUFTensors(tmp_path / "types.gguf")
    for t in types:
        m = tensors.matrix(t, mx.float32)
        # sub-blocks of 16 (Q2_K, Q3_K, Q6_K) have no exact MLX form: dequantized, still exact in fp32
        assert isinstance(m, QuantizedWeight) == (t in EXACT), t
        got = np.array(m.dequantize() if isinstance(m, QuantizedWeight) else m)
        np.testing.assert_array_equal(got, refs[t], err_msg=t)


# ---- the model against the torch engine's dequantized reference ------------------------------------
def _logits_pair(path: Path, tokens: list[int]) -> tuple[np.ndarray, np.ndarray]:
    torch = pytest.importorskip("torch")
    from localrt.backends.torch.gguf_load import GGUFTensors as TorchTensors
    from localrt.backends.torch.llama import DenseCausal
    from localrt.backends.torch.llama import Transformer as TorchTransformer

    model = Transformer(GGUFTensors(path), mx.float32)
    got = np.array(model(mx.array(tokens), make_caches(model.cfg.block_count, "f32")))
    ref_model = TorchTransformer.from_gguf(TorchTensors(path), torch.float32, "cpu")
    with torch.inference_mode():
        ref = ref_model(torch.tensor(tokens), DenseCausal(len(tokens))).numpy()
    return got, ref


@pytest.mark.parametrize(
    "arch,weight_type,tied", [("llama", "Q4_K", True), ("qwen2", "Q8_0", False), ("llama", "Q6_K", False)]
)
def test_model_matches_the_dequantized_reference(
    tmp_path: Path, arch: str, weight_type: str, tied: bool
) -> None:
    path = write_random_model(
        tmp_path / "m.gguf",
        arch=arch,
        n_embd=256,
        n_ff=512,
        n_head=4,
        n_head_kv=2,
        weight_type=weight_type,
        tied=tied,
        seed=1,
    )
    tokens = np.random.default_rng(0).integers(0, 96, 24).tolist()
    got, ref = _logits_pair(path, tokens)
    assert got.shape == ref.shape == (24, 96)
    np.testing.assert_allclose(got, ref, atol=2e-3 * np.abs(ref).max())
    assert (got.argmax(-1) == ref.argmax(-1)).all()


# ---- caches --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Transformer:
    path = write_random_model(
        tmp_path_factory.mktemp("mlx") / "tiny.gguf",
        n_vocab=96,
        n_embd=128,
        weight_type="Q4_0",
        context_length=1024,
        seed=2,
    )  # head_dim 32: one 8-bit KV group
    return Transformer(GGUFTensors(path), mx.float32)


def _feed(model: Transformer, caches: list, tokens: list[int]) -> np.ndarray:
    return np.array(model(mx.array(tokens), caches))


def test_chunked_prefill_past_the_growth_step_matches_one_pass(tiny: Transformer) -> None:
    tokens = np.random.default_rng(1).integers(0, 96, STEP + 44).tolist()
    whole = _feed(tiny, make_caches(2, "f32"), tokens)
    caches = make_caches(2, "f32")
    parts = [_feed(tiny, caches, tokens[s : s + 37]) for s in range(0, len(tokens), 37)]
    assert caches[0].offset == len(tokens)
    assert caches[0].keys.shape[2] == 2 * STEP
    np.testing.assert_allclose(np.concatenate(parts), whole, atol=1e-4)


def test_trim_forgets_the_tail(tiny: Transformer) -> None:
    rng = np.random.default_rng(2)
    prefix, a, b = (rng.integers(0, 96, n).tolist() for n in (30, 6, 6))
    caches = make_caches(2, "f16")
    _feed(tiny, caches, prefix + a)
    for c in caches:
        assert c.trim(len(a)) == len(a)
    after_trim = _feed(tiny, caches, b)
    fresh = _feed(tiny, make_caches(2, "f16"), prefix + b)[-len(b) :]
    np.testing.assert_allclose(after_trim, fresh, atol=1e-4)


def test_8bit_kv_cache_stays_close_and_is_smaller(tiny: Transformer) -> None:
    tokens = np.random.default_rng(3).integers(0, 96, 80).tolist()
    exact_caches, q8_caches = make_caches(2, "f32"), make_caches(2, "q8_0")
    exact = _feed(tiny, exact_caches, tokens[:50])
    q8 = _feed(tiny, q8_caches, tokens[:50])
    exact = np.concatenate(
        [exact, _feed(tiny, exact_caches, tokens[50:51]), _feed(tiny, exact_caches, tokens[51:])]
    )
    q8 = np.concatenate([q8, _feed(tiny, q8_caches, tokens[50:51]), _feed(tiny, q8_caches, tokens[51:])])
    assert np.abs(q8 - exact).max() < 0.02 * np.abs(exact).max()
    assert (q8.argmax(-1) == exact.argmax(-1)).mean() >= 0.95
    # 8 bits + a float32 scale and bias per 32 values: 40/128 of an fp32 cache (the f16 cache is 64/128)
    assert q8_caches[0].nbytes == pytest.approx(exact_caches[0].nbytes * 40 / 128)
    for c in q8_caches:
        c.trim(10)
    np.testing.assert_allclose(_feed(tiny, q8_caches, tokens[70:]), q8[70:], atol=1e-5)  # trim then refeed


def _engine(model: Transformer, kv: str) -> Engine:
    """One row at a time, prompts in chunks of 16, finished conversations kept in the prompt cache."""
    return Engine(kv, 16, model, prompt_cache=PromptCache(1 << 30))


def _run(engine: Engine, prompt: list[int], n: int) -> tuple[list[int], int]:
    """A greedy request's output and how many prompt tokens it evaluated."""
    row = engine.new_row(prompt, RowSampler(SamplingParams(temperature=0.0), 1024), len(prompt) + n)
    engine.run([row])
    return row.output, row.prompt_eval_count


@pytest.mark.parametrize("kv", ["f16", "q8_0"])
def test_prefix_reuse_recomputes_only_the_new_turn(tiny: Transformer, kv: str) -> None:
    rng = np.random.default_rng(4)
    first = rng.integers(0, 96, 40).tolist()
    engine = _engine(tiny, kv)
    answer, evaluated = _run(engine, first, 8)
    assert evaluated == len(first)
    assert len(answer) == 8
    follow_up = rng.integers(0, 96, 9).tolist()
    second = first + answer + follow_up
    again, evaluated = _run(engine, second, 8)
    assert evaluated == len(follow_up) + 1  # the last answer token was sampled, never fed
    assert again == _run(_engine(tiny, kv), second, 8)[0]  # same as from scratch
    # a different conversation shares nothing past the common start
    other = first[:10] + rng.integers(0, 96, 5).tolist()
    assert _run(engine, other, 2)[1] == 5
