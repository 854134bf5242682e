"""fuse_q_rope_into_query: decode builds the whole [T, H, C+R] query in one op.

In decode the query is tiny (one token per sequence) and the attention kernel wants
it as one 576-wide row per head, matching the cache rows; absorbing W_UK and rotating
q_pe in the same kernel writes that row once.  Prefill keeps rope_q separate.
"""
from __future__ import annotations

import networkx as nx

from .rewrite import NewOp, RewriteError, copy_graph, fresh_name, nodes_of, op_of, producer_of, readers_of, refuse, \
    replace, scope_of, sole_reader

PREFILL_REASON = ("the prefill kernel reads q tiles from global memory; rope stays a separate pass over q_pe "
                  "(there is no absorbed query to fuse it with)")


def fuse_q_rope_into_query(G: nx.DiGraph) -> nx.DiGraph:
    """Fuse ``mla_q_absorb`` and ``rope_q`` feeding ``mla_decode_attention`` into ``mla_decode_query``.

    before                                        after

      q_nope [T,H,N]     q_pe [T,H,R]               q_nope [T,H,N]   q_pe [T,H,R]
           |                  |                               \\      /
      mla_q_absorb (kv_b)   rope_q                 mla_decode_query (kv_b, rope pairs)
           |                  |                                  |
      q_lat [T,H,C]      q_rot [T,H,R]                     q [T,H,C+R]
             \\            /                                     |
          mla_decode_attention <- state             split (heads H, sizes [C, R]; views)
                                                          /           \\
                                                   q_lat [T,H,C]   q_rot [T,H,R]
                                                          \\           /
                                                        mla_decode_attention <- state

    Refused (logged) in prefill, and when q_lat or q_rot has another reader.
    """
    G = copy_graph(G)
    d = G.graph["model"].dims
    H, C, R = d["heads"], d["kv_lora_rank"], d["qk_rope_head_dim"]
    for rope in nodes_of(G, "rope_q"):
        (q_pe,), (q_rot,) = G.nodes[rope]["inputs"], G.nodes[rope]["outputs"]
        for reader in readers_of(G, rope, q_rot):
            if op_of(G, reader) == "mla_prefill_attention":
                refuse(G, rope, reader, PREFILL_REASON)
        attn = next((r for r in readers_of(G, rope, q_rot) if op_of(G, r) == "mla_decode_attention"), None)
        if attn is None:
            continue
        q_lat, q_rot_in, _ = G.nodes[attn]["inputs"]
        absorb = producer_of(G, attn, q_lat)
        if q_rot_in != q_rot:
            refuse(G, rope, attn, "q_rot is not the attention's rope operand")
            continue
        if op_of(G, absorb) != "mla_q_absorb":
            refuse(G, rope, attn, f"q_lat is made by {op_of(G, absorb) or 'a graph input'}, not mla_q_absorb")
            continue
        for maker, value in ((rope, q_rot), (absorb, q_lat)):
            if sole_reader(G, maker, value) != attn:
                others = [r for r in readers_of(G, maker, value) if r != attn]
                refuse(G, maker, attn, f"{value} is also read by {', '.join(others) or 'the graph outputs'}")
                break
        else:
            (q_nope,) = G.nodes[absorb]["inputs"]
            q = fresh_name(G, scope_of(q_lat) + "q_decode")
            try:
                replace(G, [absorb, rope], [
                    NewOp("mla_decode_query", [q_nope, q_pe], [q], dict(G.nodes[rope]["attrs"]),
                          dict(G.nodes[absorb]["weights"])),
                    NewOp("split", [q], [q_lat, q_rot], {"sizes": [C, R], "heads": H}),
                ])
            except RewriteError as exc:
                refuse(G, rope, attn, str(exc))
    return G

