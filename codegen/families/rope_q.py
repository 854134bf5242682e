"""rope_q: q_pe [T, H, R] (a strided view) -> q_rot [T, H, R], rotated by position (YaRN tables inline)."""
from __future__ import annotations

from codegen.kernel import Arg, KernelLaunch
from codegen.render import kernel_name

from ._dense_util import act_ctype, inner_dims, node_io, rope_params, rope_tag

FAMILY = "rope_q"
TEMPLATE = "rope_q.cu.j2"
OPS = ("rope_q",)


def lower(nid, G, opts):
    data, ins, outs, w = node_io(G, nid)
    H, R = inner_dims(G, ins[0])
    rp = rope_params(G, data["attrs"]["pairs"], data["attrs"]["output"])
    threads = max(32, min(256, -(-(H * R // 2) // 32) * 32))
    params = {"act": act_ctype(opts), "H": H, "R": R, "threads": threads, **rp}
    return [KernelLaunch(
        family=FAMILY, template=TEMPLATE,
        name=kernel_name(FAMILY, [opts.dtype, f"h{H}_r{R}", rope_tag(rp)]),
        params=params, nodes=(nid,), grid=("T", 1, 1), block=(threads, 1, 1),
        args=(Arg("ptr", f"value:{ins[0]}"), Arg("i64", f"stride:{ins[0]}:0"), Arg("i64", f"stride:{ins[0]}:1"),
              Arg("ptr", "ctx:positions"), Arg("ptr", f"value:{outs[0]}"), Arg("i32", "size:T")))]
