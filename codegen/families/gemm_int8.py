"""gemm_int8: the int8 x int8 GEMM of linear / multi_linear / gate_up_silu nodes whose weights are int8
(msModelSlim's int8_channel, W8A8_DYNAMIC), above the skinny kernel's token count, on sm_90a
(templates/gemm_int8.cu.j2).

The family claims no op: linear_skinny lowers those nodes and, where codegen/dispatch.py's linear
table gives the row "i8_wgmma", asks `launches` here for its launches, which run over that row's
token range (`lower` gives them for one node at every T):

    quant_i8     x [T, K] -> xq [T, qrow(K)] int8 (zero padded), xs [T] fp32 (templates/include/quant_int8.cuh,
                 ir/formats_int.py quantize_activation): per token, symmetric; the node's workspaces.
    i8_wgmma     one launch per weight (a multi_linear's share the quantised x; gate_up_silu's gate and up
                 are one launch): exact int32 sums by wgmma .s32.s8.s8, then (float(acc) * s_w) * s_x
                 (templates/include/gemm_int8.cuh), bit-equal to the reference; the weight by TMA (a tensor
                 map of [64, 128] boxes), a persistent grid of 128 x 128 tiles (64 output columns for
                 gate_up_silu).  Where the tiles are fewer than the SMs (decode batches: T = 17..256),
                 K is split over `splits` CTAs a tile (codegen/families/_gemm_split.py, as gemm_fp8's):
                 each writes its int32 partial tile to the node's workspace i8_partials and each
                 tile's last CTA adds them as integers before the dequant, so the result stays
                 bit-equal to the unsplit one; grid and `splits` come from T and SMS at run time.

It serves where the target offers sm_90a, the activations are 16-bit, K % 16 == 0 (16-byte strides of
the weight's tensor map) and K < 2^17 (exact int32 sums); elsewhere the exact library call stays.
"""
from __future__ import annotations

from codegen.arch import has_feature
from codegen.errors import LoweringError
from codegen.kernel import DTYPES, KernelLaunch, Workspace, inp, out, size, stride, tensor_map, weight, work
from codegen.render import kernel_name
from ir.formats import FORMATS, cdiv, companion_names, weight_format

from . import _gemm_multi, _norm_quant
from ._dense_util import inner_dims, node_io
from ._gemm_split import BK, BM, BN, PARTIAL_WORDS, TICKETS, grid, splits
from ._gemm_split import partials as partials_workspace
from .mla_decode_attention import smem_limit

FAMILY = "gemm_int8"
TEMPLATE = "gemm_int8.cu.j2"
OPS = ()          # launches of linear_skinny's nodes (its lowering calls `launches`); `lower` for one node alone
PDL = True        # both kernels wait (griddepcontrol.wait) before reading x / xq or writing
FEATURE = "sm_90a"
INT8 = FORMATS["int8_channel"]

BOX = 64                       # weight rows per TMA box (two a stage)
THREADS = 384                  # a producer warpgroup and two consumer warpgroups
STAGES = 6                     # 6 x 32 KB of ring + 32 KB of staging: 225 KB of the 227 a CTA may have
OUT_STAGING = 2 * 64 * 256     # each consumer's 64 rows x 256 bytes (gemm_ring.cuh OUT_BYTES)
QUANT_THREADS = 256            # the quantiser's CTA (one a token row)
MAX_K = 1 << 17                # exact int32 sums below it: K * 128 * 128 < 2^31
XQ, XS = "i8_xq", "i8_xs"      # the node's workspaces: the quantised x (4 bytes a word) and its scales
PARTIALS = "i8_partials"       # ... and the split GEMMs' partial tiles (rows of PARTIAL_WORDS int32)


def qrow(K: int) -> int:
    """Bytes of one quantised row: K rounded up to 16 (quant_int8.cuh qrow)."""
    return cdiv(K, 16) * 16


def smem(stages: int) -> int:
    """The ring, the consumers' staging and 1 KB of slack to start the ring on a 1024-byte boundary
    (gemm_ring.cuh smem_bytes)."""
    return stages * (BM + BN) * BK + OUT_STAGING + 1024


def fits(opts) -> bool:
    """Its ring, staging and barriers fit a CTA's shared memory on the target."""
    return smem(STAGES) + 2 * STAGES * 8 <= smem_limit(opts.arch)


def serves(K: int) -> bool:
    """The shape condition (the table's fact "i8_rows"): the weight's rows 16-byte multiples apart (TMA)
    and exact int32 sums."""
    return K % 16 == 0 and K < MAX_K


