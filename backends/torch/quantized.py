"""Weights that stay quantized in memory on the CPU, multiplied by torch's own weight-only kernels.

Swapped into a model from outside (`load_model(..., modules=QuantizedModules(...))`); the model file
stays the math. Two kernels, both with bf16 activations (the only fast CPU variants; their fp32
variants are reference loops, 15x slower than a dense fp32 matmul):

- 4-bit affine groups of 32 (Q4_0, Q4_1, Q4_K): `aten._weight_int4pack_mm_for_cpu`, which computes
  w = (q - 8) * scale + zero per group of 32 along K. GGUF's blocks map onto it without requantizing:
  Q4_0 scale d, zero 0; Q4_1 scale d, zero m + 8d; Q4_K sub-block j scale d*sc_j, zero
  8*d*sc_j - dmin*m_j. The nibbles are exact; the kernel keeps scales and zeros in bf16 (8 bits of
  mantissa), so a weight moves by at most a few hundredths of its quantization step.
- up to 8-bit affine groups of 32 (Q8_0, Q5_0, Q5_1): the same int4 kernel on two nibble planes. A
  block's integers k (w = d*k + m) are shifted to u = k + 128 in 0..255 and split u = 16a + b; then
  w = (a - 8) * 16d + (b - 8) * d + (8d + m): a "high" weight row with scale 16d and zero 0, a "low"
  one with scale d and zero 8d + m, their outputs added. Exact integers again, 1.25 bytes a weight.
- Q6_K (6-bit integers in sub-blocks of 16, w = d * sc_j * (u - 32)): the same kernel on two
  planes (`q6_k_groups`), u = 16a + b as a high plane 2a + 5 with scale 8 d sc_j plus a low plane b
  with scale d sc_j: 8s(2a - 3) + s(b - 8) = s(u - 32). The kernel's groups of 32 hold two
  sub-blocks with different scales, so the planes are multiplied twice, with each half's scales and
  the activation's other half zeroed (`Int4Linear` with halves). Exact integers, 1.25 bytes a
  weight with the bf16 scales (Q6_K: 0.82), four planes' work; the per-row int8 requantization these
  tensors had before cost SmolLM2's Q6_K file 1.5% top-1 agreement and its Q4_K_M file 0.9%
  perplexity.
- everything else (the other K-types' groups of 16, Q2_K, Q3_K, Q5_K, IQ4_*):
  `aten._weight_int8pack_mm`, int8 with one scale per output row, requantized from the dequantized
  weights (round to nearest, amax / 127). Not exact.
- float tensors (F32, F16, BF16) are not quantized at all: they load dense, as the dequantized
  numerics load them (`None` from the factory), and `kept()` says so.

The activation of every matmul but the head's is split into a bf16 head and a bf16 remainder
(x = hi + lo), stacked as twice the rows of one call: the weights are read once, and the product
keeps about 16 bits of the activation instead of bf16's 8 (the head takes bf16 rows alone: its best
logits are recomputed in fp32, `RefinedHead`). The kernels' outputs are bf16 all the same (there is no fp32-output
variant on the CPU in torch 2.13, nor `mm(out_dtype=)`), which is the main error left: the head
(the logits) in bf16 costs about 1% top-1 agreement against an fp32 head (SmolLM2 Q4_1, 2,048 tokens:
98.2% vs 99.3%), an fp32 head would not fit 1.5x the file's bytes.
"""

from __future__ import annotations

import torch
from torch import nn

from localrt.store.gguf import TensorInfo

from .gguf_load import DEQUANTIZERS
from .gguf_load import GGUFTensors
from .gguf_load import _f16
from .gguf_load import _k4_scale_min
from .gguf_load import _nibbles
from .gguf_load import dequantize
from .gguf_load import q6_k_parts

