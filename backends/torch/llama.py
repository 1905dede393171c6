"""A Llama-family transformer read straight from GGUF (Llama 2/3, SmolLM2, Mistral, Qwen2, Qwen3).

Module names are GGUF's tensor names (`blk.3.attn_output.weight`), so loading needs no renaming, except
the two fused projections (gpt-fast's `wqkv`): `attn_qkv` is GGUF's attn_q, attn_k and attn_v stacked
by rows, `ffn_gate_up` is ffn_gate over ffn_up (`FUSED`), one matmul each instead of three and two.
Attention goes through an `AttentionContext` handed to `forward`: `DenseCausal` below for one
sequence without a cache (the reference path), `attention.PagedAttention` for the engine.

RoPE follows GGUF's layout: llama.cpp's converter permutes Llama's Q/K rows so that rotation pairs
are adjacent (x[2i], x[2i+1]) -- the "normal" rope mode; Qwen models keep HF's half-split pairs
(x[i], x[i + d/2]), llama.cpp's "neox" mode. Using the matching pairing lets the weights stay as stored.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any
from typing import Protocol
from typing import TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from localrt.backends.llama_config import LlamaConfig

from .attention import AttnLayer
from .attention import attention
from .attention import causal_mask

__all__ = ["LlamaConfig", "Transformer", "DenseCausal", "random_transformer", "weight_bytes", "gguf_parts"]

# fused module -> the GGUF tensors it stacks by rows, in order
FUSED = {"attn_qkv": ("attn_q", "attn_k", "attn_v"), "ffn_gate_up": ("ffn_gate", "ffn_up")}

# (module path, GGUF weight names it is made of) -> a module to use instead of the dense one, or None
ModuleFactory = Callable[[str, list[str]], "nn.Module | None"]


class AttentionContext(Protocol):
    """Where keys and values go and how queries see them; one context serves every layer of a step."""

    positions: torch.Tensor  # [N] int64, absolute position of each token in its sequence

    def attend(self, layer: AttnLayer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [N, n_head, head_dim], k/v [N, n_kv_head, head_dim] -> [N, n_head, head_dim]."""
        ...


class DenseCausal:
    """All N tokens are one sequence starting at position 0; no cache (the reference path)."""

    def __init__(self, n_tokens: int, device: torch.device | str = "cpu") -> None:
        self.positions = torch.arange(n_tokens, device=device)

    def attend(self, layer: AttnLayer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # [N, H, D] -> [1, H, N, D] for SDPA; GQA heads are shared inside SDPA
        q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        if layer.window > 0 or layer.softcap > 0:
            out = attention(q, k, v, causal_mask(self.positions, layer.window), layer.softcap)
        else:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return out.squeeze(0).transpose(0, 1)  # [N, H, D]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # normalise in fp32 (as llama.cpp does), scale in the compute dtype; casts only where the
        # dtype differs (a no-op cast still costs a dispatch, and a decode step is mostly dispatches)
        if x.dtype == torch.float32:  # the scale inside the call: the same products, one op fewer
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        return F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype) * self.weight