def lower(nid, G, opts):
    """A linear / multi_linear / gate_up_silu node with int8 weights as the quantiser and the int8 GEMM at
    every T (a bench or a test of the GEMM alone; the model's lowering is linear_skinny's, which runs
    these launches over its table's range); a LoweringError where they cannot serve the node."""
    op, x, K, names, outs, rows = operands(G, nid)
    problems = [f"{n} is {weight_format(G, n, opts.dtype).name}" for n in names
                if weight_format(G, n, opts.dtype) is not INT8]
    if opts.dtype not in ("bf16", "fp16"):
        problems.append(f"activations are {opts.dtype}, not 16-bit")
    if K % 16:
        problems.append(f"K = {K} is not a multiple of 16")
    if K >= MAX_K:
        problems.append(f"K = {K} is not below 2^17 (int32 sums)")
    if not has_feature(opts.arch, FEATURE):
        problems.append(f"target {opts.arch} lacks {FEATURE}")
    if problems:
        raise LoweringError(f"gemm_int8 cannot serve {op} {nid}: {'; '.join(problems)}")
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
    (the row's token range, codegen.sizes.token_range); `weights` the bound int8 weight names in the
    node's order (gate_up_silu: gate, up), `rows` the output widths, `lo` the row's first T.  `normed`:
    the values holding x's int8 rows and scales, written by the norm that makes x (_norm_quant.int8_rows):
    the GEMMs read them and there is no quantiser launch.  Tuning.linear.gemm_weights_early: the first ring
    stages' weights issued before the PDL wait (parameter `early`, name part ew).  Tuning.linear.gemm_multi: a
    multi_linear's GEMMs as one launch (codegen/families/_gemm_multi.py)."""
    if opts.dtype not in ("bf16", "fp16"):
        raise ValueError(f"gemm_int8 needs 16-bit activations, got {opts.dtype}")
    act = DTYPES[opts.dtype]
    q = qrow(K)
    ws = (Workspace(XQ, ("T", q // 4), "i32"), Workspace(XS, ("T",), "f32"))

    def only(g: str) -> str:
        return g if factor is None else f"{g} * {factor}"

    quant = KernelLaunch(
        family=FAMILY, template=TEMPLATE, name=kernel_name(FAMILY, [opts.dtype, f"k{K}", "quant_i8"]),
        params={"variant": "quant", "act": act, "K": K, "qrow": q, "threads": QUANT_THREADS, "lo": lo,
                "wfmt": INT8.name},
        nodes=(nid,), grid=(only("T"), 1, 1), block=(QUANT_THREADS, 1, 1),
        args=(inp("x", act, x), stride("x_stride", x, 0), work("q", "signed char", XQ), work("s", "float", XS),
              size("T", "T")),
        workspace=ws, stage="quant_i8")
    silu = op == "gate_up_silu"
    groups = [(weights, outs[0], rows[0])] if silu else [([w], y, o) for w, y, o in zip(weights, outs, rows)]
    cols = BN // 2 if silu else BN
    min_kb = opts.tuning.linear.gemm_split_min_kb
    multi = _gemm_multi.fuses(op, rows, opts.tuning)   # Tuning.linear.gemm_multi: one launch of the GEMMs
    partials = (_gemm_multi.partials(PARTIALS, "i32", K, rows, min_kb) if multi else
                partials_workspace(PARTIALS, "i32", K, [O for _, _, O in groups], silu, min_kb))
    x_args = _norm_quant.x_args(normed, XQ, XS)
    early = opts.tuning.linear.gemm_weights_early
    gemms = []
    for names, y, O in groups:
        if silu:
            w_args = (tensor_map("wg", names[0], (BOX, BK)), weight("sg", "float", _scale(names[0])),
                      tensor_map("wu", names[1], (BOX, BK)), weight("su", "float", _scale(names[1])))
        else:
            w_args = (tensor_map("w", names[0], (BOX, BK)), weight("sw", "float", _scale(names[0])))
        nbytes = smem(STAGES)
        gemms.append(KernelLaunch(
            family=FAMILY, template=TEMPLATE,
            name=kernel_name(FAMILY, [f"{opts.dtype}_wi8", f"k{K}", f"silu{O}" if silu else f"o{O}",
                                      *(["ew"] * early)]),
            params={"variant": "gemm", "act": act, "K": K, "qrow": q, "O": O, "silu": silu, "stages": STAGES,
                    "smem": nbytes, "threads": THREADS, "cols": cols, "box_rows": BOX, "box_k": BK, "bm": BM,
                    "lo": lo, "wfmt": INT8.name, "tickets": TICKETS, "partial_words": PARTIAL_WORDS,
                    **({"early": True} if early else {})},
            nodes=(nid,), grid=(only(grid(O, K, silu, min_kb)), 1, 1), block=(THREADS, 1, 1),
            args=(*x_args, *w_args, out("y", act, y), work("partials", "int", PARTIALS), size("T", "T"),
                  size("splits", splits(O, K, silu, min_kb))),
            smem=nbytes, workspace=(partials,) if normed else (*ws, partials), stage="i8_wgmma",
            requires=(FEATURE,)))
    if multi:
        gemms = [_gemm_multi.fuse(gemms, rows, K, min_kb, factor)]
    return gemms if normed else [quant, *gemms]


def _scale(name: str) -> str:
    s, _ = companion_names(name, INT8)
    return s
