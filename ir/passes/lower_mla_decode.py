"""lower_mla_decode: decode attends over the compressed cache rows, never decompressing them.

kv_b = [W_UK; W_UV] per head.  q_nope . (W_UK c) = (q_nope W_UK) . c, so W_UK moves
into the query (one [N, C] matmul per head for the new token instead of one per
cached row), and W_UV moves after the softmax-weighted sum of the C-wide rows.
"""
from __future__ import annotations

import networkx as nx

from .rewrite import NewOp, copy_graph, fresh_name, nodes_of, replace, scope_of


def lower_mla_decode(G: nx.DiGraph) -> nx.DiGraph:
    """Lower ``mla_attention`` to ``mla_q_absorb -> mla_decode_attention -> mla_v_up`` (decode only).

    before                                    after

      q_nope [T,H,N]  q_rot  state              q_nope [T,H,N]
             \\          |    /                       |
          mla_attention (kv_b)                  mla_q_absorb (kv_b: W_UK)
                    |                                 |
                o [T, H*V]                      q_lat [T,H,C]   q_rot [T,H,R]   state
                                                        \\           |           /
                                                          mla_decode_attention      (rows [C | R], 576 wide)
                                                                    |
                                                              o_lat [T,H,C]
                                                                    |
                                                           mla_v_up (kv_b: W_UV)
                                                                    |
                                                               o [T, H*V]
    """
    if G.graph["phase"] != "decode":
        raise ValueError(f"lower_mla_decode lowers decode graphs; this graph is {G.graph['phase']}")
    G = copy_graph(G)
    for attn in nodes_of(G, "mla_attention"):
        q_nope, q_rot, state = G.nodes[attn]["inputs"]
        (o,) = G.nodes[attn]["outputs"]
        kv_b = {"kv_b": G.nodes[attn]["weights"]["kv_b"]}
        q_lat = fresh_name(G, scope_of(o) + "q_lat")
        o_lat = fresh_name(G, scope_of(o) + "o_lat")
        replace(G, [attn], [
            NewOp("mla_q_absorb", [q_nope], [q_lat], {}, dict(kv_b)),
            NewOp("mla_decode_attention", [q_lat, q_rot, state], [o_lat]),
            NewOp("mla_v_up", [o_lat], [o], {}, dict(kv_b)),
        ])
    return G
