"""fuse_router: the router GEMV, scoring, top-k and expert alignment in one op.

The router is tiny ([T, E] logits) and its three steps are each a launch over the
same few bytes; one op keeps the logits on chip and hands the grouped expert kernels
their plan directly.
"""
from __future__ import annotations

import networkx as nx

from .rewrite import NewOp, RewriteError, copy_graph, nodes_of, op_of, producer_of, readers_of, refuse, replace, \
    sole_reader


def fuse_router(G: nx.DiGraph) -> nx.DiGraph:
    """Fuse ``linear(fp32) -> moe_topk -> moe_align`` into ``moe_route``.

    before                                          after

      x [T,D]                                         x [T,D]
         |                                               |
      linear (gate, fp32)                             moe_route (gate fp32, bias if any;
         |                                               |        topk attrs, num_experts)
      logits [T,E] f32                          /        |          \\
         |                                 ids [T,K]  weights [T,K]  routing
      moe_topk (bias?)
       /        \\
    ids [T,K]   weights [T,K] f32
       |
    moe_align (num_experts)
       |
    routing

    Refused when the logits have another reader (they no longer exist afterwards).
    """
    G = copy_graph(G)
    for topk in nodes_of(G, "moe_topk"):
        (logits,) = G.nodes[topk]["inputs"]
        ids, weights = G.nodes[topk]["outputs"]
        gate = producer_of(G, topk, logits)
        if op_of(G, gate) != "linear" or G.nodes[gate]["attrs"]["precision"] != "fp32":
            refuse(G, gate or logits, topk, "the router logits do not come from an fp32 linear")
            continue
        if sole_reader(G, gate, logits) != topk:
            others = [r for r in readers_of(G, gate, logits) if r != topk]
            refuse(G, gate, topk, f"the router logits are also read by {', '.join(others) or 'the graph outputs'}")
            continue
        align = next((r for r in readers_of(G, topk, ids) if op_of(G, r) == "moe_align"), None)
        if align is None:
            refuse(G, gate, topk, "no moe_align reads the expert ids, and moe_route always makes the routing plan")
            continue
        (x,) = G.nodes[gate]["inputs"]
        bound = {"gate": G.nodes[gate]["weights"]["weight"]}
        if "bias" in G.nodes[topk]["weights"]:
            bound["bias"] = G.nodes[topk]["weights"]["bias"]
        attrs = {**G.nodes[topk]["attrs"], "num_experts": G.nodes[align]["attrs"]["num_experts"]}
        try:
            replace(G, [gate, topk, align], [
                NewOp("moe_route", [x], [ids, weights, G.nodes[align]["outputs"][0]], attrs, bound, nid=topk)])
        except RewriteError as exc:
            refuse(G, gate, topk, str(exc))
    return G
