"""rope_q: q_pe [T, H, R] (a strided view) -> q_rot [T, H, R], rotated by position (YaRN tables inline).

Alignment: no vector accesses (element loads and stores), so any view offset and stride is fine."""
from __future__ import annotations

from codegen.kernel import KernelLaunch, ctx, inp, out, size, stride
from codegen.render import kernel_name

from ._dense_util import act_ctype, inner_dims, node_io, rope_params, rope_tag

FAMILY = "rope_q"
TEMPLATE = "rope_q.cu.j2"
OPS = ("rope_q",)
PDL = True    # its kernels keep the contract of templates/include/pdl.cuh (programmatic dependent launch)


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
        args=(inp("q", params["act"], ins[0]), stride("q_stride0", ins[0], 0), stride("q_stride1", ins[0], 1),
              ctx("positions", "positions"), out("out", params["act"], outs[0]), size("T", "T")))]
