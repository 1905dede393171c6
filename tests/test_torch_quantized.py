"""Weights that stay quantized on the CPU (backends/torch/quantized.py): GGUF's 4-bit blocks map onto
torch's int4 kernel without requantizing, the kernels multiply by those weights, and a loaded model
keeps its resident weights within 1.5x the GGUF's tensor bytes."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("llama_cpp")

from localrt.backends.base import LoadOptions  # noqa: E402
from localrt.backends.torch import quantized  # noqa: E402
from localrt.backends.torch.backend import TorchModel  # noqa: E402
from localrt.backends.torch.gguf_load import DEQUANTIZERS  # noqa: E402
from localrt.backends.torch.gguf_load import GGUFTensors  # noqa: E402
from tests.test_torch_llama import F16_FIELDS  # noqa: E402
from tests.test_torch_llama import write_kquant_llama  # noqa: E402

BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q4_K": 144, "Q6_K": 210, **quantized.PAIR_BLOCK_BYTES}
BLOCK_ELEMS = {"Q4_0": 32, "Q4_1": 32, "Q4_K": 256, "Q6_K": 256, "Q8_0": 32, "Q5_0": 32, "Q5_1": 32}


def random_blocks(qtype: str, rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """Any payload bits with finite fp16 scales are a valid block."""
    rng = np.random.default_rng(seed)
    n_blocks = rows * cols // BLOCK_ELEMS[qtype]
    raw = rng.integers(0, 256, (n_blocks, BLOCK_BYTES[qtype]), dtype=np.uint8)
    for offset in F16_FIELDS[qtype]:
        raw[:, offset : offset + 2] = (
            rng.uniform(0.001, 0.05, (n_blocks, 1)).astype(np.float16).view(np.uint8)
        )
    return torch.from_numpy(raw.reshape(-1))


@pytest.mark.parametrize("qtype", quantized.INT4_TYPES)
def test_int4_groups_are_the_dequantized_weights(qtype: str) -> None:
    rows, cols = 8, 512
    raw = random_blocks(qtype, rows, cols)
    q, scale, zero = quantized.int4_groups(raw, qtype, rows, cols)
    assert int(q.min()) >= 0
    assert int(q.max()) <= 15
    mapped = ((q.float() - 8).view(rows, -1, 32) * scale[..., None] + zero[..., None]).view(rows, cols)
    reference = DEQUANTIZERS[qtype](raw.view(-1, BLOCK_BYTES[qtype])).reshape(rows, cols)
    # exact but for the zero's one fp32 rounding (Q4_1: m + 8d; Q4_K: 8 d sc - dmin m)
    torch.testing.assert_close(mapped, reference, rtol=0, atol=1e-6 * float(reference.abs().max()))


@pytest.mark.parametrize("qtype", quantized.INT4_TYPES)
def test_int4_linear_multiplies_by_those_weights(qtype: str) -> None:
    rows, cols = 64, 512
    raw = random_blocks(qtype, rows, cols, seed=1)
    q, scale, zero = quantized.int4_groups(raw, qtype, rows, cols)
    linear = quantized.Int4Linear(q, scale, zero, None)
    # the kernel keeps scales and zeros in bf16: the weights it means are these
    w = (q.float() - 8).view(rows, -1, 32) * scale.bfloat16().float()[..., None] + zero.bfloat16().float()[
        ..., None
    ]
    x = torch.randn(5, cols, generator=torch.Generator().manual_seed(2))
    got, want = linear(x), x @ w.view(rows, cols).T
    torch.testing.assert_close(got, want, rtol=0, atol=1e-2 * float(want.abs().max()))  # bf16 outputs


def test_int8_linear_is_the_row_requantization() -> None:
    w = torch.randn(48, 256, generator=torch.Generator().manual_seed(3))
    q, scale = quantized.int8_rows(w)
    assert float((q.float() * scale[:, None] - w).abs().max()) <= 0.5 * float(scale.max()) + 1e-6
    linear = quantized.Int8Linear(q, scale, None)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(4))
    want = x @ (q.float() * scale.bfloat16().float()[:, None]).T
    torch.testing.assert_close(linear(x), want, rtol=0, atol=1e-2 * float(want.abs().max()))


def tensor_bytes(path: Path) -> int:
    return sum(t.n_bytes for t in GGUFTensors(path).info.tensors)


def test_q4_k_model_stays_quantized_close_and_small(tmp_path: Path) -> None:
    """A tiny all-Q4_K Llama (its own head): int4 everywhere, scores close to the exact fp32 path."""
    path = write_kquant_llama(tmp_path / "q4k.gguf", {"token_embd": "Q4_K"}, seed=4)
    tokens = [1, *np.random.default_rng(0).integers(5, 250, 40).tolist()]
    logits = {}
    for numerics in ("quantized", "exact"):
        m = TorchModel(path, LoadOptions(num_ctx=128, num_thread=1, num_parallel=2), numerics=numerics)
        try:
            kinds = {type(module).__name__ for module in m.model.modules()}
            if numerics == "quantized":
                assert "Int4Linear" in kinds
                assert "Linear" not in kinds
                assert m.weight_bytes() <= 1.5 * tensor_bytes(path)
            else:
                assert m.weight_bytes() > 4 * tensor_bytes(path)  # fp32: about 7x a 4.5-bit file
            assert m.memory_bytes == m.weight_bytes() + m.engine.cache.nbytes
            logits[numerics] = asyncio.run(m.score(tokens, return_logits=True)).logits
        finally:
            m.unload()
    diff = np.abs(logits["quantized"] - logits["exact"]).max()
    assert diff < 0.02 * np.abs(logits["exact"]).max(), diff


def test_mixed_fused_linears_are_concatenated(tmp_path: Path) -> None:
    """Q4_K_M-style attn_v in Q6_K: q and k stay int4, v goes to two int4 planes with scales per
    half-group, one module runs both."""
    path = write_kquant_llama(tmp_path / "mixed.gguf", {"attn_v": "Q6_K"}, seed=5)
    forced = TorchModel(path, LoadOptions(num_ctx=128, num_thread=1, num_parallel=1), numerics="quantized")
    try:
        modules = list(forced.model.modules())
        assert "Concat" in {type(module).__name__ for module in modules}
        assert {m.halves for m in modules if isinstance(m, quantized.Int4Linear)} == {False, True}
    finally:
        forced.unload()


def test_kv_pool_is_num_ctx_times_parallel_sequences(tmp_path: Path) -> None:
    path = write_kquant_llama(tmp_path / "q4k.gguf", {}, seed=6)
    m = TorchModel(path, LoadOptions(num_ctx=96, num_thread=1, num_parallel=3))
    try:
        assert m.engine.pool.num_blocks == 3 * 96 // m.engine.pool.block_size
    finally:
        m.unload()


@pytest.mark.parametrize("qtype", quantized.PAIR_TYPES)
def test_pair_planes_are_the_dequantized_weights(qtype: str) -> None:
    """Q8_0 / Q5_0 / Q5_1 blocks as two int4 planes: high (scale 16d, zero 0) + low (scale d, zero
    8d + m) give back the file's weights, and the two-plane linear multiplies by them."""
    rows, cols = 16, 256
    raw = random_blocks(qtype, rows, cols, seed=7)
    q, scale, zero = quantized.pair_groups(raw, qtype, rows, cols)
    assert int(q.min()) >= 0
    assert int(q.max()) <= 15
    planes = ((q.float() - 8).view(2 * rows, -1, 32) * scale[..., None] + zero[..., None]).view(
        2 * rows, cols
    )
    mapped = planes[:rows] + planes[rows:]
    reference = DEQUANTIZERS[qtype](raw.view(-1, quantized.PAIR_BLOCK_BYTES[qtype])).reshape(rows, cols)
    torch.testing.assert_close(mapped, reference, rtol=0, atol=1e-6 * float(reference.abs().max()))
    linear = quantized.Int4Linear(q, scale, zero, None, planes=2)
    x = torch.randn(4, cols, generator=torch.Generator().manual_seed(8))
    want = x @ reference.T
    torch.testing.assert_close(linear(x), want, rtol=0, atol=2e-2 * float(want.abs().max()))