INT4_TYPES = ("Q4_0", "Q4_1", "Q4_K")
PAIR_TYPES = ("Q8_0", "Q5_0", "Q5_1")  # up to 8-bit integers in groups of 32: two int4 planes
SIXTEEN_TYPES = ("Q6_K",)  # 6-bit integers in sub-blocks of 16: two int4 planes, run once per half
PLANES = {"int4": 1, "int4x2": 2, "int4x2/16": 2}  # the kinds `Int4Linear` takes, and their planes
FLOAT_TYPES = ("F32", "F16", "BF16")  # never quantized: loaded dense
GROUP = 32
REFINE_TOP = 8  # logits of each head row recomputed in fp32 (`RefinedHead`)
PAIR_BLOCK_BYTES = {"Q8_0": 34, "Q5_0": 22, "Q5_1": 24}


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


def pair_groups(raw: torch.Tensor, ggml_type: str, rows: int, cols: int) -> tuple[torch.Tensor, ...]:
    """GGUF blocks of up-to-8-bit integers k (w = d*k + m) -> two int4 planes stacked by rows,
    (q [2*rows, cols] int32 in 0..15, scale, zero [2*rows, cols/32] fp32): rows 0..rows-1 the high
    nibbles of u = k + 128 (scale 16d, zero 0), then the low ones (scale d, zero 8d + m), so that
    w = high + low exactly (the zero rounded once in fp32)."""
    blocks = raw.view(-1, PAIR_BLOCK_BYTES[ggml_type])
    w = DEQUANTIZERS[ggml_type](blocks).reshape(-1, GROUP)  # [nb, 32] fp32
    d = _f16(blocks[:, :2])  # [nb, 1]
    m = _f16(blocks[:, 2:4]) if ggml_type == "Q5_1" else torch.zeros_like(d)
    # the integers back from the floats: d*k (+ m) is exact or within one rounding of it, so round()
    # recovers k; a block with d = 0 holds only m
    k = torch.where(d != 0, torch.round((w - m) / torch.where(d != 0, d, 1.0)), 0.0)
    u = (k + 128).to(torch.int32)  # 0..255
    q = torch.cat([(u >> 4).reshape(rows, cols), (u & 15).reshape(rows, cols)])
    scale = torch.cat([(16 * d).reshape(rows, -1), d.reshape(rows, -1)])
    zero = torch.cat([torch.zeros_like(d).reshape(rows, -1), (8 * d + m).reshape(rows, -1)])
    return q, scale, zero


def q6_k_groups(raw: torch.Tensor, rows: int, cols: int) -> tuple[torch.Tensor, ...]:
    """Q6_K blocks -> two int4 planes stacked by rows, q [2*rows, cols] int32 in 0..15, and their
    scales and zeros per half, [2, 2*rows, cols/32] fp32: half h's (h = 0: each 32-group's first 16
    columns, 1: its last 16) weights are the planes' sum under scale[h], zero[h] (zeros all 0):
    w = s(u - 32) with u = 16a + b, high plane 2a + 5 under 8s, low plane b under s."""
    d, sc, u = q6_k_parts(raw.view(-1, 210))  # [nb, 1], [nb, 16], [nb, 16, 16]
    s = (d * sc).reshape(rows, -1, 2)  # [rows, groups of 32, half]
    u = u.to(torch.int32).reshape(rows, cols)
    q = torch.cat([2 * (u >> 4) + 5, u & 15])
    scale = torch.stack([torch.cat([8 * s[..., h], s[..., h]]) for h in range(2)])
    return q, scale, torch.zeros_like(scale)


def kind_of(t: TensorInfo) -> str:
    """How a matrix of this type and shape is kept: dense, one or two int4 planes, or int8 rows."""
    if t.ggml_type in FLOAT_TYPES:
        return "dense"
    if int(t.shape[0]) % GROUP == 0 and t.ggml_type in INT4_TYPES:
        return "int4"
    if int(t.shape[0]) % GROUP == 0 and t.ggml_type in PAIR_TYPES:
        return "int4x2"
    if t.ggml_type in SIXTEEN_TYPES:
        return "int4x2/16"
    return "int8"


