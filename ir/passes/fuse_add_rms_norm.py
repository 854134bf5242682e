"""fuse_add_rms_norm: the residual add and the next rms_norm in one sweep over the row.

The sum s is still written (later residual adds read it) and keeps its name; the norm
reads it from registers instead of memory.  Where the sum is a MoE layer's combine
(moe_combine_residual), the norm joins that sweep instead.
"""
from __future__ import annotations

import networkx as nx

from .rewrite import NewOp, RewriteError, copy_graph, nodes_of, op_of, producer_of, refuse, replace

# the op that makes the residual sum -> the op that also normalises it
FUSED = {"add": "fused_add_rms_norm", "moe_combine_residual": "moe_combine_residual_rms_norm"}


def fuse_add_rms_norm(G: nx.DiGraph) -> nx.DiGraph:
    """Fuse ``add -> rms_norm`` into ``fused_add_rms_norm`` and ``moe_combine_residual ->
    rms_norm`` into ``moe_combine_residual_rms_norm``.

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

    The same with moe_combine_residual (inputs eo, weights, shared, residual; or eo, weights,
    residual with its shared_experts attr, which the fused op keeps) in place of the add: a MoE
    layer's output and the next layer's input norm (or the final norm) in one kernel.  Runs after
    fuse_combine_shared_residual and fuse_shared_experts, which make those combines.
    """
    G = copy_graph(G)
    for norm in nodes_of(G, "rms_norm"):
        (s,) = G.nodes[norm]["inputs"]
        src = producer_of(G, norm, s)
        fused_op = FUSED.get(op_of(G, src))
        if fused_op is None:
            continue
        fused = NewOp(fused_op, list(G.nodes[src]["inputs"]), [G.nodes[norm]["outputs"][0], s],
                      {**G.nodes[src]["attrs"], "eps": G.nodes[norm]["attrs"]["eps"]}, dict(G.nodes[norm]["weights"]))
        try:
            replace(G, [src, norm], [fused])
        except RewriteError as exc:
            refuse(G, src, norm, str(exc))
    return G
