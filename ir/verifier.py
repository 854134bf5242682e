"""The verifier: run after building and after every pass.

Checks: no cycles; every op known; every input defined by the graph inputs or by a
node with an edge to its reader; each value made once; outputs re-infer to the
recorded types (shapes consistent); every bound weight recorded with that shape; a quantised
weight only in a role its op takes quantised, with its companions bound in their shapes.
"""
from __future__ import annotations

from .errors import GraphError
from .formats import format_problem
from .graph import node_view, value_producers
from .lazy import nx
from .ops import OPS, ShapeError


def verify(G: nx.DiGraph) -> None:
    if not nx.is_directed_acyclic_graph(G):
        raise GraphError(f"graph has a cycle: {nx.find_cycle(G)}")
    values = G.graph["values"]
    seen: dict[str, str] = {}
    for nid, data in G.nodes(data=True):
        for v in data["outputs"]:
            if v in seen:
                raise GraphError(f"value {v!r} is made by both {seen[v]} and {nid}")
            seen[v] = nid
    producers = value_producers(G)
    for nid, data in G.nodes(data=True):
        if data["op"] not in OPS:
            raise GraphError(f"node {nid}: unknown op {data['op']!r}")
        for v in data["inputs"]:
            if v in G.graph["inputs"]:
                continue
            src = producers.get(v)
            if src is None:
                raise GraphError(f"node {nid} ({data['op']}) reads {v!r}, which nothing makes")
            if not G.has_edge(src, nid) or v not in G.edges[src, nid]["values"]:
                raise GraphError(f"node {nid} reads {v!r} from {src} but no edge carries it")
        opdef = OPS[data["op"]]
        try:
            outs, wshapes = opdef.infer(node_view(G, nid), [values[v] for v in data["inputs"]], G.graph["model"])
        except (ShapeError, KeyError) as exc:
            raise GraphError(f"node {nid} ({data['op']}): {exc}") from None
        for v, t in zip(data["outputs"], outs):
            if values.get(v) != t:
                raise GraphError(f"node {nid}: value {v!r} is recorded as {values.get(v)} but infers to {t}")
        if len(outs) != len(data["outputs"]):
            raise GraphError(f"node {nid}: {len(outs)} outputs inferred, {len(data['outputs'])} named")
        for role, required in opdef.weights.items():
            if required and role not in data["weights"]:
                raise GraphError(f"node {nid} ({data['op']}) has no weight bound for {role!r}")
        for role, name in data["weights"].items():
            info = G.graph["weights"].get(name)
            if info is None:
                raise GraphError(f"node {nid}: weight {name} is not recorded")
            if tuple(info.shape) != tuple(wshapes[role]):
                raise GraphError(f"node {nid}: weight {name} recorded as {info.shape}, op expects {wshapes[role]}")
            problem = format_problem(G.graph["weights"], name, role, opdef)
            if problem:
                raise GraphError(f"node {nid} ({data['op']}): {problem}")
    for v in G.graph["outputs"]:
        if v not in producers:
            raise GraphError(f"graph output {v!r} is never made")
