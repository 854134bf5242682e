"""fuse_shared_experts: the shared experts run inside the routed experts' grouped launches.

A DeepSeekMoE layer's shared MLP (gate / up of S*M rows, SwiGLU, down back to D) is S experts of
the routed experts' shape that every token always selects: shared expert s is rows s*M..(s+1)*M
of gate_proj / up_proj and those columns of down_proj, and the MLP's output is the sum of the S
experts' outputs (down is linear in the intermediate).  So the route gives each token S more
pairs (weight 1) after its K routed ones, the grouped gate_up_silu / down kernels serve E + S
experts from weights stacked [shared slices..., routed...] (ir.ops.WeightSlice parts: the
checkpoint is read as it is; the shared experts first, so the kernels, which walk experts in
order, start on their full tiles: ir/ops/moe.py with_shared_pairs), and the combine takes the
shared experts' output as the sum of each token's last S pairs.  Four library or skinny-linear launches a layer are gone and the
shared weights stream through the expert kernels with the routed ones.

Rounding: the shared MLP's intermediate is rounded where it was (each gate / up / SwiGLU element
is one expert row's); its output was one down GEMM rounded once and is now S pair rows each
rounded, summed in fp32 and rounded (the same value for S = 1).

Not done on a rank of a tensor / expert parallel run (its shared MLP is column-split across the
ranks and its routed experts are a slice): that graph keeps the separate shared MLP; nor with more
than MAX_SHARED shared experts.
"""
from __future__ import annotations

import networkx as nx

from ..formats import FORMATS, set_format, with_companions
from ..ops import WeightInfo, WeightSlice
from .rewrite import NewOp, RewriteError, copy_graph, nodes_of, op_of, producer_of, refuse, replace, sole_reader
from .shard_for_rank import parallel_of

COMBINES = ("moe_combine_residual", "moe_combine_residual_rms_norm")
# More shared experts than this stay linears: each is one more pair of every token in the route,
# whose kernels keep a lane per pair (32 in all, routed ones included), and a slice in each stack.
MAX_SHARED = 8


def fuse_shared_experts(G: nx.DiGraph) -> nx.DiGraph:
    """Fuse a MoE layer's shared MLP into its routed experts' ops.

    before                                                  after

                      x [T,D]                                           x [T,D]
        /        |          |           \\                                  |
    moe_route  linear(g)  linear(u)      |                     moe_route (shared_experts S)
     |  \\  \\      \\       /             |                      /      |         \\
     | w  routing   silu_and_mul        |                  ids [T,P]  w [T,P]  routing (E+S experts)
     |     |   \\         |              |                              |         |
     |  moe_gate_up_silu linear(down)   |                              |    moe_gate_up_silu (E+S)
     |       |  (E)      |              |                              |         |
     |   moe_down (E)  shared [T,D]     |                              |    moe_down (E+S)
     |       |           |              |                              |         |
     |   eo [T*K,D]      |   residual   |                              |    eo [T*P,D]   residual
      \\      |          /     /                                          \\       |       /
       moe_combine_residual(_rms_norm)                         moe_combine_residual(_rms_norm) (S)

    P = K + S pairs a token.  Refused when an intermediate has another reader, the shared MLP's
    width is not S x moe_intermediate, or the graph is a rank's of a parallel run.
    """
    G = copy_graph(G)
    if parallel_of(G)[0] > 1:
        return G
    for combine in [n for op in COMBINES for n in nodes_of(G, op)]:
        if G.nodes[combine]["attrs"].get("shared_experts"):
            continue
        try:
            _fuse_layer(G, combine)
        except _Refused as exc:
            refuse(G, exc.a, exc.b, exc.reason)
    return G


class _Refused(Exception):
    def __init__(self, a: str, b: str, reason: str):
        super().__init__(reason)
        self.a, self.b, self.reason = a, b, reason


