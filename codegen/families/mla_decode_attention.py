"""mla_decode_attention: paged attention over the compressed [c_n | k_rot] cache rows.

Two launches: `split` (CTA = token x head group x KV split; each cache row is read once
per head group into shared memory with 16-byte loads) and `combine` (merge the splits'
partial max / sum / accumulators from the workspace). The number of splits S is a size
expression: enough CTAs to fill the GPU twice over, never more than one per KV tile pair.

The block-table width comes from the runtime size ``W`` (block_tables.shape[1]).
"""
from __future__ import annotations

from codegen.kernel import Arg, KernelLaunch, Workspace
from codegen.render import kernel_name

from ._dense_util import ELEM_BYTES, LoweringError, act_ctype, const_ref, dims, inner_dims, node_io

FAMILY = "mla_decode_attention"
TEMPLATE = "mla_decode_attention.cu.j2"
OPS = ("mla_decode_attention",)

THREADS = 256
KT = 32                 # cache rows per tile (one per lane in the score phase)
MAX_HG = 16             # heads per CTA: all of them share each tile read
SM_TARGET = 2 * 132     # CTAs to aim for (two waves' worth on an H100/H200)
COMBINE_THREADS = 128


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
    HG = min(H, MAX_HG)
    NG = -(-H // HG)
    smem = smem_bytes(C, R, HG, ELEM_BYTES[opts.dtype])
    S = f"min(cdiv(MAXCTX, {2 * KT}), max(1, cdiv({SM_TARGET}, T * {NG})))"
    base = {"act": act_ctype(opts), "C": C, "R": R, "H": H, "HG": HG, "KT": KT,
            "block_size": opts.block_size, "threads": THREADS}
    name = kernel_name(FAMILY, [opts.dtype, f"c{C}_r{R}", f"h{H}", f"page{opts.block_size}"])
    ws = (Workspace("acc", ("T", f"{H} * ({S})", C), "f32"), Workspace("ml", ("T", f"{H} * ({S})", 2), "f32"))
    scale = G.graph["model"].softmax_scale
    split = KernelLaunch(
        family=FAMILY, template=TEMPLATE, name=name, params={**base, "stage": "split", "smem": smem},
        nodes=(nid,), grid=("T", NG, S), block=(THREADS, 1, 1), smem=smem, workspace=ws,
        args=(Arg("ptr", f"value:{ins[0]}"), Arg("i64", f"stride:{ins[0]}:0"), Arg("i64", f"stride:{ins[0]}:1"),
              Arg("ptr", f"value:{ins[1]}"), Arg("i64", f"stride:{ins[1]}:0"), Arg("i64", f"stride:{ins[1]}:1"),
              Arg("ptr", "ctx:kv_cache"), Arg("ptr", "ctx:block_tables"), Arg("i32", "size:W"),
              Arg("ptr", "ctx:context_lens"), Arg("ptr", "ctx:query_start"), Arg("ptr", "ctx:positions"),
              Arg("ptr", "workspace:acc"), Arg("ptr", "workspace:ml"), Arg("f32", const_ref(scale)),
              Arg("i32", "size:T"), Arg("i32", "size:B"), Arg("i32", f"size:{S}")))
    combine = KernelLaunch(
        family=FAMILY, template=TEMPLATE, name=name + "__combine",
        params={**base, "stage": "combine", "threads": COMBINE_THREADS},
        nodes=(nid,), grid=("T", H, 1), block=(COMBINE_THREADS, 1, 1), workspace=ws,
        args=(Arg("ptr", "workspace:acc"), Arg("ptr", "workspace:ml"), Arg("ptr", f"value:{outs[0]}"),
              Arg("i32", "size:T"), Arg("i32", f"size:{S}")))
    return [split, combine]
