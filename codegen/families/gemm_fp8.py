"""gemm_fp8: the FP8 x FP8 GEMM of linear / multi_linear / gate_up_silu nodes whose weights are FP8
(fp8_e4m3_block128), above the skinny kernel's token count, on sm_90a (templates/gemm_fp8.cu.j2).

The family claims no op: linear_skinny lowers those nodes and, where codegen/dispatch.py's linear
table gives the row "fp8_wgmma", asks `launches` here for its launches, which run instead of the
library call over the same token range (`lower` gives them for one node at every T):

    quant_x      x [T, K] -> xq [T, K] e4m3, xs [T, ceil(K / 128)] fp32 (templates/include/quant_fp8.cuh):
                 per token per 128 columns, scale = amax / 448 (x ~= q * s); the node's workspaces.
                 None where the RMSNorm that makes x writes those rows itself (Tuning.linear.norm_fp8,
                 ir/passes/fuse_norm_fp8_quant.py): the GEMMs read the norm's values instead.
    fp8_wgmma    one launch per weight (a multi_linear's share the quantised x; gate_up_silu's gate and
                 up are one launch): y = sum over 128-K blocks of xs * sw * (xq . w), fp32 promotion per
                 block (templates/include/gemm_fp8.cuh), the weight by TMA (a tensor map of [64, 128]
                 boxes), a persistent grid of 128 x 128 tiles (64 output columns for gate_up_silu).
                 Where the tiles are fewer than the SMs (decode batches: V2-Lite's kv_a has 5 at
                 T <= 128, o_proj 16, q 24), K is split over `splits` CTAs a tile, the grid is
                 tiles * splits, and each tile's last CTA sums the splits' partial tiles (the
                 node's workspace fp8_partials) in split order; both the grid and the kernel's
                 `splits` argument come from T and SMS at run time (`splits`), so one bundle serves
                 every captured batch size.

It serves where the target offers sm_90a, the activations are 16-bit and K % 16 == 0 (whole 16-byte
chunks of the quantised rows; 16-byte strides of the weight's tensor map).
"""
from __future__ import annotations

from codegen.arch import has_feature
from codegen.errors import LoweringError
from codegen.kernel import DTYPES, KernelLaunch, Workspace, inp, out, size, stride, tensor_map, weight, work
from codegen.render import kernel_name
from ir.formats import FP8, FP8_BLOCK, cdiv, companion_names, weight_format

from . import _gemm_multi, _norm_quant
from ._dense_util import inner_dims, node_io
from ._gemm_split import BK, BM, BN, PARTIAL_WORDS, TICKETS, grid, splits
from ._gemm_split import partials as partials_workspace
from .mla_decode_attention import smem_limit

FAMILY = "gemm_fp8"
TEMPLATE = "gemm_fp8.cu.j2"
OPS = ()          # launches of linear_skinny's nodes (its lowering calls `launches`); `lower` for one node alone
PDL = True        # both kernels wait (griddepcontrol.wait) before reading x / xq or writing
FEATURE = "sm_90a"

BOX = 64                       # weight rows per TMA box (two a stage)
THREADS = 384                  # a producer warpgroup and two consumer warpgroups
STAGES = 6                     # 6 x 32 KB of ring + 32 KB of staging: 225 KB of the 227 a CTA may have
OUT_STAGING = 2 * 64 * 256     # each consumer's 64 rows x 256 bytes (gemm_fp8.cuh OUT_BYTES)
QUANT_WARPS = 8                # (token, group) items a quantiser CTA (quant_fp8.cuh WARPS)
XQ, XS = "fp8_xq", "fp8_xs"    # the node's workspaces: the quantised x (4 bytes a word) and its scales
PARTIALS = "fp8_partials"      # ... and the split GEMMs' partial tiles (rows of PARTIAL_WORDS fp32)


def smem(stages: int) -> int:
    """The ring, the consumers' staging and 1 KB of slack to start the ring on a 1024-byte boundary
    (gemm_fp8.cuh smem_bytes)."""
    return stages * (BM + BN) * BK + OUT_STAGING + 1024


def fits(opts) -> bool:
    """Its ring, staging and barriers fit a CTA's shared memory on the target."""
    return smem(STAGES) + 2 * STAGES * 8 <= smem_limit(opts.arch)


def serves(K: int) -> bool:
    """The shape condition (the table's fact "fp8_rows"): whole 16-byte chunks of K."""
    return K % 16 == 0


def lower(nid, G, opts):
    """A linear / multi_linear / gate_up_silu node with FP8 weights as the quantiser and the FP8 GEMM at
    every T (a bench or a test of the GEMM alone; the model's lowering is linear_skinny's, which runs
    these launches over its table's range); a LoweringError where they cannot serve the node."""
    op, x, K, names, outs, rows = operands(G, nid)
    problems = [f"{n} is {weight_format(G, n, opts.dtype).name}" for n in names
                if weight_format(G, n, opts.dtype) is not FP8]
    if opts.dtype not in ("bf16", "fp16"):
        problems.append(f"activations are {opts.dtype}, not 16-bit")
    if not serves(K):
        problems.append(f"K = {K} is not a multiple of 16")
    if not has_feature(opts.arch, FEATURE):
        problems.append(f"target {opts.arch} lacks {FEATURE}")
    if problems:
        raise LoweringError(f"gemm_fp8 cannot serve {op} {nid}: {'; '.join(problems)}")
    return launches(nid, op, x, K, names, outs, rows, opts, None, 1)