def _maker(G, reader: str, value: str, op: str, what: str) -> str:
    """The node making `value` for `reader`, which must run `op` and be read by `reader` alone."""
    src = producer_of(G, reader, value)
    if op_of(G, src) != op:
        raise _Refused(src or value, reader, f"{what} comes from {op_of(G, src) or 'a graph input'}, not {op}")
    return src


def _only_reader(G, maker: str, value: str, reader: str, what: str) -> None:
    if sole_reader(G, maker, value) != reader:
        raise _Refused(maker, reader, f"{what} ({value}) has readers besides {reader}")


def _fuse_layer(G: nx.DiGraph, combine: str) -> None:
    eo, w, shared, residual = G.nodes[combine]["inputs"]
    down = _maker(G, combine, eo, "moe_down", "the routed experts' output")
    ea, routing = G.nodes[down]["inputs"]
    gate_up = _maker(G, down, ea, "moe_gate_up_silu", "moe_down's input")
    x, routing_gu = G.nodes[gate_up]["inputs"]
    route = _maker(G, gate_up, routing_gu, "moe_route", "the routing")
    ids, w_route, routing_route = G.nodes[route]["outputs"]
    if routing != routing_gu or w != w_route:
        raise _Refused(route, combine, "moe_down, moe_gate_up_silu and the combine do not share one route")
    shared_down = _maker(G, combine, shared, "linear", "the shared experts' output")
    (sa,) = G.nodes[shared_down]["inputs"]
    act = _maker(G, shared_down, sa, "silu_and_mul", "the shared down projection's input")
    sg, su = G.nodes[act]["inputs"]
    shared_gate = _maker(G, act, sg, "linear", "the shared gate")
    shared_up = _maker(G, act, su, "linear", "the shared up")
    for lin in (shared_gate, shared_up):
        if G.nodes[lin]["inputs"] != [x]:
            raise _Refused(lin, route, "the shared MLP reads another input than the routed experts")
    for maker, value, reader, what in (
            (route, w, combine, "the routing weights"), (gate_up, ea, down, "the experts' SwiGLU"),
            (down, eo, combine, "the routed experts' output"), (shared_down, shared, combine, "the shared output"),
            (act, sa, shared_down, "the shared SwiGLU"), (shared_gate, sg, act, "the shared gate"),
            (shared_up, su, act, "the shared up")):
        _only_reader(G, maker, value, reader, what)
    readers = {r for r in G.successors(route) if routing in G.edges[route, r]["values"]}
    if readers != {gate_up, down} or routing in G.graph["outputs"]:
        raise _Refused(route, gate_up, f"the routing is read by {sorted(readers - {gate_up, down})} too")
    if any(ids in G.edges[route, r]["values"] for r in G.successors(route)) or ids in G.graph["outputs"]:
        raise _Refused(route, combine, "the expert ids have readers (they would gain the shared pairs)")

    E, M = G.nodes[route]["attrs"]["num_experts"], G.nodes[gate_up]["attrs"]["out_dim"]
    S = int(G.graph["model"].dims["shared_experts"])
    width = G.nodes[shared_gate]["attrs"]["out_dim"]
    if S > MAX_SHARED:
        raise _Refused(shared_gate, gate_up, f"{S} shared experts; more than {MAX_SHARED} stay linears (each is a "
                                             f"pair of every token in the route)")
    if S < 1 or width != S * M or G.nodes[shared_up]["attrs"]["out_dim"] != width:
        raise _Refused(shared_gate, gate_up, f"the shared MLP is {width} wide, not shared_experts ({S}) x "
                                             f"moe_intermediate ({M})")
    bound = {
        "gate": _stack(G, G.nodes[gate_up]["weights"]["gate"], G.nodes[shared_gate]["weights"]["weight"], 0, S, M),
        "up": _stack(G, G.nodes[gate_up]["weights"]["up"], G.nodes[shared_up]["weights"]["weight"], 0, S, M),
        "weight": _stack(G, G.nodes[down]["weights"]["weight"], G.nodes[shared_down]["weights"]["weight"], 1, S, M),
    }
    new_routing, new_ea, new_eo = (f"{v}_with_shared" for v in (routing, ea, eo))
    new_ids, new_w = f"{ids}_with_shared", f"{w}_with_shared"
    combine_data = G.nodes[combine]
    new = [
        NewOp("moe_route", [x], [new_ids, new_w, new_routing], {**G.nodes[route]["attrs"], "shared_experts": S},
              dict(G.nodes[route]["weights"]), nid=route),
        NewOp("moe_gate_up_silu", [x, new_routing], [new_ea], {**G.nodes[gate_up]["attrs"], "num_experts": E + S},
              {"gate": bound["gate"], "up": bound["up"]}, nid=gate_up),
        NewOp("moe_down", [new_ea, new_routing], [new_eo], {**G.nodes[down]["attrs"], "num_experts": E + S},
              {"weight": bound["weight"]}, nid=down),
        NewOp(combine_data["op"], [new_eo, new_w, residual], list(combine_data["outputs"]),
              {**combine_data["attrs"], "shared_experts": S}, dict(combine_data["weights"]), nid=combine),
    ]
    old = [route, gate_up, down, combine, shared_gate, shared_up, act, shared_down]
    # what each new op stands for (replace gives every new op all the sources): the shared MLP's
    # gate / up / SwiGLU join the experts' gate_up_silu, its down the experts' down
    stands_for = {route: [route], gate_up: [gate_up, shared_gate, shared_up, act], down: [down, shared_down],
                  combine: [combine]}
    sources = {nid: [src for n in group for src in G.nodes[n].get("sources", [n])] for nid, group in stands_for.items()}
    try:
        replace(G, old, new)
    except RewriteError as exc:
        for name in with_companions(G.graph["weights"], bound.values()):
            if not any(name in d["weights"].values() for _, d in G.nodes(data=True)):
                G.graph["weights"].pop(name, None)
        raise _Refused(route, combine, str(exc)) from None
    for nid, srcs in sources.items():
        data = G.nodes[nid]
        data["sources"] = srcs
        data["passes"] = {src: data["passes"][src] for src in srcs}


