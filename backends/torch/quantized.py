"""Weights that stay quantized in memory on the CPU, multiplied by torch's own weight-only kernels.

Swapped into a `Transformer` from outside (`Transformer.from_gguf(..., modules=QuantizedModules(...))`);
the model file stays the math. Two kernels, both with bf16 activations (the only fast CPU variants;
their fp32 variants are reference loops, 15x slower than a dense fp32 matmul):

- 4-bit affine groups of 32 (Q4_0, Q4_1, Q4_K): `aten._weight_int4pack_mm_for_cpu`, which computes
  w = (q - 8) * scale + zero per group of 32 along K. GGUF's blocks map onto it without requantizing:
  Q4_0 scale d, zero 0; Q4_1 scale d, zero m + 8d; Q4_K sub-block j scale d*sc_j, zero
  8*d*sc_j - dmin*m_j. The nibbles are exact; the kernel keeps scales and zeros in bf16 (8 bits of
  mantissa), so a weight moves by at most a few hundredths of its quantization step.
- everything else (Q5_*, Q6_K, Q8_0, Q2_K, Q3_K, F16, ...): `aten._weight_int8pack_mm`, int8 with one
  scale per output row, requantized from the dequantized weights (round to nearest, amax / 127). Not
  exact: groups of 16 or 32 with their own scales have no per-row int8 equivalent in torch's ops.

The activation of every matmul is split into a bf16 head and a bf16 remainder (x = hi + lo), stacked
as twice the rows of one call: the weights are read once, and the product keeps about 16 bits of the
activation instead of bf16's 8. The kernels' outputs are bf16 all the same (there is no fp32-output
variant on the CPU in torch 2.13, nor `mm(out_dtype=)`), which is the main error left: the head
(the logits) in bf16 costs about 1% top-1 agreement against an fp32 head (SmolLM2 Q4_1, 2,048 tokens:
98.2% vs 99.3%), an fp32 head would not fit 1.5x the file's bytes.
"""

from __future__ import annotations

import torch
from torch import nn

from .gguf_load import GGUFTensors, _f16, _k4_scale_min, _nibbles, dequantize

INT4_TYPES = ("Q4_0", "Q4_1", "Q4_K")
GROUP = 32


def int4_groups(raw: torch.Tensor, ggml_type: str, rows: int, cols: int) -> tuple[torch.Tensor, ...]:
    """GGUF blocks -> (q [rows, cols] int32 in 0..15, scale, zero [rows, cols/32] fp32) with
    w = (q - 8) * scale + zero exactly (the zero rounded once in fp32)."""
    if ggml_type == "Q4_0":
        b = raw.view(-1, 18)
        q, scale = _nibbles(b[:, 2:]), _f16(b[:, :2])  # [nb, 32], [nb, 1]
        zero = torch.zeros_like(scale)
    elif ggml_type == "Q4_1":
        b = raw.view(-1, 20)
        q, scale, m = _nibbles(b[:, 4:]), _f16(b[:, :2]), _f16(b[:, 2:4])
        zero = m + 8 * scale
    elif ggml_type == "Q4_K":
        b = raw.view(-1, 144)
        nb = b.shape[0]
        d, dmin = _f16(b[:, :2]), _f16(b[:, 2:4])
        sc, mn = _k4_scale_min(b[:, 4:16])  # [nb, 8] each
        qs = b[:, 16:144].view(nb, 4, 1, 32)
        q = torch.cat([qs & 0x0F, qs >> 4], dim=2).reshape(nb * 8, 32)  # sub-block 2c: low, 2c+1: high
        scale = (d * sc).reshape(-1, 1)  # exact: an fp16 times a 6-bit integer
        zero = 8 * scale - (dmin * mn).reshape(-1, 1)
    else:
        raise ValueError(f"{ggml_type} is not a 4-bit affine type")
    return q.to(torch.int32).reshape(rows, cols), scale.reshape(rows, -1), zero.reshape(rows, -1)


def split_bf16(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] fp32 -> [2M, K] bf16: the rows of bf16(x), then of bf16(x - bf16(x))."""
    hi = x.to(torch.bfloat16)
    return torch.cat([hi, (x - hi.float()).to(torch.bfloat16)])


class Int4Linear(nn.Module):
    """y = x @ W.T (+ b) for W in 4-bit affine groups of 32, packed for torch's CPU int4 kernel."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = q.shape
        pad = -self.out_features % 16  # the packing wants rows in multiples of 16: zero rows, sliced off
        if pad:
            q = torch.cat([q, torch.full((pad, q.shape[1]), 8, dtype=q.dtype)])
            scale, zero = (torch.cat([t, t.new_zeros(pad, t.shape[1])]) for t in (scale, zero))
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1))
        # [K/32, N, 2]: the kernel's layout of (scale, zero) per group and output row
        sz = torch.stack([scale, zero], -1).transpose(0, 1).contiguous().to(torch.bfloat16)
        self.register_buffer("scales_and_zeros", sz)
        self.register_buffer("bias", bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).float()
        m = flat.shape[0]
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(
            split_bf16(flat), self.packed, GROUP, self.scales_and_zeros
        )
        y = y[:m, : self.out_features].float() + y[m:, : self.out_features].float()  # [M, N]
        if self.bias is not None:
            y = y + self.bias
        return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)


