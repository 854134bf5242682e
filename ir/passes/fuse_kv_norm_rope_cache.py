"""fuse_kv_norm_rope_cache: kv_a_layernorm, rope on k and the cache write in one op.

All three read or write the same 576-wide row of one token, so one kernel reads
(c, k_pe) once, writes the row to the paged cache and hands c_n and k_rot on to
whoever still wants them (prefill decompresses from them).
"""
from __future__ import annotations

import networkx as nx

from .rewrite import NewOp, RewriteError, copy_graph, nodes_of, op_of, producer_of, refuse, replace


def fuse_kv_norm_rope_cache(G: nx.DiGraph) -> nx.DiGraph:
    """Fuse ``rms_norm -> cache_write <- rope_k`` into ``mla_kv_cache_write``.

    before                                     after

      c [T,C]            k_pe [T,R]              c [T,C]      k_pe [T,R]
         |                   |                        \\        /
      rms_norm (kv_a_ln)  rope_k                  mla_kv_cache_write (norm = kv_a_ln)
         |                   |                     /        |        \\
      c_n [T,C]          k_rot [T,R]           c_n [T,C]  k_rot [T,R]  state
           \\              /
            cache_write
                 |
               state

    c_n and k_rot keep their names and readers. Refused when c_n is not made by
    rms_norm or k_rot not by rope_k (for instance before split_rope).
    """
    G = copy_graph(G)
    for cw in nodes_of(G, "cache_write"):
        c_n, k_rot = G.nodes[cw]["inputs"]
        norm, rope = producer_of(G, cw, c_n), producer_of(G, cw, k_rot)
        if op_of(G, norm) != "rms_norm":
            refuse(G, norm or c_n, cw, f"c_n is made by {op_of(G, norm) or 'a graph input'}, not rms_norm")
            continue
        if op_of(G, rope) != "rope_k":
            hint = " (run split_rope first)" if op_of(G, rope) == "rope" else ""
            refuse(G, rope or k_rot, cw, f"k_rot is made by {op_of(G, rope) or 'a graph input'}, not rope_k{hint}")
            continue
        (c,), (k_pe,) = G.nodes[norm]["inputs"], G.nodes[rope]["inputs"]
        attrs = {"eps": G.nodes[norm]["attrs"]["eps"], **G.nodes[rope]["attrs"]}
        fused = NewOp("mla_kv_cache_write", [c, k_pe], [c_n, k_rot, G.nodes[cw]["outputs"][0]], attrs,
                      {"norm": G.nodes[norm]["weights"]["weight"]}, nid=cw)
        try:
            replace(G, [norm, rope, cw], [fused])
        except RewriteError as exc:
            refuse(G, norm, cw, str(exc))
    return G
