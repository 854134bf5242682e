"""Spec -> networkx.DiGraph, one graph per phase (prefill, decode) from the same spec.

Nodes are op instances; an edge u -> v carries the values u makes that v reads.
Blocks are inlined (``call``) and layers unrolled, so every node binds concrete
checkpoint names: node ``L3.mla.q`` is layer 3's q projection.  Graph attributes:

  phase    "prefill" | "decode"
  model    the ModelConfig (dims, eps, rope, softmax scale)
  values   value name -> TType (shape, dtype)
  weights  bound checkpoint name -> WeightInfo (expected shape, fp32, per-expert parts)
  inputs   ["ids"];  outputs ["logits"]
  spec_file the spec's file name;  origins  builder node id -> SpecSite (op, YAML path, line),
           kept through every pass so generated code can name the spec lines it implements
"""
from __future__ import annotations

import fnmatch
from dataclasses import dataclass

from .errors import SpecError
from .formats import ACT, FORMATS, set_format
from .lazy import nx
from .ops import OPS, Node, ShapeError, TType, WeightInfo
from .ops.base import width_problem
from .spec import Spec

PHASES = ("prefill", "decode")


@dataclass(frozen=True)
class SpecSite:
    """Where a builder node came from: its op and its entry in the spec."""
    op: str
    path: str            # YAML path, e.g. "blocks.mla.ops[4]"
    line: int | None     # line in the spec file
    layer: int | None    # the decoder layer it was unrolled for (None: embed / head)


def node_view(G: nx.DiGraph, nid: str) -> Node:
    """The Node record ops see (attrs, bound weights, layer, model) for a graph node."""
    data = G.nodes[nid]
    return Node(op=data["op"], attrs=data["attrs"], weights=data["weights"], layer=data["layer"], model=G.graph["model"])


def add_op(G: nx.DiGraph, nid: str, op: str, attrs: dict, inputs: list[str], outputs: list[str], *,
           weights: dict | None = None, layer: int | None, path: str, order: float,
           producers: dict[str, str] | None = None) -> list[TType]:
    """Add one node, infer its outputs, bind its weights and wire its edges. Raises ShapeError."""
    values = G.graph["values"]
    node = Node(op=op, attrs=attrs, weights=weights or {}, layer=layer, model=G.graph["model"])
    opdef = OPS[op]
    out_types, wshapes = opdef.infer(node, [values[v] for v in inputs], G.graph["model"])
    if len(out_types) != len(outputs):
        raise ShapeError(f"{op} makes {len(out_types)} outputs, {len(outputs)} named")
    G.add_node(nid, op=op, attrs=attrs, inputs=list(inputs), outputs=list(outputs), weights=dict(node.weights),
               layer=layer, path=path, order=order)
    producers = producers if producers is not None else value_producers(G)
    for v in inputs:
        src = producers.get(v)
        if src is not None:
            if G.has_edge(src, nid):
                G.edges[src, nid]["values"].append(v)
            else:
                G.add_edge(src, nid, values=[v])
    for v, t in zip(outputs, out_types):
        values[v] = t
        producers[v] = nid
    return out_types


def value_producers(G: nx.DiGraph) -> dict[str, str]:
    return {v: n for n, d in G.nodes(data=True) for v in d["outputs"]}


def bind_weights(G: nx.DiGraph, nid: str, templates: dict, wshapes: dict, layer: int | None) -> dict:
    """Format {layer}/{expert} into checkpoint names and record what each must look like."""
    opdef = OPS[G.nodes[nid]["op"]]
    node = node_view(G, nid)
    bound = {}
    E = G.graph["model"].dims["experts"]
    for role, template in templates.items():
        keep_fp32 = role in opdef.fp32_roles(node)
        if role in opdef.expert_weights:
            parts = tuple(template.format(layer=layer, expert=e) for e in range(E))
            name = template.format(layer=layer, expert="*")
            info = WeightInfo(tuple(wshapes[role]), keep_fp32, parts)
        else:
            name = template.format(layer=layer)
            info = WeightInfo(tuple(wshapes[role]), keep_fp32)
        known = G.graph["weights"].get(name)
        if known is not None and known != info:
            raise ShapeError(f"weight {name} is bound twice with different shapes ({known.shape} vs {info.shape})")
        G.graph["weights"][name] = info
        bound[role] = name
    return bound


def _check_widths(named: list[tuple[str, tuple, str]]) -> None:
    """Every concrete dim of each (what, shape, shown) within what the kernels index
    (ir.ops.base.MAX_WIDTH): the dims a spec names are checked as it loads, the ones an op derives
    from them (H*(N+R), C+R, H*(N+V), ...) here, where they are first known."""
    for what, shape, shown in named:
        for n in shape:
            if isinstance(n, int) and width_problem(n):
                raise ShapeError(f"{what} would be {shown}: {width_problem(n)}")


