"""silu_and_mul: [gate, up] [T, n] (possibly strided views) -> silu(gate) * up."""
from __future__ import annotations

from codegen.kernel import KernelLaunch, inp, out, size, stride
from codegen.render import kernel_name

from ._dense_util import ELEM_BYTES, LoweringError, act_ctype, inner_dims, node_io, vec16

FAMILY = "silu_and_mul"
TEMPLATE = "silu_and_mul.cu.j2"
OPS = ("silu_and_mul",)
PDL = True    # its kernels keep the contract of templates/include/pdl.cuh (programmatic dependent launch)
THREADS = 256


def lower(nid, G, opts):
    data, ins, outs, w = node_io(G, nid)
    inner = inner_dims(G, ins[0])
    if len(inner) != 1:
        raise LoweringError(f"silu_and_mul lowers [T, n] values; {ins[0]} is [T, {', '.join(map(str, inner))}]")
    (n,) = inner
    ctype = act_ctype(opts)
    vec = vec16(n, ELEM_BYTES[opts.dtype])
    params = {"act": ctype, "N": n, "threads": THREADS, "vec": vec}   # vec: static_assert'd in the kernel
    return [KernelLaunch(
        family=FAMILY, template=TEMPLATE, name=kernel_name(FAMILY, [opts.dtype, f"n{n}"]),
        params=params, nodes=(nid,), grid=("T", -(-n // (THREADS * vec)), 1), block=(THREADS, 1, 1),
        args=(inp("g", params["act"], ins[0]), stride("g_stride", ins[0], 0),
              inp("u", params["act"], ins[1]), stride("u_stride", ins[1], 0),
              out("out", params["act"], outs[0]), size("T", "T")))]


def tasks(launch, tiling):
    """The decode task graph's tiles (codegen/tasks.py): one per token, its rows only."""
    return tiling.per_token(launch)
