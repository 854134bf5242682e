"""shard_for_rank: one rank's part of the graph under tensor / expert parallelism.

``G.graph["parallel"] = {"world": w, "rank": r}`` (set by whoever builds the rank's graphs)
asks for it; without it, or with w == 1, the graph is returned as it is.  Which weight is
split how is ir/parallel.py's table (the loader reads the same table, so the slice a node
binds is the slice the rank reads).  Activations stay whole on every rank; the rank's graph
runs at the rank's shapes, so its kernels are ordinary kernels for H / w heads, I / w
columns, E / w experts:

    MLA        linear q(_b) [T, H*(N+R)]   -> [T, H/w*(N+R)]   (rows of the weight)
               split heads=H               -> heads=H/w
               mla_attention kv_b [H*(N+V), C] -> [H/w*(N+V), C]  (model dims: heads = H/w)
               linear o_proj [D, H*V]      -> [D, H/w*V]       (columns)    -> partial sum
    dense FFN  gate/up [I, D] -> [I/w, D]; down [D, I] -> [D, I/w]          -> partial sum
    MoE        router over all E (replicated), then

                 moe_topk -> ids, weights               moe_topk -> ids, weights
                    |                          ==>          |
                 moe_align(E) ...                       moe_local_experts(first=r*E/w, count=E/w)
                 moe_gate_up / moe_down (E experts)         |  local ids, weights (0: another rank's pair)
                 moe_combine(eo, weights)               moe_align(E/w) ... moe_gate_up / moe_down (E/w)
                                                        moe_combine(eo, local weights)   -> partial sum
               shared experts split like the dense FFN                        -> partial sum

The values that are now this rank's partial sums are listed in ``G.graph["partial"]``;
insert_all_reduce (the next pass) makes them whole again.  ``G.graph["shards"]`` records,
for every weight that is not replicated, the ir.parallel.Shard this rank binds.
"""
from __future__ import annotations

import dataclasses

import networkx as nx

from ..formats import FORMATS, block_slice_problem, cdiv, companion_names
from ..graph import add_op, node_view, topo_order
from ..ops import OPS, ShapeError
from ..parallel import ParallelError, Shard, rule_for, sharded_shape, weight_shard
from .rewrite import copy_graph, fresh_name, readers_of, scope_of

EXPERT_OPS = ("moe_align", "moe_gate_up", "moe_gate_up_silu", "moe_down", "moe_expert_ffn")


def parallel_of(G: nx.DiGraph) -> tuple[int, int]:
    """(world, rank) the graph is for; (1, 0) when it is not split."""
    par = G.graph.get("parallel") or {}
    return int(par.get("world", 1)), int(par.get("rank", 0))


