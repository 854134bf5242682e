"""fuse_decode_prologue: decode's query and its cache write in one op, side by side.

mla_decode_query (absorbed query + rope on q) and mla_kv_cache_write (kv norm + rope on k +
the cache write) both read the layer's input projections and neither reads the other; the
attention needs both.  At decode's batch sizes each is a launch of a few microseconds, so one
launch whose grid holds both (codegen/families/mla_decode_query.py) saves a kernel a layer.
"""
from __future__ import annotations

import networkx as nx

from .rewrite import NewOp, RewriteError, copy_graph, nodes_of, op_of, producer_of, refuse, replace


def fuse_decode_prologue(G: nx.DiGraph) -> nx.DiGraph:
    """Fuse the ``mla_decode_query`` and ``mla_kv_cache_write`` feeding one ``mla_decode_attention``
    into ``mla_decode_prologue``.

    before                                                  after

      q_nope  q_pe            c     k_pe                     q_nope  q_pe   c   k_pe
          \\    /               \\    /                            \\    |    |   /
      mla_decode_query     mla_kv_cache_write               mla_decode_prologue (kv_b, norm, eps, rope)
            |                /     |     \\                    /       |      |      \\
            q            c_n   k_rot   state                 q       c_n   k_rot   state
            |                             |                  |                        |
          split --> q_lat, q_rot --> mla_decode_attention <--+---- (the same readers) -+

    Every output keeps its name and its readers.  Refused (logged) when the two rotate with
    different rope layouts.
    """
    G = copy_graph(G)
    for attn in nodes_of(G, "mla_decode_attention"):
        q_lat, _, state = G.nodes[attn]["inputs"]
        split = producer_of(G, attn, q_lat)
        query = producer_of(G, split, G.nodes[split]["inputs"][0]) if op_of(G, split) == "split" else None
        write = producer_of(G, attn, state)
        if op_of(G, query) != "mla_decode_query" or op_of(G, write) != "mla_kv_cache_write":
            continue
        qa, wa = G.nodes[query]["attrs"], G.nodes[write]["attrs"]
        if (qa["pairs"], qa["output"]) != (wa["pairs"], wa["output"]):
            refuse(G, query, write, f"q rotates {qa['pairs']}/{qa['output']} and k {wa['pairs']}/{wa['output']}")
            continue
        fused = NewOp("mla_decode_prologue", [*G.nodes[query]["inputs"], *G.nodes[write]["inputs"]],
                      [*G.nodes[query]["outputs"], *G.nodes[write]["outputs"]], dict(wa),
                      {**G.nodes[query]["weights"], **G.nodes[write]["weights"]})
        try:
            replace(G, [query, write], [fused])
        except RewriteError as exc:
            refuse(G, query, write, str(exc))
    return G
