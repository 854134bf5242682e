"""fuse_combine_shared_residual: the MoE combine also adds the shared experts and the residual.

Three [T, D] sweeps (weighted sum over K, + shared, + residual) become one; the
rounding points stay those of the unfused chain (see moe_combine_residual).
"""
from __future__ import annotations

import networkx as nx

from .rewrite import NewOp, RewriteError, copy_graph, nodes_of, op_of, other_input, readers_of, refuse, replace, \
    sole_reader


def fuse_combine_shared_residual(G: nx.DiGraph) -> nx.DiGraph:
    """Fuse ``moe_combine -> add(shared) -> add(residual)`` into ``moe_combine_residual``.

    before                                              after

      eo [T*K,D]  weights [T,K]                           eo   weights   shared   x_mid
            \\      /                                        \\      |       |      /
           moe_combine                                        moe_combine_residual
               |                                                      |
          routed [T,D]   shared [T,D]                            x_out [T,D]
                 \\        /
                    add
                     |
                  y [T,D]    x_mid [T,D] (residual)
                      \\       /
                        add          (either operand order)
                         |
                    x_out [T,D]

    Refused when routed or y has another reader (neither exists afterwards).
    """
    G = copy_graph(G)
    for combine in nodes_of(G, "moe_combine"):
        (routed,) = G.nodes[combine]["outputs"]
        add_shared = sole_reader(G, combine, routed)
        if op_of(G, add_shared) != "add":
            readers = readers_of(G, combine, routed)
            refuse(G, combine, add_shared or routed,
                   f"routed must be read by exactly one add (the shared experts); read by {readers}")
            continue
        (y,) = G.nodes[add_shared]["outputs"]
        add_residual = sole_reader(G, add_shared, y)
        if op_of(G, add_residual) != "add":
            readers = readers_of(G, add_shared, y)
            refuse(G, combine, add_shared, f"y = routed + shared must be read only by the residual add; read by "
                                           f"{readers or 'the graph outputs'}")
            continue
        eo, weights = G.nodes[combine]["inputs"]
        shared = other_input(G, add_shared, routed)
        residual = other_input(G, add_residual, y)
        try:
            replace(G, [combine, add_shared, add_residual], [
                NewOp("moe_combine_residual", [eo, weights, shared, residual], list(G.nodes[add_residual]["outputs"]))])
        except RewriteError as exc:
            refuse(G, combine, add_residual, str(exc))
    return G
