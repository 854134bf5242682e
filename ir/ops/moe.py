"""DeepSeekMoE: routing (softmax greedy, V2 group-limited, V3 noaux_tc), alignment, grouped experts, combine.

Token-expert pairs are numbered p = t*K + k.  Per-pair tensors ([T*K, ...]) are kept
in pair order; ``routing`` says which pairs each expert serves (pairs sorted by
expert, and each expert's [start, end) in that order), so a grouped kernel can run
every active expert in one launch.

With ``shared_experts`` S > 0 (ir/passes/fuse_shared_experts.py), moe_route also gives every
token S always-selected pairs after its K routed ones, and numbers the experts of the grouped
ops' weight stack: experts 0..S-1 are the shared MLP's slices, the routed expert e is S + e.
The shared pairs have weight 1, each token has P = K + S pairs, and the combine adds the last S
of them as the shared experts' output.
"""
from __future__ import annotations

from ..formats_int import linear
from ..lazy import F, torch
from .base import Attr, OpDef, TType, expect, register
from .core import norm_quant_ref, norm_quant_types, rms_norm_ref

SCORING = ("softmax", "sigmoid")
METHODS = ("greedy", "group_limited_greedy", "noaux_tc")


def _topk_attrs():
    return {
        "scoring": Attr("choice", "softmax", SCORING),
        "method": Attr("choice", "greedy", METHODS),
        "top_k": Attr("dim"),
        "groups": Attr("dim", 1),
        "topk_groups": Attr("dim", 1),
        "norm_topk_prob": Attr("bool", False),
        "routed_scaling_factor": Attr("float", 1.0, positive=True),
    }


