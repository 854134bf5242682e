"""fuse_sibling_linears: linears that read one input become one multi_linear.

At decode's few tokens a linear is a pass over its weight; siblings that read the same x
(MLA's q or q_a and kv_a off the attention norm, the shared experts' or the dense FFN's gate
and up off the FFN norm) then cost one launch, one read of x and one tail instead of two.
Above the skinny kernel's crossover the runtime still runs one GEMM per weight.
"""
from __future__ import annotations

import networkx as nx

from ..ops.core import MULTI_LINEAR_MAX
from .rewrite import NewOp, RewriteError, copy_graph, nodes_of, readers_of, refuse, replace


def fuse_sibling_linears(G: nx.DiGraph) -> nx.DiGraph:
    """Fuse the act-precision ``linear`` nodes that read one value into one ``multi_linear``.

    before                                        after

                 h [T,D]                                      h [T,D]
          /         |                                           |
    linear (q)   linear (kv_a)              multi_linear (weight0 = q, weight1 = kv_a;
         |          |                                     out_dims [H*(N+R), C+R])
    q [T,H*(N+R)]  ckv [T,C+R]                         /                 \\
                                               q [T,H*(N+R)]          ckv [T,C+R]

    The siblings keep their output names (their readers are unchanged) and execution order
    (weight i is the i-th sibling to run).  Refused, with the reason logged: an fp32 linear
    (the router keeps float32 weights and output), a linear nothing reads (eliminate_dead's),
    siblings whose weights are stored in another format (each format forms its own groups: one
    multi_linear has one weight format), and siblings past MULTI_LINEAR_MAX (the next group).
    """
    G = copy_graph(G)
    groups: dict[str, list[str]] = {}
    for nid in nodes_of(G, "linear"):
        groups.setdefault(G.nodes[nid]["inputs"][0], []).append(nid)
    for x, siblings in groups.items():
        if len(siblings) < 2:
            continue
        live = [n for n in siblings if _is_read(G, n)]
        act = [n for n in live if G.nodes[n]["attrs"]["precision"] == "act"]
        for n in siblings:
            other = next((m for m in siblings if m != n), n)
            if n not in live:
                refuse(G, n, other, f"nothing reads {n} (eliminate_dead drops it)")
            elif n not in act:
                refuse(G, n, other, f"{n} is an fp32 linear (its weights and output stay float32); siblings "
                                    f"reading {x} fuse at the activation precision only")
        by_format: dict = {}
        for n in act:
            by_format.setdefault(_format(G, n), []).append(n)
        if len(by_format) > 1:
            first, *others = by_format.values()
            for group in others:
                refuse(G, first[0], group[0], f"their weights are stored in different formats "
                                              f"({_format(G, first[0]) or 'activation dtype'} and "
                                              f"{_format(G, group[0]) or 'activation dtype'}); each format fuses apart")
        for same in by_format.values():
            chunks = [same[i:i + MULTI_LINEAR_MAX] for i in range(0, len(same), MULTI_LINEAR_MAX)]
            for group in chunks[1:]:
                refuse(G, same[0], group[0], f"a multi_linear takes at most {MULTI_LINEAR_MAX} weights; "
                                             f"{', '.join(group)} start another")
            for group in chunks:
                if len(group) >= 2:
                    _fuse(G, x, group)
    return G


def _format(G: nx.DiGraph, nid: str) -> str | None:
    return G.graph["weights"][G.nodes[nid]["weights"]["weight"]].format


def _is_read(G: nx.DiGraph, nid: str) -> bool:
    (out,) = G.nodes[nid]["outputs"]
    return bool(readers_of(G, nid, out)) or out in G.graph["outputs"]


def _fuse(G: nx.DiGraph, x: str, group: list[str]) -> None:
    outputs = [G.nodes[n]["outputs"][0] for n in group]
    weights = {f"weight{i}": G.nodes[n]["weights"]["weight"] for i, n in enumerate(group)}
    out_dims = [G.nodes[n]["attrs"]["out_dim"] for n in group]
    try:
        replace(G, group, [NewOp("multi_linear", [x], outputs, {"out_dims": out_dims}, weights, nid=group[0])])
    except RewriteError as exc:
        refuse(G, group[0], group[1], str(exc))
