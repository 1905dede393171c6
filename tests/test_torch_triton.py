"""The fused Triton paged-attention kernel (the CUDA decode path), run on the CPU by Triton's interpreter
and compared with the gather path."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton decorates the kernel
torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from localrt.backends.torch.attention import PagedAttention  # noqa: E402
from localrt.backends.torch.attention import SeqChunk  # noqa: E402
from localrt.backends.torch.kv_cache import KVCache  # noqa: E402
from localrt.backends.torch.llama import LlamaConfig  # noqa: E402
from localrt.backends.torch.llama import random_transformer  # noqa: E402

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
    reason="Triton needs a GPU or its interpreter",
)


@pytest.mark.parametrize("kv_type", ["f32", "f16", "bf16", "q8_0"])
def test_fused_decode_equals_gather_path(kv_type: str) -> None:
    """A decode step for sequences of different lengths, scattered blocks, GQA (4 query heads per KV head)."""
    model = random_transformer(LlamaConfig("llama", 64, 256, 64, 128, 2, 8, 2, 8), seed=3)
    lengths = [5, 33, 16, 47]
    tables = [[3, 7, 30, 31], [1, 2, 9, 10], [4, 5, 11, 12], [13, 14, 15, 20]]
    prompts = [torch.randint(0, 64, (n,), generator=torch.Generator().manual_seed(n)) for n in lengths]
    logits = {}
    for fused in (False, True):
        cache = KVCache(2, 32, 2, 8, kv_type, torch.float32, "cpu")
        with torch.inference_mode():
            prefill = [SeqChunk(n - 1, n - 1, t) for n, t in zip(lengths, tables)]
            model(torch.cat([p[:-1] for p in prompts]), PagedAttention(cache, prefill, "cpu", fused=fused))
            decode = [SeqChunk(1, n, t) for n, t in zip(lengths, tables)]
            logits[fused] = model(
                torch.stack([p[-1] for p in prompts]), PagedAttention(cache, decode, "cpu", fused=fused)
            )
    torch.testing.assert_close(logits[True], logits[False], atol=1e-4, rtol=1e-4)
