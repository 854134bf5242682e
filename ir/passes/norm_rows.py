"""What the passes that let an RMSNorm write its readers' quantised rows share (fuse_norm_int8_quant,
fuse_norm_fp8_quant):
which ops are norms, which readers multiply a norm's output by weights that quantise it, the names of the
rows, and the rewrite that adds them to the norm.

A norm holds its whole output row in one CTA, so the per-token quantisation its readers would run as a
launch of their own (one reduction over the row, then the quotients) costs it one more reduction; the
readers then read the norm's rows.  The norm keeps writing its 16-bit output: the residual stream, the
readers without quantised weights, and the readers' own fallbacks read it.

Not a pass (no pass function here): ir/passes/fuse_norm_int8_quant.py and fuse_norm_fp8_quant.py are.
"""
from __future__ import annotations

from typing import Callable

import networkx as nx

from ..formats import WeightFormat, weight_format
from .rewrite import NewOp, RewriteError, copy_graph, nodes_of, readers_of, refuse, replace

# The ops whose first output is an RMSNorm of a whole row (ir/ops: rms_norm_ref)
NORMS = ("rms_norm", "fused_add_rms_norm", "moe_combine_residual_rms_norm")
# op -> the weight roles that multiply its first input (None: a multi_linear's weight0, weight1, ...)
X_ROLES = {"linear": ("weight",), "multi_linear": None, "gate_up_silu": ("gate", "up"),
           "moe_gate_up": ("gate", "up"), "moe_gate_up_silu": ("gate", "up"), "moe_expert_ffn": ("gate", "up")}


def row_names(h: str, quant: str) -> tuple[str, str]:
    """The values holding the quantised rows of norm output `h` and their scales."""
    tag = {"int8": "i8", "fp8": "f8"}[quant]
    return f"{h}.q{tag}", f"{h}.s{tag}"


def quant_rows(G: nx.DiGraph, x: str, quant: str) -> tuple[str, str] | None:
    """(rows, scales) of value `x` in format `quant` where the norm that makes x writes them, else None."""
    q, s = row_names(x, quant)
    values = G.graph["values"]
    return (q, s) if q in values and s in values else None


def x_formats(G: nx.DiGraph, nid: str, value: str) -> list[WeightFormat]:
    """The storage formats of the weights node `nid` multiplies `value` by ([] where it does not read
    `value` as its first input through weights: a residual add, a router)."""
    data = G.nodes[nid]
    roles = X_ROLES.get(data["op"], ())
    if not data["inputs"] or data["inputs"][0] != value or roles == ():
        return []
    if data["op"] == "linear" and data["attrs"].get("precision") == "fp32":
        return []
    bound = data["weights"]
    names = [bound[r] for r in roles] if roles is not None else [bound[r] for r in sorted(bound)]
    return [weight_format(G, n) for n in names]


def add_quant_rows(G: nx.DiGraph, quant: str, wants: Callable[[list[WeightFormat]], bool],
                   width_problem: Callable[[int], str | None] = lambda n: None) -> nx.DiGraph:
    """A copy of G in which every norm with a reader whose weight formats `wants` also writes its output's
    quantised rows in format `quant` (attrs["quant"], two more outputs: row_names); refused (logged) where
    `width_problem` of the row width says why the readers cannot take the rows."""
    G = copy_graph(G)
    for norm in [n for op in NORMS for n in nodes_of(G, op)]:
        data = G.nodes[norm]
        h = data["outputs"][0]
        takers = [r for r in readers_of(G, norm, h) if wants(x_formats(G, r, h))]
        if not takers or data["attrs"].get("quant") is not None:
            continue
        if G.graph["values"][h].shape[0] != "T":
            refuse(G, norm, takers[0], f"the norm's rows are {G.graph['values'][h].shape[0]}, not the step's tokens")
            continue
        problem = width_problem(G.graph["values"][h].shape[1])
        if problem:
            refuse(G, norm, takers[0], problem)
            continue
        try:
            give_rows(G, norm, quant)
        except RewriteError as exc:
            refuse(G, norm, takers[0], str(exc))
    return G


def give_rows(G: nx.DiGraph, norm: str, quant: str) -> str:
    """Rewrite norm node `norm` of G in place into the same op writing its output's quantised rows in
    format `quant` too (two more outputs, row_names); returns its id.  RewriteError: G unchanged."""
    data = G.nodes[norm]
    new = NewOp(data["op"], list(data["inputs"]), [*data["outputs"], *row_names(data["outputs"][0], quant)],
                {**data["attrs"], "quant": quant}, dict(data["weights"]), nid=norm)
    (nid,) = replace(G, [norm], [new])
    return nid