def shard_for_rank(G: nx.DiGraph) -> nx.DiGraph:
    """Rewrite the whole-model graph into rank r's graph at its shapes (see the module docstring)."""
    world, rank = parallel_of(G)
    if world == 1 or G.graph.get("shards") is not None:
        return G
    H = copy_graph(G)
    model = G.graph["model"]
    d = model.dims
    if d["heads"] % world:
        raise ParallelError(f"{model.name}: heads = {d['heads']} does not divide by {world} ranks")
    dims = dict(d, heads=d["heads"] // world)
    H.graph["model"] = dataclasses.replace(model, dims_items=tuple(sorted(dims.items())))
    shards, partial = {}, []
    E = d["experts"]
    for nid in topo_order(H):
        data = H.nodes[nid]
        for role, name in data["weights"].items():
            if rule_for(name) is None:
                continue
            if name not in shards:   # a weight several nodes bind is sliced once
                info = H.graph["weights"][name]
                shard = shards[name] = weight_shard(name, info.shape, model, world, rank)
                _shard_weight(H, name, shard)
                for cname, cshard in _companion_shards(H, name, info, shard):
                    shards[cname] = cshard
                    _shard_weight(H, cname, cshard)
            shard = shards[name]
            if data["op"] == "linear" and shard.kind == "rows":
                data["attrs"]["out_dim"] = shard.stop - shard.start
            if shard.kind == "cols":
                partial.extend(data["outputs"])
        if data["op"] == "split" and data["attrs"].get("heads") == d["heads"]:
            data["attrs"]["heads"] = dims["heads"]
        if data["op"] in EXPERT_OPS and data["attrs"]["num_experts"] == E:
            if E % world:
                raise ParallelError(f"{model.name}: routed experts = {E} do not divide by {world} ranks")
            data["attrs"]["num_experts"] = E // world
        if data["op"] == "moe_topk":
            _localize(H, nid, rank * (E // world), E // world)
        if data["op"] == "moe_combine":
            partial.extend(data["outputs"])
    _reinfer(H)
    H.graph["shards"] = shards
    H.graph["partial"] = partial
    return H


def _shard_weight(H: nx.DiGraph, name: str, shard) -> None:
    info = H.graph["weights"][name]
    parts = info.parts[shard.start:shard.stop] if shard.kind == "experts" else info.parts
    H.graph["weights"][name] = dataclasses.replace(info, shape=sharded_shape(info.shape, shard), parts=parts)


def _companion_shards(H: nx.DiGraph, name: str, info, shard) -> list:
    """(companion, its Shard) for a quantised weight's scales: the same experts, or the blocks of the
    rank's rows / columns, which must fall on block edges (a rank's slice may not split a block)."""
    if info.format is None:
        return []
    fmt = FORMATS[info.format]
    if fmt.block is None:
        raise ParallelError(f"weight {name} ({fmt.name}): integer weights run on one GPU only (no rank slices of "
                            f"their per-channel scales yet)")
    if shard.kind in ("rows", "cols"):
        problem = block_slice_problem(fmt, shard.dim, shard.start, shard.stop, info.shape[shard.dim])
        if problem:
            raise ParallelError(f"weight {name} {tuple(info.shape)} ({fmt.name}): this rank's slice {problem}")
        b = fmt.block[shard.dim]
        shard = Shard(shard.kind, shard.start // b, cdiv(shard.stop, b))
    return [(cname, shard) for cname in companion_names(name, fmt)]


def _localize(H: nx.DiGraph, topk: str, first: int, count: int) -> None:
    """Put moe_local_experts between moe_topk and every reader of its ids and weights."""
    ids, weights = H.nodes[topk]["outputs"]
    readers = {v: readers_of(H, topk, v) for v in (ids, weights)}
    local = [fresh_name(H, f"{v}_local") for v in (ids, weights)]
    data = H.nodes[topk]
    nid = local[0]
    add_op(H, nid, "moe_local_experts", {"first": first, "count": count}, [ids, weights], local,
           layer=data["layer"], path=data["path"], order=data["order"] + 0.5)
    H.nodes[nid]["sources"] = list(data.get("sources", [topk]))
    H.nodes[nid]["passes"] = {s: ["shard_for_rank"] for s in H.nodes[nid]["sources"]}
    for old, new in zip((ids, weights), local):
        for r in readers[old]:
            reroute(H, topk, old, nid, new, r)


def reroute(H: nx.DiGraph, maker: str, value: str, new_maker: str, new_value: str, reader: str) -> None:
    """Make ``reader`` read ``new_value`` (made by ``new_maker``) where it read ``value``."""
    data = H.nodes[reader]
    data["inputs"] = [new_value if v == value else v for v in data["inputs"]]
    carried = H.edges[maker, reader]["values"]
    carried.remove(value)
    if not carried:
        H.remove_edge(maker, reader)
    if H.has_edge(new_maker, reader):
        H.edges[new_maker, reader]["values"].append(new_value)
    else:
        H.add_edge(new_maker, reader, values=[new_value])


def _reinfer(H: nx.DiGraph) -> None:
    """Recompute every value's type at the rank's shapes; a shape that no longer fits is a ParallelError."""
    values = H.graph["values"]
    for nid in topo_order(H):
        data = H.nodes[nid]
        try:
            outs, wshapes = OPS[data["op"]].infer(node_view(H, nid), [values[v] for v in data["inputs"]],
                                                  H.graph["model"])
        except ShapeError as exc:
            raise ParallelError(f"node {nid} ({data['op']}) does not fit one rank's shapes: {exc}") from None
        for v, t in zip(data["outputs"], outs):
            values[v] = t
        for role, name in data["weights"].items():
            if tuple(H.graph["weights"][name].shape) != tuple(wshapes[role]):
                raise ParallelError(f"node {nid} ({data['op']}) expects {role} of shape {wshapes[role]} on one "
                                    f"rank, the rank binds {name} as {H.graph['weights'][name].shape}")


__all__ = ["parallel_of", "reroute", "scope_of", "shard_for_rank"]