class Rotary(nn.Module):
    """cos/sin tables for RoPE, indexed by absolute position."""

    def __init__(
        self, cfg: LlamaConfig, freq_factors: torch.Tensor | None = None, attn_factor: float = 1.0
    ) -> None:
        """`freq_factors` divide the frequencies (Llama 3.1, Phi-3's LongRoPE); `attn_factor` scales
        cos and sin (Phi-3's LongRoPE)."""
        super().__init__()
        self.n_rot = cfg.rope_dimension_count or cfg.attention_key_length
        self.neox = cfg.rope_neox
        inv_freq = cfg.rope_freq_base ** (-torch.arange(0, self.n_rot, 2, dtype=torch.float64) / self.n_rot)
        if freq_factors is not None:  # Llama 3.1's rope_freqs.weight divides the frequencies
            inv_freq = inv_freq / freq_factors.double()
        positions = torch.arange(cfg.context_length, dtype=torch.float64) / cfg.rope_scaling_factor
        angles = torch.outer(positions, inv_freq)  # [max_pos, n_rot/2]
        self.register_buffer("cos", (angles.cos() * attn_factor).float(), persistent=False)
        self.register_buffer("sin", (angles.sin() * attn_factor).float(), persistent=False)

        self._tables: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def _cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[N, 1, n_rot] each: cos of each pair's angle at both of its places, and sin with the sign
        its partner's product takes (-sin first), in the rope mode's pairing; looked up once per step
        (every layer of a step rotates by the same positions tensor)."""
        if self._tables is None or self._tables[0] is not positions:
            cos, sin = self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)  # [N, 1, n_rot/2]
            if self.neox:  # pairs (i, i + n_rot/2)
                wide = torch.cat([cos, cos], -1), torch.cat([-sin, sin], -1)
            else:  # pairs (2i, 2i+1)
                wide = cos.repeat_interleave(2, -1), torch.stack([-sin, sin], -1).flatten(-2)
            self._tables = (positions, *wide)
        return self._tables[1], self._tables[2]

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [N, heads, head_dim] rotated by each token's position: x * cos + partner(x) * (-+sin),
        the products and sum of the pairwise formula (o1 = x1 cos - x2 sin, o2 = x2 cos + x1 sin), in
        four whole-row ops instead of a dozen on halves."""
        cos, sin = self._cos_sin(positions)
        if self.n_rot == x.shape[-1]:
            rot = x if x.dtype == torch.float32 else x.float()
            n, h, d = rot.shape
            # each element's pair partner: the other half (neox) or the neighbour (normal mode)
            shape = (n, h, 2, d // 2) if self.neox else (n, h, d // 2, 2)
            partner = rot.reshape(shape).flip(2 if self.neox else 3).view(n, h, d)
            out = rot * cos + partner * sin
            return out if out.dtype == x.dtype else out.to(x.dtype)
        # partial rotation (the rest of each head passes through): the pairwise formula on halves
        cos, sin = self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)
        rot, rest = x[..., : self.n_rot].float(), x[..., self.n_rot :]
        if self.neox:
            x1, x2 = rot.chunk(2, dim=-1)  # pairs (i, i + n_rot/2)
        else:
            x1, x2 = rot[..., 0::2], rot[..., 1::2]  # pairs (2i, 2i+1)
        o1, o2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
        out = torch.cat([o1, o2], -1) if self.neox else torch.stack([o1, o2], -1).flatten(-2)
        return torch.cat([out.to(x.dtype), rest], -1) if rest.shape[-1] else out.to(x.dtype)


class Block(nn.Module):
    """Pre-norm attention + SwiGLU MLP. Attributes carry GGUF's names (`attn_q`, `ffn_gate`, ...)."""

    def __init__(self, cfg: LlamaConfig, layer: int, qkv_bias: bool, qk_norm: bool) -> None:
        super().__init__()
        self.n_head, self.n_kv = cfg.attention_head_count, cfg.attention_head_count_kv
        self.head_dim = cfg.attention_key_length
        dim, hidden, eps = cfg.embedding_length, cfg.feed_forward_length, cfg.attention_layer_norm_rms_epsilon
        self.attn_norm = RMSNorm(dim, eps)
        self.qkv_sizes = [self.n_head * self.head_dim, self.n_kv * self.head_dim, self.n_kv * self.head_dim]
        self.attn_qkv = nn.Linear(dim, sum(self.qkv_sizes), bias=qkv_bias)
        self.attn_output = nn.Linear(self.n_head * self.head_dim, dim, bias=False)
        # Qwen3 normalises each head's q and k before RoPE
        self.attn_q_norm = RMSNorm(self.head_dim, eps) if qk_norm else None
        self.attn_k_norm = RMSNorm(self.head_dim, eps) if qk_norm else None
        self.ffn_norm = RMSNorm(dim, eps)
        self.ffn_gate_up = nn.Linear(dim, 2 * hidden, bias=False)
        self.ffn_down = nn.Linear(hidden, dim, bias=False)
        # what other families change in the same computation (Gemma: q scale, windows, soft-caps)
        self.q_scale = 1.0  # multiplies q after RoPE (the context applies SDPA's 1/sqrt(head_dim))
        self.attn_layer = AttnLayer(layer)  # handed to `ctx.attend`

    def attention(self, x: torch.Tensor, rotary: Rotary, ctx: AttentionContext) -> torch.Tensor:
        n = x.shape[0]
        qkv = self.attn_qkv(x)  # one matmul for the three projections: [N, (H + 2 Hkv) D]
        n_q, n_qk = self.qkv_sizes[0], self.qkv_sizes[0] + self.qkv_sizes[1]
        v = qkv[:, n_qk:].view(n, self.n_kv, self.head_dim)  # [N, Hkv, D]
        if self.attn_q_norm is not None and self.attn_k_norm is not None:
            q = self.attn_q_norm(qkv[:, :n_q].view(n, self.n_head, self.head_dim))
            k = self.attn_k_norm(qkv[:, n_q:n_qk].view(n, self.n_kv, self.head_dim))
            qk = torch.cat([q, k], 1)
        else:  # q's heads then k's lie side by side in the projection: viewed as one, not copied
            qk = qkv[:, :n_qk].view(n, self.n_head + self.n_kv, self.head_dim)
        qk = rotary(qk, ctx.positions)  # one rotation for q and k: [N, H + Hkv, D]
        q, k = qk[:, : self.n_head], qk[:, self.n_head :]
        if self.q_scale != 1.0:
            q = q * self.q_scale
        out = ctx.attend(self.attn_layer, q, k, v)  # [N, H, D]
        return self.attn_output(out.reshape(n, self.n_head * self.head_dim))

    def activation(self, gate: torch.Tensor) -> torch.Tensor:
        return F.silu(gate)  # SwiGLU

    def feed_forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.ffn_gate_up(x).chunk(2, -1)  # one matmul for both: [N, hidden] each
        return self.ffn_down(self.activation(gate) * up)

    def forward(self, x: torch.Tensor, rotary: Rotary, ctx: AttentionContext) -> torch.Tensor:
        x = x + self.attention(self.attn_norm(x), rotary, ctx)
        return x + self.feed_forward(self.ffn_norm(x))


