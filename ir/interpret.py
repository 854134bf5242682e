"""The reference interpreter: run a graph op by op with each op's torch semantics.

This is the ground truth that passes (same result before and after) and generated
kernels (same result as the op) are tested against, and the `reference` backend.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only
    import networkx as nx

from .graph import node_view, topo_order
from .ops import OPS


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
        w = {role: weights[name] for role, name in data["weights"].items()}
        ins = [env[v] for v in data["inputs"]]
        if rows is not None and "logits" in data["outputs"]:
            ins, outs = logit_rows_only(data["op"], node, ins, w, ctx, rows)
        else:
            outs = OPS[data["op"]].run(node, ins, w, ctx)
        env.update(zip(data["outputs"], outs))
        for v in data["inputs"]:  # free intermediates as soon as their last reader ran
            if last_use.get(v) == i and v not in wanted and v not in inputs:
                env.pop(v, None)
    return {v: env[v] for v in wanted}
