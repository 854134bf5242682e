"""fuse_gate_up_silu: SwiGLU in the epilogue of the fused gate + up linear.

After fuse_sibling_linears the shared experts' (and the dense FFN's) gate and up are one
multi_linear whose two outputs only feed silu_and_mul; fused, one kernel reads x once, pairs each
gate row with its up row and writes silu(gate) * up alone: no gate / up round trip through
memory and one launch less a layer.
"""
from __future__ import annotations

import networkx as nx

from .rewrite import NewOp, RewriteError, copy_graph, nodes_of, op_of, readers_of, refuse, replace, sole_reader


def fuse_gate_up_silu(G: nx.DiGraph) -> nx.DiGraph:
    """Fuse ``multi_linear (gate, up) -> silu_and_mul`` into ``gate_up_silu``.

    before                                          after

              x [T,D]                                      x [T,D]
                 |                                            |
      multi_linear (weight0 = gate, weight1 = up)       gate_up_silu (gate, up)
            /            \\                                    |
       g [T,n]         u [T,n]                             a [T,n]
            \\            /
            silu_and_mul
                 |
              a [T,n]

    Refused when the multi_linear has other than two outputs, g or u has another reader, or
    silu_and_mul takes them the other way round.
    """
    G = copy_graph(G)
    for lin in nodes_of(G, "multi_linear"):
        outs = G.nodes[lin]["outputs"]
        act = next((r for r in readers_of(G, lin, outs[0]) if op_of(G, r) == "silu_and_mul"), None)
        if act is None:
            continue    # not a gate + up pair (MLA's q + kv_a, say): nothing to refuse
        if len(outs) != 2:
            refuse(G, lin, act, f"silu_and_mul pairs two linears; this multi_linear has {len(outs)} outputs")
            continue
        g, u = outs
        if sole_reader(G, lin, g) != act or sole_reader(G, lin, u) != act:
            readers = sorted(set(readers_of(G, lin, g)) | set(readers_of(G, lin, u)))
            refuse(G, lin, act, f"gate and up must be read only by one silu_and_mul; read by {readers}")
            continue
        if G.nodes[act]["inputs"] != [g, u]:
            refuse(G, lin, act, "silu_and_mul takes up as its gate operand (swapped inputs)")
            continue
        data = G.nodes[lin]
        try:
            replace(G, [lin, act], [NewOp("gate_up_silu", list(data["inputs"]), list(G.nodes[act]["outputs"]),
                                          {"out_dim": data["attrs"]["out_dims"][0]},
                                          {"gate": data["weights"]["weight0"], "up": data["weights"]["weight1"]},
                                          nid=lin)])
        except RewriteError as exc:
            refuse(G, lin, act, str(exc))
    return G