def test_q6_k_planes_are_the_dequantized_weights() -> None:
    """Q6_K's sub-blocks of 16 as two int4 planes (high 2a + 5 under 8s + low b under s) with a
    scale set per half of each 32-group: every q a nibble, and each half's weights are exactly the
    file's under its own scales."""
    rows, cols = 16, 512
    raw = random_blocks("Q6_K", rows, cols, seed=9)
    q, scale, zero = quantized.q6_k_groups(raw, rows, cols)
    assert int(q.min()) >= 0
    assert int(q.max()) <= 15
    planes = (q.float() - 8).view(2 * rows, -1, 2, 16) * scale.permute(1, 2, 0)[..., None]
    planes = planes + zero.permute(1, 2, 0)[..., None]  # [2 * rows, groups, half, 16]
    mapped = (planes[:rows] + planes[rows:]).reshape(rows, cols)
    assert torch.equal(mapped, DEQUANTIZERS["Q6_K"](raw.view(-1, 210)).reshape(rows, cols))


def test_q6_k_linear_multiplies_by_those_weights() -> None:
    """The halves-wise linear against the planes' own weights (the kernel's bf16 scales), and its
    rounding stays far below that of the per-row int8 requantization it replaces."""
    rows, cols = 48, 512
    raw = random_blocks("Q6_K", rows, cols, seed=10)
    q, scale, zero = quantized.q6_k_groups(raw, rows, cols)
    linear = quantized.Int4Linear(q, scale, zero, None, planes=2)
    halves = (q.float() - 8).view(2 * rows, -1, 2, 16) * scale.bfloat16().float().permute(1, 2, 0)[..., None]
    w = (halves[:rows] + halves[rows:]).reshape(rows, cols)
    x = torch.randn(5, cols, generator=torch.Generator().manual_seed(11))
    got, want = linear(x), x @ w.T
    torch.testing.assert_close(got, want, rtol=0, atol=1e-2 * float(want.abs().max()))  # bf16 outputs
    weights = DEQUANTIZERS["Q6_K"](raw.view(-1, 210)).reshape(rows, cols)
    exact, int8 = x @ weights.T, quantized.Int8Linear(*quantized.int8_rows(weights), None)(x)
    assert float((got - exact).norm()) < 0.5 * float((int8 - exact).norm())


