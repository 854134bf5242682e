"""fuse_expert_ffn: the grouped expert FFN in one op (decode).

In decode a step has a handful of tokens, so each grouped expert op is a short launch that
streams its experts' weights; the SwiGLU intermediate a [T*K, M] between moe_gate_up_silu and
moe_down is a few rows.  Fused, the node's a is its own workspace, and its lowering
(codegen/families/moe_expert_ffn.py) can run gate/up, SwiGLU and down as one persistent launch
whose down tiles start as soon as their rows of a are written, or as the two grouped launches,
by the step's token count.  Prefill keeps the two ops (its pairs are many, and two full-width
grouped GEMMs serve it better).
"""
from __future__ import annotations

import networkx as nx

from .rewrite import NewOp, RewriteError, copy_graph, nodes_of, op_of, readers_of, refuse, replace, sole_reader


def fuse_expert_ffn(G: nx.DiGraph) -> nx.DiGraph:
    """Fuse ``moe_gate_up_silu -> moe_down`` into ``moe_expert_ffn``.

    before                                          after

      x [T,D]   routing                               x [T,D]   routing
          \\     /    \\                                   \\     /
      moe_gate_up_silu  |                           moe_expert_ffn (gate, up, down)
       (gate, up)       |                                    |
           |            |                               eo [T*K,D]
       a [T*K,M]        |
            \\          /
            moe_down (weight)
                 |
             eo [T*K,D]

    The new node keeps moe_down's id (it makes moe_down's output).  Refused when a has another
    reader, moe_down reads a other than as its input 0 or reads another routing, or the two ops
    disagree on the number of experts.
    """
    G = copy_graph(G)
    for gate_up in nodes_of(G, "moe_gate_up_silu"):
        (a,) = G.nodes[gate_up]["outputs"]
        x, routing = G.nodes[gate_up]["inputs"]
        down = sole_reader(G, gate_up, a)
        if op_of(G, down) != "moe_down":
            readers = readers_of(G, gate_up, a)
            if not any(op_of(G, r) == "moe_down" for r in readers):
                continue    # no expert down projection to fuse with: nothing to refuse
            refuse(G, gate_up, next(r for r in readers if op_of(G, r) == "moe_down"),
                   f"the SwiGLU ({a}) must be read only by one moe_down; read by {readers}"
                   + (" and is a graph output" if a in G.graph["outputs"] else ""))
            continue
        a_down, routing_down = G.nodes[down]["inputs"]
        if a_down != a:
            refuse(G, gate_up, down, f"moe_down reads the SwiGLU ({a}) as its routing, not as its input")
            continue
        if routing_down != routing:
            refuse(G, gate_up, down, f"moe_down reads another routing ({routing_down}) than moe_gate_up_silu "
                                     f"({routing})")
            continue
        gu, dn = G.nodes[gate_up], G.nodes[down]
        if gu["attrs"]["num_experts"] != dn["attrs"]["num_experts"]:
            refuse(G, gate_up, down, f"moe_gate_up_silu serves {gu['attrs']['num_experts']} experts, moe_down "
                                     f"{dn['attrs']['num_experts']}")
            continue
        attrs = {"num_experts": gu["attrs"]["num_experts"], "inner_dim": gu["attrs"]["out_dim"],
                 "out_dim": dn["attrs"]["out_dim"]}
        weights = {"gate": gu["weights"]["gate"], "up": gu["weights"]["up"], "down": dn["weights"]["weight"]}
        try:
            replace(G, [gate_up, down], [NewOp("moe_expert_ffn", [x, routing], list(dn["outputs"]), attrs, weights,
                                               nid=down)])
        except RewriteError as exc:
            refuse(G, gate_up, down, str(exc))
    return G
