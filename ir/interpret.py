"""The reference interpreter: run a graph op by op with each op's torch semantics.

This is the ground truth that passes (same result before and after) and generated
kernels (same result as the op) are tested against, and the `reference` backend.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only
    import networkx as nx

from .formats import FORMATS, companions_of, dequantize
from .formats_int import IntMatrix
from .graph import node_view, topo_order
from .ops import OPS


def bound_weight(G: nx.DiGraph, weights: dict, name: str, ins: list):
    """Bound weight `name` as an op's reference semantics takes it: as stored, or, when quantised,
    dequantised exactly (ir.formats.dequantize, float32) and cast to the dtype the op computes in
    (that of its first float input: the activation dtype, or float32); an integer format as an
    IntMatrix, which the op's linear() multiplies by with int8 activations."""
    info = G.graph["weights"][name]
    if info.format is None:
        return weights[name]
    fmt = FORMATS[info.format]
    if fmt.block is None:    # an integer format: the op multiplies by it exactly (ir/formats_int.py linear)
        return IntMatrix(weights[name], [weights[c] for c in companions_of(G.graph["weights"], name)], fmt)
    full = dequantize(weights[name], [weights[c] for c in companions_of(G.graph["weights"], name)],
                      FORMATS[info.format])
    act = next((t.dtype for t in ins if hasattr(t, "dtype") and t.dtype.is_floating_point), full.dtype)
    return full.to(act)


def logit_rows_only(op: str, node, ins: list, w: dict, ctx, rows):
    """Run the node that makes "logits" for the rows `rows` only (StepContext.logit_rows): a
    row-wise linear on those rows of its input; any other op whole, then those rows."""
    if op == "linear":
        ins = [ins[0].index_select(0, rows), *ins[1:]]
        return ins, OPS[op].run(node, ins, w, ctx)
    return ins, [o.index_select(0, rows) for o in OPS[op].run(node, ins, w, ctx)]


def run_graph(G: nx.DiGraph, inputs: dict, weights: dict, ctx, keep: tuple[str, ...] = ()) -> dict:
    """inputs: value -> tensor (``ids``); weights: bound name -> tensor; returns the graph outputs (+ keep)."""
    order = topo_order(G)
    wanted = set(G.graph["outputs"]) | set(keep)
    last_use: dict[str, int] = {}
    for i, nid in enumerate(order):
        for v in G.nodes[nid]["inputs"]:
            last_use[v] = i
    env = dict(inputs)
    rows = getattr(ctx, "logit_rows", None)
    for i, nid in enumerate(order):
        data = G.nodes[nid]
        node = node_view(G, nid)
        ins = [env[v] for v in data["inputs"]]
        w = {role: bound_weight(G, weights, name, ins) for role, name in data["weights"].items()}
        if rows is not None and "logits" in data["outputs"]:
            ins, outs = logit_rows_only(data["op"], node, ins, w, ctx, rows)
        else:
            outs = OPS[data["op"]].run(node, ins, w, ctx)
        env.update(zip(data["outputs"], outs))
        for v in data["inputs"]:  # free intermediates as soon as their last reader ran
            if last_use.get(v) == i and v not in wanted and v not in inputs:
                env.pop(v, None)
    return {v: env[v] for v in wanted}
