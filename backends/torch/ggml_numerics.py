"""Opt-in: reproduce the rounding of llama.cpp's CPU kernels, to compare with llama.cpp token for token.

The engine's default numerics are plain float32 on dequantized weights (equal to transformers' GGUF
loader). llama.cpp's CPU backend rounds in three more places (ggml-cpu.c, arch/x86/quants.c):

- a quantized weight's matmul first quantizes the activation row to the weight type's `vec_dot_type`:
  Q8_0 (blocks of 32: d = amax/127 kept as fp16, q = round-half-even(x * 127/amax)) for Q4_0 Q5_0
  Q8_0; Q8_1 (the same, plus s = fp16(d * sum q), which the Q4_1/Q5_1 dot product uses for the
  block-min term m * s) for Q4_1 Q5_1; Q8_K (blocks of 256: iscale = -127/x_amax, q = round(iscale
  * x), d = 1/iscale in fp32) for the k-quants; fp16 for F16 weights.
- the KV cache is fp16 (its default), and without flash attention K.Q is an F16 matmul, so Q is
  rounded to fp16 too, and the softmax weights are rounded to fp16 before they multiply V.
- everything else (norms, RoPE, SwiGLU, softmax) is float32, as here.

`emulate(model, tensors)` installs this on a loaded `Transformer` (hooks on its linears): the linears
round as llama.cpp's do in every pass of the engine, scores included, whose attention is the paged
cache's (its fp16 K and V). `GGMLDenseCausal` is the matching whole-sequence attention, for comparing a
model's forward pass with llama.cpp's directly. Never by default.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from localrt.errors import LocalrtError

from .attention import AttnLayer
from .gguf_load import GGUFTensors
from .llama import DenseCausal
from .llama import gguf_parts

# weight type -> activation format of its dot product (ggml-cpu.c type_traits_cpu[].vec_dot_type)
VEC_DOT_TYPE: dict[str, str] = {
    "Q4_0": "Q8_0",
    "Q5_0": "Q8_0",
    "Q8_0": "Q8_0",
    "Q4_1": "Q8_1",
    "Q5_1": "Q8_1",
    "Q2_K": "Q8_K",
    "Q3_K": "Q8_K",
    "Q4_K": "Q8_K",
    "Q5_K": "Q8_K",
    "Q6_K": "Q8_K",
    "F16": "F16",
    "BF16": "BF16",
}


def fake_q8_0(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [N, K] -> (dequantized Q8_0 activations [N, K], fp32 d [N, K/32], integer sums [N, K/32])."""
    n, k = x.shape
    blocks = x.float().reshape(n, k // 32, 32)
    amax = blocks.abs().amax(-1, keepdim=True)  # [N, nb, 1]
    d = amax / 127.0
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    q = torch.round(blocks * inv)  # torch.round is half-to-even, as _mm256_round_ps(_MM_ROUND_NEAREST)
    d16 = d.half().float()
    return (q * d16).reshape(n, k), d.squeeze(-1), q.sum(-1)


def fake_q8_k(x: torch.Tensor) -> torch.Tensor:
    """x [N, K] -> dequantized Q8_K activations (blocks of 256, fp32 scale from the signed extreme)."""
    n, k = x.shape
    blocks = x.float().reshape(n, k // 256, 256)
    extreme = blocks.gather(-1, blocks.abs().argmax(-1, keepdim=True))  # signed value of largest |x|
    iscale = torch.where(extreme != 0, -127.0 / extreme, torch.zeros_like(extreme))
    q = torch.round(iscale * blocks).clamp(max=127)
    d = torch.where(extreme != 0, 1.0 / iscale, torch.zeros_like(iscale))
    return (q * d).reshape(n, k)


class ActivationRounding:
    """A forward pre-hook (round the input like the weight's vec_dot_type) and post-hook (Q8_1's min term)."""

    def __init__(self, vec_type: str, mins: torch.Tensor | None) -> None:
        self.vec_type = vec_type
        self.mins = mins  # [out, K/32] fp32 block minimums of a Q4_1/Q5_1 weight
        self._s_error: torch.Tensor | None = None

    def pre(self, module: nn.Module, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        x = args[0]
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        if self.vec_type == "F16":
            out = flat.half().to(x.dtype)
        elif self.vec_type == "BF16":
            out = flat.bfloat16().to(x.dtype)
        elif self.vec_type == "Q8_K":
            out = fake_q8_k(flat).to(x.dtype)
        else:
            out, d, qsum = fake_q8_0(flat)
            out = out.to(x.dtype)
            if self.vec_type == "Q8_1" and self.mins is not None:
                # the dot product adds m * s with s = fp16(d * sum q), not m * fp16(d) * sum q
                s = (d * qsum).half().float()
                self._s_error = s - d.half().float() * qsum  # [N, nb]
        return (out.reshape(shape),)

    def post(self, module: nn.Module, args: tuple[torch.Tensor, ...], y: torch.Tensor) -> torch.Tensor:
        if self._s_error is None or self.mins is None:
            return y
        err, self._s_error = self._s_error, None
        return y + (err @ self.mins.T).reshape(y.shape).to(y.dtype)


def _block_mins(tensors: GGUFTensors, name: str) -> torch.Tensor:
    """Q4_1/Q5_1 weight -> its fp16 block minimums [rows, K/32] as fp32 (zeros for types without)."""
    t = tensors.by_name[name]
    rows = int(t.shape[1]) if len(t.shape) > 1 else 1
    if t.ggml_type not in ("Q4_1", "Q5_1"):
        return torch.zeros(rows, int(t.shape[0]) // 32)
    raw = tensors.raw(name)
    block_bytes = {"Q4_1": 20, "Q5_1": 24}[t.ggml_type]
    blocks = raw.view(rows, -1, block_bytes)
    return blocks[..., 2:4].contiguous().view(torch.float16).float().squeeze(-1)


def emulate(model: nn.Module, tensors: GGUFTensors) -> list[torch.utils.hooks.RemovableHandle]:
    """Round every linear's input as llama.cpp's CPU backend does for that weight's GGUF type.

    Returns the hook handles (`.remove()` them to go back to the default numerics). The tied head
    (no `output.weight`) uses token_embd's type, as llama.cpp does. A fused linear (attn_qkv) rounds
    once for all its parts, which llama.cpp does too when their types share a vec_dot_type.
    """
    handles = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        parts = gguf_parts(name, tensors)
        vec_types = {VEC_DOT_TYPE.get(tensors.by_name[p].ggml_type) for p in parts}
        if vec_types == {"Q8_0", "Q8_1"}:
            vec_types = {"Q8_1"}  # the same activation rounding; Q8_0 parts add no min term
        if len(vec_types) != 1 or None in vec_types:
            continue
        (vec_type,) = vec_types
        mins = None
        if vec_type == "Q8_1":
            mins = torch.cat([_block_mins(tensors, p) for p in parts]).to(module.weight.device)
        hook = ActivationRounding(vec_type, mins)
        handles.append(module.register_forward_pre_hook(hook.pre))
        handles.append(module.register_forward_hook(hook.post))
    return handles


class GGMLDenseCausal(DenseCausal):
    """Dense causal attention with llama.cpp's non-flash CPU rounding: fp16 K, V (the cache) and Q
    (the F16 matmul's vec_dot_type), fp32 scores and softmax, fp16 softmax weights times V."""

    def attend(self, layer: AttnLayer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if layer.window or layer.softcap:
            raise LocalrtError(
                "llama.cpp numerics emulate full attention only (no sliding window or soft-cap)"
            )
        n, n_head, head_dim = q.shape
        group = n_head // k.shape[1]
        r = [t.half().float().transpose(0, 1) for t in (q, k, v)]  # [H(kv), N, D]
        qh, kh, vh = r[0], r[1].repeat_interleave(group, 0), r[2].repeat_interleave(group, 0)
        scores = (qh @ kh.transpose(1, 2)) * head_dim**-0.5  # [H, N, N]
        causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        probs = F.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)
        out = probs.half().float() @ vh  # [H, N, D]
        return out.transpose(0, 1).to(q.dtype)
