"""Graph-editing helpers the passes share: copy, look up, replace, refuse, clean up.

A pass never edits its input; it starts from ``copy_graph(G)``.  A rewrite names the
nodes it replaces and the ops that stand for them (``NewOp``).  ``replace`` first
checks everything that could go wrong (the new ops infer, their weights are bound
the way the op wants them, no value that disappears is still read, the graph stays
acyclic) and only then edits, so a failed rewrite leaves the graph as it was and the
pass can log a refusal instead.

Values are wired by name: a new op that makes a value under its old name keeps every
reader of it, so consumers need new edges but no renaming.  New nodes take the
``order`` of the earliest node they replace, which keeps ``ir.graph.topo_order``
deterministic (edges alone already make it valid), its layer and spec path, and a
``sources`` list: the builder's node ids they stand for, so generated code can name
its origin, and ``passes``: for each source, the passes that fused it into this node
(inherited from the nodes replaced, plus the pass running now, which ``run_pipeline``
names in ``G.graph["running_pass"]``).  Weights are bound by the names the replaced nodes used; names no node
binds any more are dropped from ``G.graph["weights"]``.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import networkx as nx

from ..formats import format_problem, with_companions
from ..graph import add_op, topo_order, value_producers
from ..ops import OPS, Node, ShapeError

log = logging.getLogger("dsgraph.passes")


class RewriteError(Exception):
    """A rewrite that would break the graph; the pass turns it into a logged refusal."""


@dataclass
class NewOp:
    """One op a rewrite adds. ``weights`` holds bound checkpoint names, reused from the replaced nodes."""

    op: str
    inputs: list[str]
    outputs: list[str]
    attrs: dict = field(default_factory=dict)
    weights: dict = field(default_factory=dict)
    nid: str | None = None    # default: its first output's name, as the graph builder names nodes


# ---- copying and looking up ----------------------------------------------------------------------

def copy_graph(G: nx.DiGraph) -> nx.DiGraph:
    """A copy a pass may edit freely: every dict and list in nodes, edges and graph tables is new.

    Leaves (names, numbers, TType, WeightInfo, the ModelConfig) are immutable and shared.
    """
    H = G.copy()
    for _, data in H.nodes(data=True):
        data.update(_fresh(data))
    for _, _, data in H.edges(data=True):
        data.update(_fresh(data))
    H.graph.update(_fresh(H.graph))
    return H


def _fresh(value):
    if isinstance(value, dict):
        return {k: _fresh(v) for k, v in value.items()}
    if isinstance(value, (list, set)):
        return type(value)(_fresh(v) for v in value)
    return value


def nodes_of(G: nx.DiGraph, op: str) -> list[str]:
    """Nodes running ``op``, in execution order (a snapshot: passes edit while they walk it)."""
    return [n for n in topo_order(G) if G.nodes[n]["op"] == op]


def op_of(G: nx.DiGraph, nid: str | None) -> str | None:
    return None if nid is None else G.nodes[nid]["op"]


def producer_of(G: nx.DiGraph, reader: str, value: str) -> str | None:
    """The node that makes ``value`` for ``reader`` (None for a graph input)."""
    for p in G.predecessors(reader):
        if value in G.edges[p, reader]["values"]:
            return p
    return None


def readers_of(G: nx.DiGraph, maker: str, value: str) -> list[str]:
    """Nodes that read ``value`` made by ``maker``, in execution order."""
    found = [s for s in G.successors(maker) if value in G.edges[maker, s]["values"]]
    return sorted(found, key=lambda n: (G.nodes[n]["order"], n))


def sole_reader(G: nx.DiGraph, maker: str, value: str) -> str | None:
    """The one node reading ``value``, or None if it has none or several (or is a graph output)."""
    found = readers_of(G, maker, value)
    if len(found) != 1 or value in G.graph["outputs"]:
        return None
    return found[0]


def describe(G: nx.DiGraph, nid: str) -> str:
    return f"{nid} ({G.nodes[nid]['op']})" if nid in G else nid


def other_input(G: nx.DiGraph, nid: str, value: str) -> str:
    """The other operand of a two-input node that reads ``value``."""
    a, b = G.nodes[nid]["inputs"]
    return b if a == value else a


# ---- refusals ------------------------------------------------------------------------------------

def refuse(G: nx.DiGraph, a: str, b: str, reason: str) -> None:
    """Log and record a fusion that was not done and why (recorded once per graph)."""
    a, b = describe(G, a), describe(G, b)
    log.info("cannot fuse %s with %s: %s", a, b, reason)
    message = f"cannot fuse {a} with {b}: {reason}"
    refusals = G.graph.setdefault("refusals", [])
    if message not in refusals:
        refusals.append(message)


# ---- editing -------------------------------------------------------------------------------------

def replace(G: nx.DiGraph, old: list[str], new: list[NewOp]) -> list[str]:
    """Replace the nodes ``old`` by the ops ``new`` (added in the order given); returns the new node ids.

    Raises RewriteError, with the graph untouched, when the rewrite would break it.
    """
    _check_replace(G, old, new)
    first = min(old, key=lambda n: (G.nodes[n]["order"], n))
    order, layer, path = (G.nodes[first][k] for k in ("order", "layer", "path"))
    sources = [s for n in sorted(old, key=lambda n: (G.nodes[n]["order"], n)) for s in G.nodes[n].get("sources", [n])]
    running = G.graph.get("running_pass")
    passes = {}
    for n in old:
        for s in G.nodes[n].get("sources", [n]):
            made_by = list(G.nodes[n].get("passes", {}).get(s, ()))
            passes[s] = made_by + [running] if running and running not in made_by else made_by
    made = {v for op in new for v in op.outputs}
    # Readers outside the rewrite keep reading values the new ops make under the old names.
    kept_readers = {(v, r) for n in old for v in G.nodes[n]["outputs"] if v in made
                    for r in readers_of(G, n, v) if r not in old}
    remove_nodes(G, old)
    producers = value_producers(G)
    nids = []
    for op in new:
        nid = op.nid or op.outputs[0]
        add_op(G, nid, op.op, op.attrs, op.inputs, op.outputs, weights=op.weights, layer=layer, path=path,
               order=order, producers=producers)
        G.nodes[nid]["sources"] = list(sources)
        G.nodes[nid]["passes"] = {s: list(p) for s, p in passes.items()}
        nids.append(nid)
    for v, r in sorted(kept_readers):
        src = producers[v]
        if G.has_edge(src, r):
            if v not in G.edges[src, r]["values"]:
                G.edges[src, r]["values"].append(v)
        else:
            G.add_edge(src, r, values=[v])
    prune_values(G)
    prune_weights(G)
    return nids


def remove_nodes(G: nx.DiGraph, nids) -> None:
    """Remove nodes and the values only they made (weights: call ``prune_weights``)."""
    for n in list(nids):
        for v in G.nodes[n]["outputs"]:
            G.graph["values"].pop(v, None)
        G.remove_node(n)


def prune_values(G: nx.DiGraph) -> None:
    """Drop value types nothing makes any more (graph inputs stay)."""
    made = set(G.graph["inputs"]) | {v for _, d in G.nodes(data=True) for v in d["outputs"]}
    for v in [v for v in G.graph["values"] if v not in made]:
        del G.graph["values"][v]


def prune_weights(G: nx.DiGraph) -> None:
    """Drop bound weights no node reads any more (so the loader does not ask for them); a quantised
    weight's companions (its scales) stay while it does."""
    used = with_companions(G.graph["weights"], {name for _, d in G.nodes(data=True) for name in d["weights"].values()})
    for name in [w for w in G.graph["weights"] if w not in used]:
        del G.graph["weights"][name]


