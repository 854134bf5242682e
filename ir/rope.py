"""Rotary embedding tables (plain and YaRN), as transformers computes them.

The YaRN softmax factor ``mscale(factor, mscale_all_dim)**2`` is folded into the
attention scale (ModelConfig.softmax_scale); the cos/sin tables carry
``attention_factor = mscale(factor, mscale) / mscale(factor, mscale_all_dim)``,
which is 1.0 for every published DeepSeek config.
"""
from __future__ import annotations

import math
from functools import lru_cache

import torch


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


@lru_cache(maxsize=16)
def _inv_freq(rope, dim: int) -> tuple[float, ...]:
    base = rope.theta
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolation = 1.0 / pos_freqs
    if rope.scaling != "yarn":
        return tuple(extrapolation.tolist())
    interpolation = 1.0 / (rope.factor * pos_freqs)

    def correction_dim(rotations):
        return (dim * math.log(rope.original_max_position_embeddings / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp, as transformers does
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation_factor = 1 - ramp
    inv = interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor
    return tuple(inv.tolist())


def inv_freq(rope, dim: int) -> torch.Tensor:
    """[dim/2] float32 inverse frequencies."""
    return torch.tensor(_inv_freq(rope, dim), dtype=torch.float32)


def attention_factor(rope) -> float:
    if rope.scaling != "yarn":
        return 1.0
    if rope.mscale and rope.mscale_all_dim:
        return yarn_mscale(rope.factor, rope.mscale) / yarn_mscale(rope.factor, rope.mscale_all_dim)
    return yarn_mscale(rope.factor)


def cos_sin(rope, dim: int, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin: [T, dim/2] float32 for the given int positions (already scaled by the attention factor)."""
    freqs = positions.float()[:, None] * inv_freq(rope, dim).to(positions.device)[None, :]
    scale = attention_factor(rope)
    return torch.cos(freqs) * scale, torch.sin(freqs) * scale


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pairs: str, output: str) -> torch.Tensor:
    """Rotate the last dim of x ([..., R]) by per-token angles (cos/sin broadcast over middle dims).

    pairs: which elements form a rotation pair in the input: "adjacent" (x0,x1),(x2,x3)... as
    DeepSeek's checkpoints lay them out, or "halves" (x_i, x_{i+R/2}) as in GPT-NeoX.
    output: "interleaved" writes the pairs back adjacent (transformers' DeepseekV2), "halves"
    writes all first members then all second members (DeepseekV3's rope_interleave form).
    """
    xf = x.float()
    if pairs == "adjacent":
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
    else:
        half = xf.shape[-1] // 2
        x1, x2 = xf[..., :half], xf[..., half:]
    while cos.dim() < x1.dim():
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    y1 = x1 * cos - x2 * sin
    y2 = x2 * cos + x1 * sin
    if output == "interleaved":
        y = torch.stack((y1, y2), dim=-1).flatten(-2)
    else:
        y = torch.cat((y1, y2), dim=-1)
    return y.to(x.dtype)