ROUTING_DIMS = ("top_k", "groups", "topk_groups")


def _check_routing(op: str, attrs: dict, ins: list[TType], wshapes: dict, model) -> None:
    """What a spec's MoE ops imply must be its dims: each op runs whatever it is given (so the
    ops' own checks, which kernel tests reuse at other sizes, cannot know), but a router narrower
    than the experts only ever routes to its first ones, and an expert stack of another count
    reads past its per-expert checkpoint tensors or leaves picked experts without weights.  Only
    a spec's graph is checked so: the passes then regroup experts (E + shared, E / ranks)."""
    d = model.dims
    if op == "moe_topk":
        E = ins[0].shape[1]
        if E != d["experts"]:
            raise ShapeError(f"the router's width ({E}, from {ins[0]}) is not the number of routed experts "
                             f"(dims.experts = {d['experts']})")
    for key in ROUTING_DIMS:   # stated once, in dims: the planner and the runtime read them there
        if key in attrs and attrs[key] != d[key]:
            raise ShapeError(f"{key}={attrs[key]} differs from the spec's dims.{key} ({d[key]})")
    for role in OPS[op].expert_weights:
        if role in wshapes and wshapes[role][0] != d["experts"]:
            raise ShapeError(f"{role} stacks {wshapes[role][0]} experts (num_experts), but the checkpoint has one "
                             f"tensor per routed expert: dims.experts = {d['experts']}")


