"""rms_norm: x [T, n] (a possibly strided view) -> out [T, n]; one CTA per row."""
from __future__ import annotations

from codegen.kernel import KernelLaunch, inp, out, size, stride, weight
from codegen.render import kernel_name

from . import _norm_quant
from ._dense_util import ELEM_BYTES, act_ctype, block_threads_for_row, c_float, inner_dims, node_io

FAMILY = "rms_norm"
TEMPLATE = "rms_norm.cu.j2"
OPS = ("rms_norm",)
PDL = True    # its kernels keep the contract of templates/include/pdl.cuh (programmatic dependent launch)


def lower(nid, G, opts):
    data, ins, outs, w = node_io(G, nid)
    (n,) = inner_dims(G, ins[0])
    threads = block_threads_for_row(n, ELEM_BYTES[opts.dtype])
    params = {"act": act_ctype(opts), "N": n, "threads": threads, "eps": c_float(data["attrs"]["eps"])}

    def make(q_params, q_parts, q_args, factor):
        return KernelLaunch(
            family=FAMILY, template=TEMPLATE, name=kernel_name(FAMILY, [opts.dtype, f"d{n}", *q_parts]),
            params={**params, **q_params}, nodes=(nid,), grid=(_norm_quant.grid(factor), 1, 1),
            block=(threads, 1, 1),
            args=(inp("x", params["act"], ins[0]), stride("x_stride", ins[0], 0),
                  weight("w", params["act"], w["weight"]), out("out", params["act"], outs[0]), *q_args,
                  size("T", "T")))
    return _norm_quant.launches(G, nid, opts, n, make)


def tasks(launch, tiling):
    """The decode task graph's tiles (codegen/tasks.py): one per token, its rows only."""
    return tiling.per_token(launch)


def segment_body(launch):
    """Its task body in a persistent segment (templates/include/task_bodies.cuh): one token row a task."""
    p = launch.params
    if _norm_quant.writes_rows(launch):   # the task body writes the 16-bit row only
        return None
    return {"kind": "rms_norm", "N": p["N"], "eps": p["eps"]}
