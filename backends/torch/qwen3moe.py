"""Qwen3-MoE (GGUF architecture `qwen3moe`): Qwen3's attention block (`llama.py`) with a mixture of
experts in place of every layer's MLP, as llama.cpp's qwen3moe graph computes it.

Routing, per token x: p = softmax(W_router x) over all experts; the top k (`expert_used_count`) are
kept with weights p[selected] / max(sum of them, 2^-14) (llama.cpp always renormalises for this
family, whatever the checkpoint's `norm_topk_prob` said); each chosen expert e adds
w_e * W_down_e(silu(W_gate_e x) * W_up_e x). No shared expert.

The experts are GGUF's 3-D tensors as stored (`ffn_gate_exps` [E, n_ff, dim], `ffn_up_exps`,
`ffn_down_exps` [E, dim, n_ff]). Dispatch is batched: the step's (token, slot) pairs are sorted by
expert, each expert runs once on all of its tokens, and the results are scattered back weighted;
the Python loop is over experts, never over tokens.

OLMoE (GGUF architecture `olmoe`) is served by the same code: its graph in llama.cpp differs only in
that the top-k weights are NOT renormalised (p[selected] as they are), the q/k RMS norms run over the
whole projection (one weight of n_head * head_dim) before it is split into heads, and the experts
are `feed_forward_length` wide.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from localrt.backends.family_config import llama_like_config
from localrt.errors import LocalrtError

from .llama import Block
from .llama import LlamaConfig
from .llama import RMSNorm
from .llama import Rotary
from .llama import Transformer
from .llama import vocab_size_of

ARCH = "qwen3moe"
MIN_WEIGHT_SUM = 6.103515625e-5  # llama.cpp's floor for the renormalising sum (the smallest normal f16)


@dataclass(frozen=True)
class ExpertShape:
    """A layer's routed experts, as the file's metadata gives them."""

    count: int  # experts per layer (`expert_count`)
    used: int  # experts each token is routed to (`expert_used_count`)
    width: int  # each expert's hidden size


class Experts(nn.Module):
    """One 3-D expert tensor, named as GGUF names it (`blk.N.ffn_gate_exps.weight`)."""

    def __init__(self, n_expert: int, rows: int, cols: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_expert, rows, cols), requires_grad=False)


class WholeProjectionRMSNorm(RMSNorm):
    """OLMoE's q/k norm: one RMS norm over all heads of a token ([N, H, D] in, normalised over H * D)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.flatten(-2)).view_as(x)


class MoEBlock(Block):
    def __init__(self, cfg: LlamaConfig, layer: int, experts: ExpertShape, renormalise: bool = True) -> None:
        super().__init__(cfg, layer, qkv_bias=False, qk_norm=True)
        del self.ffn_gate_up, self.ffn_down  # the dense MLP is not used by this family
        dim, n_expert, n_ff = cfg.embedding_length, experts.count, experts.width
        self.n_used = experts.used
        self.renormalise = renormalise  # the top-k weights divided by their sum (qwen3moe; not olmoe)
        self.ffn_gate_inp = nn.Linear(dim, n_expert, bias=False)  # the router
        self.ffn_gate_exps = Experts(n_expert, n_ff, dim)
        self.ffn_up_exps = Experts(n_expert, n_ff, dim)
        self.ffn_down_exps = Experts(n_expert, dim, n_ff)

    def feed_forward(self, x: torch.Tensor) -> torch.Tensor:
        n, k = x.shape[0], self.n_used
        probs = torch.softmax(self.ffn_gate_inp(x).float(), -1)  # [N, E]
        weights, chosen = probs.topk(k, -1)  # [N, k] each
        if self.renormalise:
            weights = weights / weights.sum(-1, keepdim=True).clamp(min=MIN_WEIGHT_SUM)
        flat = chosen.reshape(-1)  # [N * k] expert of each (token, slot)
        order = torch.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert
        counts = torch.bincount(flat, minlength=probs.shape[1]).tolist()  # one host sync per layer
        token = order // k  # [N * k] token of each grouped pair
        xs = x[token]  # [N * k, dim]
        ys = torch.empty_like(xs)
        start = 0
        for e, count in enumerate(counts):
            if count == 0:
                continue
            rows = slice(start, start + count)
            gate = xs[rows] @ self.ffn_gate_exps.weight[e].T  # [count, n_ff]
            up = xs[rows] @ self.ffn_up_exps.weight[e].T
            ys[rows] = (F.silu(gate) * up) @ self.ffn_down_exps.weight[e].T  # [count, dim]
            start += count
        ys = ys * weights.reshape(-1)[order, None].to(ys.dtype)
        return torch.zeros(n, x.shape[1], dtype=ys.dtype, device=x.device).index_add_(0, token, ys)


class Qwen3MoE(Transformer):
    arch = ARCH

    def __init__(self, cfg: LlamaConfig, experts: ExpertShape) -> None:
        super().__init__(cfg, qk_norm=True)
        self.blk = nn.ModuleList(MoEBlock(cfg, i, experts) for i in range(cfg.block_count))

    @classmethod
    def expert_width(cls, md: dict[str, Any], cfg: LlamaConfig, n_used: int) -> int:
        return int(md.get(f"{cls.arch}.expert_feed_forward_length", cfg.feed_forward_length // n_used))

    @classmethod
    def of_file(cls, tensors: Any) -> Qwen3MoE:
        md, arch = tensors.metadata, cls.arch
        cfg = llama_like_config(md, vocab_size_of(tensors), arch)
        n_expert = int(md.get(f"{arch}.expert_count", 0))
        n_used = int(md.get(f"{arch}.expert_used_count", 0))
        if not 0 < n_used <= n_expert:
            raise LocalrtError(f"GGUF metadata {arch}.expert_count / expert_used_count are missing or wrong")
        return cls(cfg, ExpertShape(n_expert, n_used, cls.expert_width(md, cfg, n_used)))

    def finish(self, tensors: Any, device: torch.device | str) -> None:
        self.rotary = Rotary(self.cfg).to(device)  # real buffers, off the meta device (no frequency factors)


class OLMoE(Qwen3MoE):
    """OLMoE: the routed block without renormalisation, q/k norms over the whole projection."""

    arch = "olmoe"

    def __init__(self, cfg: LlamaConfig, experts: ExpertShape) -> None:
        super().__init__(cfg, experts)
        eps, width = cfg.attention_layer_norm_rms_epsilon, cfg.attention_key_length
        for i in range(cfg.block_count):
            block = MoEBlock(cfg, i, experts, renormalise=False)
            block.attn_q_norm = WholeProjectionRMSNorm(cfg.attention_head_count * width, eps)
            block.attn_k_norm = WholeProjectionRMSNorm(cfg.attention_head_count_kv * width, eps)
            self.blk[i] = block

    @classmethod
    def expert_width(cls, md: dict[str, Any], cfg: LlamaConfig, n_used: int) -> int:
        return cfg.feed_forward_length  # llama.cpp's olmoe experts use n_ff
