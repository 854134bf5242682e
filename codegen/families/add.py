"""add: elementwise a + b over [T, ...] rows (act or f32 values)."""
from __future__ import annotations

import math

from codegen.kernel import KernelLaunch, inp, out, size, stride
from codegen.render import kernel_name

from ._dense_util import ELEM_BYTES, LoweringError, ctype_of, inner_dims, node_io, vec16

FAMILY = "add"
TEMPLATE = "add.cu.j2"
OPS = ("add",)
PDL = True    # its kernels keep the contract of templates/include/pdl.cuh (programmatic dependent launch)
THREADS = 256


def lower(nid, G, opts):
    data, ins, outs, w = node_io(G, nid)
    inner = inner_dims(G, ins[0])
    if len(inner) != 1:
        # [T, H, d] values are added as [T, H*d] rows; that needs rows laid out densely.
        raise LoweringError(f"add lowers [T, n] values; {ins[0]} is [T, {', '.join(map(str, inner))}]")
    n = math.prod(inner)
    tag, ctype = ctype_of(G, ins[0], opts)
    vec = vec16(n, ELEM_BYTES[tag])
    per_cta = THREADS * vec
    params = {"ctype": ctype, "N": n, "threads": THREADS, "vec": vec}   # vec: static_assert'd in the kernel
    return [KernelLaunch(
        family=FAMILY, template=TEMPLATE, name=kernel_name(FAMILY, [tag, f"n{n}"]),
        params=params, nodes=(nid,), grid=("T", -(-n // per_cta), 1), block=(THREADS, 1, 1),
        args=(inp("a", ctype, ins[0]), stride("a_stride", ins[0], 0),
              inp("b", ctype, ins[1]), stride("b_stride", ins[1], 0),
              out("out", ctype, outs[0]), size("T", "T")))]


def tasks(launch, tiling):
    """The decode task graph's tiles (codegen/tasks.py): one per token, its rows only."""
    return tiling.per_token(launch)
