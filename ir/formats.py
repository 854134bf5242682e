"""Weight storage formats: how a checkpoint stores one logical weight, and its companion tensors.

A logical weight (a linear's W [O, I], or the stacked experts' W [E, O, I]) has one storage format.
Narrow formats carry companion tensors (MLC-LLM's param map: one logical weight, several stored
tensors), named by appending a suffix to the weight's checkpoint name:

    format               stored element    companions (suffix: shape for W [.., O, I])      meaning
    bf16 / fp16 / fp32   that dtype        none                                              W
    fp8_e4m3_block128    float8_e4m3fn     _scale_inv: float32 [.., ceil(O/128), ceil(I/128)]  W[o, i] = q[o, i] * s[o // 128, i // 128]

(DeepSeek-V3's released layout: edge blocks are partial -- "ceil blocks" -- e.g. kv_a_proj_with_mqa's 576 rows
have 5 row blocks, the last one 64 rows.)

Huawei msModelSlim's integer formats (what its W8A8 / W4A8 checkpoints store; vllm-ascend runs them), each
weight with `_scale` / `_offset` companions (float32 [.., O, 1]; the offsets written as zeros: symmetric):

    int8_channel         int8 [.., O, I]   W8A8_DYNAMIC        W[o, i] = q[o, i] * s[o]
    int8_static          int8 [.., O, I]   W8A8 (static)       as int8_channel; the activation's per-tensor
                                                               input_scale / input_offset, deq_scale, quant_bias
                                                               are module siblings (ir/formats_int.py)
    int4_channel         int8 [.., O/2, I] W4A8_DYNAMIC 1.0.0  two int4 per byte along O: byte[j, i] =
                                                               (q[2j+1, i] << 4) | (q[2j, i] & 0xF); W = q * s[o]
    int4_channel_byte    int8 [.., O, I]   one int4 (-8..7) per byte, W = q * s[o]
    int4_group256        int8 [.., O, I]   W4A8_DYNAMIC < 1.0.0: one int4 per byte, `_scale_second` /
                                           `_offset_second` [.., O, I/256]: W[o, i] = (q[o, i] * s2[o, i // 256]) * s[o]
    int4_group256_packed int8 [.., O/2, I] the same scales, two int4 per byte along O

A packed int4 weight also has a `scale_bias` module sibling (an Ascend-kernel correction, 8 * s[o] * sum_i q[o, i];
checked at load, never added).  Activations are quantised per token (dynamic) or per tensor (static) to int8:
ir/formats_int.py holds that arithmetic, the one definition the reference and the kernels share.

The activation dtype (Options.dtype) is separate: a bf16 model may keep some weights in FP8.  A weight whose
format is None in the graph is stored in the activation dtype (or fp32 where the op pins fp32).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class WeightFormat:
    name: str                       # the spelling in specs, manifests and the CLI
    storage: str                    # the stored element type: bf16 | fp16 | fp32 | fp8_e4m3
    block: tuple[int, int] | None   # (rows, cols) a scale covers, or None (unscaled, or per output channel)
    companions: tuple[str, ...]     # checkpoint-name suffixes of the companion tensors
    pack: int = 1                   # values per stored element along O (2: two int4 in one int8)
    group: int | None = None        # the second-stage scale's group along I (msModelSlim per-group int4)
    siblings: tuple[str, ...] = ()  # tensors beside the module's `weight` (their leaf names): static W8A8's
                                    # activation quantisation, packed int4's scale_bias checksum
    activation: str | None = None   # int8 activation quantisation: "token" (dynamic) | "tensor" (static)

    @property
    def quantized(self) -> bool:
        return bool(self.companions)


FP8_BLOCK = 128
FORMATS: dict[str, WeightFormat] = {f.name: f for f in (
    WeightFormat("bf16", "bf16", None, ()),
    WeightFormat("fp16", "fp16", None, ()),
    WeightFormat("fp32", "fp32", None, ()),
    WeightFormat("fp8_e4m3_block128", "fp8_e4m3", (FP8_BLOCK, FP8_BLOCK), ("_scale_inv",)),
    WeightFormat("int8_channel", "int8", None, ("_scale", "_offset"), activation="token"),
    WeightFormat("int8_static", "int8", None, ("_scale", "_offset"), activation="tensor",
                 siblings=("input_scale", "input_offset", "deq_scale", "quant_bias")),
    WeightFormat("int4_channel", "int4", None, ("_scale", "_offset"), pack=2, siblings=("scale_bias",),
                 activation="token"),
    WeightFormat("int4_channel_byte", "int4", None, ("_scale", "_offset"), activation="token"),
    WeightFormat("int4_group256", "int4", None, ("_scale", "_offset", "_scale_second", "_offset_second"),
                 group=256, activation="token"),
    WeightFormat("int4_group256_packed", "int4", None, ("_scale", "_offset", "_scale_second", "_offset_second"),
                 pack=2, group=256, siblings=("scale_bias",), activation="token"),
)}
FP8 = FORMATS["fp8_e4m3_block128"]
INT_FORMATS = tuple(f for f in FORMATS.values() if f.storage in ("int8", "int4"))

# The tensors DeepSeek-V3's FP8 checkpoints store in FP8 (globs over checkpoint names; bound per-expert
# stacks match too): every decoder-layer linear -- transformers' FineGrainedFP8 replaces each nn.Linear but
# lm_head -- so not the embedding, the norms, the router gate (a TopkRouter, not a Linear) and its
# e_score_correction_bias, nor lm_head.  `spec --from-config`, `--dtype fp8` / `weight_format="fp8"` and
# `dsgraph quantize` all take the FP8 weights from here.
FP8_CHECKPOINT_GLOBS = ("model.layers.*.self_attn.*_proj*.weight", "model.layers.*.mlp.*_proj.weight")


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


ACT = "act"     # a spec's spelling of "stored in the activation dtype" (weight_formats)
UNSCALED = tuple(n for n, f in FORMATS.items() if not f.quantized)   # what a kernel takes unless it says more
FP8_MAX = 448.0                     # the largest finite float8_e4m3fn


def weight_formats_yaml(globs, fmt: WeightFormat) -> str:
    """A spec's ``weight_formats:`` section storing the weights `globs` match in `fmt` (ir/spec.py reads it)."""
    import json

    lines = ["", "weight_formats:                 # how the checkpoint stores its weights (first match wins; "
                 "the rest: the activation dtype)"]
    lines += [f"  {json.dumps(g)}: {fmt.name}" for g in globs]
    return "\n".join(lines) + "\n"