def _stack(G: nx.DiGraph, routed: str, shared: str, dim: int, S: int, M: int) -> str:
    """Bind (and return the name of) the S slices of the shared MLP's weight `shared` of M rows
    (dim 0: gate / up) or columns (dim 1: down), followed by the routed experts' stack `routed`."""
    r, s = G.graph["weights"][routed], G.graph["weights"][shared]
    if r.parts is None or s.parts is not None or r.keep_fp32 or s.keep_fp32:
        raise _Refused(routed, shared, "the expert and shared weights are not a plain stack and a plain tensor")
    slices = tuple(WeightSlice(shared, dim, i * M, (i + 1) * M, tuple(s.shape)) for i in range(S))
    if any(sl.shape() != tuple(r.shape[1:]) for sl in slices):
        raise _Refused(routed, shared, f"a slice of {shared} {s.shape} is not an expert's {tuple(r.shape[1:])}")
    name = routed.replace(".experts.*.", ".experts.*+shared_experts.")
    if name == routed:
        name = f"{routed}+shared"
    if r.format != s.format:
        raise _Refused(routed, shared, f"the routed experts are stored as {r.format or 'the activation dtype'}, "
                                       f"the shared ones as {s.format or 'the activation dtype'}: one stack has one format")
    G.graph["weights"][name] = WeightInfo((r.shape[0] + S, *r.shape[1:]), False, (*slices, *r.parts))
    if r.format is not None:
        try:   # the stack's scales: the shared scale's blocks of each slice, then the routed experts' scales
            set_format(G.graph["weights"], name, FORMATS[r.format])
        except ValueError as exc:
            del G.graph["weights"][name]
            raise _Refused(routed, shared, f"the shared experts' slices cannot carry their scales: {exc}") from None
    return name
