"""mla_decode_attention: paged attention over the compressed [c_n | k_rot] cache rows.

Two launches: `split` (CTA = token x head group x KV split; each cache row is read once
per head group into shared memory with 16-byte loads) and `combine` (merge the non-empty
splits' partial max / sum / accumulators from the workspace).

bf16 / fp16 with (C + R) % 16 == 0 and C % 64 == 0 (V2-Lite: 512 + 64) take the tensor-core
split (MlaDecodeMma: 16 heads as the mma M dimension, 32-row tiles through a 2-deep cp.async
ring, 4 warps, two CTAs per SM); fp32 and odd shapes the CUDA-core one (MlaDecode). The number
of splits S is a size expression: about SLOTS CTAs in all (one wave at two CTAs per SM), never
more than one split per KT-row tile of the longest context.

The block-table width comes from the runtime size ``W`` (block_tables.shape[1]).
"""
from __future__ import annotations

from codegen.kernel import KernelLaunch, Workspace, ctx, inp, out, size, stride, work
from codegen.render import kernel_name

from ._dense_util import ELEM_BYTES, LoweringError, act_ctype, c_float, inner_dims, node_io

FAMILY = "mla_decode_attention"
TEMPLATE = "mla_decode_attention.cu.j2"
OPS = ("mla_decode_attention",)

THREADS = 256
KT = 32                 # cache rows per tile (one per lane in the score phase)
MAX_HG = 16             # heads per CTA: all of them share each tile read
SM_TARGET = 2 * 132     # CTAs to aim for (two waves' worth on an H100/H200)
COMBINE_THREADS = 128
MMA_WARPS = 4
MMA_THREADS = 32 * MMA_WARPS
MMA_HG = 16             # heads per CTA on the tensor-core path (the mma M dimension)
NSTAGE = 2              # cp.async ring depth (tiles in flight per CTA)
SLOTS = 2 * 132         # resident CTAs of the tensor-core split (2 per SM: ~81 KB of shared memory each)
# Measured on the H200 at 64 x 4096: this (4 warps, 2 stages, 2 CTAs / SM) 134 us; 8 warps,
# 4 stages, 1 CTA / SM 173 us -- more independent CTAs per SM beat a deeper ring.
MAX_S = 2 * 132         # upper bound of S on either path (the combine's shared arrays)


def use_mma(C: int, R: int, dtype: str) -> bool:
    return dtype in ("bf16", "fp16") and (C + R) % 16 == 0 and C % (16 * MMA_WARPS) == 0


def mma_smem_bytes(C: int, R: int) -> int:
    kp = C + R + 8
    return NSTAGE * KT * kp * 2 + MMA_WARPS * (KT // 8) * 32 * 16


def smem_bytes(C: int, R: int, HG: int, elem: int) -> int:
    W = C + R
    wp = (W + 1) // 2
    kph = wp if wp % 2 else wp + 1
    pp = (HG + 3) // 4 * 4
    q = HG * 2 * wp * 4
    k = (KT * 2 * kph * elem + 15) // 16 * 16
    return q + k + KT * pp * 4 + pp * 4 + KT * 8


def lower(nid, G, opts):
    data, ins, outs, w = node_io(G, nid)
    H, C = inner_dims(G, ins[0])
    _, R = inner_dims(G, ins[1])
    if opts.block_size < 1:
        raise LoweringError(f"block_size must be >= 1, got {opts.block_size}")
    mma = use_mma(C, R, opts.dtype)
    if mma:
        HG, threads = MMA_HG, MMA_THREADS
        NG = -(-H // HG)
        smem = mma_smem_bytes(C, R)
        S = f"min(cdiv(MAXCTX, {KT}), max(1, {SLOTS} // (T * {NG})))"
    else:
        HG, threads = min(H, MAX_HG), THREADS
        NG = -(-H // HG)
        smem = smem_bytes(C, R, HG, ELEM_BYTES[opts.dtype])
        S = f"min(cdiv(MAXCTX, {2 * KT}), max(1, cdiv({SM_TARGET}, T * {NG})))"
    base = {"act": act_ctype(opts), "C": C, "R": R, "H": H, "HG": HG, "KT": KT,
            "block_size": opts.block_size, "threads": threads, "mma": mma, "nstage": NSTAGE, "max_s": MAX_S}
    name = kernel_name(FAMILY, [opts.dtype, f"c{C}_r{R}", f"h{H}", f"page{opts.block_size}"])
    ws = (Workspace("acc", ("T", f"{H} * ({S})", C), "f32"), Workspace("ml", ("T", f"{H} * ({S})", 2), "f32"))
    act = base["act"]
    split = KernelLaunch(
        family=FAMILY, template=TEMPLATE, name=name,
        params={**base, "stage": "split", "smem": smem, "scale": c_float(G.graph["model"].softmax_scale)},
        nodes=(nid,), grid=("T", NG, S), block=(threads, 1, 1), smem=smem, workspace=ws, stage="split",
        args=(inp("q_lat", act, ins[0]), stride("ql_s0", ins[0], 0), stride("ql_s1", ins[0], 1),
              inp("q_rot", act, ins[1]), stride("qr_s0", ins[1], 0), stride("qr_s1", ins[1], 1),
              ctx("cache", "kv_cache", act), ctx("block_tables", "block_tables"), size("bt_width", "W"),
              ctx("context_lens", "context_lens"), ctx("query_start", "query_start"), ctx("positions", "positions"),
              work("ws_acc", "float", "acc"), work("ws_ml", "float", "ml"),
              size("T", "T"), size("B", "B"), size("S", S)))
    combine = KernelLaunch(
        family=FAMILY, template=TEMPLATE, name=name + "__combine",
        params={**base, "stage": "combine", "threads": COMBINE_THREADS},
        nodes=(nid,), grid=("T", H, 1), block=(COMBINE_THREADS, 1, 1), workspace=ws, stage="combine",
        args=(work("ws_acc", "float", "acc", writes=False), work("ws_ml", "float", "ml", writes=False),
              out("out", act, outs[0]), size("T", "T"), size("S", S)))
    return [split, combine]