def test_cpu_default_keeps_q8_0_quantized(tmp_path: Path) -> None:
    """The default load on the CPU keeps a Q8_0 file in two int4 planes (no dense linear left), within
    1.5x the file's tensor bytes, and scores close to the dequantized fp32 weights."""
    path = write_kquant_llama(tmp_path / "q8.gguf", {"": "Q8_0"}, seed=9)
    tokens = [1, *np.random.default_rng(1).integers(5, 250, 40).tolist()]
    logits = {}
    for numerics in ("auto", "dequantized"):
        opts = LoadOptions(num_ctx=128, num_thread=1, num_parallel=2, numerics=numerics)
        m = TorchModel(path, opts)
        try:
            kinds = {type(module).__name__ for module in m.model.modules()}
            if numerics == "auto":
                assert m.numerics == "quantized"
                assert "Int4Linear" in kinds
                assert "Linear" not in kinds
                assert m.weight_bytes() <= 1.5 * tensor_bytes(path)
            else:
                assert m.numerics == "dequantized"
                assert "Int4Linear" not in kinds
            logits[numerics] = asyncio.run(m.score(tokens, return_logits=True)).logits
        finally:
            m.unload()
    diff = np.abs(logits["auto"] - logits["dequantized"]).max()
    assert diff < 0.02 * np.abs(logits["dequantized"]).max(), diff


def test_float_file_falls_back_to_dequantized(tmp_path: Path) -> None:
    """An F32 file has nothing to keep quantized: the default load is the dequantized path, said so,
    with the same logits as asking for it."""
    path = write_kquant_llama(tmp_path / "f32.gguf", {}, seed=10, dequantized=True)
    tokens = [1, *np.random.default_rng(2).integers(5, 250, 30).tolist()]
    logits = []
    for numerics in ("auto", "dequantized"):
        m = TorchModel(path, LoadOptions(num_ctx=128, num_thread=1, num_parallel=1, numerics=numerics))
        try:
            assert m.numerics == "dequantized"
            assert "Int4Linear" not in {type(module).__name__ for module in m.model.modules()}
            logits.append(asyncio.run(m.score(tokens, return_logits=True)).logits)
        finally:
            m.unload()
    np.testing.assert_array_equal(logits[0], logits[1])


def test_numerics_is_a_load_option() -> None:
    """`numerics` from a request or a Modelfile reaches the backend's load options; a bad value is
    refused naming the option and its values."""
    from localrt.errors import OptionError
    from localrt.runtime.options import Options

    assert Options.merge().load_options().numerics == "auto"
    assert Options.merge({"numerics": "dequantized"}).load_options().numerics == "dequantized"
    assert Options.merge({"numerics": "Exact"}, lenient=(True,)).load_options().numerics == "exact"
    with pytest.raises(OptionError, match="option 'numerics' must be one of auto, quantized"):
        Options.merge({"numerics": "fast"})


def test_ps_reports_the_numerics_and_the_weights(models_dir: Path, smollm2_gguf: Path) -> None:
    """The runtime's ps rows carry the torch engine's numerics and resident weight bytes; changing
    the option reloads the model."""
    from localrt.runtime.front import Runtime
    from localrt.store.store import Store
    from tests.test_runtime import FRANCE
    from tests.test_runtime import collect
    from tests.test_runtime import import_model

    store = Store(models_dir)
    import_model(store, "smollm2:135m", smollm2_gguf)

    async def scenario() -> list[dict]:
        rt = Runtime(store)
        seen = []
        try:
            for numerics in ("auto", "dequantized"):
                options = {"backend": "torch", "num_predict": 2, "numerics": numerics}
                await collect(rt.chat("smollm2:135m", FRANCE, options=options))
                (row,) = rt.ps()
                seen.append(row.details)
        finally:
            await rt.close()
        return seen

    quantized_row, dense_row = asyncio.run(scenario())
    assert quantized_row["numerics"] == "quantized"
    assert dense_row["numerics"] == "dequantized"
    assert quantized_row["weight_bytes"] <= 1.5 * tensor_bytes(smollm2_gguf)
    assert dense_row["weight_bytes"] > 4 * tensor_bytes(smollm2_gguf)
