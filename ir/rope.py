"""Rotary embedding tables (plain and YaRN), as transformers computes them.

The YaRN softmax factor ``mscale(factor, mscale_all_dim)**2`` is folded into the
attention scale (ModelConfig.softmax_scale); the cos/sin tables carry
``attention_factor = mscale(factor, mscale) / mscale(factor, mscale_all_dim)``,
which is 1.0 for every published DeepSeek config.

The inverse frequencies are computed in plain Python, rounding to float32 after
every step exactly where transformers' float32 torch code rounds, so codegen (which
bakes them into kernels as constants) needs no torch and its output does not depend
on the CPU torch happens to run on.  Only ``base ** x`` can differ: torch's
vectorised float32 pow is not always correctly rounded, Python's is; the two agree
for every shipped spec and are at most one float32 ulp apart otherwise
(tests/ir/test_rope_yarn.py).
"""
from __future__ import annotations

import math
import struct
from functools import lru_cache

from .lazy import torch


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def _f32(x: float) -> float:
    """x rounded to the nearest float32 (as a Python float)."""
    return struct.unpack("f", struct.pack("f", x))[0]


@lru_cache(maxsize=16)
def inv_freq_values(rope, dim: int) -> tuple[float, ...]:
    """[dim/2] inverse frequencies as float32 values, in transformers' order of float32 operations."""
    base = _f32(rope.theta)
    # pos_freqs = base ** (arange(0, dim, 2, float32) / dim)
    pos_freqs = [_f32(base ** _f32(i / dim)) for i in range(0, dim, 2)]
    extrapolation = [_f32(1.0 / p) for p in pos_freqs]
    if rope.scaling != "yarn":
        return tuple(extrapolation)
    factor = _f32(rope.factor)
    interpolation = [_f32(1.0 / _f32(factor * p)) for p in pos_freqs]

    def correction_dim(rotations):
        return (dim * math.log(rope.original_max_position_embeddings / (rotations * 2 * math.pi))) / (2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp, as transformers does
    low32, span = _f32(low), _f32(high - low)
    out = []
    for i in range(dim // 2):
        ramp = min(max(_f32(_f32(i - low32) / span), 0.0), 1.0)      # clamp((arange - low) / (high - low), 0, 1)
        extrapolation_factor = _f32(1.0 - ramp)
        out.append(_f32(_f32(interpolation[i] * _f32(1.0 - extrapolation_factor))
                        + _f32(extrapolation[i] * extrapolation_factor)))
    return tuple(out)


def inv_freq(rope, dim: int) -> torch.Tensor:
    """[dim/2] float32 inverse frequencies."""
    return torch.tensor(inv_freq_values(rope, dim), dtype=torch.float32)


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
