"""linear_skinny: linear / multi_linear, x [T, K] (a possibly strided view) -> y_i [T, O_i] = x W_i^T,
and gate_up_silu, x -> silu(x W_gate^T) * (x W_up^T).

Each node lowers to two steps, of which a step runs one (decided from T on the host, no sync, so
a decode graph captured at one batch size holds exactly one of them):

    T <= SKINNY_MAX_TOKENS   the skinny kernel (templates/include/skinny.cuh): each weight byte read
                             once with 16-byte loads, tensor-core mma with the tokens as N, the
                             stacked weights of a multi_linear in one launch.  Its grid has the
                             factor codegen.sizes.only_below(SKINNY_MAX_TOKENS): 0 above.
    up to WIDE_MAX_TOKENS    with WIDE on, the wide kernel (templates/include/linear_wide.cuh): the
                             same loads, the warps splitting the rows, K split over a cluster;
                             its grid is 0 outside SKINNY_MAX_TOKENS < T <= WIDE_MAX_TOKENS.
    above                    the library call (cuBLAS, one GEMM per weight), whose from_tokens says
                             so; the runtime skips it below.

A linear at fp32 precision (the router, when fuse_router did not take it) is the library call at
every T: its weights and output stay float32 whatever the activation dtype.
"""
from __future__ import annotations

from codegen.errors import LoweringError
from codegen.kernel import DTYPES, KernelLaunch, inp, out, size, stride, weight
from codegen.render import kernel_name
from codegen.sizes import only_above, only_below

from ._dense_util import inner_dims, node_io

FAMILY = "linear_skinny"
TEMPLATE = "linear_skinny.cu.j2"
OPS = ("linear", "multi_linear", "gate_up_silu")
PDL = True   # every CTA waits (griddepcontrol.wait) before reading x or writing y; weights before it

# Up to this many tokens the kernel serves the node, cuBLAS above: a tensor-core n8 tile holds 8
# tokens and the kernel runs two (templates/include/skinny.cuh MAX_TOKENS).  To be measured on the
# H200 (tests/gpu/perf_linear.py prints kernel against cuBLAS at T = 1..16): a smaller crossover
# is a change of this constant alone, a larger one needs more n8 tiles in the kernel.
SKINNY_MAX_TOKENS = 16

# The kernel's shape (tests/gpu/perf_linear.py --variants times others; not yet measured): WARPS
# warps split K in 32-wide steps, a CTA owns ROW_TILES 16-row tiles of the stacked weights, and
# UNROLL steps of 16-byte weight loads per thread are in flight at a time (UNROLL x 2 rows x
# ROW_TILES x 16 B: 32 KB a CTA at 8 x 1 x 4).  KSPLIT > 1 splits K over a cluster of that many
# CTAs as well (KSPLIT times the CTAs: for shapes whose row tiles are about the SM count, such as
# o_proj's 128; reduced through distributed shared memory, skinny.cuh), off until measured.
WARPS, ROW_TILES, UNROLL, KSPLIT = 8, 1, 4, 1

# The wide kernel for SKINNY_MAX_TOKENS < T <= WIDE_MAX_TOKENS (16-bit activations): off until
# measured on the H200 against cuBLAS (tests/gpu/perf_linear.py --tokens 17,32,64,128 --wide; its
# property test is tests/gpu/test_kernels_linear.py test_linear_wide).  cuBLAS read these weights at
# 1.4-1.8 TB/s in decode steps of 32-256 tokens (PERF_NOTES v16).  WIDE_UNROLL: 32-k steps a batch
# of weight loads in flight (two batches: the next loads while one multiplies).  WIDE_CLUSTERS:
# clusters of each size the H200 holds at once at one CTA an SM (tests/gpu/probe_clusters.py: 132
# SMs, 66 clusters of 2, but only 30 of 4 and 15 of 8: the GPCs' SM counts), so a K split never
# makes a second wave of clusters.
WIDE = False
WIDE_MAX_TOKENS = 128
WIDE_UNROLL = 2
WIDE_CLUSTERS = {1: 132, 2: 66, 4: 30, 8: 15}
WIDE_ROWS = 128   # stacked rows a CTA (templates/include/linear_wide.cuh ROWS_PER_CTA)