def route_ref(logits: torch.Tensor, bias: torch.Tensor | None, a: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """router logits [T, E] (fp32) -> (ids [T, K] int64, weights [T, K] fp32), as transformers routes."""
    logits = logits.float()
    T, E = logits.shape
    G, K = a["groups"], a["top_k"]
    scores = logits.softmax(dim=-1) if a["scoring"] == "softmax" else logits.sigmoid()
    if a["method"] == "greedy":
        weights, ids = torch.topk(scores, K, dim=-1)
    elif a["method"] == "group_limited_greedy":
        group_scores = scores.view(T, G, E // G).max(dim=-1).values
        keep = torch.zeros_like(group_scores).scatter_(1, torch.topk(group_scores, a["topk_groups"], dim=-1)[1], 1)
        masked = scores.masked_fill(~keep.bool().repeat_interleave(E // G, dim=1), 0.0)
        weights, ids = torch.topk(masked, K, dim=-1)
    else:  # noaux_tc: choose with the correction bias, weigh without it
        choice = scores + (bias.float() if bias is not None else 0.0)
        group_scores = choice.view(T, G, E // G).topk(2, dim=-1)[0].sum(dim=-1)
        keep = torch.zeros_like(group_scores).scatter_(1, torch.topk(group_scores, a["topk_groups"], dim=-1)[1], 1)
        choice = choice.masked_fill(~keep.bool().repeat_interleave(E // G, dim=1), float("-inf"))
        ids = torch.topk(choice, K, dim=-1)[1]
        weights = scores.gather(1, ids)
    if a["norm_topk_prob"]:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return ids, weights * a["routed_scaling_factor"]


def check_topk_attrs(attrs, E):
    G, K, TG = attrs["groups"], attrs["top_k"], attrs["topk_groups"]
    expect(1 <= K <= E, f"top_k={K} must be between 1 and the number of experts {E}")
    expect(G >= 1 and E % G == 0, f"experts ({E}) must divide into groups ({G})")
    expect(1 <= TG <= G, f"topk_groups={TG} must be between 1 and groups={G}")
    if attrs["method"] != "greedy":
        expect(K <= TG * (E // G), f"top_k={K} exceeds the experts in the {TG} chosen groups ({TG * (E // G)})")
    if attrs["method"] == "noaux_tc":
        expect(attrs["scoring"] == "sigmoid", "noaux_tc routing uses sigmoid scoring")
        expect(E // G >= 2, "noaux_tc needs at least 2 experts per group (it sums each group's top 2)")


def align_ref(ids: torch.Tensor, num_experts: int) -> dict:
    """Pairs grouped by expert: order[offsets[e]:offsets[e + 1]] are expert e's pairs.  A pair
    whose id is outside [0, E) (-1: another rank's expert, see local_experts_ref) is no expert's:
    it sorts after every expert's segment, past offsets[E], and no grouped op computes it."""
    flat = ids.reshape(-1)
    valid = (flat >= 0) & (flat < num_experts)
    order = torch.argsort(torch.where(valid, flat, num_experts), stable=True)
    counts = torch.bincount(flat[valid], minlength=num_experts)
    offsets = torch.zeros(num_experts + 1, dtype=torch.int64, device=ids.device)
    offsets[1:] = torch.cumsum(counts, 0)
    return {"order": order, "offsets": offsets, "top_k": ids.shape[1]}


def grouped_linear(x: torch.Tensor, rows_of_pair: bool, routing: dict, weight: torch.Tensor, n_pairs: int) -> torch.Tensor:
    """out[p] = x[row(p)] @ weight[expert(p)]^T, with row(p) = p // K (token) or p (pair)."""
    out = torch.zeros(n_pairs, weight.shape[1], dtype=x.dtype, device=x.device)
    offsets = routing["offsets"].tolist()
    for e in range(weight.shape[0]):
        if offsets[e] == offsets[e + 1]:
            continue
        pairs = routing["order"][offsets[e]:offsets[e + 1]]
        rows = pairs if rows_of_pair else pairs // routing["top_k"]
        out[pairs] = linear(x[rows], weight[e])
    return out


def _pairs_dim(x: TType, K: int) -> str:
    return f"{x.shape[0]}*{K}"


def pairs_per_token(rows) -> int | None:
    """P of a per-pair dim "T*P" (_pairs_dim's), or None for any other dim."""
    t, star, p = str(rows).partition("*")
    return int(p) if star and t and p.isdigit() else None


@register
class MoeTopk(OpDef):
    name = "moe_topk"
    outputs = 2
    attrs = _topk_attrs()
    weights = {"bias": False}
    fp32_weights = ("bias",)
    doc = "router logits [T, E] fp32 -> [ids [T, K], weights [T, K] fp32]"

    @classmethod
    def infer(cls, node, ins, model):
        (lg,) = ins
        expect(len(lg.shape) == 2 and lg.dtype == "f32", f"moe_topk expects fp32 router logits [T, E], got {lg}")
        E, K = lg.shape[1], node.attrs["top_k"]
        check_topk_attrs(node.attrs, E)
        shapes = {"bias": (E,)} if "bias" in node.weights else {}
        return [TType((lg.shape[0], K), "i64"), TType((lg.shape[0], K), "f32")], shapes

    @classmethod
    def run(cls, node, ins, w, ctx):
        return list(route_ref(ins[0], w.get("bias"), node.attrs))


@register
class MoeAlign(OpDef):
    name = "moe_align"
    attrs = {"num_experts": Attr("dim")}
    doc = "ids [T, K] -> routing: pairs sorted by expert and each expert's [start, end)"

    @classmethod
    def infer(cls, node, ins, model):
        (ids,) = ins
        expect(ids.dtype == "i64" and len(ids.shape) == 2, f"moe_align expects expert ids [T, K], got {ids}")
        return [TType((_pairs_dim(ids, ids.shape[1]), node.attrs["num_experts"]), "routing")], {}

    @classmethod
    def run(cls, node, ins, w, ctx):
        return [align_ref(ins[0], node.attrs["num_experts"])]


def _expert_shapes(node, E, n, k, roles):
    return {r: (E, n, k) for r in roles}


@register
class MoeGateUp(OpDef):
    name = "moe_gate_up"
    scaled_weights = ("gate", "up")
    inputs = 2
    outputs = 2
    attrs = {"num_experts": Attr("dim"), "out_dim": Attr("dim")}
    weights = {"gate": True, "up": True}
    expert_weights = ("gate", "up")
    doc = "[x [T, D], routing] -> [gate, up] per pair [T*K, M]: all active experts in one grouped op"

    @classmethod
    def infer(cls, node, ins, model):
        x, r = ins
        expect(r.dtype == "routing", f"moe_gate_up's second input must be routing, got {r}")
        expect(len(x.shape) == 2 and x.dtype == "act", f"moe_gate_up expects an activation [T, D], got {x}")
        expect(r.shape[1] == node.attrs["num_experts"], "moe_gate_up and moe_align disagree on the number of experts")
        out = TType((r.shape[0], node.attrs["out_dim"]), "act")
        return [out, out], _expert_shapes(node, node.attrs["num_experts"], node.attrs["out_dim"], x.shape[1], ("gate", "up"))

    @classmethod
    def run(cls, node, ins, w, ctx):
        x, r = ins
        n = x.shape[0] * r["top_k"]
        return [grouped_linear(x, False, r, w["gate"], n), grouped_linear(x, False, r, w["up"], n)]


@register
class MoeGateUpSilu(OpDef):
    name = "moe_gate_up_silu"
    scaled_weights = ("gate", "up")
    inputs = 2
    attrs = {"num_experts": Attr("dim"), "out_dim": Attr("dim")}
    weights = {"gate": True, "up": True}
    expert_weights = ("gate", "up")
    doc = "[x [T, D], routing] -> silu(x W_gate^T) * (x W_up^T) per pair [T*K, M] (SwiGLU fused into the experts)"

    @classmethod
    def infer(cls, node, ins, model):
        outs, shapes = MoeGateUp.infer(node, ins, model)
        return [outs[0]], shapes

    @classmethod
    def run(cls, node, ins, w, ctx):
        g, u = MoeGateUp.run(node, ins, w, ctx)
        return [F.silu(g) * u]


@register
class MoeDown(OpDef):
    name = "moe_down"
    scaled_weights = ("weight",)
    inputs = 2
    attrs = {"num_experts": Attr("dim"), "out_dim": Attr("dim")}
    weights = {"weight": True}
    expert_weights = ("weight",)
    doc = "[a [T*K, M], routing] -> per pair a @ W_down[expert]^T [T*K, D]"

    @classmethod
    def infer(cls, node, ins, model):
        a, r = ins
        expect(r.dtype == "routing", f"moe_down's second input must be routing, got {r}")
        expect(len(a.shape) == 2 and a.shape[0] == r.shape[0], f"moe_down expects per-pair rows [{r.shape[0]}, M], got {a}")
        return [TType((a.shape[0], node.attrs["out_dim"]), "act")], \
            _expert_shapes(node, node.attrs["num_experts"], node.attrs["out_dim"], a.shape[1], ("weight",))

    @classmethod
    def run(cls, node, ins, w, ctx):
        a, r = ins
        return [grouped_linear(a, True, r, w["weight"], a.shape[0])]


@register
class MoeExpertFfn(OpDef):
    name = "moe_expert_ffn"
    scaled_weights = ("gate", "up", "down")
    inputs = 2
    attrs = {"num_experts": Attr("dim"), "inner_dim": Attr("dim"), "out_dim": Attr("dim")}
    weights = {"gate": True, "up": True, "down": True}
    expert_weights = ("gate", "up", "down")
    doc = ("[x [T, D], routing] -> per pair (silu(x W_gate^T) * (x W_up^T)) W_down^T [T*K, D]: the expert FFN "
           "in one op (decode)")

    @classmethod
    def infer(cls, node, ins, model):
        x, r = ins
        E, M, D = node.attrs["num_experts"], node.attrs["inner_dim"], node.attrs["out_dim"]
        expect(r.dtype == "routing", f"moe_expert_ffn's second input must be routing, got {r}")
        expect(len(x.shape) == 2 and x.dtype == "act", f"moe_expert_ffn expects an activation [T, D], got {x}")
        expect(r.shape[1] == E, "moe_expert_ffn and the routing disagree on the number of experts")
        return [TType((r.shape[0], D), "act")], {"gate": (E, M, x.shape[1]), "up": (E, M, x.shape[1]),
                                                  "down": (E, D, M)}

    @classmethod
    def run(cls, node, ins, w, ctx):
        # The unfused refs themselves: the same roundings, the same result.
        (a,) = MoeGateUpSilu.run(node, ins, w, ctx)
        return MoeDown.run(node, [a, ins[1]], {"weight": w["down"]}, ctx)


def combine_ref(eo: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """sum_k w[t, k] * eo[t*K + k]; a pair of weight 0 adds nothing, whatever its row holds (the
    row of a pair no expert computed, e.g. another rank's, is never written)."""
    T, K = weights.shape
    w = weights[..., None].float()
    terms = torch.where(w != 0, eo.view(T, K, -1).float() * w, torch.zeros((), device=eo.device))
    return terms.sum(dim=1)


@register
class MoeCombine(OpDef):
    name = "moe_combine"
    inputs = 2
    doc = "[expert out [T*K, D], weights [T, K]] -> sum_k w * out [T, D]"

    @classmethod
    def infer(cls, node, ins, model):
        eo, wt = ins
        expect(wt.dtype == "f32" and len(wt.shape) == 2, f"moe_combine expects fp32 weights [T, K], got {wt}")
        expect(eo.shape[0] == f"{wt.shape[0]}*{wt.shape[1]}", f"moe_combine: {eo} is not one row per pair of {wt}")
        return [TType((wt.shape[0], eo.shape[1]), "act")], {}

    @classmethod
    def run(cls, node, ins, w, ctx):
        return [combine_ref(ins[0], ins[1]).to(ins[0].dtype)]


@register
class MoeRoute(OpDef):
    name = "moe_route"
    outputs = 3
    attrs = {**_topk_attrs(), "num_experts": Attr("dim"), "shared_experts": Attr("int", 0, minimum=0)}
    weights = {"gate": True, "bias": False}
    fp32_weights = ("gate", "bias")
    doc = "x [T, D] -> [ids, weights, routing]: router GEMV (fp32) + scoring + top-k + alignment in one op"

    @classmethod
    def infer(cls, node, ins, model):
        (x,) = ins
        E, K, S = node.attrs["num_experts"], node.attrs["top_k"], node.attrs.get("shared_experts", 0)
        expect(len(x.shape) == 2 and x.dtype == "act", f"moe_route expects an activation [T, D], got {x}")
        check_topk_attrs(node.attrs, E)
        expect(S >= 0, f"moe_route: shared_experts={S} must be >= 0")
        shapes = {"gate": (E, x.shape[1])}
        if "bias" in node.weights:
            shapes["bias"] = (E,)
        T, P = x.shape[0], K + S
        return [TType((T, P), "i64"), TType((T, P), "f32"), TType((_pairs_dim(x, P), E + S), "routing")], shapes

    @classmethod
    def run(cls, node, ins, w, ctx):
        logits = F.linear(ins[0].float(), w["gate"].float())
        ids, weights = with_shared_pairs(*route_ref(logits, w.get("bias"), node.attrs), node.attrs["num_experts"],
                                         node.attrs.get("shared_experts", 0))
        return [ids, weights, align_ref(ids, node.attrs["num_experts"] + node.attrs.get("shared_experts", 0))]


def with_shared_pairs(ids: torch.Tensor, weights: torch.Tensor, E: int, S: int):
    """(ids, weights) [T, K] -> [T, K + S]: each token's routed pairs (expert e as S + e), then its
    S shared experts (ids 0..S-1, weight 1).  The shared experts come first in the stack: the
    grouped kernels walk experts in order, so their full tiles (every token's) start first and
    the light routed tiles fill the tail."""
    if not S:
        return ids, weights
    T = ids.shape[0]
    shared = torch.arange(S, dtype=ids.dtype, device=ids.device).expand(T, S)
    return torch.cat([ids + S, shared], 1), torch.cat([weights, weights.new_ones(T, S)], 1)


def shared_from_pairs(eo: torch.Tensor, T: int, S: int) -> tuple[torch.Tensor, torch.Tensor]:
    """eo [T*P, D] with each token's S shared pairs last -> (its routed rows [T*(P-S), D], the
    shared experts' output [T, D]: the sum of the S rows, rounded once, as the shared MLP's down
    projection rounds its output)."""
    rows = eo.view(T, -1, eo.shape[1])
    acc = torch.promote_types(eo.dtype, torch.float32)        # fp32 sums for 16-bit rows, fp64 stays fp64
    return rows[:, :-S].reshape(-1, eo.shape[1]), rows[:, -S:].sum(dim=1, dtype=acc).to(eo.dtype)


@register
class MoeCombineResidual(OpDef):
    name = "moe_combine_residual"
    inputs = (3, 4)
    attrs = {"shared_experts": Attr("int", 0, minimum=0)}
    doc = ("[expert out [T*K, D], weights [T, K], shared [T, D], residual [T, D]] -> residual + shared + "
           "sum_k w * out; with shared_experts S > 0 the inputs are [expert out [T*P, D], weights [T, P], "
           "residual] and the shared experts' output is the sum of each token's last S pairs")

    @classmethod
    def infer(cls, node, ins, model):
        S = node.attrs.get("shared_experts", 0)
        expect(len(ins) == (3 if S else 4), f"moe_combine_residual takes {3 if S else 4} inputs with "
                                            f"shared_experts={S}, got {len(ins)}")
        eo, wt, res = ins[0], ins[1], ins[-1]
        (out,), _ = MoeCombine.infer(node, [eo, wt], model)
        sh = out if S else ins[2]
        expect(0 <= S < wt.shape[1], f"moe_combine_residual: shared_experts={S} needs more than {S} pairs "
                                     f"a token, got weights {wt}")
        expect(sh == out and res == out, f"moe_combine_residual: shared {sh} and residual {res} must be {out}")
        return [out], {}

    @classmethod
    def run(cls, node, ins, w, ctx):
        eo, wt, res = ins[0], ins[1], ins[-1]
        S = node.attrs.get("shared_experts", 0)
        if S:
            eo, sh = shared_from_pairs(eo, wt.shape[0], S)
            wt = wt[:, :-S]
        else:
            sh = ins[2]
        # Same rounding points as the unfused chain: routed sum -> act, + shared -> act, + residual.
        routed = combine_ref(eo, wt).to(eo.dtype)
        return [res + (routed + sh)]


@register
class MoeCombineResidualRmsNorm(OpDef):
    name = "moe_combine_residual_rms_norm"
    inputs = (3, 4)
    outputs = 2
    attrs = {"eps": Attr("float", None, positive=True), "shared_experts": Attr("int", 0, minimum=0)}
    weights = {"weight": True}
    doc = ("[expert out [T*K, D], weights [T, K], shared [T, D], residual [T, D]] -> [rms_norm(s), s], "
           "s = residual + shared + sum_k w * out: the MoE layer's combine and the next norm (shared_experts: "
           "as moe_combine_residual)")

    @classmethod
    def infer(cls, node, ins, model):
        (out,), _ = MoeCombineResidual.infer(node, ins, model)
        return [out, out, *norm_quant_types(node, out)], {"weight": (out.shape[1],)}

    @classmethod
    def run(cls, node, ins, w, ctx):
        (s,) = MoeCombineResidual.run(node, ins, w, ctx)
        h = rms_norm_ref(s, w["weight"], node.attrs["eps"])
        return [h, s, *norm_quant_ref(node, h)]


def local_experts_ref(ids: torch.Tensor, weights: torch.Tensor, first: int, count: int):
    """(ids, weights) [T, K] over all E experts -> the same pairs over this rank's experts
    [first, first + count), renumbered from 0.  A pair routed to another rank's expert gets id
    -1 and weight 0: alignment leaves it out (align_ref), so no grouped expert op computes it,
    and the combine skips it (combine_ref); the rank's partial sum is all-reduced."""
    local = (ids >= first) & (ids < first + count)
    return (torch.where(local, ids - first, torch.full((), -1, dtype=ids.dtype, device=ids.device)),
            torch.where(local, weights, torch.zeros((), dtype=weights.dtype, device=weights.device)))


@register
class MoeLocalExperts(OpDef):
    name = "moe_local_experts"
    inputs = 2
    outputs = 2
    attrs = {"first": Attr("int", minimum=0), "count": Attr("dim")}
    doc = ("[ids [T, K], weights [T, K] fp32] -> the pairs over this rank's experts [first, first+count) "
           "(expert parallel): local ids, and id -1 with weight 0 for pairs another rank serves")

    @classmethod
    def infer(cls, node, ins, model):
        ids, wt = ins
        expect(ids.dtype == "i64" and len(ids.shape) == 2, f"moe_local_experts expects expert ids [T, K], got {ids}")
        expect(wt.dtype == "f32" and wt.shape == ids.shape, f"moe_local_experts expects fp32 weights like {ids}, got {wt}")
        expect(node.attrs["first"] >= 0, f"moe_local_experts: first expert {node.attrs['first']} is negative")
        return [ids, wt], {}

    @classmethod
    def run(cls, node, ins, w, ctx):
        return list(local_experts_ref(ins[0], ins[1], node.attrs["first"], node.attrs["count"]))