def operands(G, nid: str) -> tuple:
    """(op, x, K, the bound weight names in the node's order (gate_up_silu: gate, up), the outputs,
    the output widths) of a linear / multi_linear / gate_up_silu node."""
    data, (x,), outs, bound = node_io(G, nid)
    op = data["op"]
    (K,) = inner_dims(G, x)
    if op == "gate_up_silu":
        return op, x, K, [bound["gate"], bound["up"]], list(outs), [data["attrs"]["out_dim"]]
    names = [bound["weight"]] if op == "linear" else [bound[f"weight{i}"] for i in range(len(outs))]
    return op, x, K, names, list(outs), [inner_dims(G, y)[0] for y in outs]


def launches(nid: str, op: str, x: str, K: int, weights: list[str], outs: list[str], rows: list[int], opts,
             factor: str | None, lo: int, normed: tuple[str, str] | None = None) -> list[KernelLaunch]:
    """The quantiser's launch, then the GEMMs' (one per output), their grids multiplied by `factor`
    (the row's token range, codegen.sizes.token_range); `weights` the bound FP8 weight names in the
    node's order (gate_up_silu: gate, up), `rows` the output widths, `lo` the row's first T.  `normed`:
    the values holding x's e4m3 rows and scales, written by the norm that makes x (_norm_quant.fp8_rows):
    the GEMMs read them and there is no quantiser launch.  Tuning.moe.fp8_overlap (which covers the FP8 x FP8
    GEMMs of the experts and of the linears): the consumers promote each K block under the next block's wgmma
    (parameter `overlap`, name part ovl).  Tuning.linear.gemm_weights_early: the first ring stages' weights
    issued before the PDL wait (parameter `early`, name part ew).  Tuning.linear.gemm_multi: a multi_linear's
    GEMMs as one launch (codegen/families/_gemm_multi.py)."""
    if opts.dtype not in ("bf16", "fp16"):
        raise ValueError(f"gemm_fp8 needs 16-bit activations, got {opts.dtype}")
    act = DTYPES[opts.dtype]
    KB = cdiv(K, FP8_BLOCK)
    ws = (Workspace(XQ, ("T", K // 4), "i32"), Workspace(XS, ("T", KB), "f32"))
    silu = op == "gate_up_silu"
    groups = [(weights, outs[0], rows[0])] if silu else [([w], y, o) for w, y, o in zip(weights, outs, rows)]
    min_kb = opts.tuning.linear.gemm_split_min_kb
    multi = _gemm_multi.fuses(op, rows, opts.tuning)   # Tuning.linear.gemm_multi: one launch of the GEMMs
    partials = (_gemm_multi.partials(PARTIALS, "f32", K, rows, min_kb) if multi else
                partials_workspace(PARTIALS, "f32", K, [O for _, _, O in groups], silu, min_kb))
    x_args = _norm_quant.x_args(normed, XQ, XS, "int")

    def only(g: str) -> str:
        return g if factor is None else f"{g} * {factor}"

    quant = KernelLaunch(
        family=FAMILY, template=TEMPLATE, name=kernel_name(FAMILY, [opts.dtype, f"k{K}", "quant_x"]),
        params={"variant": "quant", "act": act, "K": K, "KB": KB, "warps": QUANT_WARPS, "group": FP8_BLOCK},
        nodes=(nid,), grid=(only(f"cdiv(T * {KB}, {QUANT_WARPS})"), 1, 1), block=(QUANT_WARPS * 32, 1, 1),
        args=(inp("x", act, x), stride("x_stride", x, 0), work("xq", "int", XQ), work("xs", "float", XS),
              size("T", "T")),
        workspace=ws, stage="quant_x")
    overlap, early = opts.tuning.moe.fp8_overlap, opts.tuning.linear.gemm_weights_early
    gemms = []
    for ws_names, y, O in groups:
        cols = BN // 2 if silu else BN
        if silu:
            w_args = (tensor_map("wg", ws_names[0], (BOX, BK)), weight("sg", "float", _scale(ws_names[0])),
                      tensor_map("wu", ws_names[1], (BOX, BK)), weight("su", "float", _scale(ws_names[1])))
        else:
            w_args = (tensor_map("w", ws_names[0], (BOX, BK)), weight("sw", "float", _scale(ws_names[0])))
        nbytes = smem(STAGES)
        gemms.append(KernelLaunch(
            family=FAMILY, template=TEMPLATE,
            name=kernel_name(FAMILY, [f"{opts.dtype}_wfp8", f"k{K}", f"silu{O}" if silu else f"o{O}",
                                      *(["ovl"] * overlap), *(["ew"] * early)]),
            params={"variant": "gemm", "act": act, "K": K, "O": O, "silu": silu, "stages": STAGES, "smem": nbytes,
                    "threads": THREADS, "cols": cols, "box_rows": BOX, "box_k": BK, "bm": BM, "lo": lo,
                    "tickets": TICKETS, "partial_words": PARTIAL_WORDS, **({"overlap": True} if overlap else {}),
                    **({"early": True} if early else {})},
            nodes=(nid,), grid=(only(grid(O, K, silu, min_kb)), 1, 1), block=(THREADS, 1, 1),
            args=(*x_args, *w_args, out("y", act, y), work("partials", "float", PARTIALS), size("T", "T"),
                  size("splits", splits(O, K, silu, min_kb))),
            smem=nbytes, workspace=(partials,) if normed else (*ws, partials), stage="fp8_wgmma",
            requires=(FEATURE,)))
    if multi:
        gemms = [_gemm_multi.fuse(gemms, rows, K, min_kb, factor)]
    return gemms if normed else [quant, *gemms]


def _scale(name: str) -> str:
    (s,) = companion_names(name, FP8)
    return s
