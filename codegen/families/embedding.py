"""embedding: ids [T] int64 -> rows of the table [T, D] (one CTA per token, 16-byte copies)."""
from __future__ import annotations

from codegen.kernel import KernelLaunch, inp, out, size, weight
from codegen.render import kernel_name

from ._dense_util import ELEM_BYTES, act_ctype, block_threads_for_row, dims, inner_dims, node_io

FAMILY = "embedding"
TEMPLATE = "embedding.cu.j2"
OPS = ("embedding",)
PDL = True    # its kernels keep the contract of templates/include/pdl.cuh (programmatic dependent launch)


def lower(nid, G, opts):
    data, ins, outs, w = node_io(G, nid)
    (D,) = inner_dims(G, outs[0])
    vocab = dims(G)["vocab"]
    threads = block_threads_for_row(D, ELEM_BYTES[opts.dtype], hi=256)
    params = {"act": act_ctype(opts), "D": D, "vocab": vocab, "threads": threads}
    return [KernelLaunch(
        family=FAMILY, template=TEMPLATE,
        name=kernel_name(FAMILY, [opts.dtype, f"v{vocab}_d{D}"]),
        params=params, nodes=(nid,), grid=("T", 1, 1), block=(threads, 1, 1),
        args=(inp("ids", "i64", ins[0]), weight("table", params["act"], w["weight"]),
              out("out", params["act"], outs[0]), size("T", "T")))]


def tasks(launch, tiling):
    """The decode task graph's tiles (codegen/tasks.py): one per token, its rows only."""
    return tiling.per_token(launch)
