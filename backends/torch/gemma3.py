"""Gemma 3 (text), read straight from GGUF (GGUF architecture `gemma3`).

What differs from the Llama file (`model.py`), as llama.cpp's gemma3 graph computes it:
- Five sliding-window layers for each global one: layer i slides iff i % period < period - 1 (period
  6 unless the file says otherwise); a sliding layer's query at p sees keys p - window + 1 .. p.
- Two RoPE bases: `rope.freq_base` for global layers (with the file's linear scaling, if any),
  `rope.freq_base_swa` for sliding ones (never scaled). Rotation pairs are halves (neox).
- q and k are RMS-normed per head before RoPE; attention scale 1/sqrt(head_dim) (27B: 1/sqrt(dim/heads)).
- Sandwich norms: RMSNorm before and after attention and before and after the MLP.
- The embedding is scaled by sqrt(dim); the MLP is GELU(tanh) gated; the head is tied unless the
  file carries `output.weight`; an optional final soft-cap c * tanh(logits / c).
- Norm weights are used as stored: llama.cpp's converter already added Gemma's "1 +" to them.

Module names are GGUF's tensor names, fused like the Llama file's (`attn_qkv`, `ffn_gate_up`), so
the same loader and the same quantized modules serve both.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from localrt.backends.llama_config import llama_fields, metadata_getter
from localrt.errors import LocalrtError

from .model import AttentionContext, LlamaConfig, ModuleFactory, RMSNorm, Rotary, load_weights, vocab_size_of

ARCH = "gemma3"
DEFAULT_SWA_PERIOD = 6  # llama.cpp's default; the converter never writes the pattern
SIZE_27B_LAYERS = 62  # the one size whose attention scale is 1/sqrt(dim / heads)


@dataclass
class Gemma3Config(LlamaConfig):
    sliding_window: int = 0  # tokens a sliding layer's query sees (itself included); 0: no sliding layers
    sliding_layers: tuple[bool, ...] = ()  # per layer: True = sliding window
    rope_freq_base_swa: float = 10000.0
    attention_scale: float = 0.0  # multiplies q.k
    final_logit_softcapping: float = 0.0  # 0: off
    attn_logit_softcapping: float = 0.0  # 0: off (Gemma 2 caps attention scores)
    qk_norm: bool = True  # per-head RMSNorm of q and k (Gemma 2 has none)

    @classmethod
    def from_gguf(cls, metadata: dict[str, Any], vocab_size: int) -> Gemma3Config:  # type: ignore[override]
        return read_config(metadata, vocab_size, GEMMA3)


@dataclass(frozen=True)
class Family:
    """What llama.cpp assumes for a Gemma generation when the file is silent."""

    arch: str
    swa_period: int  # layer i slides iff i % period < period - 1
    window: int  # sliding window when the file has none (0: no sliding layers)
    layers_27b: int  # the 27B size scales attention by 1/sqrt(dim / heads)
    attn_softcap: float
    final_softcap: float
    qk_norm: bool
    swa_base: float | None  # sliding layers' RoPE base when the file has none (None: the global one)


GEMMA3 = Family(ARCH, DEFAULT_SWA_PERIOD, 0, SIZE_27B_LAYERS, 0.0, 0.0, True, 10000.0)


def read_config(metadata: dict[str, Any], vocab_size: int, family: Family) -> Gemma3Config:
    arch = family.arch
    get = metadata_getter(metadata, arch)
    fields = llama_fields(metadata, arch, vocab_size, context_length=131072, eps=None)
    n_layer, n_embd = fields["block_count"], fields["embedding_length"]
    n_head, head_dim = fields["attention_head_count"], fields["attention_key_length"]
    window = int(get("attention.sliding_window", family.window))
    pattern = metadata.get(f"{arch}.attention.sliding_window_pattern", family.swa_period)
    base = fields["rope_freq_base"]
    return Gemma3Config(
        **fields,
        rope_neox=True,
        sliding_window=window,
        sliding_layers=sliding_pattern(pattern, n_layer) if window > 0 else (False,) * n_layer,
        rope_freq_base_swa=float(
            get("rope.freq_base_swa", base if family.swa_base is None else family.swa_base)
        ),
        attention_scale=1 / math.sqrt(n_embd / n_head if n_layer == family.layers_27b else head_dim),
        final_logit_softcapping=float(get("final_logit_softcapping", family.final_softcap)),
        attn_logit_softcapping=float(get("attn_logit_softcapping", family.attn_softcap)),
        qk_norm=family.qk_norm,
    )


def sliding_pattern(pattern: Any, n_layer: int) -> tuple[bool, ...]:
    """Which layers slide: a per-layer bool array as given, else a period n (layer i slides iff
    i % n < n - 1; n = 0: every layer slides, n = 1: none)."""
    if isinstance(pattern, (list, tuple)) or hasattr(pattern, "tolist"):
        flags = [bool(x) for x in (pattern.tolist() if hasattr(pattern, "tolist") else pattern)]
        if len(flags) != n_layer:
            raise LocalrtError(
                f"{ARCH}.attention.sliding_window_pattern has {len(flags)} entries, not {n_layer}"
            )
        return tuple(flags)
    period = DEFAULT_SWA_PERIOD if pattern is None else int(pattern)
    if period == 0:
        return (True,) * n_layer
    return tuple(i % period < period - 1 for i in range(n_layer))


class Block(nn.Module):
    """Sandwich-normed attention and GELU-gated MLP. Attributes carry GGUF's names."""

    def __init__(self, cfg: Gemma3Config, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.window = cfg.sliding_window if cfg.sliding_layers[layer] else 0
        self.n_head, self.n_kv = cfg.attention_head_count, cfg.attention_head_count_kv
        self.head_dim = cfg.attention_key_length
        dim, hidden, eps = cfg.embedding_length, cfg.feed_forward_length, cfg.attention_layer_norm_rms_epsilon
        # the attention context applies SDPA's 1/sqrt(head_dim): q carries the rest of the scale
        self.q_scale = cfg.attention_scale * math.sqrt(self.head_dim)
        self.attn_norm = RMSNorm(dim, eps)
        self.qkv_sizes = [self.n_head * self.head_dim, self.n_kv * self.head_dim, self.n_kv * self.head_dim]
        self.attn_qkv = nn.Linear(dim, sum(self.qkv_sizes), bias=False)
        self.attn_q_norm = RMSNorm(self.head_dim, eps) if cfg.qk_norm else None
        self.attn_k_norm = RMSNorm(self.head_dim, eps) if cfg.qk_norm else None
        self.attend_options: dict[str, Any] = {}  # what the attention context must honour
        if self.window:
            self.attend_options["window"] = self.window
        if cfg.attn_logit_softcapping > 0:
            self.attend_options["softcap"] = cfg.attn_logit_softcapping
        self.attn_output = nn.Linear(self.n_head * self.head_dim, dim, bias=False)
        self.post_attention_norm = RMSNorm(dim, eps)
        self.ffn_norm = RMSNorm(dim, eps)
        self.ffn_gate_up = nn.Linear(dim, 2 * hidden, bias=False)
        self.ffn_down = nn.Linear(hidden, dim, bias=False)
        self.post_ffw_norm = RMSNorm(dim, eps)

    def attention(self, x: torch.Tensor, rotary: Rotary, ctx: AttentionContext) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.attn_qkv(x).split(self.qkv_sizes, -1)
        q = q.view(n, self.n_head, self.head_dim)  # [N, H, D]
        k = k.view(n, self.n_kv, self.head_dim)  # [N, Hkv, D]
        v = v.view(n, self.n_kv, self.head_dim)
        if self.attn_q_norm is not None and self.attn_k_norm is not None:
            q, k = self.attn_q_norm(q), self.attn_k_norm(k)
        qk = rotary(torch.cat([q, k], 1), ctx.positions)  # one rotation for q and k: [N, H + Hkv, D]
        q, k = qk[:, : self.n_head], qk[:, self.n_head :]
        if self.q_scale != 1.0:
            q = q * self.q_scale
        out = ctx.attend(self.layer, q, k, v, **self.attend_options)  # [N, H, D]
        return self.attn_output(out.reshape(n, self.n_head * self.head_dim))

    def feed_forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.ffn_gate_up(x).chunk(2, -1)  # [N, hidden] each
        return self.ffn_down(F.gelu(gate, approximate="tanh") * up)

    def forward(self, x: torch.Tensor, rotary: Rotary, ctx: AttentionContext) -> torch.Tensor:
        x = x + self.post_attention_norm(self.attention(self.attn_norm(x), rotary, ctx))
        return x + self.post_ffw_norm(self.feed_forward(self.ffn_norm(x)))


class Gemma3(nn.Module):
    config_from_gguf = staticmethod(Gemma3Config.from_gguf)

    def __init__(self, cfg: Gemma3Config) -> None:
        super().__init__()
        self.cfg = cfg
        self.token_embd = nn.Embedding(cfg.vocab_size, cfg.embedding_length)
        self.blk = nn.ModuleList(Block(cfg, i) for i in range(cfg.block_count))
        self.output_norm = RMSNorm(cfg.embedding_length, cfg.attention_layer_norm_rms_epsilon)
        self.output = nn.Linear(cfg.embedding_length, cfg.vocab_size, bias=False)
        self.embed_scale = math.sqrt(cfg.embedding_length)  # exact in fp32, as llama.cpp's sqrtf
        self.rotary, self.rotary_swa = _rotaries(cfg)
        _cap_logits(self)

    @property
    def dtype(self) -> torch.dtype:
        return self.output_norm.weight.dtype

    @property
    def windows(self) -> list[int]:
        """Each layer's sliding window in tokens, 0 for the global layers."""
        return [block.window for block in self.blk]  # type: ignore[union-attr]

    def hidden(
        self,
        tokens: torch.Tensor,
        ctx: AttentionContext,
        *,
        num_layers: int | None = None,
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """tokens [N] -> final-normed hidden states [R, dim] of `rows` (all N when None)."""
        x = self.token_embd(tokens) * self.embed_scale  # [N, dim]
        for block in self.blk[: num_layers or len(self.blk)]:
            x = block(x, self.rotary_swa if block.window else self.rotary, ctx)
        if rows is not None:
            x = x[rows]  # [R, dim]
        return self.output_norm(x)

    def forward(
        self,
        tokens: torch.Tensor,
        ctx: AttentionContext,
        *,
        num_layers: int | None = None,
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """tokens [N] -> logits [R, vocab] in float32 (soft-capped by `output` itself, see `_cap_logits`)."""
        return self.output(self.hidden(tokens, ctx, num_layers=num_layers, rows=rows)).float()

    @classmethod
    def from_gguf(
        cls,
        tensors: Any,
        dtype: torch.dtype,
        device: torch.device | str,
        modules: ModuleFactory | None = None,
    ) -> Gemma3:
        cfg = cls.config_from_gguf(tensors.metadata, vocab_size_of(tensors))
        with torch.device("meta"):
            model = cls(cfg)
        load_weights(model, tensors, dtype, device, modules)
        model.rotary, model.rotary_swa = (r.to(device) for r in _rotaries(cfg))  # real buffers, off meta
        _cap_logits(model)  # again: `modules` may have swapped the head
        return model


def _cap_logits(model: Gemma3) -> None:
    """The final soft-cap c * tanh(logits / c) as a hook on the head, so every caller of
    `model.output` (the engine, scoring) gets capped logits."""
    cap = model.cfg.final_logit_softcapping
    head = model.output
    if cap > 0 and not getattr(head, "soft_capped", False):
        head.register_forward_hook(lambda _m, _i, out: cap * torch.tanh(out.float() / cap))
        head.soft_capped = True  # type: ignore[assignment]


def _rotaries(cfg: Gemma3Config) -> tuple[Rotary, Rotary]:
    """RoPE tables of the global layers and of the sliding ones (their own base, never scaled)."""
    local = replace(cfg, rope_freq_base=cfg.rope_freq_base_swa, rope_scaling_factor=1.0)
    return Rotary(cfg), Rotary(local)


def random_gemma3(cfg: Gemma3Config, seed: int = 0, dtype: torch.dtype = torch.float32) -> Gemma3:
    """A randomly initialised model (engine tests): nn defaults, with a seeded generator."""
    torch.manual_seed(seed)
    model = Gemma3(cfg).to(dtype)
    model.requires_grad_(False)
    return model.eval()
