"""lower_mla_prefill: prefill attention decompresses the latent with kv_b and attends per prompt.

A prompt's keys are its own tokens, so a prompt's first step needs no cache read: c_n
and k_rot come straight from the cache-write node (which still writes, so decode can
read the rows later).  A later chunk of a long prompt (chunked prefill), or a decode
token in a step with a prefill chunk, also attends to the rows earlier steps cached:
the attention takes the cache state and kv_b to read and decompress that prefix
(ir/ops/attention.py MlaPrefillAttention).  The cache holds rows in the activation
dtype, so a prefix row is the c_n / k_rot its step made.
"""
from __future__ import annotations

import networkx as nx

from .rewrite import NewOp, RewriteError, copy_graph, fresh_name, nodes_of, op_of, producer_of, refuse, replace, \
    scope_of


def lower_mla_prefill(G: nx.DiGraph) -> nx.DiGraph:
    """Lower ``mla_attention`` to ``linear(kv_b) + mla_prefill_attention`` (prefill only).

    before                                      after

      c_n   k_rot                                 c_n ---------- linear (kv_b)
        \\   /                                     |                 |
      cache_write                                 cache_write       kv [T, H*(N+V)]
           |                                      |                 |
         state                                  state (the prefix  |   k_rot
           |                                      earlier steps     |  /
           |                                      cached)           | /
      mla_attention (kv_b) <- q_nope, q_rot      mla_prefill_attention (kv_b) <- q_nope, q_rot, state
           |                                                 |             (the cached prefix, if any)
         o [T, H*V]                                        o [T, H*V]

    The cache writer may be cache_write (reads c_n, k_rot) or mla_kv_cache_write
    (makes them); either way the lowering reads the same two values.
    """
    if G.graph["phase"] != "prefill":
        raise ValueError(f"lower_mla_prefill lowers prefill graphs; this graph is {G.graph['phase']}")
    G = copy_graph(G)
    d = G.graph["model"].dims
    H, N, V = d["heads"], d["qk_nope_head_dim"], d["v_head_dim"]
    for attn in nodes_of(G, "mla_attention"):
        q_nope, q_rot, state = G.nodes[attn]["inputs"]
        (o,) = G.nodes[attn]["outputs"]
        writer = producer_of(G, attn, state)
        if op_of(G, writer) == "cache_write":
            c_n, k_rot = G.nodes[writer]["inputs"]
        elif op_of(G, writer) == "mla_kv_cache_write":
            c_n, k_rot = G.nodes[writer]["outputs"][:2]
        else:
            refuse(G, writer or state, attn, f"the cache state comes from {op_of(G, writer) or 'a graph input'}, "
                                             "so the rows it wrote (c_n, k_rot) cannot be found")
            continue
        kv_b = G.nodes[attn]["weights"]["kv_b"]
        kv = fresh_name(G, scope_of(o) + "kv")
        try:
            replace(G, [attn], [
                NewOp("linear", [c_n], [kv], {"out_dim": H * (N + V), "precision": "act"}, {"weight": kv_b}),
                NewOp("mla_prefill_attention", [q_nope, q_rot, kv, k_rot, state], [o], {}, {"kv_b": kv_b}),
            ])
        except RewriteError as exc:
            refuse(G, writer, attn, str(exc))
    return G
