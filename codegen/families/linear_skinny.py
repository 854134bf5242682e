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
every T: its weights and output stay float32 whatever the activation dtype.  So is a linear over
rows other than the step's T tokens (the kv_b GEMM over the prefill attention's TK context rows).

Weights in FP8 (fp8_e4m3_block128, ir/formats.py; every weight of the node, bf16 or fp16
activations): the kernel reads the FP8 bytes and their block scales (the companion weights
"<weight>_scale_inv") and widens them in registers (templates/include/fp8.cuh); its name carries
"wfp8" and its load pipeline is Tuning.linear.fp8_*.  Above skinny_upto, on sm_90a, the FP8 x FP8
GEMM (codegen/families/gemm_fp8.py: a quantiser launch, then wgmma; no quantiser where the RMSNorm that
makes x writes x's e4m3 rows, Tuning.linear.norm_fp8) takes the place of the library call; elsewhere (no sm_90a, K % 16 != 0) the library call dequantises each weight to the activation
dtype (torch) before the cuBLAS GEMM, every step -- correct, not fast.  Where Tuning.linear.fp8_chunks_upto
is set (off by default), the FP8 skinny kernel also serves skinny_upto < T <= fp8_chunks_upto, its tokens in
chunks of 16 along grid.y (_fp8_chunks), and the FP8 GEMM starts above it.

Weights in int8 (msModelSlim's int8_channel: W8A8_DYNAMIC, every weight of the node, bf16 or fp16
activations; codegen/dispatch.py's linear table, rows skinny_wi8 / int_mm): x is quantised per token by
its own launch (stage quant_int8, templates/include/quant_int8.cuh) into two workspaces, then the int8
kernel (templates/include/int8.cuh) multiplies int8 x int8 into int32 and scales (float(acc) * s_w) * s_x,
bit-equal to ir/formats_int.py's reference; its name carries "wi8".  Where the RMSNorm that makes x
writes x's int8 rows itself (Tuning.linear.norm_int8, ir/passes/fuse_norm_int8_quant.py), the int8 kernels
read those and no quantiser launch runs.  Above skinny_upto, on sm_90a with
K % 16 == 0, the int8 GEMM (codegen/families/gemm_int8.py: its own quantiser launch over every token, then
wgmma s32.s8.s8, equally exact) takes the place of the library call; elsewhere the library call (marked
weight_format int8_channel) is the exact integer product by torch (int_linear), not a tuned GEMM.
Up to Tuning.linear.i8_prologue_upto tokens (off by default; row skinny_wi8_xq, where the quantised rows fit
shared memory) the int8 kernel quantises x itself in each CTA's prologue (templates/include/int8_prologue.cuh,
the quantiser's arithmetic: bit-equal) and the quantiser's launch, a kernel boundary on decode's chain, is gone.
"""
from __future__ import annotations

import dataclasses

from codegen import dispatch
from codegen.errors import LoweringError
from codegen.kernel import DTYPES, KernelLaunch, Workspace, inp, out, size, stride, weight, work
from codegen.render import kernel_name
from codegen.arch import has_feature
from codegen.sizes import only_above, only_below, token_range
from codegen.tuning import DEFAULT_TUNING
from ir.formats import FORMATS, FP8, companion_names, weight_format

from . import _norm_quant, gemm_fp8, gemm_int8
from ._dense_util import inner_dims, node_io

FAMILY = "linear_skinny"
TEMPLATE = "linear_skinny.cu.j2"
OPS = ("linear", "multi_linear", "gate_up_silu")
PDL = True   # every CTA waits (griddepcontrol.wait) before reading x or writing y; weights before it
# Storage formats its kernel reads (codegen/lower.py weight_format_problem): FP8 blocks are widened in
# registers up to skinny_upto; above it gemm_fp8's launches or the library call (which dequantises:
# cuda_backend._library_weight) take them.  int8 weights: the quantiser's launch and the int8 kernel up to
# skinny_upto, gemm_int8's launches or the exact integer library call above (_lower_int8).
INT8 = FORMATS["int8_channel"]
WEIGHT_FORMATS = ("bf16", "fp16", "fp32", FP8.name, INT8.name)
QUANT_THREADS = 256               # the quantiser's CTA (one a token row)
PIPELINES = ("rolling", "batch")   # FP8 weights' load pipelines (fp8.cuh)

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


def min_blocks(warps: int, row_tiles: int, unroll: int, pipeline: str | None = None) -> int:
    """CTAs per SM the register budget is set for (__launch_bounds__): two (<= 128 registers at 256
    threads: ~100 used at 8 x 1 x 4) while a thread keeps at most 4 x 2 weight loads in flight,
    else one (more loads in flight need more registers than two CTAs leave).  FP8 (fp8.cuh): rolling
    keeps two up to 4 steps of one row tile; batch holds twice a 16-bit step's x and widened weights."""
    if pipeline == "rolling":
        return 2 if warps <= 8 and row_tiles == 1 and unroll <= 4 else 1
    loads = unroll * row_tiles * (2 if pipeline == "batch" else 1)
    return 2 if warps <= 8 and loads <= 4 else 1


def variant_tag(warps: int, row_tiles: int, unroll: int, ksplit: int = 1, default_unroll: int | None = None,
                pipeline: str | None = None, default_pipeline: str | None = None) -> str | None:
    """The kernel-name part of a non-default shape (None for the default): w8r1u4, w8r1u4k2, w8r1u1_batch."""
    d = DEFAULT_TUNING.linear
    default_unroll = d.unroll if default_unroll is None else default_unroll
    if (warps, row_tiles, unroll, ksplit, pipeline) == (d.warps, d.row_tiles, default_unroll, d.ksplit,
                                                        default_pipeline):
        return None
    return (f"w{warps}r{row_tiles}u{unroll}" + (f"k{ksplit}" if ksplit > 1 else "")
            + (f"_{pipeline}" if pipeline != default_pipeline else ""))


def lower(nid, G, opts, *, warps: int | None = None, row_tiles: int | None = None, unroll: int | None = None,
          ksplit: int | None = None, pipeline: str | None = None):
    """The shape's arguments default to opts.tuning.linear (a test may pass one explicitly); unroll and
    pipeline of FP8 weights to its fp8_* knobs (pipeline is FP8's only)."""
    from codegen.lower import library_call
    t = opts.tuning.linear
    warps, row_tiles, ksplit = warps or t.warps, row_tiles or t.row_tiles, ksplit or t.ksplit
    data, (x,), outs, bound = node_io(G, nid)
    precision = "fp32" if data["op"] == "linear" and data["attrs"]["precision"] == "fp32" else "act"
    roles_ = sorted(data["weights"])
    if precision == "act" and any(weight_format(G, bound[r], opts.dtype) is INT8 for r in roles_):
        if ksplit != 1 or pipeline is not None:
            raise LoweringError(f"int8 weights: the skinny linear splits K inside a CTA only and has no load "
                                f"pipelines (ksplit 1 and no pipeline, got {ksplit} and {pipeline!r})")
        return _lower_int8(nid, G, opts, warps=warps, row_tiles=row_tiles, unroll=unroll or t.unroll)
    # int8 weights went above: what follows sees 16-bit or FP8 ones only
    if G.graph["values"][x].shape[0] != "T":
        # rows other than the step's tokens (the prefill attention's TK context rows): the grid
        # factors read T (the FP8 GEMM's too), so the library call takes every row count; FP8
        # weights there are dequantised to the activation dtype (cuda_backend._library_weight)
        call = library_call(nid, data)
        if _fp8_weights(G, list(bound.values()), opts):
            call = dataclasses.replace(call, attrs={**call.attrs, "weight_format": FP8.name})
        return [call]
    gemms, alone = _fp8_gemms(nid, G, opts)
    if alone:   # no skinny row (Tuning.linear.skinny_upto = 0): the FP8 GEMM at every T
        return gemms
    rows_ = dispatch.rows(data["op"], {"precision": precision, "weight_format": "same", "dtype": opts.dtype},
                          opts.tuning)
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
    fp8 = _fp8_weights(G, [bound[r] for r in roles], opts)
    if fp8:
        d = DEFAULT_TUNING.linear
        default_pipeline, default_unroll = (d.fp8_silu_pipeline, d.fp8_silu_unroll) if silu else \
            (d.fp8_pipeline, d.fp8_unroll)
        tuned_pipeline, tuned_unroll = (t.fp8_silu_pipeline, t.fp8_silu_unroll) if silu else \
            (t.fp8_pipeline, t.fp8_unroll)
    else:
        default_pipeline, default_unroll, tuned_pipeline, tuned_unroll = None, DEFAULT_TUNING.linear.unroll, None, t.unroll
    if pipeline is not None and (not fp8 or pipeline not in PIPELINES):
        raise LoweringError(f"pipeline {pipeline!r}: FP8 weights only, one of {', '.join(PIPELINES)}")
    unroll, pipeline = unroll or tuned_unroll, pipeline or tuned_pipeline
    w_args = [f"w{i}" for i in range(len(rows))]
    s_args = [f"s{i}" for i in range(len(rows))] if fp8 else []
    y_args = [f"y{i}" for i in range(len(outs))]
    if ksplit not in (1, 2, 4, 8):
        raise LoweringError(f"a cluster of {ksplit} CTAs; the skinny linear splits K over 1, 2, 4 or 8")
    params = {"act": act, "K": K, "rows": rows, "warps": warps, "rt": row_tiles, "unroll": unroll, "ks": ksplit,
              "min_blocks": min_blocks(warps, row_tiles, unroll, pipeline), "max_tokens": SKINNY_MAX_TOKENS,
              "w_args": w_args, "y_args": y_args, "silu": silu, "wfmt": FP8.name if fp8 else opts.dtype,
              "s_args": s_args}
    if fp8:
        params["rolling"] = pipeline == "rolling"
    parts = [f"{opts.dtype}_wfp8" if fp8 else opts.dtype, f"k{K}",
             f"silu{rows[0]}" if silu else "o" + "_".join(map(str, rows))]
    tag = variant_tag(warps, row_tiles, unroll, ksplit, default_unroll, pipeline, default_pipeline)
    if tag:
        parts.append(tag)
    w_ctype = "unsigned char" if fp8 else act
    args = (inp("x", act, x), stride("x_stride", x, 0),
            *(weight(a, w_ctype, bound[r]) for a, r in zip(w_args, roles)),
            *(weight(a, "float", companion_names(bound[r], FP8)[0]) for a, r in zip(s_args, roles)),
            *(out(a, act, y) for a, y in zip(y_args, outs)),
            size("T", "T"))
    ctas = -(-sum(rows) // (16 * row_tiles)) * ksplit
    # stage: the op served, so reviews pair kernels by it (role linear_skinny.multi_linear, ...)
    launch = KernelLaunch(
        family=FAMILY, template=TEMPLATE, name=kernel_name(FAMILY, parts), params=params, nodes=(nid,),
        grid=(f"{ctas} * {only_below(upto)}", 1, 1), block=(warps * 32, 1, 1), args=args,
        stage=data["op"])
    if gemms:   # the FP8 GEMM above the skinny range (its row ends the table: no library call)
        return [launch, *_fp8_chunks(nid, G, opts, launch, gemms)]
    call = library_call(nid, data, from_tokens=upto + 1)
    if fp8:
        call = dataclasses.replace(call, attrs={**call.attrs, "weight_format": FP8.name})
    return [launch, call]


def _fp8_gemms(nid, G, opts) -> tuple[list, bool]:
    """(gemm_fp8's launches over the linear table's "fp8_wgmma" row, whether no skinny row precedes
    it): none unless the node's weights are all FP8, its activations 16-bit and its x the step's T
    tokens (the launches' grids read T).  Where the norm that makes x writes x's e4m3 rows
    (Tuning.linear.norm_fp8) the GEMMs read those and there is no quantiser launch."""
    row = _fp8_row(nid, G, opts)
    if row is None:
        return [], False
    (lo, hi), alone = row
    op, x, K, names, outs, rows = gemm_fp8.operands(G, nid)
    return (gemm_fp8.launches(nid, op, x, K, names, outs, rows, opts, token_range(lo, hi), lo,
                              _norm_quant.fp8_rows(G, x, opts)), alone)


def fp8x_from(nid, G, opts) -> int | None:
    """The first token count at which the node multiplies its x FP8 x FP8 (gemm_fp8's row), None: never
    (_norm_quant.fp8_from: where the norm that makes x starts writing x's e4m3 rows)."""
    row = _fp8_row(nid, G, opts)
    return None if row is None else row[0][0]


def _fp8_row(nid, G, opts) -> tuple[tuple[int, int | None], bool] | None:
    """((lo, hi) of the linear table's "fp8_wgmma" row, whether no skinny row precedes it), or None where
    gemm_fp8 does not serve the node (_fp8_gemms' conditions)."""
    data = G.nodes[nid]
    if (data["op"] == "linear" and data["attrs"]["precision"] == "fp32") or opts.dtype not in ("bf16", "fp16"):
        return None
    op, x, K, names, outs, rows = gemm_fp8.operands(G, nid)
    if G.graph["values"][x].shape[0] != "T" or not _fp8_weights(G, names, opts):
        return None
    facts = {"precision": "act", "weight_format": FP8.name, "sm_90a": has_feature(opts.arch, gemm_fp8.FEATURE),
             "fp8_rows": gemm_fp8.serves(K), "fp8_fits": gemm_fp8.fits(opts)}
    rows_ = dispatch.rows(op, facts, opts.tuning)
    wgmma = dispatch.row_range(rows_, "fp8_wgmma")
    if not wgmma:
        return None
    ((lo, hi),) = wgmma
    return (lo, hi), not dispatch.row_range(rows_, "skinny")


def _fp8_chunks(nid, G, opts, launch: KernelLaunch, gemms: list) -> list:
    """Between the skinny row and gemm_fp8's (the linear table's "skinny_fp8_chunks",
    Tuning.linear.fp8_chunks_upto): the node's FP8 skinny kernel `launch` over every T, its tokens in
    chunks of SKINNY_MAX_TOKENS along grid.y (templates/include/fp8_chunks.cuh), then `gemms`, whose
    workspaces (the quantised x, the split partials) are sized to nothing where the chunks run.
    `gemms` alone where the table has no such row."""
    # gemms exist: the table's FP8 case held for this node
    facts = {"precision": "act", "weight_format": FP8.name, "sm_90a": True, "fp8_rows": True, "fp8_fits": True}
    span = dispatch.row_range(dispatch.rows(G.nodes[nid]["op"], facts, opts.tuning), "skinny_fp8_chunks")
    if not span:
        return gemms
    ((lo, hi),) = span
    return [_chunked(launch, lo, hi), *_above(gemms, hi)]


def _chunked(launch: KernelLaunch, lo: int, hi: int) -> KernelLaunch:
    """The skinny kernel `launch` over lo <= T <= hi, its tokens in chunks of SKINNY_MAX_TOKENS along grid.y
    (templates/include/fp8_chunks.cuh, int8_chunks.cuh): kernel-name part "c16", stage "<op>_chunks"."""
    p, n = launch.params, SKINNY_MAX_TOKENS
    ctas = -(-sum(p["rows"]) // (16 * p["rt"])) * p.get("ks", 1)
    return dataclasses.replace(
        launch, name=kernel_name(FAMILY, [*launch.name.split("__")[1:], f"c{n}"]), params={**p, "chunk": n},
        grid=(f"{ctas} * {token_range(lo, hi)}", f"cdiv(T, {n})", 1), stage=f"{launch.stage}_chunks")


def _above(gemms: list, hi: int) -> list:
    """The GEMM launches above the chunks (from hi + 1 tokens), their workspaces (the quantised x, the split
    partials) sized to nothing where the chunks run."""
    past = only_above(hi)

    def unused_here(ws: Workspace) -> Workspace:
        return dataclasses.replace(ws, shape=(f"({ws.shape[0]}) * {past}", *ws.shape[1:]))
    return [dataclasses.replace(g, workspace=tuple(map(unused_here, g.workspace))) for g in gemms]


def _fp8_weights(G, names: list[str], opts) -> bool:
    """Whether the node's weights are FP8 (all of them); a LoweringError where the kernel cannot take
    their formats."""
    fmts = [weight_format(G, n, opts.dtype) for n in names]
    if all(f.name == opts.dtype for f in fmts):
        return False
    if any(f is not FP8 for f in fmts):
        found = ", ".join(f"{n}: {f.name}" for n, f in zip(names, fmts))
        raise LoweringError(f"the skinny linear takes weights all in {opts.dtype} or all in {FP8.name}, got {found}")
    if opts.dtype == "fp32":
        raise LoweringError(f"{FP8.name} weights need bf16 or fp16 activations, not fp32")
    return True


def _lower_int8(nid, G, opts, *, warps: int, row_tiles: int, unroll: int):
    """int8_channel weights: the quantiser's launch and the int8 kernel's up to skinny_upto tokens
    (both over two workspaces: x_int8, the quantised rows, and x_scale); above, gemm_int8's launches
    where the linear table gives its row (sm_90a, K % 16 == 0, K < 2^17), else the exact library call;
    the exact call alone over rows other than the step's T tokens."""
    from codegen.lower import library_call
    data, (x,), outs, bound = node_io(G, nid)
    silu = data["op"] == "gate_up_silu"
    roles = ["gate", "up"] if silu else (["weight"] if data["op"] == "linear" else
                                         [f"weight{i}" for i in range(len(outs))])
    fmts = [weight_format(G, bound[r], opts.dtype) for r in roles]
    if any(f is not INT8 for f in fmts):
        found = ", ".join(f"{bound[r]}: {f.name}" for r, f in zip(roles, fmts))
        raise LoweringError(f"the skinny linear takes weights all in {opts.dtype} or all in {INT8.name}, got {found}")
    (K,) = inner_dims(G, x)
    xq = min(opts.tuning.linear.i8_prologue_upto, opts.tuning.linear.skinny_upto)
    facts = {"precision": "act", "weight_format": INT8.name, "dtype": opts.dtype,
             "sm_90a": has_feature(opts.arch, gemm_int8.FEATURE), "i8_rows": gemm_int8.serves(K),
             "i8_fits": gemm_int8.fits(opts), "i8_xq_fits": xq_fits(K, xq, warps, row_tiles, opts)}
    rows_ = dispatch.rows(data["op"], facts, opts.tuning)
    none = dispatch.row_range(rows_, dispatch.NONE)
    if none:
        raise LoweringError(next(r.reason for r in rows_ if r.variant == dispatch.NONE) + f", not {opts.dtype}")
    call = library_call(nid, data)
    call = dataclasses.replace(call, attrs={**call.attrs, "weight_format": INT8.name})
    if G.graph["values"][x].shape[0] != "T":   # the launches' grids read T: TK rows go whole to the exact call
        return [call]
    normed = _norm_quant.int8_rows(G, x, opts)   # the norm that makes x writes its int8 rows: no quantiser
    gemms = []
    for lo, hi in dispatch.row_range(rows_, "i8_wgmma"):   # the int8 GEMM above the skinny range
        op, _, _, names, outs_, widths = gemm_int8.operands(G, nid)
        gemms += gemm_int8.launches(nid, op, x, K, names, outs_, widths, opts, token_range(lo, hi), lo, normed)
    skinny = dispatch.row_range(rows_, "skinny_wi8")
    prologue = dispatch.row_range(rows_, "skinny_wi8_xq")
    chunks = dispatch.row_range(rows_, "skinny_wi8_chunks")   # Tuning.linear.i8_chunks_upto: above skinny_upto
    if not skinny and not prologue:
        return gemms or [call]
    if chunks:   # the int8 GEMM starts above the chunks
        gemms = _above(gemms, chunks[-1][1])
    rows = [data["attrs"]["out_dim"]] * 2 if silu else [inner_dims(G, y)[0] for y in outs]
    act = DTYPES[opts.dtype]
    w_args = [f"w{i}" for i in range(len(rows))]
    s_args = [f"s{i}" for i in range(len(rows))]
    y_args = [f"y{i}" for i in range(len(outs))]
    params = {"act": act, "K": K, "rows": rows, "warps": warps, "rt": row_tiles, "unroll": unroll,
              "min_blocks": min_blocks(warps, row_tiles, unroll), "max_tokens": SKINNY_MAX_TOKENS,
              "w_args": w_args, "y_args": y_args, "s_args": s_args, "silu": silu, "wfmt": INT8.name,
              "quant": False}
    parts = [f"{opts.dtype}_wi8", f"k{K}", f"silu{rows[0]}" if silu else "o" + "_".join(map(str, rows))]
    tag = variant_tag(warps, row_tiles, unroll)
    if tag:
        parts.append(tag)
    w_operands = (*(weight(a, "signed char", bound[r]) for a, r in zip(w_args, roles)),
                  *(weight(a, "float", companion_names(bound[r], INT8)[0]) for a, r in zip(s_args, roles)),
                  *(out(a, act, y) for a, y in zip(y_args, outs)),
                  size("T", "T"))
    ctas = -(-sum(rows) // (16 * row_tiles))
    if normed:   # the norm that makes x wrote its int8 rows: they win over the prologue's and the quantiser's
        first, top = min(a for a, _ in prologue + skinny), max(b for _, b in prologue + skinny)
        plain = KernelLaunch(
            family=FAMILY, template=TEMPLATE, name=kernel_name(FAMILY, parts), params=params, nodes=(nid,),
            grid=(f"{ctas} * {token_range(first, top)}", 1, 1), block=(warps * 32, 1, 1),
            args=(*_norm_quant.x_args(normed, "x_int8", "x_scale"), *w_operands), stage=data["op"])
        steps = [plain, *(_chunked(plain, lo, hi) for lo, hi in chunks)]
        return [*steps, *gemms] if gemms else [*steps, dataclasses.replace(call, from_tokens=top + 1)]
    steps = []
    for _, n in prologue:   # x quantised in each CTA's prologue: no quantiser launch, no workspaces
        nbytes = xq_smem(K, n, warps)
        steps.append(KernelLaunch(
            family=FAMILY, template=TEMPLATE, name=kernel_name(FAMILY, [*parts, f"xq{n}"]),
            params={**params, "xq": n, "smem": nbytes}, nodes=(nid,), grid=(f"{ctas} * {only_below(n)}", 1, 1),
            block=(warps * 32, 1, 1), args=(inp("x", act, x), stride("x_stride", x, 0), *w_operands),
            smem=nbytes, stage=data["op"] + "_xq"))
    quantised = skinny + chunks   # the kernels that read the quantiser's rows: one contiguous range
    if quantised:
        lo, top = quantised[0][0], quantised[-1][1]
        factor = token_range(lo, top)
        qrow = -(-K // 16) * 16
        rows = f"min(T, {top}) * min(1, {top} // max(T, 1))"   # none above the range: the GEMM has its own
        ws = (Workspace("x_int8", (rows, qrow // 4), "i32"),   # int8 rows of qrow bytes
              Workspace("x_scale", (rows,), "f32"))
        steps.append(KernelLaunch(
            family=FAMILY, template=TEMPLATE, name=kernel_name(FAMILY, [f"{opts.dtype}_qi8", f"k{K}"]),
            params={"act": act, "K": K, "qrow": qrow, "threads": QUANT_THREADS, "max_tokens": SKINNY_MAX_TOKENS,
                    "wfmt": INT8.name, "quant": True},
            nodes=(nid,), grid=(f"T * {factor}", 1, 1), block=(QUANT_THREADS, 1, 1),
            args=(inp("x", act, x), stride("x_stride", x, 0), work("q", "signed char", "x_int8"),
                  work("s", "float", "x_scale"), size("T", "T")),
            workspace=ws, stage="quant_int8"))
        plain = KernelLaunch(
            family=FAMILY, template=TEMPLATE, name=kernel_name(FAMILY, parts), params=params, nodes=(nid,),
            grid=(f"{ctas} * {token_range(*skinny[0]) if skinny else 0}", 1, 1), block=(warps * 32, 1, 1),
            args=(work("xq", "signed char", "x_int8", writes=False), work("xs", "float", "x_scale", writes=False),
                  *w_operands),
            workspace=ws, stage=data["op"])
        steps += [plain] if skinny else []
        steps += [_chunked(plain, lo, hi) for lo, hi in chunks]
    if gemms:   # the int8 GEMM's row ends the table: no library call
        return [*steps, *gemms]
    top = max(hi for _, hi in prologue + skinny)
    return [*steps, dataclasses.replace(call, from_tokens=top + 1)]


def xq_smem(K: int, tokens: int, warps: int) -> int:
    """Dynamic shared memory of the int8 kernel that quantises `tokens` rows of x itself (int8_prologue.cuh
    XqSmem): the int8 rows (K rounded up to 16 bytes), their scales, each row's partial maxima a warp."""
    return tokens * -(-K // 16) * 16 + 4 * tokens + 4 * tokens * warps


def xq_fits(K: int, tokens: int, warps: int, row_tiles: int, opts) -> bool:
    """Whether that kernel's shared memory (its rows and its static partial sums, skinny.cuh red_floats)
    fits a CTA on the target."""
    from .mla_decode_attention import smem_limit
    return tokens > 0 and xq_smem(K, tokens, warps) + 4 * warps * row_tiles * 16 * SKINNY_MAX_TOKENS \
        <= smem_limit(opts.arch)


def tasks(launch, tiling):
    """The decode task graph's tiles (codegen/tasks.py): runs of the CTAs' row tiles of the stacked
    weights (16 * rt output columns a CTA; a gate_up_silu's rows are gate and up interleaved, so
    8 * rt), its ksplit CTAs together, at most two tasks an SM (more only add waits: the lm head's
    6400 row tiles are 264 tasks on 132 SMs); each reads x whole and writes its columns of the outputs."""
    p = launch.params
    if p["wfmt"] == INT8.name:   # the int8 quantiser and kernel read x through workspaces: one task each
        return None
    width = 16 * p["rt"] // (2 if p["silu"] else 1)
    outs = [tiling.value_of(launch, a) for a in p["y_args"]]
    ncols = [tiling.shape(y)[-1] for y in outs]
    width *= -(-(-(-sum(ncols) // width)) // (2 * tiling.sizes["SMS"]))
    x = tiling.whole(tiling.value_of(launch, "x"))
    tiles = []
    for k, lo in enumerate(range(0, sum(ncols), width)):
        writes, start = [], 0
        for y, n in zip(outs, ncols):
            a, b = max(lo, start), min(lo + width, start + n)
            if a < b:
                writes.append(tiling.cols(y, a - start, b - start))
            start += n
        tiles.append(tiling.tile(k, [x], writes))
    return tiles


def segment_body(launch):
    """Its task body in a persistent segment (templates/include/task_bodies.cuh): a CTA's row tiles, for
    weights in the activation dtype without a cluster (the segment's CTAs are not clustered); None else."""
    p = launch.params
    if p.get("quant") or p["wfmt"] not in ("bf16", "fp16", "fp32") or p["ks"] != 1:
        return None
    return {"kind": "linear", **{k: p[k] for k in ("K", "rows", "warps", "rt", "unroll", "silu", "w_args", "y_args")}}
