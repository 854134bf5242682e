"""fused_add_rms_norm: [x, residual] -> [rms_norm(x + residual), x + residual]; one CTA per row.

`launch` is also the norm's kernel of a moe_route that carries the norm (ir/passes/
fuse_norm_into_route.py) at the T its one-launch form does not serve."""
from __future__ import annotations

from codegen.kernel import KernelLaunch, inp, out, size, stride, weight
from codegen.render import kernel_name

from ._dense_util import ELEM_BYTES, act_ctype, block_threads_for_row, c_float, inner_dims, node_io

FAMILY = "fused_add_rms_norm"
TEMPLATE = "fused_add_rms_norm.cu.j2"
OPS = ("fused_add_rms_norm",)
PDL = True    # its kernels keep the contract of templates/include/pdl.cuh (programmatic dependent launch)


def launch(nid: str, G, opts, x: str, res: str, w: str, h: str, s: str, eps: float, rows="T",
           stage: str = "") -> KernelLaunch:
    """The kernel over `rows` CTAs (T, or T times a 0 / 1 factor of T)."""
    (n,) = inner_dims(G, x)
    threads = block_threads_for_row(n, ELEM_BYTES[opts.dtype])
    params = {"act": act_ctype(opts), "N": n, "threads": threads, "eps": c_float(eps)}
    act = params["act"]
    return KernelLaunch(
        family=FAMILY, template=TEMPLATE, name=kernel_name(FAMILY, [opts.dtype, f"d{n}"]),
        params=params, nodes=(nid,), grid=(rows, 1, 1), block=(threads, 1, 1), stage=stage,
        args=(inp("x", act, x), stride("x_stride", x, 0), inp("res", act, res), stride("res_stride", res, 0),
              weight("w", act, w), out("h", act, h), out("s", act, s), size("T", "T")))


def lower(nid, G, opts):
    data, ins, outs, w = node_io(G, nid)
    return [launch(nid, G, opts, ins[0], ins[1], w["weight"], outs[0], outs[1], data["attrs"]["eps"])]