def split_bf16(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] fp32 -> [2M, K] bf16: the rows of bf16(x), then of bf16(x - bf16(x))."""
    m = x.shape[0]
    out = torch.empty(2 * m, x.shape[1], dtype=torch.bfloat16, device=x.device)
    hi = out[:m].copy_(x)
    out[m:].copy_(x - hi)  # the difference in fp32 (hi is promoted), rounded once: four ops, no cat
    return out


class SplitLinear(nn.Module):
    """y = x @ W.T (+ b) through a bf16-activation kernel (`matmul`): x goes in as its bf16 head and
    remainder stacked by rows (`split_bf16`), and the two halves of the output are added in fp32."""

    bias: torch.Tensor | None

    def __init__(self, out_features: int, in_features: int, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = out_features, in_features
        self.register_buffer("bias", bias)

    def matmul(self, x2: torch.Tensor) -> torch.Tensor:
        """[2M, K] bf16 -> [2M, >= N] (the kernel's own output rows)."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor, split: bool = True) -> torch.Tensor:
        """`split` False: x goes in as bf16 alone (one row each; `RefinedHead`, whose best logits
        are recomputed in fp32 anyway)."""
        flat = x if x.dim() == 2 else x.reshape(-1, self.in_features)
        if flat.dtype != torch.float32:
            flat = flat.float()
        m = flat.shape[0]
        if split:
            y = self.matmul(split_bf16(flat)).float()
            y = y[:m].add_(y[m:])  # the halves added in fp32 (widened first: an add of one dtype is faster)
        else:
            y = self.matmul(flat.to(torch.bfloat16)).float()
        y = self.combine(y)  # [M, N]
        if self.bias is not None:
            y = y + self.bias
        if y.dtype != x.dtype:
            y = y.to(x.dtype)
        return y if x.dim() == 2 else y.reshape(*x.shape[:-1], self.out_features)

    def combine(self, y: torch.Tensor) -> torch.Tensor:
        """The kernel's output columns -> the N outputs (padding sliced off, planes added)."""
        return y


class Int4Linear(SplitLinear):
    """W in 4-bit affine groups of 32, packed for torch's CPU int4 kernel.

    `planes` 2: q holds two planes stacked by rows (`pair_groups`, `q6_k_groups`), W their sum.
    scale and zero [2, rows, K/32] (`q6_k_groups`): one set for each half of every 32-group (groups
    of 16), the kernel run once per half on the activation with the other half zeroed."""

    def __init__(
        self,
        q: torch.Tensor,
        scale: torch.Tensor,
        zero: torch.Tensor,
        bias: torch.Tensor | None,
        planes: int = 1,
    ):
        super().__init__(q.shape[0] // planes, q.shape[1], bias)
        self.planes = planes
        self.halves = scale.dim() == 3
        scale, zero = (t if self.halves else t[None] for t in (scale, zero))
        pad = -q.shape[0] % 16  # the packing wants rows in multiples of 16: zero rows, sliced off
        if pad:
            q = torch.cat([q, torch.full((pad, q.shape[1]), 8, dtype=q.dtype)])
            scale, zero = (torch.cat([t, t.new_zeros(t.shape[0], pad, t.shape[2])], 1) for t in (scale, zero))
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1))
        # [K/32, N, 2]: the kernel's layout of (scale, zero) per group and output row (one per half)
        sz = torch.stack([scale, zero], -1).transpose(1, 2).contiguous().to(torch.bfloat16)
        self.register_buffer("scales_and_zeros", sz if self.halves else sz[0])
        # the columns of each group's first half (groups of 16)
        first = torch.arange(self.in_features) % GROUP < GROUP // 2 if self.halves else None
        self.register_buffer("first_half", first)

    def matmul(self, x2: torch.Tensor) -> torch.Tensor:
        if self.first_half is None:
            return self._kernel(x2, self.scales_and_zeros)
        first = torch.where(self.first_half, x2, 0)  # exact: the other half zeroed, not rounded
        return (
            self._kernel(first, self.scales_and_zeros[0]).float()
            + self._kernel(x2 - first, self.scales_and_zeros[1]).float()
        )

    def _kernel(self, x2: torch.Tensor, sz: torch.Tensor) -> torch.Tensor:
        # torch's own binding of the op, not `torch.ops.aten`'s Python wrapper (a frame more per matmul)
        return torch._weight_int4pack_mm_for_cpu(x2, self.packed, GROUP, sz)

    def combine(self, y: torch.Tensor) -> torch.Tensor:
        n = self.out_features
        if self.planes == 2:
            return y[:, :n] + y[:, n : 2 * n]
        return y if y.shape[1] == n else y[:, :n]


