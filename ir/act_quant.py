"""FP8 activations for the FP8 x FP8 GEMMs: the reference semantics of the quantiser
(templates/include/quant_fp8.cuh) and of the product it feeds (templates/include/gemm_fp8.cuh).

Per token t and 128-column group g of x [T, K] (the last group partial where K % 128 != 0):

    amax = max(max |x[t, 128 g : 128 g + 128]|, AMAX_FLOOR)
    s[t, g] = amax / 448                       (fp32 division)
    q[t, c] = e4m3(x[t, c] / s[t, c // 128])   (fp32 division, round to nearest even, saturated to +-448)

so x ~= q * s (DeepSeek-V3 / DeepGEMM's convention: the scale is the multiplier).  The floor keeps an
all-zero group's scale finite (its bytes are 0).  The GEMM with an fp8_e4m3_block128 weight (q_w, s_w)
is then, exactly,

    y[t, o] = sum over K blocks kb of  s[t, kb] * s_w[o // 128, kb] * (q[t, kb-block] . q_w[o, kb-block])

which `linear_fp8` evaluates in float64 (the kernel's fp32 promotion per block stays within fp32 of it).

The grouped expert GEMMs (templates/include/moe_gemm_fp8.cuh) quantise their input the same way, row by
row: moe_gate_up's x [T, D] once a token (its K pairs share the token's row), moe_down's a [NP, M] once
a pair.  Pair p then multiplies its row rows[p] (p // K, or p) by its expert's weight [E, N, KD] with
scales [E, ceil(N / 128), ceil(KD / 128)]: `grouped_linear_fp8`.  `act_fp8_roundtrip` is what a
reference that runs on 16-bit or fp32 activations feeds its op where the kernel ran on e4m3 ones.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .formats import FP8_BLOCK, FP8_MAX, cdiv

AMAX_FLOOR = 1e-10    # quant_fp8.cuh AMAX_FLOOR


def quantize_act_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] (any float dtype) -> (q float8_e4m3fn [T, K], s float32 [T, ceil(K / 128)])."""
    if x.dim() != 2:
        raise ValueError(f"quantize_act_fp8 takes x [T, K], got shape {tuple(x.shape)}")
    T, K = x.shape
    KB = cdiv(K, FP8_BLOCK)
    xf = F.pad(x.float(), (0, KB * FP8_BLOCK - K)).view(T, KB, FP8_BLOCK)
    amax = xf.abs().amax(dim=-1).clamp_min(AMAX_FLOOR)
    # tensor by tensor: true fp32 division (torch multiplies by the reciprocal of a scalar divisor on
    # CUDA, which rounds differently from the kernel's amax / 448)
    s = amax / torch.full_like(amax, FP8_MAX)
    q = (xf / s.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(T, KB * FP8_BLOCK)[:, :K].contiguous(), s


def dequantize_act_fp8(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """q * s per token per 128 columns, in float64 (exact: an e4m3 value times an fp32 scale)."""
    K = q.shape[1]
    return q.double() * s.double().repeat_interleave(FP8_BLOCK, dim=1)[:, :K]


def dequantize_weight_fp8(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """W = q * s per 128 x 128 block (edge blocks partial), in float64."""
    O, K = q.shape
    return q.double() * s.double().repeat_interleave(FP8_BLOCK, 0)[:O].repeat_interleave(FP8_BLOCK, 1)[:, :K]


def linear_fp8(qx: torch.Tensor, sx: torch.Tensor, qw: torch.Tensor, sw: torch.Tensor) -> torch.Tensor:
    """y [T, O] float64 = the FP8 x FP8 product of the quantised x (qx, sx) and weight (qw, sw)."""
    return dequantize_act_fp8(qx, sx) @ dequantize_weight_fp8(qw, sw).T


def act_fp8_roundtrip(x: torch.Tensor) -> torch.Tensor:
    """x [R, K] as the FP8 GEMMs see it: quantised per row per 128 columns, dequantised, in x's dtype."""
    return dequantize_act_fp8(*quantize_act_fp8(x)).to(x.dtype)


def dequantize_experts_fp8(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """W [E, N, KD] float64 = q * s per expert per 128 x 128 block (edge blocks partial)."""
    _, N, KD = q.shape
    return q.double() * s.double().repeat_interleave(FP8_BLOCK, 1)[:, :N].repeat_interleave(FP8_BLOCK, 2)[:, :, :KD]


def grouped_linear_fp8(qx: torch.Tensor, sx: torch.Tensor, rows: torch.Tensor, experts: torch.Tensor,
                       qw: torch.Tensor, sw: torch.Tensor) -> torch.Tensor:
    """y [P, N] float64: pair p's FP8 x FP8 product, row rows[p] of the quantised activations (qx [R, KD],
    sx [R, ceil(KD / 128)]) times expert experts[p]'s FP8 weight (qw [E, N, KD], sw); a pair whose expert
    is outside [0, E) (another rank's) is zeros, as no kernel writes it."""
    x = dequantize_act_fp8(qx, sx)
    w = dequantize_experts_fp8(qw, sw)
    y = torch.zeros(rows.shape[0], qw.shape[1], dtype=torch.float64, device=x.device)
    rows, experts = rows.to(x.device), experts.to(x.device)
    for e in torch.unique(experts).tolist():
        if 0 <= e < qw.shape[0]:
            at = (experts == e).nonzero().squeeze(1)
            y[at] = x[rows[at]] @ w[e].T
    return y
