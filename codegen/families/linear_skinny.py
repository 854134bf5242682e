"""linear_skinny: linear / multi_linear, x [T, K] (a possibly strided view) -> y_i [T, O_i] = x W_i^T,
and gate_up_silu, x -> silu(x W_gate^T) * (x W_up^T).

Each node lowers to two steps, of which a step runs one (decided from T on the host, no sync, so
a decode graph captured at one batch size holds exactly one of them; codegen/dispatch.py's linear
table, Tuning.linear.skinny_upto):

    T <= skinny_upto   the skinny kernel (templates/include/skinny.cuh): each weight byte read once
                       with 16-byte loads, tensor-core mma with the tokens as N, the stacked weights
                       of a multi_linear in one launch.  Its grid has the factor of its range: 0 above.
    T >  skinny_upto   the library call (cuBLAS, one GEMM per weight), whose from_tokens says so;
                       the runtime skips it below.

A linear at fp32 precision (the router, when fuse_router did not take it) is the library call at
every T: its weights and output stay float32 whatever the activation dtype.
"""
from __future__ import annotations

from codegen import dispatch
from codegen.errors import LoweringError
from codegen.kernel import DTYPES, KernelLaunch, inp, out, size, stride, weight
from codegen.render import kernel_name
from codegen.sizes import only_below
from codegen.tuning import DEFAULT_TUNING

from ._dense_util import inner_dims, node_io

FAMILY = "linear_skinny"
TEMPLATE = "linear_skinny.cu.j2"
OPS = ("linear", "multi_linear", "gate_up_silu")
PDL = True   # every CTA waits (griddepcontrol.wait) before reading x or writing y; weights before it

# The most tokens the kernel takes: a tensor-core n8 tile holds 8 tokens and the kernel runs two
# (templates/include/skinny.cuh MAX_TOKENS).  Tuning.linear.skinny_upto, at most this, is where
# cuBLAS takes over; a larger one needs more n8 tiles in the kernel.
SKINNY_MAX_TOKENS = 16

# The kernel's shape (Tuning.linear): `warps` warps split K in 32-wide steps, a CTA owns `row_tiles`
# 16-row tiles of the stacked weights, and `unroll` steps of 16-byte weight loads per thread are in
# flight at a time (unroll x 2 rows x row_tiles x 16 B: 32 KB a CTA at 8 x 1 x 4).  ksplit > 1
# splits K over a cluster of that many CTAs as well (ksplit times the CTAs: for shapes whose row
# tiles are about the SM count, such as o_proj's 128; reduced through distributed shared memory,
# skinny.cuh).


def min_blocks(warps: int, row_tiles: int, unroll: int) -> int:
    """CTAs per SM the register budget is set for (__launch_bounds__): two (<= 128 registers at 256
    threads: ~100 used at 8 x 1 x 4) while a thread keeps at most 4 x 2 weight loads in flight,
    else one (more loads in flight need more registers than two CTAs leave)."""
    return 2 if warps <= 8 and unroll * row_tiles <= 4 else 1


def variant_tag(warps: int, row_tiles: int, unroll: int, ksplit: int = 1) -> str | None:
    """The kernel-name part of a non-default shape (None for the default): w8r1u4, w8r1u4k2."""
    d = DEFAULT_TUNING.linear
    if (warps, row_tiles, unroll, ksplit) == (d.warps, d.row_tiles, d.unroll, d.ksplit):
        return None
    return f"w{warps}r{row_tiles}u{unroll}" + (f"k{ksplit}" if ksplit > 1 else "")


def lower(nid, G, opts, *, warps: int | None = None, row_tiles: int | None = None, unroll: int | None = None,
          ksplit: int | None = None):
    """The shape's arguments default to opts.tuning.linear (a test may pass one explicitly)."""
    from codegen.lower import library_call
    t = opts.tuning.linear
    warps, row_tiles = warps or t.warps, row_tiles or t.row_tiles
    unroll, ksplit = unroll or t.unroll, ksplit or t.ksplit
    data, (x,), outs, bound = node_io(G, nid)
    precision = "fp32" if data["op"] == "linear" and data["attrs"]["precision"] == "fp32" else "act"
    rows_ = dispatch.rows(data["op"], {"precision": precision}, opts.tuning)
    skinny = dispatch.row_range(rows_, "skinny")
    if not skinny:
        return [library_call(nid, data)]
    ((_, upto),) = skinny
    if opts.dtype not in DTYPES:
        raise LoweringError(f"unsupported activation dtype {opts.dtype!r} (one of {', '.join(DTYPES)})")
    (K,) = inner_dims(G, x)
    silu = data["op"] == "gate_up_silu"
    if silu:   # a gate and an up of n rows each, interleaved 8 by 8 in the kernel; one output
        rows, roles = [data["attrs"]["out_dim"]] * 2, ["gate", "up"]
    else:
        rows = [inner_dims(G, y)[0] for y in outs]
        roles = ["weight"] if data["op"] == "linear" else [f"weight{i}" for i in range(len(outs))]
    act = DTYPES[opts.dtype]
    w_args = [f"w{i}" for i in range(len(rows))]
    y_args = [f"y{i}" for i in range(len(outs))]
    if ksplit not in (1, 2, 4, 8):
        raise LoweringError(f"a cluster of {ksplit} CTAs; the skinny linear splits K over 1, 2, 4 or 8")
    params = {"act": act, "K": K, "rows": rows, "warps": warps, "rt": row_tiles, "unroll": unroll, "ks": ksplit,
              "min_blocks": min_blocks(warps, row_tiles, unroll), "max_tokens": SKINNY_MAX_TOKENS, "w_args": w_args,
              "y_args": y_args, "silu": silu}
    parts = [opts.dtype, f"k{K}", f"silu{rows[0]}" if silu else "o" + "_".join(map(str, rows))]
    tag = variant_tag(warps, row_tiles, unroll, ksplit)
    if tag:
        parts.append(tag)
    args = (inp("x", act, x), stride("x_stride", x, 0),
            *(weight(a, act, bound[r]) for a, r in zip(w_args, roles)),
            *(out(a, act, y) for a, y in zip(y_args, outs)),
            size("T", "T"))
    ctas = -(-sum(rows) // (16 * row_tiles)) * ksplit
    # stage: the op served, so reviews pair kernels by it (role linear_skinny.multi_linear, ...)
    launch = KernelLaunch(
        family=FAMILY, template=TEMPLATE, name=kernel_name(FAMILY, parts), params=params, nodes=(nid,),
        grid=(f"{ctas} * {only_below(upto)}", 1, 1), block=(warps * 32, 1, 1), args=args,
        stage=data["op"])
    return [launch, library_call(nid, data, from_tokens=upto + 1)]
