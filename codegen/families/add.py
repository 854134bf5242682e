"""add: elementwise a + b over [T, ...] rows (act or f32 values)."""
from __future__ import annotations

import math

from codegen.kernel import Arg, KernelLaunch
from codegen.render import kernel_name

from ._dense_util import ELEM_BYTES, LoweringError, ctype_of, inner_dims, node_io, vec16

FAMILY = "add"
TEMPLATE = "add.cu.j2"
OPS = ("add",)
THREADS = 256


def lower(nid, G, opts):
    data, ins, outs, w = node_io(G, nid)
    inner = inner_dims(G, ins[0])
    if len(inner) != 1:
        # [T, H, d] values are added as [T, H*d] rows; that needs rows laid out densely.
        raise LoweringError(f"add lowers [T, n] values; {ins[0]} is [T, {inner}]")
    n = math.prod(inner)
    tag, ctype = ctype_of(G, ins[0], opts)
    vec = vec16(n, ELEM_BYTES[tag])
    per_cta = THREADS * vec
    params = {"ctype": ctype, "N": n, "threads": THREADS}
    return [KernelLaunch(
        family=FAMILY, template=TEMPLATE, name=kernel_name(FAMILY, [tag, f"n{n}"]),
        params=params, nodes=(nid,), grid=("T", -(-n // per_cta), 1), block=(THREADS, 1, 1),
        args=(Arg("ptr", f"value:{ins[0]}"), Arg("i64", f"stride:{ins[0]}:0"),
              Arg("ptr", f"value:{ins[1]}"), Arg("i64", f"stride:{ins[1]}:0"),
              Arg("ptr", f"value:{outs[0]}"), Arg("i32", "size:T")))]
