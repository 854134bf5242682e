"""fuse_add_rms_norm: the residual add and the next rms_norm in one sweep over the row.

The sum s is still written (later residual adds read it) and keeps its name; the norm
reads it from registers instead of memory.
"""
from __future__ import annotations

import networkx as nx

from .rewrite import NewOp, RewriteError, copy_graph, nodes_of, op_of, producer_of, refuse, replace

AFTER_COMBINE_REASON = ("the residual sum is made by the MoE combine epilogue (fuse_combine_shared_residual ran "
                        "first); normalising inside the combine is not implemented")


def fuse_add_rms_norm(G: nx.DiGraph) -> nx.DiGraph:
    """Fuse ``add -> rms_norm`` into ``fused_add_rms_norm``.

    before                          after

      a [T,D]   b [T,D]               a [T,D]   b [T,D]
          \\     /                         \\     /
            add                       fused_add_rms_norm (weight, eps)
             |                            /          \\
          s [T,D] --> other readers    h [T,D]     s [T,D] --> other readers
             |
          rms_norm (weight, eps)
             |
          h [T,D]

    Runs after fuse_combine_shared_residual: a norm after a MoE layer reads the sum
    moe_combine_residual made, and that refusal is logged.
    """
    G = copy_graph(G)
    for norm in nodes_of(G, "rms_norm"):
        (s,) = G.nodes[norm]["inputs"]
        add = producer_of(G, norm, s)
        if op_of(G, add) == "moe_combine_residual":
            refuse(G, add, norm, AFTER_COMBINE_REASON)
        if op_of(G, add) != "add":
            continue
        fused = NewOp("fused_add_rms_norm", list(G.nodes[add]["inputs"]), [G.nodes[norm]["outputs"][0], s],
                      {"eps": G.nodes[norm]["attrs"]["eps"]}, dict(G.nodes[norm]["weights"]))
        try:
            replace(G, [add, norm], [fused])
        except RewriteError as exc:
            refuse(G, add, norm, str(exc))
    return G
