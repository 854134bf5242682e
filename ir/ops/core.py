"""Dense building blocks: embedding, linear, norms, residual add, split, SwiGLU."""
from __future__ import annotations

from ..formats import FP8_BLOCK, cdiv
from ..formats_int import IntMatrix, linear, qrow, quantized_rows
from ..lazy import F, torch
from .base import MULTI_LINEAR_MAX, Attr, Node, OpDef, TType, expect, is_float, register, same_rows


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Mirrors transformers: normalise in fp32, cast back, then scale by the weight.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


# The quantised rows a norm may also write for readers that would quantise its output themselves
# (attrs["quant"], set by ir/passes/fuse_norm_int8_quant.py / fuse_norm_fp8_quant.py; never by a spec):
# "int8" adds q int32 [T, qrow(n) / 4] (the int8 rows, four bytes a word) and s float32 [T]
# (ir/formats_int.py quantized_rows); "fp8" adds q int32 [T, n / 4] (e4m3 bytes, four a word) and s float32
# [T, ceil(n / 128)] (ir/act_quant.py quantize_act_fp8: per token per 128 columns).
NORM_QUANT = ("int8", "fp8")


def norm_quant_types(node, h: TType) -> list[TType]:
    """The types of the quantised rows a norm with normed output `h` writes after its usual outputs."""
    quant = node.attrs.get("quant")
    if quant is None:
        return []
    expect(quant in NORM_QUANT, f"a norm's quantised rows are one of {', '.join(NORM_QUANT)}, got {quant!r}")
    rows, n = h.shape
    if quant == "fp8":
        expect(n % 16 == 0, f"a norm's FP8 rows are whole 16-byte chunks: width {n} is not a multiple of 16")
        return [TType((rows, n // 4), "i32"), TType((rows, cdiv(n, FP8_BLOCK)), "f32")]
    return [TType((rows, qrow(n) // 4), "i32"), TType((rows,), "f32")]


def norm_quant_ref(node, h: torch.Tensor) -> list:
    """The quantised rows of the normed output h (norm_quant_types), computed from h as its readers would."""
    quant = node.attrs.get("quant")
    if quant == "fp8":
        from ..act_quant import quantize_act_fp8   # imports torch: only where a graph runs
        q, s = quantize_act_fp8(h)
        return [q.view(torch.uint8).view(torch.int32), s]
    return list(quantized_rows(h)) if quant is not None else []


@register
class Embedding(OpDef):
    name = "embedding"
    weights = {"weight": True}
    doc = "ids [T] -> rows of the embedding table [T, D]"

    @classmethod
    def infer(cls, node, ins, model):
        (ids,) = ins
        expect(ids.dtype == "i64" and len(ids.shape) == 1, f"embedding expects int64 ids [T], got {ids}")
        D, vocab = model.dims["hidden"], model.dims["vocab"]
        return [TType((ids.shape[0], D), "act")], {"weight": (vocab, D)}

    @classmethod
    def run(cls, node, ins, w, ctx):
        return [w["weight"][ins[0]]]


@register
class Linear(OpDef):
    name = "linear"
    scaled_weights = ("weight",)
    attrs = {"out_dim": Attr("dim"), "precision": Attr("choice", "act", ("act", "fp32"))}
    weights = {"weight": True}
    doc = "x [T, k] @ W[n, k]^T -> [T, n]; precision fp32 keeps the router in float32"

    @classmethod
    def infer(cls, node, ins, model):
        (x,) = ins
        expect(len(x.shape) == 2 and is_float(x), f"linear expects a float [T, k] input, got {x}")
        n, k = node.attrs["out_dim"], x.shape[1]
        out_dtype = "f32" if node.attrs["precision"] == "fp32" else "act"
        expect(node.attrs["precision"] == "fp32" or x.dtype == "act",
               f"linear at activation precision needs an activation input, got {x}")
        return [TType((x.shape[0], n), out_dtype)], {"weight": (n, k)}

    @classmethod
    def fp32_roles(cls, node):
        return ("weight",) if node.attrs["precision"] == "fp32" else ()

    @classmethod
    def run(cls, node, ins, w, ctx):
        x, weight = ins[0], w["weight"]
        if node.attrs["precision"] == "fp32":
            return [F.linear(x.float(), weight.float())]
        # rows gathered from the cache (mla_gather_context) come in the cache's dtype, which a reference
        # engine may keep wider than its weights (float64 over float32 weights); an integer weight's
        # linear computes in x's dtype (IntMatrix)
        return [linear(x if isinstance(weight, IntMatrix) else x.to(weight.dtype), weight)]


@register
class MultiLinear(OpDef):
    name = "multi_linear"
    scaled_weights = tuple(f"weight{i}" for i in range(MULTI_LINEAR_MAX))
    outputs = -1  # as many as out_dims
    attrs = {"out_dims": Attr("dims")}
    weights = {f"weight{i}": i < 2 for i in range(MULTI_LINEAR_MAX)}
    doc = ("x [T, k] @ W_i[n_i, k]^T -> [T, n_i] for each weight i: sibling linears that read one input "
           "(ir/passes/fuse_sibling_linears.py), so one kernel reads x once for all of them")

    @classmethod
    def infer(cls, node, ins, model):
        (x,) = ins
        dims = node.attrs["out_dims"]
        expect(len(x.shape) == 2 and x.dtype == "act", f"multi_linear expects an activation [T, k] input, got {x}")
        expect(2 <= len(dims) <= MULTI_LINEAR_MAX, f"multi_linear has 2..{MULTI_LINEAR_MAX} weights, got {len(dims)}")
        roles = [f"weight{i}" for i in range(len(dims))]
        # (nothing bound yet while a graph builder adds the node: it binds the weights right after)
        expect(not node.weights or sorted(node.weights) == roles,
               f"multi_linear with {len(dims)} out_dims binds {', '.join(roles)}; bound: {', '.join(sorted(node.weights))}")
        return [TType((x.shape[0], n), "act") for n in dims], {r: (n, x.shape[1]) for r, n in zip(roles, dims)}

    @classmethod
    def run(cls, node, ins, w, ctx):
        return [linear(ins[0], w[f"weight{i}"]) for i in range(len(node.attrs["out_dims"]))]


def gate_up_silu_ref(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(x gate^T) * (x up^T), rounded where the unfused linear, linear and silu_and_mul round
    (in place on the gate product: the runtime runs this above the skinny kernel's token count)."""
    return F.silu(linear(x, gate), inplace=True).mul_(linear(x, up))


@register
class GateUpSilu(OpDef):
    name = "gate_up_silu"
    scaled_weights = ("gate", "up")
    attrs = {"out_dim": Attr("dim")}
    weights = {"gate": True, "up": True}
    doc = ("x [T, k] -> silu(x W_gate^T) * (x W_up^T) [T, n]: SwiGLU in the epilogue of the fused gate + up "
           "linear (ir/passes/fuse_gate_up_silu.py)")

    @classmethod
    def infer(cls, node, ins, model):
        (x,) = ins
        expect(len(x.shape) == 2 and x.dtype == "act", f"gate_up_silu expects an activation [T, k] input, got {x}")
        n = node.attrs["out_dim"]
        return [TType((x.shape[0], n), "act")], {"gate": (n, x.shape[1]), "up": (n, x.shape[1])}

    @classmethod
    def run(cls, node, ins, w, ctx):
        return [gate_up_silu_ref(ins[0], w["gate"], w["up"])]


@register
class RmsNorm(OpDef):
    name = "rms_norm"
    attrs = {"eps": Attr("float", None, positive=True)}
    weights = {"weight": True}
    doc = "x [T, n] -> x / rms(x) * w"

    @classmethod
    def infer(cls, node, ins, model):
        (x,) = ins
        expect(len(x.shape) == 2 and x.dtype == "act", f"rms_norm expects an activation [T, n], got {x}")
        return [x, *norm_quant_types(node, x)], {"weight": (x.shape[1],)}

    @classmethod
    def run(cls, node, ins, w, ctx):
        h = rms_norm_ref(ins[0], w["weight"], node.attrs["eps"])
        return [h, *norm_quant_ref(node, h)]


@register
class FusedAddRmsNorm(OpDef):
    name = "fused_add_rms_norm"
    inputs = 2
    outputs = 2
    attrs = {"eps": Attr("float", None, positive=True)}
    weights = {"weight": True}
    doc = "[x, residual] -> [rms_norm(x + residual), x + residual]"

    @classmethod
    def infer(cls, node, ins, model):
        x, r = ins
        expect(x == r and len(x.shape) == 2 and x.dtype == "act", f"fused_add_rms_norm needs equal inputs, got {x} and {r}")
        return [x, x, *norm_quant_types(node, x)], {"weight": (x.shape[1],)}

    @classmethod
    def run(cls, node, ins, w, ctx):
        s = ins[0] + ins[1]
        h = rms_norm_ref(s, w["weight"], node.attrs["eps"])
        return [h, s, *norm_quant_ref(node, h)]


@register
class Add(OpDef):
    name = "add"
    inputs = 2
    doc = "elementwise a + b"

    @classmethod
    def infer(cls, node, ins, model):
        a, b = ins
        expect(a == b and is_float(a), f"add needs two float values of one type, got {a} and {b}")
        return [a], {}

    @classmethod
    def run(cls, node, ins, w, ctx):
        return [ins[0] + ins[1]]


@register
class Split(OpDef):
    name = "split"
    outputs = -1  # as many as sizes
    attrs = {"sizes": Attr("dims"), "heads": Attr("dim", None)}
    doc = "[T, sum] -> pieces [T, s_i]; with heads: [T, heads*sum] -> [T, heads, s_i] (views, no copy)"

    @classmethod
    def infer(cls, node, ins, model):
        (x,) = ins
        sizes, heads = node.attrs["sizes"], node.attrs["heads"]
        total = sum(sizes)
        if heads is None:
            expect(len(x.shape) == 2 and x.shape[1] == total,
                   f"split sizes {sizes} add up to {total}, the input is {x}")
            return [TType((x.shape[0], s), x.dtype) for s in sizes], {}
        width = x.shape[-1] if len(x.shape) == 3 else x.shape[1]
        expect(len(x.shape) in (2, 3), f"split expects a 2-d or 3-d input, got {x}")
        if len(x.shape) == 2:
            expect(width == heads * total, f"split into {heads} heads of {sizes} needs width {heads * total}, input is {x}")
        else:
            expect(x.shape[1] == heads and width == total, f"split of {x} into {heads} heads of {sizes} does not fit")
        return [TType((x.shape[0], heads, s), x.dtype) for s in sizes], {}

    @classmethod
    def run(cls, node, ins, w, ctx):
        x, sizes, heads = ins[0], node.attrs["sizes"], node.attrs["heads"]
        if heads is not None:
            x = x.view(x.shape[0], heads, sum(sizes))
        return list(torch.split(x, sizes, dim=-1))


@register
class SiluAndMul(OpDef):
    name = "silu_and_mul"
    inputs = 2
    doc = "[gate, up] -> silu(gate) * up (SwiGLU)"

    @classmethod
    def infer(cls, node, ins, model):
        g, u = ins
        expect(g == u and g.dtype == "act", f"silu_and_mul needs equal activation inputs, got {g} and {u}")
        return [g], {}

    @classmethod
    def run(cls, node, ins, w, ctx):
        return [F.silu(ins[0]) * ins[1]]


__all__ = ["NORM_QUANT", "norm_quant_ref", "norm_quant_types", "rms_norm_ref", "same_rows", "Node"]