class Int8Linear(SplitLinear):
    """W = q * scale with int8 q [N, K] and one scale per output row."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None):
        super().__init__(*q.shape, bias)
        self.register_buffer("weight_int8", q)
        self.register_buffer("scale", scale.to(torch.bfloat16))

    def matmul(self, x2: torch.Tensor) -> torch.Tensor:
        return torch._weight_int8pack_mm(x2, self.weight_int8, self.scale)


class BF16Linear(SplitLinear):
    """A dense bf16 weight (a head whose type has no torch kernel): rows double as the embedding."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__(*weight.shape, bias)
        self.register_buffer("weight_bf16", weight.to(torch.bfloat16))

    def matmul(self, x2: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x2, self.weight_bf16)


class Concat(nn.Module):
    """A fused linear whose parts have different kernels or plane counts (Q4_K_M: attn_q, attn_k Q4_K,
    attn_v Q6_K)."""

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


class RefinedHead(nn.Module):
    """The head through a bf16-output kernel, then each row's `REFINE_TOP` best logits recomputed in
    fp32 from the weight's own rows (`rows`: ids -> weight rows, exact from the GGUF's bytes, or the
    bf16 weight's). The kernel rounds logits near 20 to about 0.06, enough to swap near-tied
    candidates (SmolLM2 Q4_1, "What is the capital of France?": "The" 24.144 vs "La" 24.049 exactly,
    "La" first after the kernel's rounding); the recomputed ones decide greedy picks and top logprobs
    as the fp32 head would, for the cost of `REFINE_TOP` dot products a row."""

    def __init__(self, kernel: SplitLinear, rows: nn.Module) -> None:
        super().__init__()
        self.kernel, self.rows = kernel, rows
        self.out_features, self.in_features = kernel.out_features, kernel.in_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the activation in bf16 alone: its ~2^-9 relative error moves a logit about as much as the
        # kernel's bf16 output does, and the best ones are recomputed below; half the kernel's rows,
        # which at 16 sequences saves about a tenth of a step (the head is the largest matmul)
        logits = self.kernel(x, split=False)
        flat, hidden = logits.reshape(-1, self.out_features), x.reshape(-1, self.in_features).float()
        top = flat.topk(min(REFINE_TOP, self.out_features), -1).indices  # [R, k]
        exact = torch.bmm(self.rows(top).float(), hidden[:, :, None]).squeeze(-1)  # [R, k]
        if self.kernel.bias is not None:
            exact = exact + self.kernel.bias[top]
        return flat.scatter(1, top, exact.to(flat.dtype)).reshape(logits.shape)


