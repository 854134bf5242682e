"""segment: a persistent decode segment, one launch running the tasks of a run of member launches
(codegen/segments.py decides the runs; templates/segment.cu.j2, templates/include/segment.cuh).

It implements no graph op: `launch` builds it from the member launches.  Member j's arguments are
its own, renamed m<j>_<name>, plus m<j>_tasks (its grid's CTAs, the tasks it brings: evaluated by the
runtime like any size); its body (the member family's `segment_body`) names the device function.
The launch's nodes are the members' with the lead first: the runtime binds the ctx kv_cache of the
node that leads (codegen/segments.py picks the member that binds one)."""
from __future__ import annotations

import dataclasses
import hashlib
import json

from codegen.errors import LoweringError
from codegen.kernel import DTYPES, Arg, KernelLaunch, SizeRef
from codegen.render import kernel_name

FAMILY = "segment"
TEMPLATE = "segment.cu.j2"
OPS = ()
PDL = True    # every CTA waits (griddepcontrol.wait) before it reads a value, writes or takes a task
SKINNY_RED_TILE = 16 * 16    # skinny.cuh: floats of a warp's partial sums per row tile (TILE x MAX_TOKENS)
NORM_SCRATCH = 32            # norm.cuh's block_sum: a float a warp
# An H100 SM's shared memory and what the driver reserves a CTA: every CTA of a segment must be resident at
# once (its first task is its blockIdx), so two an SM need twice the CTA's static shared memory
SM_SMEM = 228 * 1024
CTA_RESERVED_SMEM = 1024


def lower(nid, G, opts):
    raise LoweringError(f"{nid}: a segment is made from a decode plan's launches (codegen/segments.py), "
                        f"not lowered from a node")


def smem_floats(body: dict) -> int:
    if body["kind"] == "linear":
        return body["warps"] * body["rt"] * SKINNY_RED_TILE
    if body["kind"] == "v_up":
        return -(-body["smem_bytes"] // 4)       # mla_absorb.cuh AbsorbVUp::SMEM
    return NORM_SCRATCH


def ctas_refusal(smem_floats: int, ctas: int) -> str | None:
    """Why `ctas` CTAs of a segment with this scratch cannot all be resident on an SM (None: they can).
    Registers need no check: `__launch_bounds__(THREADS, ctas)` makes ptxas fit them."""
    need = ctas * (smem_floats * 4 + 4 + CTA_RESERVED_SMEM)     # the scratch, `slot`, the reserve
    return None if need <= SM_SMEM else f"{ctas} CTAs an SM need {need} B of shared memory, an SM has {SM_SMEM}"


def member_tasks(m: KernelLaunch) -> str:
    """A member's task count: its grid's CTAs (a 3-D grid's y and z are constants: its body's grid_yz)."""
    x, y, z = m.grid
    return x if (y, z) == (1, 1) else f"({x}) * {y * z}"


def launch(members, bodies, waits, *, lead: int, gate: str | None, pdl: bool, ctas: int = 1) -> KernelLaunch:
    """One launch for `members` (KernelLaunch, in plan order) with their `bodies` (segment_body) and
    `waits` (per member, the earlier members it waits for); `lead` the member whose node leads;
    `gate` the factor of the token range every member runs in (None: every T); `ctas` the CTAs an SM
    (Tuning.persistent.ctas_per_sm; 1 where two do not fit, the reason in params["ctas_refused"])."""
    threads = {m.block for m in members}
    if len(threads) != 1 or any(list(m.grid[1:]) != b.get("grid_yz", [1, 1]) for m, b in zip(members, bodies)):
        raise LoweringError(f"a segment's members share one block size and have 1-D grids (or bodies that take "
                            f"theirs): {', '.join(m.name for m in members)}")
    (block,) = threads
    act = members[0].params["act"]
    args, infos = [], []
    for j, (m, body, w) in enumerate(zip(members, bodies, waits)):
        args += [dataclasses.replace(a, name=f"m{j}_{a.name}") for a in m.args]
        args.append(Arg(f"m{j}_tasks", "int", SizeRef(member_tasks(m))))
        infos.append({**body, "kernel": m.name, "waits": list(w)})
    params = {"act": act, "threads": block[0], "members": infos, "smem_floats": max(map(smem_floats, bodies))}
    if ctas != 1:       # one CTA an SM: no key, the kernels v43 measured
        refused = ctas_refusal(params["smem_floats"], ctas)
        params.update({"ctas_refused": refused} if refused else {"ctas": ctas})
    digest = hashlib.sha256(json.dumps(params, sort_keys=True).encode()).hexdigest()[:10]
    dtype = {c: d for d, c in DTYPES.items()}[act]
    total = " + ".join(f"({member_tasks(m)})" for m in members)
    sms = "SMS" if params.get("ctas", 1) == 1 else f"{ctas} * SMS"
    grid = f"min({sms}, {total})" + (f" * {gate}" if gate else "")
    nodes = [n for m in (members[lead], *members[:lead], *members[lead + 1:]) for n in m.nodes]
    origins = tuple(o for m in members for o in m.origins)
    return KernelLaunch(family=FAMILY, template=TEMPLATE,
                        name=kernel_name(FAMILY, [dtype, f"{len(members)}m", digest]), params=params,
                        nodes=tuple(dict.fromkeys(nodes)), grid=(grid, 1, 1), block=block, args=tuple(args),
                        stage="", origins=origins, pdl=pdl, requires=tuple(sorted({r for m in members
                                                                                     for r in m.requires})))