TM = TypeVar("TM", bound="Transformer")


class Transformer(nn.Module):
    def __init__(
        self,
        cfg: LlamaConfig,
        *,
        qkv_bias: bool = False,
        qk_norm: bool = False,
        freq_factors: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        self.cfg = cfg
        self.token_embd = nn.Embedding(cfg.vocab_size, cfg.embedding_length)
        self.blk = nn.ModuleList(Block(cfg, i, qkv_bias, qk_norm) for i in range(cfg.block_count))
        self.output_norm = RMSNorm(cfg.embedding_length, cfg.attention_layer_norm_rms_epsilon)
        self.output = nn.Linear(cfg.embedding_length, cfg.vocab_size, bias=False)
        self.rotary = Rotary(cfg, freq_factors)
        self.windows = cfg.windows  # each layer's sliding window in tokens, 0 for full attention

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype (the norms stay dense when linears and the embedding are swapped)."""
        return self.output_norm.weight.dtype

    def hidden(self, tokens: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        """tokens [N] -> final-normed hidden states [N, dim] (embeddings)."""
        return self.output_norm(self.run_blocks(tokens, ctx))

    def forward(
        self,
        tokens: torch.Tensor,
        ctx: AttentionContext,
        *,
        num_layers: int | None = None,
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """tokens [N] -> logits [R, vocab] in float32 of `rows` (all N when None).

        `num_layers` runs only the first blocks (self-speculative drafting); the final norm and
        head still apply, so the shallow model speaks the same vocabulary.
        """
        x = self.run_blocks(tokens, ctx, num_layers)
        if rows is not None:
            x = x[rows]  # [R, dim]: the head is the biggest matmul, so only where logits are needed
        return self.output(self.output_norm(x)).float()

    def run_blocks(
        self, tokens: torch.Tensor, ctx: AttentionContext, num_layers: int | None = None
    ) -> torch.Tensor:
        """tokens [N] -> hidden states [N, dim] after the first `num_layers` blocks (all when None),
        before the final norm."""
        x = self.embed(tokens)  # [N, dim]
        for block in itertools.islice(self.blk, num_layers or None):  # a slice would build a ModuleList
            x = block(x, self.rotary_of(block), ctx)
        return x

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [N] -> the first hidden states [N, dim] (Gemma scales them)."""
        return self.token_embd(tokens)

    def rotary_of(self, block: nn.Module) -> Rotary:
        """The RoPE tables a block rotates by (Gemma's sliding layers have their own)."""
        return self.rotary

    @classmethod
    def from_gguf(
        cls: type[TM],
        tensors: Any,
        dtype: torch.dtype,
        device: torch.device | str,
        modules: ModuleFactory | None = None,
    ) -> TM:
        """Build from a `gguf_load.GGUFTensors`, dequantizing tensor by tensor into `dtype` on `device`.

        `modules` (speed from outside, e.g. `quantized.QuantizedModules`) may supply each linear and the
        embedding itself, from the GGUF tensors named; those are never dequantized here. Module names
        are GGUF's; a fused module is read from its parts; a missing `output.weight` ties the head to
        token_embd. Every family builds this way; what differs is its `of_file` (the empty model the
        file describes) and `finish` (what is read after the weights).
        """
        with torch.device("meta"):
            model = cls.of_file(tensors)  # no memory: every weight is assigned below, one at a time
        swapped = _swap_modules(model, tensors, modules) if modules is not None else set()
        state: dict[str, torch.Tensor] = {}
        for name in model.state_dict():
            module = name.rsplit(".", 1)[0]
            if _under(name, swapped) or (name == "output.weight" and name not in tensors):
                continue  # supplied from outside, or tied embeddings (SmolLM2): token_embd below
            parts = gguf_parts(module, tensors, name.rsplit(".", 1)[1])
            state[name] = torch.cat([tensors.get(p) for p in parts]).to(device=device, dtype=dtype)
        model.load_state_dict(state, strict=False, assign=True)
        if "output.weight" not in tensors and "output" not in swapped:
            model.output.weight = model.token_embd.weight
        model.requires_grad_(False)
        model.eval()
        model.finish(tensors, device)  # buffers computed at construction are still on the meta device
        return model

    @classmethod
    def of_file(cls: type[TM], tensors: Any) -> TM:
        """The model a GGUF's metadata and tensor names describe, its weights not yet loaded."""
        cfg = LlamaConfig.from_gguf(tensors.metadata, vocab_size_of(tensors))
        qkv_bias, qk_norm = "blk.0.attn_q.bias" in tensors, "blk.0.attn_q_norm.weight" in tensors
        return cls(cfg, qkv_bias=qkv_bias, qk_norm=qk_norm)

    def finish(self, tensors: Any, device: torch.device | str) -> None:
        """After the weights: the RoPE tables computed for real, off the meta device (with the file's
        frequency factors, Llama 3.1's `rope_freqs.weight`)."""
        freq_factors = tensors.get("rope_freqs.weight") if "rope_freqs.weight" in tensors else None
        self.rotary = Rotary(self.cfg, freq_factors).to(device)


def vocab_size_of(tensors: Any) -> int:
    """The vocabulary size: the tokenizer's list, else the embedding's rows."""
    vocab = tensors.metadata.get("tokenizer.ggml.tokens")
    return len(vocab) if vocab is not None else tensors.by_name["token_embd.weight"].shape[1]


M = TypeVar("M", bound=nn.Module)


def gguf_parts(module: str, tensors: Any, leaf: str = "weight") -> list[str]:
    """The GGUF tensors a module's `leaf` is made of: `blk.0.attn_qkv` -> attn_q, attn_k, attn_v."""
    prefix, _, last = module.rpartition(".")
    if f"{module}.{leaf}" in tensors:
        return [f"{module}.{leaf}"]  # stored fused (Phi-3's attn_qkv)
    if last == "ffn_gate_up" and f"{prefix}.ffn_gate.{leaf}" not in tensors:
        return [f"{prefix}.ffn_up.{leaf}"]  # Phi-3: ffn_up holds the gate rows, then the up rows
    if last in FUSED:
        return [f"{prefix}.{part}.{leaf}" for part in FUSED[last]]
    if module == "output" and "output.weight" not in tensors:
        return [f"token_embd.{leaf}"]  # the tied head
    return [f"{module}.{leaf}"]


def _under(name: str, modules: set[str]) -> bool:
    return any(name.startswith(m + ".") for m in modules)


def _swap_modules(model: nn.Module, tensors: Any, modules: ModuleFactory) -> set[str]:
    swapped = set()
    for name, module in list(model.named_modules()):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            new = modules(name, gguf_parts(name, tensors))
            if new is not None:
                model.set_submodule(name, new)
                swapped.add(name)
    return swapped


def weight_bytes(model: nn.Module) -> int:
    """Resident bytes of a model's weights: parameters and persistent buffers (packed quantized
    weights, their scales), each storage counted once (a tied head shares the embedding's)."""
    seen: set[int] = set()
    total = 0
    for t in model.state_dict(keep_vars=True).values():
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def random_transformer(cfg: LlamaConfig, seed: int = 0, dtype: torch.dtype = torch.float32) -> Transformer:
    """A randomly initialised model (tests, benchmarks): nn defaults, with a seeded generator."""
    return random_model(Transformer, cfg, seed, dtype)


def random_model(cls: Callable[[Any], M], cfg: Any, seed: int = 0, dtype: torch.dtype = torch.float32) -> M:
    """`cls(cfg)` with nn's default initialisation from a seeded generator, in `dtype`, for inference."""
    torch.manual_seed(seed)
    model = cls(cfg).to(dtype)
    model.requires_grad_(False)
    return model.eval()