class _Builder:
    def __init__(self, spec: Spec, phase: str):
        self.spec = spec
        self.G = nx.DiGraph(phase=phase, model=spec.model, spec_name=spec.name, values={}, weights={},
                            inputs=["ids"], outputs=["logits"], spec_file=spec.file, origins={})
        self.G.graph["values"]["ids"] = TType(("T",), "i64")
        self.producers: dict[str, str] = {}
        self.order = 0

    def inline(self, block_name: str, prefix: str, bindings: dict[str, str], layer: int | None, kind) -> list[str]:
        block = self.spec.blocks[block_name]
        env = dict(bindings)
        for decl in block.ops:
            if decl.op == "call":
                target = decl.attrs["block"]
                if target == "{attention}":
                    target = kind.attention
                elif target == "{ffn}":
                    target = kind.ffn
                sub = self.spec.blocks[target]
                if len(sub.inputs) != len(decl.inputs) or len(sub.outputs) != len(decl.outputs):
                    raise self.spec.error(decl.path, f"block {target!r} takes {len(sub.inputs)} input(s) and makes "
                                                     f"{len(sub.outputs)} output(s); the call passes {len(decl.inputs)} "
                                                     f"and names {len(decl.outputs)}")
                outs = self.inline(target, f"{prefix}{target}.", dict(zip(sub.inputs, (env[i] for i in decl.inputs))),
                                   layer, kind)
                env.update(zip(decl.outputs, outs))
                continue
            if layer is None:
                for role, template in decl.weights.items():
                    if "{layer}" in template:
                        raise self.spec.error(f"{decl.path}.{role}", f"weight {template!r} uses {{layer}}, but block "
                                                                     f"{block_name!r} runs outside a decoder layer")
            inputs = [env[i] for i in decl.inputs]
            outputs = [prefix + o for o in decl.outputs]
            attrs = dict(decl.attrs)
            if "eps" in OPS[decl.op].attrs and attrs.get("eps") is None:
                attrs["eps"] = self.spec.model.rms_norm_eps
            nid = outputs[0]
            try:
                # Bind with placeholder shapes first so infer sees which optional weights exist.
                node = Node(op=decl.op, attrs=attrs, weights=dict(decl.weights), layer=layer, model=self.spec.model)
                out_types, wshapes = OPS[decl.op].infer(node, [self.G.graph["values"][v] for v in inputs], self.spec.model)
                if len(out_types) != len(outputs):
                    raise ShapeError(f"{decl.op} makes {len(out_types)} outputs, {len(outputs)} named")
                _check_routing(decl.op, attrs, [self.G.graph["values"][v] for v in inputs], wshapes, self.spec.model)
                _check_widths([(f"value {o}", t.shape, str(t)) for o, t in zip(decl.outputs, out_types)] +
                              [(f"weight {decl.weights[r]}", shape, str(list(shape))) for r, shape in wshapes.items()])
                add_op(self.G, nid, decl.op, attrs, inputs, outputs, weights={}, layer=layer, path=decl.path,
                       order=self.order, producers=self.producers)
                self.G.nodes[nid]["weights"] = bind_weights(self.G, nid, decl.weights, wshapes, layer)
                self.G.graph["origins"][nid] = SpecSite(decl.op, decl.path, self.spec.located.line(decl.path), layer)
            except ShapeError as exc:
                where = f" (layer {layer})" if layer is not None else ""
                raise self.spec.error(decl.path, f"{decl.op}{where}: {exc}") from None
            except KeyError as exc:
                raise self.spec.error(decl.path, f"{decl.op}: missing {exc}") from None
            self.order += 1
            env.update(zip(decl.outputs, outputs))
        return [env[o] for o in block.outputs]

    def build(self) -> nx.DiGraph:
        spec = self.spec
        (x,) = self._single(self.inline("embed", "embed.", {spec.blocks["embed"].inputs[0]: "ids"}, None, None), "embed")
        for layer in range(spec.dims["layers"]):
            _, kind = spec.plan.kind(layer)
            block = spec.blocks["decoder_layer"]
            (x,) = self._single(self.inline("decoder_layer", f"L{layer}.", {block.inputs[0]: x}, layer, kind), "decoder_layer")
        (logits,) = self._single(self.inline("head", "head.", {spec.blocks["head"].inputs[0]: x}, None, None), "head")
        t = self.G.graph["values"][logits]
        if t.shape[1:] != (spec.dims["vocab"],):
            raise spec.error("blocks.head.outputs", f"the head must make logits [T, vocab={spec.dims['vocab']}], makes {t}")
        self._rename_value(logits, "logits")
        self._apply_weight_formats()
        return self.G

    def _apply_weight_formats(self) -> None:
        """Give each bound weight the format of the spec's first weight_formats glob that matches its
        name, and bind its companions; a glob that matches nothing, or a format on a weight its op
        cannot take quantised, is a located SpecError."""
        rules = self.spec.weight_formats
        if not rules:
            return
        weights = self.G.graph["weights"]
        chosen: dict[str, tuple[str, str]] = {}
        hits = {pattern: 0 for pattern, _ in rules}
        for name in weights:
            for pattern, fmt in rules:
                if fnmatch.fnmatchcase(name, pattern):
                    hits[pattern] += 1
                    if fmt != ACT:
                        chosen[name] = (pattern, fmt)
                    break
        for pattern, n in hits.items():
            if not n:
                raise self.spec.error(f"weight_formats.{pattern}", f"{pattern!r} matches no weight the spec binds")
        for nid, data in self.G.nodes(data=True):
            opdef = OPS[data["op"]]
            for role, name in data["weights"].items():
                if name not in chosen:
                    continue
                pattern, fmt = chosen[name]
                if role not in opdef.scaled_weights or weights[name].keep_fp32:
                    why = "is kept in float32" if weights[name].keep_fp32 else "cannot take a quantised weight"
                    raise self.spec.error(f"weight_formats.{pattern}",
                                          f"{name} would be {fmt}, but it is the {role} of {data['op']} "
                                          f"{nid}, which {why}")
        for name, (pattern, fmt) in chosen.items():
            try:
                set_format(weights, name, FORMATS[fmt])
            except ValueError as exc:
                raise self.spec.error(f"weight_formats.{pattern}", str(exc)) from None

    def _single(self, outs, block):
        if len(outs) != 1:
            raise self.spec.error(f"blocks.{block}.outputs", f"block {block!r} must have exactly one output")
        return outs

    def _rename_value(self, old: str, new: str) -> None:
        nid = self.producers[old]
        data = self.G.nodes[nid]
        data["outputs"] = [new if o == old else o for o in data["outputs"]]
        self.G.graph["values"][new] = self.G.graph["values"].pop(old)


def build_graph(spec: Spec, phase: str) -> nx.DiGraph:
    if phase not in PHASES:
        raise ValueError(f"phase must be one of {PHASES}, got {phase!r}")
    for block in ("embed", "head", "decoder_layer"):
        if len(spec.blocks[block].inputs) != 1:
            raise SpecError(f"block {block!r} must take exactly one input", file=spec.file,
                            path=f"blocks.{block}.inputs", line=spec.located.line(f"blocks.{block}.inputs"))
    return _Builder(spec, phase).build()


def topo_order(G: nx.DiGraph) -> list[str]:
    """Deterministic execution order: topological, ties broken by the spec's op order."""
    return list(nx.lexicographical_topological_sort(G, key=lambda n: (G.nodes[n]["order"], n)))
