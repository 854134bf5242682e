"""fuse_moe_silu: SwiGLU in the epilogue of the grouped gate/up expert GEMM.

gate and up are [T*K, M] each; fused, only their product leaves the kernel.
"""
from __future__ import annotations

import networkx as nx

from .rewrite import NewOp, RewriteError, copy_graph, nodes_of, op_of, readers_of, refuse, replace, sole_reader


def fuse_moe_silu(G: nx.DiGraph) -> nx.DiGraph:
    """Fuse ``moe_gate_up -> silu_and_mul`` into ``moe_gate_up_silu``.

    before                                   after

      x [T,D]   routing                        x [T,D]   routing
          \\     /                                  \\     /
        moe_gate_up (gate, up)               moe_gate_up_silu (gate, up)
          /        \\                                  |
      g [T*K,M]   u [T*K,M]                       a [T*K,M]
          \\        /
         silu_and_mul
              |
          a [T*K,M]

    Refused when g or u has another reader, or silu_and_mul takes them the other way round.
    """
    G = copy_graph(G)
    for gate_up in nodes_of(G, "moe_gate_up"):
        g, u = G.nodes[gate_up]["outputs"]
        act = sole_reader(G, gate_up, g)
        if op_of(G, act) != "silu_and_mul" or sole_reader(G, gate_up, u) != act:
            readers = sorted(set(readers_of(G, gate_up, g)) | set(readers_of(G, gate_up, u)))
            refuse(G, gate_up, act or g, f"gate and up must be read only by one silu_and_mul; read by {readers}")
            continue
        if G.nodes[act]["inputs"] != [g, u]:
            refuse(G, gate_up, act, "silu_and_mul takes up as its gate operand (swapped inputs)")
            continue
        data = G.nodes[gate_up]
        try:
            replace(G, [gate_up, act], [NewOp("moe_gate_up_silu", list(data["inputs"]), list(G.nodes[act]["outputs"]),
                                              dict(data["attrs"]), dict(data["weights"]))])
        except RewriteError as exc:
            refuse(G, gate_up, act, str(exc))
    return G