def weight_format(G, name: str, act: str = "bf16") -> WeightFormat:
    """The storage format of bound weight `name` of graph G: its WeightInfo's format, or (None) the
    activation dtype's `act` (fp32 where the weight is pinned to fp32)."""
    info = G.graph["weights"][name]
    if info.format is not None:
        return FORMATS[info.format]
    return FORMATS["fp32" if info.keep_fp32 else act]


def companions_of(weights: dict, name: str) -> tuple[str, ...]:
    """The bound companion names (scales) of bound weight `name` in a graph's weights table; () if unscaled."""
    info = weights[name]
    if info.format is None:
        return ()
    return companion_names(name, FORMATS[info.format])


def with_companions(weights: dict, names) -> set[str]:
    """`names` and the companions each of them carries: what a pass that drops unbound weights keeps."""
    out = set(names)
    for n in names:
        if n in weights:
            out.update(companions_of(weights, n))
    return out


def block_slice_problem(fmt: WeightFormat, dim: int, start: int, stop: int, whole: int) -> str | None:
    """Why rows/columns [start, stop) of a `whole`-long dim of a block-scaled weight cannot be cut with its
    scales (the cut must fall on block edges; the last block may be partial), or None."""
    if fmt.block is None:
        return None
    b = fmt.block[dim]
    if start % b or (stop % b and stop != whole):
        return (f"{start}:{stop} of a {whole}-long dim does not fall on the {b}-wide blocks of its "
                f"{fmt.name} scales")
    return None