def _check_replace(G: nx.DiGraph, old: list[str], new: list[NewOp]) -> None:
    old_set = set(old)
    missing = [n for n in old if n not in G]
    if missing:
        raise RewriteError(f"nodes {missing} are not in the graph")
    values = G.graph["values"]
    available = {v for n, d in G.nodes(data=True) if n not in old_set for v in d["outputs"]}
    available |= set(G.graph["inputs"])
    types = {}
    nids = [op.nid or op.outputs[0] for op in new]
    for nid in nids:
        if (nid in G and nid not in old_set) or nids.count(nid) > 1:
            raise RewriteError(f"node id {nid!r} is taken")
    for op in new:
        for v in op.inputs:
            if v not in available and v not in types:
                raise RewriteError(f"{op.op} would read {v!r}, which nothing would make")
        node = Node(op=op.op, attrs=op.attrs, weights=op.weights, layer=G.nodes[old[0]]["layer"],
                    model=G.graph["model"])
        try:
            outs, wshapes = OPS[op.op].infer(node, [types.get(v) or values[v] for v in op.inputs], G.graph["model"])
        except (ShapeError, KeyError) as exc:
            raise RewriteError(f"{op.op} does not accept these inputs: {exc}") from None
        if len(outs) != len(op.outputs):
            raise RewriteError(f"{op.op} makes {len(outs)} outputs, {len(op.outputs)} named")
        for v, t in zip(op.outputs, outs):
            if v in available or v in types:
                raise RewriteError(f"{v!r} would be made twice")
            if v in values and values[v] != t:
                raise RewriteError(f"{op.op} makes {v!r} as {t}; its readers expect {values[v]}")
            types[v] = t
        _check_weights(G, op, node, wshapes)
    for n in old:
        for v in G.nodes[n]["outputs"]:
            if v in types:
                continue
            if v in G.graph["outputs"]:
                raise RewriteError(f"{v!r} is a graph output")
            outside = [r for r in readers_of(G, n, v) if r not in old_set]
            if outside:
                raise RewriteError(f"{v!r} is also read by {describe(G, outside[0])}")
    # A new node reading a value made downstream of a replaced node would close a cycle.
    downstream = set()
    for n in old:
        downstream |= nx.descendants(G, n)
    downstream -= old_set
    producers = value_producers(G)
    for op in new:
        for v in op.inputs:
            if producers.get(v) in downstream:
                raise RewriteError(f"{v!r} is made by {describe(G, producers[v])}, which depends on the fused nodes")