class Int8Linear(nn.Module):
    """y = x @ (q * scale).T (+ b) with int8 q [N, K] and one scale per output row."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = q.shape
        self.register_buffer("weight_int8", q)
        self.register_buffer("scale", scale.to(torch.bfloat16))
        self.register_buffer("bias", bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).float()
        m = flat.shape[0]
        y = torch.ops.aten._weight_int8pack_mm(split_bf16(flat), self.weight_int8, self.scale)
        y = y[:m].float() + y[m:].float()
        if self.bias is not None:
            y = y + self.bias
        return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)


class BF16Linear(nn.Module):
    """A dense bf16 weight (a head whose type has no torch kernel): rows double as the embedding."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("weight_bf16", weight.to(torch.bfloat16))
        self.register_buffer("bias", bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).float()
        m = flat.shape[0]
        y = torch.nn.functional.linear(split_bf16(flat), self.weight_bf16)
        y = y[:m].float() + y[m:].float()
        if self.bias is not None:
            y = y + self.bias
        return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)


class Concat(nn.Module):
    """A fused linear whose parts have different kernels (Q4_K_M: attn_q, attn_k Q4_K, attn_v Q6_K)."""

    def __init__(self, parts: list[nn.Module]) -> None:
        super().__init__()
        self.parts = nn.ModuleList(parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([part(x) for part in self.parts], -1)


class GGUFRows(nn.Module):
    """An embedding kept as the GGUF's own bytes: the rows a step looks up are dequantized exactly."""

    def __init__(self, raw: torch.Tensor, ggml_type: str, rows: int, dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.register_buffer("raw", raw.view(rows, -1))  # [vocab, bytes per row]
        self.ggml_type, self.dim, self.dtype = ggml_type, dim, dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        rows = dequantize(self.raw[flat].reshape(-1), self.ggml_type, (self.dim, flat.numel()))
        return rows.to(self.dtype).reshape(*ids.shape, self.dim)


class RowsOf(nn.Module):
    """The embedding of a tied bf16 head: its weight's rows."""

    def __init__(self, head: BF16Linear, dtype: torch.dtype) -> None:
        super().__init__()
        self.head, self.dtype = head, dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head.weight_bf16[ids].to(self.dtype)


def int8_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] fp32 -> (int8 [N, K], scale [N]): symmetric, round to nearest, amax / 127 per row."""
    scale = w.abs().amax(-1).clamp(min=1e-30) / 127.0
    return torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8), scale


class QuantizedModules:
    """A `model.ModuleFactory`: each linear and the embedding built from its GGUF tensors, kept packed.

    - a linear part in a 4-bit affine type: `Int4Linear` (exact nibbles); any other type: `Int8Linear`
      (per-row requantization). A fused linear with parts of both kinds is a `Concat`.
    - the head (output, or the tied token_embd): `Int4Linear` for 4-bit types, else dense bf16,
      because per-row int8 moves logits by enough to flip 3% of top-1 tokens (Q8_0 head, SmolLM2).
    - the embedding: the GGUF's bytes, rows dequantized on lookup; a tied bf16 head lends its rows.
    """

    def __init__(self, tensors: GGUFTensors, dtype: torch.dtype = torch.float32) -> None:
        self.tensors = tensors
        self.dtype = dtype
        self.tied = "output.weight" not in tensors
        self._heads: dict[str, nn.Module] = {}

    def __call__(self, name: str, parts: list[str]) -> nn.Module | None:
        if name == "token_embd":
            head = self._head(parts[0]) if self.tied else None
            if isinstance(head, BF16Linear):
                return RowsOf(head, self.dtype)
            t = self.tensors.by_name[parts[0]]
            return GGUFRows(
                self.tensors.raw(parts[0]), t.ggml_type, int(t.shape[1]), int(t.shape[0]), self.dtype
            )
        if name == "output":
            return self._head(parts[0])
        modules = [self._linear(p) for p in parts]
        if len(modules) == 1:
            return modules[0]
        if all(isinstance(m, Int4Linear) for m in modules):
            return self._int4(parts)  # one kernel call for the fused weight
        if all(isinstance(m, Int8Linear) for m in modules):
            return self._int8(parts)
        return Concat(modules)

    def _is_int4(self, name: str) -> bool:
        t = self.tensors.by_name[name]
        return t.ggml_type in INT4_TYPES and int(t.shape[0]) % GROUP == 0

    def _linear(self, name: str) -> nn.Module:
        return self._int4([name]) if self._is_int4(name) else self._int8([name])

    def _head(self, name: str) -> nn.Module:
        if name not in self._heads:
            if self._is_int4(name):
                self._heads[name] = self._int4([name])
            else:
                self._heads[name] = BF16Linear(self.tensors.get(name).float(), self._bias([name]))
        return self._heads[name]

    def _int4(self, parts: list[str]) -> Int4Linear:
        groups = []
        for p in parts:
            t = self.tensors.by_name[p]
            groups.append(int4_groups(self.tensors.raw(p), t.ggml_type, int(t.shape[1]), int(t.shape[0])))
        q, scale, zero = (torch.cat([g[i] for g in groups]) for i in range(3))
        return Int4Linear(q, scale, zero, self._bias(parts))

    def _int8(self, parts: list[str]) -> Int8Linear:
        pieces = [int8_rows(self.tensors.get(p).float()) for p in parts]
        q, scale = torch.cat([p[0] for p in pieces]), torch.cat([p[1] for p in pieces])
        return Int8Linear(q, scale, self._bias(parts))

    def _bias(self, parts: list[str]) -> torch.Tensor | None:
        names = [p.removesuffix(".weight") + ".bias" for p in parts]
        if not all(n in self.tensors for n in names):
            return None
        return torch.cat([self.tensors.get(n) for n in names]).float()
