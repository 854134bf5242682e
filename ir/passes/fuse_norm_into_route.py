"""fuse_norm_into_route: a MoE layer's residual add + RMSNorm inside its route.

At decode the route is the first kernel of a MoE layer and the norm the kernel before it: both
are latency-bound at small batches (b=1: ~2.4 us and ~6 us a layer of a few KB each, PERF_NOTES
v16), and the route reads nothing but the norm's output.  In one op the route's CTAs add and
normalise their token tile's rows themselves (a few KB from L2 each) and the first CTA of each
tile writes h and s for the experts and the combine after it: one launch and one kernel boundary
fewer a MoE layer.  Above the fused route's token bound the lowering runs the norm's own kernel
and the three-launch route after it (codegen/families/moe_route.py), as before.
"""
from __future__ import annotations

import networkx as nx

from .rewrite import NewOp, RewriteError, copy_graph, nodes_of, op_of, producer_of, refuse, replace

# Off: the norm and the route stay two ops (an A/B; tests/ir/test_fuse_norm_into_route.py)
ENABLED = True


def fuse_norm_into_route(G: nx.DiGraph) -> nx.DiGraph:
    """Fuse ``fused_add_rms_norm -> moe_route`` into ``moe_route`` with ``norm_eps``.

    before                                   after

      a [T,D]   b [T,D]                        a [T,D]   b [T,D]
          \\     /                                  \\     /
      fused_add_rms_norm (weight, eps)         moe_route (gate[, bias], norm weight, norm_eps)
        /          \\                         /    |     \\          \\       \\
    h [T,D]       s [T,D] -> readers        ids weights routing   h [T,D]  s [T,D] -> readers
       |   \\
    moe_route  other readers (experts)

    h and s keep their names and readers.  Runs after fuse_add_rms_norm (which makes the norm op)
    and fuse_router / fuse_shared_experts (which make the route); a route whose x another op makes
    is left alone.
    """
    G = copy_graph(G)
    if not ENABLED:
        return G
    for route in nodes_of(G, "moe_route"):
        ins = G.nodes[route]["inputs"]
        if len(ins) != 1:
            continue
        norm = producer_of(G, route, ins[0])
        if op_of(G, norm) != "fused_add_rms_norm" or G.nodes[norm]["outputs"][0] != ins[0]:
            continue
        h, s = G.nodes[norm]["outputs"]
        attrs = {**G.nodes[route]["attrs"], "norm_eps": G.nodes[norm]["attrs"]["eps"]}
        weights = {**G.nodes[route]["weights"], "norm": G.nodes[norm]["weights"]["weight"]}
        try:
            replace(G, [norm, route], [NewOp("moe_route", list(G.nodes[norm]["inputs"]),
                                             [*G.nodes[route]["outputs"], h, s], attrs, weights, nid=route)])
        except RewriteError as exc:
            refuse(G, norm, route, str(exc))
    return G