def int8_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] fp32 -> (int8 [N, K], scale [N]): symmetric, round to nearest, amax / 127 per row."""
    scale = w.abs().amax(-1).clamp(min=1e-30) / 127.0
    return torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8), scale


class QuantizedModules:
    """A `model.ModuleFactory`: each linear and the embedding built from its GGUF tensors, kept packed.

    - a linear part in a 4-bit affine type: `Int4Linear` (exact nibbles); Q8_0, Q5_0, Q5_1: an
      `Int4Linear` of two planes, Q6_K of two with a scale set per half-group (exact integers); a float type: None (loaded dense); any other type:
      `Int8Linear` (per-row requantization). A fused linear whose parts differ in kind is a `Concat`.
    - the head (output, or the tied token_embd): `Int4Linear` (one or two planes) where the type
      allows, else dense bf16, because per-row int8 moves logits by enough to flip 3% of top-1 tokens
      (Q8_0 head, SmolLM2); its best logits refined in fp32 (`RefinedHead`) from the GGUF's bytes
      (the bf16 weight's rows for a bf16 head).
    - the embedding: the GGUF's bytes, rows dequantized on lookup (shared with a tied head's
      refinement); a tied bf16 head lends its rows.
    """

    def __init__(self, tensors: GGUFTensors, dtype: torch.dtype = torch.float32) -> None:
        self.tensors = tensors
        self.dtype = dtype
        self.tied = "output.weight" not in tensors
        self._heads: dict[str, RefinedHead] = {}
        self.counts: dict[str, int] = {}  # "kind (GGUF type)" -> tensors, for `kept()`

    def __call__(self, name: str, parts: list[str]) -> nn.Module | None:
        kinds = [self._kind(p) for p in parts]
        for p, kind in zip(parts, kinds) if not (name == "output" and self.tied) else ():
            label = f"{kind} ({self.tensors.by_name[p].ggml_type})"
            self.counts[label] = self.counts.get(label, 0) + 1
        if "dense" in kinds:
            return None  # float weights: dense, as the dequantized numerics load them
        if name == "token_embd":
            return self._head(parts[0]).rows if self.tied else self._gguf_rows(parts[0])
        if name == "output":
            return self._head(parts[0])
        if len(set(kinds)) == 1:
            return self._module(parts, kinds[0])  # one kernel call for the fused weight
        return Concat([self._module([p], kind) for p, kind in zip(parts, kinds)])

    def kept(self) -> str:
        """What the factory did, for the load log: e.g. "int4 (Q4_1) x 211, bf16 (Q8_0) x 1"."""
        return ", ".join(f"{label} x {n}" for label, n in sorted(self.counts.items()))

    def _kind(self, name: str) -> str:
        return kind_of(self.tensors.by_name[name])

    def _module(self, parts: list[str], kind: str) -> nn.Module:
        if kind == "int8":
            return self._int8(parts)
        return self._int4(parts)

    def _head(self, name: str) -> RefinedHead:
        if name not in self._heads:
            kernel: SplitLinear
            if self._kind(name) in PLANES:
                kernel = self._int4([name])
                rows: nn.Module = self._gguf_rows(name)
            else:
                kernel = BF16Linear(self.tensors.get(name).float(), self._bias([name]))
                rows = RowsOf(kernel, self.dtype)
            self._heads[name] = RefinedHead(kernel, rows)
        return self._heads[name]

    def _gguf_rows(self, name: str) -> GGUFRows:
        t = self.tensors.by_name[name]
        return GGUFRows(self.tensors.raw(name), t.ggml_type, int(t.shape[1]), int(t.shape[0]), self.dtype)

    def _int4(self, parts: list[str]) -> Int4Linear:
        """The parts (all of one plane count) stacked by rows; several planes: every part's first
        plane, then every part's second, ..., so the module's planes are the fused weight's."""
        groups = []
        for p in parts:
            t = self.tensors.by_name[p]
            rows, cols = int(t.shape[1]), int(t.shape[0])
            if t.ggml_type in SIXTEEN_TYPES:
                groups.append(q6_k_groups(self.tensors.raw(p), rows, cols))
            elif t.ggml_type in PAIR_TYPES:
                groups.append(pair_groups(self.tensors.raw(p), t.ggml_type, rows, cols))
            else:
                groups.append(int4_groups(self.tensors.raw(p), t.ggml_type, rows, cols))
        planes = PLANES[self._kind(parts[0])]
        stacked = []
        for i in range(3):  # q, scale, zero (scale and zero [2, rows, groups] for groups of 16)
            split = [g[i].chunk(planes, -2) for g in groups]  # per part: its planes
            stacked.append(torch.cat([h[j] for j in range(planes) for h in split], -2))
        return Int4Linear(*stacked, self._bias(parts), planes=planes)

    def _int8(self, parts: list[str]) -> Int8Linear:
        pieces = [int8_rows(self.tensors.get(p).float()) for p in parts]
        q, scale = torch.cat([p[0] for p in pieces]), torch.cat([p[1] for p in pieces])
        return Int8Linear(q, scale, self._bias(parts))

    def _bias(self, parts: list[str]) -> torch.Tensor | None:
        names = [p.removesuffix(".weight") + ".bias" for p in parts]
        if not all(n in self.tensors for n in names):
            return None
        return torch.cat([self.tensors.get(n) for n in names]).float()
