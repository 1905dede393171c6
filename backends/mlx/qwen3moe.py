"""Qwen3-MoE in MLX (GGUF architecture `qwen3moe`): Qwen3's attention block (`llama.py`) with a mixture
of experts in place of every layer's MLP, as llama.cpp's qwen3moe graph computes it.

Routing, per token x: p = softmax(W_router x) over all experts; the top k (`expert_used_count`) are
kept with weights p[selected] / max(sum of them, 2^-14) (llama.cpp always renormalises for this
family); each chosen expert e adds w_e * W_down_e(silu(W_gate_e x) * W_up_e x). No shared expert.

The experts are GGUF's 3-D tensors (`ffn_gate_exps` [E, n_ff, dim], `ffn_up_exps`, `ffn_down_exps`
[E, dim, n_ff]), kept MLX-quantized where the type has an exact form. Dispatch is one gathered
matrix product per tensor for the whole step (`mx.gather_qmm` / `mx.gather_mm`: each (token, slot)
pair multiplies its expert's matrix); from SORT_FROM pairs on, the pairs are sorted by expert first
so each expert's rows run together. No Python loop over tokens or experts.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from localrt.backends.family_config import llama_like_config
from localrt.backends.llama_config import LlamaConfig
from localrt.errors import LocalrtError

from .gguf_load import GGUFTensors
from .gguf_load import QuantizedWeight
from .llama import Block
from .llama import Linear
from .llama import Transformer
from .llama import silu

ARCH = "qwen3moe"
MIN_WEIGHT_SUM = 6.103515625e-5  # llama.cpp's floor for the renormalising sum (the smallest normal f16)
SORT_FROM = 64  # (token, slot) pairs from which they are grouped by expert before the products


def gathered(x: mx.array, w: QuantizedWeight | mx.array, experts: mx.array, is_sorted: bool) -> mx.array:
    """x [..., 1, in] times each pair's expert matrix w[e] [out, in] -> [..., 1, out]."""
    if isinstance(w, QuantizedWeight):
        return mx.gather_qmm(
            x, *w.packed, rhs_indices=experts, transpose=True, sorted_indices=is_sorted, **w.layout
        )
    return mx.gather_mm(x, w.swapaxes(-1, -2), rhs_indices=experts, sorted_indices=is_sorted)


class MoEBlock(Block):
    n_used: int

    def load_feed_forward(self, t: GGUFTensors, p: str, dtype: mx.Dtype) -> None:
        self.ffn_gate_inp = Linear(t.dense(p + "ffn_gate_inp.weight", mx.float32))  # the router, fp32
        self.ffn_gate_exps = t.experts(p + "ffn_gate_exps.weight", dtype)
        self.ffn_up_exps = t.experts(p + "ffn_up_exps.weight", dtype)
        self.ffn_down_exps = t.experts(p + "ffn_down_exps.weight", dtype)

    def feed_forward(self, h: mx.array) -> mx.array:
        _, n, dim = h.shape
        k = self.n_used
        x = h.reshape(n, dim)
        probs = mx.softmax(self.ffn_gate_inp(x.astype(mx.float32)), axis=-1, precise=True)  # [N, E]
        chosen = mx.argpartition(-probs, kth=k - 1, axis=-1)[:, :k]  # [N, k]
        weights = mx.take_along_axis(probs, chosen, axis=-1)
        weights = weights / mx.maximum(weights.sum(-1, keepdims=True), MIN_WEIGHT_SUM)
        if n * k >= SORT_FROM:  # each expert's pairs together
            flat = chosen.reshape(-1)
            order = mx.argsort(flat)
            xs = x[order // k][:, None]  # [N*k, 1, dim]
            ys = self._experts(xs, flat[order], True)  # [N*k, 1, dim]
            ys = ys[mx.argsort(order)].reshape(n, k, dim)
        else:
            ys = self._experts(x[:, None, None], chosen, False).reshape(
                n, k, dim
            )  # [N, k, 1, dim] -> [N, k, dim]
        out = (ys * weights[..., None].astype(ys.dtype)).sum(axis=1)  # [N, dim]
        return out.reshape(1, n, dim)

    def _experts(self, x: mx.array, experts: mx.array, is_sorted: bool) -> mx.array:
        gate = gathered(x, self.ffn_gate_exps, experts, is_sorted)
        up = gathered(x, self.ffn_up_exps, experts, is_sorted)
        return gathered(silu(gate) * up, self.ffn_down_exps, experts, is_sorted)


class Qwen3MoE(Transformer):
    block_class = MoEBlock

    def read_config(self, metadata: dict[str, Any], vocab_size: int) -> LlamaConfig:
        cfg = llama_like_config(metadata, vocab_size, ARCH)
        n_expert = int(metadata.get(f"{ARCH}.expert_count", 0))
        self.n_used = int(metadata.get(f"{ARCH}.expert_used_count", 0))
        if not 0 < self.n_used <= n_expert:
            raise LocalrtError(f"GGUF metadata {ARCH}.expert_count / expert_used_count are missing or wrong")
        return cfg

    def make_block(self, t: GGUFTensors, i: int) -> Block:
        block = super().make_block(t, i)
        block.n_used = self.n_used  # type: ignore[attr-defined]
        return block