def wide_ksplit(rows: int, k: int, clusters: dict = WIDE_CLUSTERS) -> int:
    """CTAs a cluster splits K over: the most of 1, 2, 4, 8 whose clusters (one per 128 stacked
    rows) all run at once, with at least one 32-k step a CTA."""
    ctas = -(-rows // WIDE_ROWS)
    ks = 1
    while ks < 8 and ctas <= clusters[ks * 2] and -(-k // 32) >= ks * 2:
        ks *= 2
    return ks


def min_blocks(warps: int, row_tiles: int, unroll: int) -> int:
    """CTAs per SM the register budget is set for (__launch_bounds__): two (<= 128 registers at 256
    threads: ~100 used at 8 x 1 x 4) while a thread keeps at most 4 x 2 weight loads in flight,
    else one (more loads in flight need more registers than two CTAs leave)."""
    return 2 if warps <= 8 and unroll * row_tiles <= 4 else 1


def variant_tag(warps: int, row_tiles: int, unroll: int, ksplit: int = 1) -> str | None:
    """The kernel-name part of a non-default shape (None for the default): w8r1u4, w8r1u4k2."""
    if (warps, row_tiles, unroll, ksplit) == (WARPS, ROW_TILES, UNROLL, KSPLIT):
        return None
    return f"w{warps}r{row_tiles}u{unroll}" + (f"k{ksplit}" if ksplit > 1 else "")


def lower(nid, G, opts, *, warps: int = WARPS, row_tiles: int = ROW_TILES, unroll: int = UNROLL,
          ksplit: int = KSPLIT, wide: bool | None = None, wide_ks: int | None = None):
    """The node's steps (module docstring).  wide / wide_ks: the wide kernel on or off and its K
    split, against WIDE and wide_ksplit (for the property tests and perf_linear.py)."""
    from codegen.lower import library_call
    data, (x,), outs, bound = node_io(G, nid)
    if data["op"] == "linear" and data["attrs"]["precision"] == "fp32":
        return [library_call(nid, data)]
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
        grid=(f"{ctas} * {only_below(SKINNY_MAX_TOKENS)}", 1, 1), block=(warps * 32, 1, 1), args=args,
        stage=data["op"])
    if not ((WIDE if wide is None else wide) and opts.dtype != "fp32"):
        return [launch, library_call(nid, data, from_tokens=SKINNY_MAX_TOKENS + 1)]
    return [launch, wide_launch(nid, data, params, parts[:3], args, wide_ks),
            library_call(nid, data, from_tokens=WIDE_MAX_TOKENS + 1)]


def wide_launch(nid, data, skinny_params: dict, parts: list, args: tuple, ks: int | None = None) -> KernelLaunch:
    """The wide kernel's launch for the node the skinny launch serves (same arguments)."""
    rows, K = skinny_params["rows"], skinny_params["K"]
    ks = wide_ksplit(sum(rows), K) if ks is None else ks
    if ks not in (1, 2, 4, 8) or -(-K // 32) < ks:
        raise LoweringError(f"the wide linear splits K = {K} over 1, 2, 4 or 8 CTAs, at least one 32-wide step "
                            f"each; got {ks}")
    smem = 8 * 16 * 128 * 4    # linear_wide.cuh red_floats(): the CTA's sums, 64 KB
    params = {k: skinny_params[k] for k in ("act", "K", "rows", "w_args", "y_args", "silu")}
    params.update(ks=ks, unroll=WIDE_UNROLL, min_tokens=SKINNY_MAX_TOKENS + 1, max_tokens=WIDE_MAX_TOKENS,
                  smem_bytes=smem, rows_per_cta=WIDE_ROWS)
    ctas = -(-sum(rows) // WIDE_ROWS) * ks
    window = f"{only_above(SKINNY_MAX_TOKENS)} * {only_below(WIDE_MAX_TOKENS)}"
    return KernelLaunch(
        family=FAMILY, template="linear_wide.cu.j2", name=kernel_name(FAMILY, [*parts, f"wide_k{ks}u{WIDE_UNROLL}"]),
        params=params, nodes=(nid,), grid=(f"{ctas} * {window}", 1, 1), block=(256, 1, 1), args=args, smem=smem,
        stage=f"{data['op']}_wide")
