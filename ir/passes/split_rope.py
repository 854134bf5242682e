"""split_rope: one rope over (q_pe, k_pe) becomes two independent ropes.

The two halves end up in different kernels: the key half fuses into the cache write
(fuse_kv_norm_rope_cache), the query half into the decode query (fuse_q_rope_into_query).
"""
from __future__ import annotations

import networkx as nx

from .rewrite import NewOp, copy_graph, nodes_of, replace


def split_rope(G: nx.DiGraph) -> nx.DiGraph:
    """Split every ``rope`` into ``rope_q`` and ``rope_k`` with the same pair layout.

    before                                   after

      q_pe [T,H,R]   k_pe [T,R]                q_pe [T,H,R]     k_pe [T,R]
            \\         /                            |                |
               rope                              rope_q           rope_k
            /         \\                            |                |
      q_rot [T,H,R]  k_rot [T,R]               q_rot [T,H,R]    k_rot [T,R]
    """
    G = copy_graph(G)
    for nid in nodes_of(G, "rope"):
        data = G.nodes[nid]
        (q_pe, k_pe), (q_rot, k_rot) = data["inputs"], data["outputs"]
        attrs = {"pairs": data["attrs"]["pairs"], "output": data["attrs"]["output"]}
        replace(G, [nid], [NewOp("rope_q", [q_pe], [q_rot], dict(attrs)),
                           NewOp("rope_k", [k_pe], [k_rot], dict(attrs))])
    return G
