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
from localrt.backends.torch.gguf_load import DEQUANTIZERS, GGUFTensors  # noqa: E402
from tests.test_torch_model import F16_FIELDS, write_kquant_llama  # noqa: E402

BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q4_K": 144}
BLOCK_ELEMS = {"Q4_0": 32, "Q4_1": 32, "Q4_K": 256}


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
    """Q4_K_M-style attn_v in Q6_K: q and k stay int4, v goes to int8, one module runs both."""
    path = write_kquant_llama(tmp_path / "mixed.gguf", {"attn_v": "Q6_K"}, seed=5)
    forced = TorchModel(path, LoadOptions(num_ctx=128, num_thread=1, num_parallel=1), numerics="quantized")
    try:
        assert "Concat" in {type(module).__name__ for module in forced.model.modules()}
    finally:
        forced.unload()


def test_kv_pool_is_num_ctx_times_parallel_sequences(tmp_path: Path) -> None:
    path = write_kquant_llama(tmp_path / "q4k.gguf", {}, seed=6)
    m = TorchModel(path, LoadOptions(num_ctx=96, num_thread=1, num_parallel=3))
    try:
        assert m.engine.pool.num_blocks == 3 * 96 // m.engine.pool.block_size
    finally:
        m.unload()
