"""insert_all_reduce: make a rank's partial sums whole where something needs the whole value.

shard_for_rank lists in ``G.graph["partial"]`` the values that each rank holds only a share
of (o_proj over its heads, the FFN down over its columns, the MoE combine over its experts).
A sum of two partial sums is still one (routed + shared), so it stays partial and the MoE
gets one all-reduce, not two; any other reader gets the whole value:

    before                                  after

      o [T, H/w*V]                            o [T, H/w*V]
         |                                       |
      linear o_proj -> y (partial)            linear o_proj -> y (partial)
         |                                       |
      add(x, y) -> x_mid                      all_reduce -> y_sum [T, D]
                                                 |
                                              add(x, y_sum) -> x_mid

      routed (partial)  shared (partial)      routed   shared
            \\           /                        \\      /
               add -> y (partial)                  add -> y (partial)
                |                                   |
           add(x_mid, y)                        all_reduce -> y_sum
                                                    |
                                                add(x_mid, y_sum)

Nothing fuses across an all_reduce afterwards: the fusions match ops by their producers
and readers, and an all_reduce is neither an add nor a combine (fuse_combine_shared_residual
refuses, and says so, when the MoE's routed + shared is read by the all-reduce).
"""
from __future__ import annotations

import networkx as nx

from ..graph import add_op, value_producers
from .rewrite import copy_graph, fresh_name, readers_of
from .shard_for_rank import reroute


def insert_all_reduce(G: nx.DiGraph) -> nx.DiGraph:
    """One all_reduce after each partial sum that a reader needs whole (see the module docstring)."""
    if not G.graph.get("partial"):
        return G
    H = copy_graph(G)
    partial = set(H.graph.pop("partial"))
    producers = value_producers(H)
    # An add of two partial sums is a partial sum: propagate, in execution order.
    changed = True
    while changed:
        changed = False
        for nid, data in H.nodes(data=True):
            if data["op"] == "add" and all(v in partial for v in data["inputs"]) and data["outputs"][0] not in partial:
                partial.add(data["outputs"][0])
                changed = True
    for v in sorted(partial, key=lambda v: (H.nodes[producers[v]]["order"], v)):
        maker = producers[v]
        needy = [r for r in readers_of(H, maker, v)
                 if not (H.nodes[r]["op"] == "add" and all(i in partial for i in H.nodes[r]["inputs"]))]
        if not needy and v not in H.graph["outputs"]:
            continue
        data = H.nodes[maker]
        out = fresh_name(H, f"{v}_sum")
        add_op(H, out, "all_reduce", {}, [v], [out], layer=data["layer"], path=data["path"],
               order=data["order"] + 0.5)
        H.nodes[out]["sources"] = list(data.get("sources", [maker]))
        H.nodes[out]["passes"] = {s: ["insert_all_reduce"] for s in H.nodes[out]["sources"]}
        for r in needy:
            reroute(H, maker, v, out, out, r)
        H.graph["outputs"] = [out if o == v else o for o in H.graph["outputs"]]
    return H