def companion_info(info, fmt: WeightFormat, suffix: str):
    """The WeightInfo of a block format's scale companion for a weight bound as `info`: the scale shape,
    float32, its stacked parts the matching scales (a slice of a weight becomes that slice of its
    scale's blocks).  A ValueError if a slice of the weight does not fall on block edges."""
    from .ops.base import WeightInfo, WeightSlice

    if fmt.block is None:
        return _channel_companion_info(info, fmt, suffix)
    parts = None
    if info.parts is not None:
        parts = []
        for p in info.parts:
            if isinstance(p, str):
                parts.append(p + suffix)
                continue
            problem = block_slice_problem(fmt, p.dim, p.start, p.stop, p.stored[p.dim])
            if problem:
                raise ValueError(f"stacked part {p.name} {problem}")
            b = fmt.block[p.dim]
            parts.append(WeightSlice(p.name + suffix, p.dim, p.start // b, cdiv(p.stop, b), scale_shape(p.stored, fmt)))
        parts = tuple(parts)
    return WeightInfo(scale_shape(tuple(info.shape), fmt), True, parts)


def _channel_companion_info(info, fmt: WeightFormat, suffix: str):
    """An integer format's companion (per output channel [.., O, 1], or per group [.., O, I/G]): per-expert
    parts follow the weight's; a slice of rows is those rows of the scale.  A slice of columns is refused:
    the activation a column block multiplies would be quantised apart from the rest of its row."""
    from .formats_int import companion_shape
    from .ops.base import WeightInfo, WeightSlice

    parts = None
    if info.parts is not None:
        parts = []
        for p in info.parts:
            if isinstance(p, str):
                parts.append(p + suffix)
                continue
            if p.dim != len(p.stored) - 2:
                raise ValueError(f"stacked part {p.name} is a slice of input columns; {fmt.name} quantises each "
                                 f"activation row whole")
            parts.append(WeightSlice(p.name + suffix, p.dim, p.start, p.stop, companion_shape(fmt, suffix, p.stored)))
        parts = tuple(parts)
    return WeightInfo(companion_shape(fmt, suffix, tuple(info.shape)), True, parts)


def companion_shape_of(fmt: WeightFormat, suffix: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape of companion `suffix` of a weight of logical `shape` in `fmt` (a block scale, or an integer
    format's per-channel / per-group scale)."""
    if fmt.block is not None:
        return scale_shape(shape, fmt)
    from .formats_int import companion_shape
    return companion_shape(fmt, suffix, shape)


def stored_shape(fmt: WeightFormat | None, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape a weight of logical `shape` is stored in: packed int4 holds two output channels a byte."""
    if fmt is None or fmt.pack == 1:
        return tuple(shape)
    from .formats_int import stored_shape as packed
    return packed(fmt, tuple(shape))


def set_format(weights: dict, name: str, fmt: WeightFormat) -> None:
    """Store bound weight `name` in quantised format `fmt`: its WeightInfo's format, and its companions
    bound beside it.  (An unscaled weight's format stays None: it is stored in the activation dtype.)"""
    from dataclasses import replace

    if not fmt.quantized:
        raise ValueError(f"{name}: format {fmt.name} is unscaled; an unscaled weight is stored in the activation dtype")
    if fmt.activation == "tensor":
        raise ValueError(f"{name}: format {fmt.name} (static W8A8) is read and checked by the loader "
                         f"(runtime/msmodelslim.py), but no op computes its per-tensor activation quantisation yet")
    info = replace(weights[name], format=fmt.name)
    weights[name] = info
    for suffix, cname in zip(fmt.companions, companion_names(name, fmt)):
        weights[cname] = companion_info(info, fmt, suffix)


def dequantize(weight, companions, fmt: WeightFormat):
    """The float32 weight a quantised `weight` and its `companions` (in fmt.companions order) stand for:
    the reference semantics of every op on an FP8 weight.  FP8 blocks: W = q * s per block, the
    edge blocks partial, exact in float32 (an e4m3 value times a float32 scale rounds once).  The integer
    formats: ir/formats_int.dequantize_int (their ops multiply exactly instead: formats_int.int_linear)."""
    from .lazy import torch

    if not fmt.quantized:
        return weight
    if fmt.block is None:
        from .formats_int import dequantize_int
        return dequantize_int(weight, companions, fmt)
    (scale_inv,) = companions
    want = scale_shape(tuple(weight.shape), fmt)
    if tuple(scale_inv.shape) != want:
        raise ValueError(f"{fmt.name} scale has shape {tuple(scale_inv.shape)}, expected {want} for a weight of "
                         f"shape {tuple(weight.shape)}")
    rows, cols = weight.shape[-2:]
    return weight.to(torch.float32) * _spread_scale(scale_inv.to(torch.float32), rows, cols, fmt)


def quantize(weight, fmt: WeightFormat):
    """(q, companions) storing float `weight` [.., rows, cols] in format `fmt`.  FP8 as DeepSeek-V3's
    checkpoints are written: per block s = amax|W| / 448 in float32 (an all-zero block gets s = 1),
    q = W / s saturated to +-448 and rounded to nearest even in float8_e4m3fn; the stored scale_inv is s.
    The integer formats as msModelSlim writes them: ir/formats_int.quantize_int."""
    from .lazy import F, torch

    if fmt in INT_FORMATS:
        from .formats_int import quantize_int
        return quantize_int(weight, fmt)
    if fmt is not FP8:
        raise ValueError(f"quantising to {fmt.name} is not supported (only {FP8.name} and the integer formats)")
    w = weight.to(torch.float32)
    *lead, rows, cols = w.shape
    br, bc = fmt.block
    pr, pc = cdiv(rows, br) * br - rows, cdiv(cols, bc) * bc - cols
    padded = F.pad(w, (0, pc, 0, pr))      # zeros: they never raise a block's amax
    blocks = padded.reshape(*lead, cdiv(rows, br), br, cdiv(cols, bc), bc)
    amax = blocks.abs().amax(dim=(-3, -1))
    s = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (w / _spread_scale(s, rows, cols, fmt)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, (s,)


def _spread_scale(scale_inv, rows: int, cols: int, fmt: WeightFormat):
    """A block scale [.., ceil(rows/br), ceil(cols/bc)] spread to one value per element [.., rows, cols]."""
    br, bc = fmt.block
    return scale_inv.repeat_interleave(br, -2)[..., :rows, :].repeat_interleave(bc, -1)[..., :cols]


def format_problem(weights: dict, name: str, role: str, opdef) -> str | None:
    """Why bound weight `name` cannot be the `role` of an op `opdef` in a graph whose weights table is
    `weights` (its format, its companions), or None."""
    info = weights[name]
    if info.format is None:
        return None
    fmt = FORMATS.get(info.format)
    if fmt is None:
        return f"weight {name} has unknown format {info.format!r} (known: {', '.join(FORMATS)})"
    if role not in opdef.scaled_weights or info.keep_fp32:
        return f"weight {name} is {fmt.name}, but {opdef.name} takes its {role} unquantised"
    if fmt.block is None:
        from .formats_int import INT_OPS
        if opdef.name not in INT_OPS:
            return f"weight {name} is {fmt.name}, but {opdef.name} takes its {role} in float or FP8 only"
    for cname in companion_names(name, fmt):
        c = weights.get(cname)
        if c is None:
            return f"weight {name} is {fmt.name}, but its companion {cname} is not bound"
    for suffix, cname in zip(fmt.companions, companion_names(name, fmt)):
        c = weights[cname]
        want = companion_shape_of(fmt, suffix, tuple(info.shape))
        if tuple(c.shape) != want or not c.keep_fp32:
            return (f"companion {cname} is bound as {tuple(c.shape)}{'' if c.keep_fp32 else ' (not float32)'}, "
                    f"{fmt.name} needs float32 {want} for {name} {tuple(info.shape)}")
        if (c.parts is None) != (info.parts is None) or (c.parts is not None and len(c.parts) != len(info.parts)):
            return f"companion {cname} is not stacked as {name} is"
    return None
