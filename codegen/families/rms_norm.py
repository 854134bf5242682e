"""rms_norm: x [T, n] (a possibly strided view) -> out [T, n]; one CTA per row."""
from __future__ import annotations

from codegen.kernel import Arg, KernelLaunch
from codegen.render import kernel_name

from ._dense_util import ELEM_BYTES, act_ctype, block_threads_for_row, const_ref, inner_dims, node_io

FAMILY = "rms_norm"
TEMPLATE = "rms_norm.cu.j2"
OPS = ("rms_norm",)


def lower(nid, G, opts):
    data, ins, outs, w = node_io(G, nid)
    (n,) = inner_dims(G, ins[0])
    threads = block_threads_for_row(n, ELEM_BYTES[opts.dtype])
    params = {"act": act_ctype(opts), "N": n, "threads": threads}
    return [KernelLaunch(
        family=FAMILY, template=TEMPLATE, name=kernel_name(FAMILY, [opts.dtype, f"d{n}"]),
        params=params, nodes=(nid,), grid=("T", 1, 1), block=(threads, 1, 1),
        args=(Arg("ptr", f"value:{ins[0]}"), Arg("i64", f"stride:{ins[0]}:0"),
              Arg("ptr", f"weight:{w['weight']}"), Arg("ptr", f"value:{outs[0]}"),
              Arg("f32", const_ref(data["attrs"]["eps"])), Arg("i32", "size:T")))]
