"""Weight storage formats: how a checkpoint stores one logical weight, and its companion tensors.

A logical weight (a linear's W [O, I], or the stacked experts' W [E, O, I]) has one storage format.
Narrow formats carry companion tensors (MLC-LLM's param map: one logical weight, several stored
tensors), named by appending a suffix to the weight's checkpoint name:

    format               stored element    companions (suffix: shape for W [.., O, I])      meaning
    bf16 / fp16 / fp32   that dtype        none                                              W
    fp8_e4m3_block128    float8_e4m3fn     _scale_inv: float32 [.., ceil(O/128), ceil(I/128)]  W[o, i] = q[o, i] * s[o // 128, i // 128]

(DeepSeek-V3's released layout: edge blocks are partial -- "ceil blocks" -- e.g. kv_a_proj_with_mqa's 576 rows
have 5 row blocks, the last one 64 rows.)  int8 per output channel and packed int4 (msModelSlim W8A8 / W4A8)
are to be added here as rows of the same table.

The activation dtype (Options.dtype) is separate: a bf16 model may keep some weights in FP8.  A weight whose
format is None in the graph is stored in the activation dtype (or fp32 where the op pins fp32).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class WeightFormat:
    name: str                       # the spelling in specs, manifests and the CLI
    storage: str                    # the stored element type: bf16 | fp16 | fp32 | fp8_e4m3
    block: tuple[int, int] | None   # (rows, cols) a scale covers, or None (unscaled)
    companions: tuple[str, ...]     # checkpoint-name suffixes of the companion tensors

    @property
    def quantized(self) -> bool:
        return bool(self.companions)


FP8_BLOCK = 128
FORMATS: dict[str, WeightFormat] = {f.name: f for f in (
    WeightFormat("bf16", "bf16", None, ()),
    WeightFormat("fp16", "fp16", None, ()),
    WeightFormat("fp32", "fp32", None, ()),
    WeightFormat("fp8_e4m3_block128", "fp8_e4m3", (FP8_BLOCK, FP8_BLOCK), ("_scale_inv",)),
)}
FP8 = FORMATS["fp8_e4m3_block128"]


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def scale_shape(shape: tuple[int, ...], fmt: WeightFormat) -> tuple[int, ...]:
    """The shape of a block format's scale tensor for a weight of `shape` (leading dims kept, the last two
    divided into ceil blocks)."""
    if fmt.block is None:
        raise ValueError(f"format {fmt.name} has no scales")
    if len(shape) < 2:
        raise ValueError(f"format {fmt.name} needs a weight of 2 or more dims, got shape {tuple(shape)}")
    *lead, rows, cols = shape
    return (*lead, cdiv(rows, fmt.block[0]), cdiv(cols, fmt.block[1]))


def companion_names(weight_name: str, fmt: WeightFormat) -> tuple[str, ...]:
    """Checkpoint names of a weight's companion tensors, in the order of fmt.companions."""
    return tuple(weight_name + suffix for suffix in fmt.companions)


def weight_format(G, weight_name: str, act_dtype: str = "bf16") -> WeightFormat:
    """The storage format of bound weight `weight_name` of graph G: its WeightInfo's `format` where it
    declares one, else fp32 for a weight the op pins to fp32, else the activation dtype's."""
    info = G.graph["weights"][weight_name]
    name = getattr(info, "format", None)
    if name is None:
        return FORMATS["fp32" if getattr(info, "keep_fp32", False) else act_dtype]
    if name not in FORMATS:
        raise ValueError(f"weight {weight_name} has unknown format {name!r} (one of {', '.join(FORMATS)})")
    return FORMATS[name]
