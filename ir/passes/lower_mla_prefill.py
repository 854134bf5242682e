"""lower_mla_prefill: prefill attention decompresses the latent with kv_b and attends per sequence.

A step's sequences attend to their whole context: a whole prompt to its own tokens, a later chunk
of a long prompt (chunked prefill) or a decode token in a step with a prefill chunk also to the
rows earlier steps cached.  So the keys come from the cache, after this step's write: each
sequence's rows 0 .. context_len - 1 gathered (TK rows in all: T for whole prompts), decompressed
by one kv_b GEMM, and attended with each query's absolute position as its causal bound.  The
cache holds rows in the activation dtype, so a gathered row is the c_n / k_rot its step made.
"""
from __future__ import annotations

import networkx as nx

from .rewrite import NewOp, RewriteError, copy_graph, fresh_name, nodes_of, op_of, producer_of, refuse, replace, \
    scope_of


def lower_mla_prefill(G: nx.DiGraph) -> nx.DiGraph:
    """Lower ``mla_attention`` to ``mla_gather_context + linear(kv_b) + mla_prefill_attention`` (prefill only).

    before                                      after

      c_n   k_rot                                 c_n   k_rot
        \\   /                                       \\   /
      cache_write                                 cache_write
           |                                           |
         state                                       state
           |                                           |
           |                                  mla_gather_context   (each sequence's cache rows)
           |                                           |
           |                                   rows [TK, C+R] -- split --> c_ctx [TK, C], k_ctx [TK, R]
           |                                                                 |              |
           |                                                          linear (kv_b)         |
           |                                                                 |              |
      mla_attention (kv_b) <- q_nope, q_rot     mla_prefill_attention <- q_nope, q_rot, kv [TK, H*(N+V)], k_ctx
           |                                         (keys=context)
         o [T, H*V]                                        o [T, H*V]
    """
    if G.graph["phase"] != "prefill":
        raise ValueError(f"lower_mla_prefill lowers prefill graphs; this graph is {G.graph['phase']}")
    G = copy_graph(G)
    d = G.graph["model"].dims
    H, N, V, C, R = d["heads"], d["qk_nope_head_dim"], d["v_head_dim"], d["kv_lora_rank"], d["qk_rope_head_dim"]
    for attn in nodes_of(G, "mla_attention"):
        q_nope, q_rot, state = G.nodes[attn]["inputs"]
        (o,) = G.nodes[attn]["outputs"]
        writer = producer_of(G, attn, state)
        if op_of(G, writer) not in ("cache_write", "mla_kv_cache_write"):
            refuse(G, writer or state, attn, f"the cache state comes from {op_of(G, writer) or 'a graph input'}, "
                                             "not a cache write this step")
            continue
        kv_b = G.nodes[attn]["weights"]["kv_b"]
        scope = scope_of(o)
        rows, c_ctx, k_ctx, kv = (fresh_name(G, scope + n) for n in ("ctx_rows", "ctx_c", "ctx_k_rot", "kv"))
        try:
            replace(G, [attn], [
                NewOp("mla_gather_context", [state], [rows]),
                NewOp("split", [rows], [c_ctx, k_ctx], {"sizes": [C, R], "heads": None}),
                NewOp("linear", [c_ctx], [kv], {"out_dim": H * (N + V), "precision": "act"}, {"weight": kv_b}),
                NewOp("mla_prefill_attention", [q_nope, q_rot, kv, k_ctx], [o], {"keys": "context"}),
            ])
        except RewriteError as exc:
            refuse(G, writer, attn, str(exc))
    return G