def _check_weights(G: nx.DiGraph, op: NewOp, node: Node, wshapes: dict) -> None:
    opdef = OPS[op.op]
    for role, required in opdef.weights.items():
        if required and role not in op.weights:
            raise RewriteError(f"{op.op} needs a weight for {role!r}")
    for role, name in op.weights.items():
        info = G.graph["weights"].get(name)
        if info is None:
            raise RewriteError(f"{op.op} would bind {name}, which is not a bound weight")
        if tuple(info.shape) != tuple(wshapes[role]):
            raise RewriteError(f"{op.op} expects {role} of shape {wshapes[role]}, {name} is {info.shape}")
        if info.keep_fp32 != (role in opdef.fp32_roles(node)):
            raise RewriteError(f"{op.op} keeps {role} in {'fp32' if not info.keep_fp32 else 'the activation dtype'}, "
                               f"{name} is bound otherwise")
        if (info.parts is not None) != (role in opdef.expert_weights):
            raise RewriteError(f"{op.op}'s {role} and {name} disagree on being per-expert")
        problem = format_problem(G.graph["weights"], name, role, opdef)
        if problem:
            raise RewriteError(problem)


# ---- naming --------------------------------------------------------------------------------------

def fresh_name(G: nx.DiGraph, base: str) -> str:
    """``base``, or ``base_1``, ``base_2``... whichever no value or node uses yet."""
    def taken(name):
        return name in G.graph["values"] or name in G
    if not taken(base):
        return base
    i = 1
    while taken(f"{base}_{i}"):
        i += 1
    return f"{base}_{i}"


def scope_of(value: str) -> str:
    """The block prefix of a value name: ``L3.mla.o`` -> ``L3.mla.``."""
    return value[: value.rfind(".") + 1]
