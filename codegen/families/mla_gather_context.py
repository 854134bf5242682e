"""mla_gather_context: state -> rows [TK, C + R], each sequence's paged cache rows in position order,
packed sequence after sequence at key_start[b] (templates/include/mla_gather.cuh).  The prefill
attention's keys: one kv_b GEMM decompresses them (the prefix earlier steps cached and the rows
this step wrote alike).  Grid: (row groups of the longest context, sequences); a warp a row, 16-byte
chunks where C + R and the bases allow."""
from __future__ import annotations

from codegen.kernel import KernelLaunch, ctx, out, size
from codegen.render import kernel_name

from ._dense_util import act_ctype, inner_dims, node_io

FAMILY = "mla_gather_context"
TEMPLATE = "mla_gather_context.cu.j2"
OPS = ("mla_gather_context",)
PDL = True    # its kernels keep the contract of templates/include/pdl.cuh (programmatic dependent launch)

ROWS = 8      # rows a CTA (a warp each)


def lower(nid, G, opts):
    _, _, outs, _ = node_io(G, nid)
    (W,) = inner_dims(G, outs[0])
    act = act_ctype(opts)
    params = {"act": act, "W": W, "block_size": opts.block_size, "rows": ROWS, "threads": ROWS * 32}
    return [KernelLaunch(
        family=FAMILY, template=TEMPLATE, name=kernel_name(FAMILY, [opts.dtype, f"w{W}", f"page{opts.block_size}"]),
        params=params, nodes=(nid,), grid=(f"cdiv(MAXCTX, {ROWS})", "B", 1), block=(ROWS * 32, 1, 1),
        args=(ctx("cache", "kv_cache", act), ctx("block_tables", "block_tables"), size("bt_width", "W"),
              ctx("context_lens", "context_lens"), ctx("key_start", "key_start"), out("out", act, outs[0])))]
