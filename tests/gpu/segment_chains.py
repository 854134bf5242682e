"""The persistent segment chains of tests/gpu/test_kernels_persistent.py (its docstring describes them),
built here so that bench/perf_segment.py times the same launches: each chain's members as their own
launches and the segment that runs them, its inputs, outputs and sizes."""
from __future__ import annotations

import functools

import torch

from kernel_cases import TType, act, empty_out, model, rand, single_op_graph

from codegen import segments
from codegen.families import family_for_op
from codegen.families import segment as segment_family
from codegen.kernel import KernelLaunch, Options
from codegen.plan import NodeInfo, PhasePlan

# mlp: (K of o_proj's input, D hidden, I the MLP's width): V2-Lite's dense layer, odd widths, fp32's.
# combine_q: (D hidden, K pairs a token, S shared experts among them (0: a shared input), Q q's width).
# vup_o: (the o_lat view's lead: 0 contiguous, 1 a row pitch of C + 8 from element 1, every scalar path);
# the widths are V2-Lite's (model("lite")), where v_up's tensor-core CTA has 256 threads.
# A norm joins a segment of its block size: D's rows must take 256 threads (16-bit 2048, fp32 1024, odd
# 225..256)
SHAPES = {"mlp": {"lite": (2048, 2048, 10944), "odd": (41, 255, 53), "wide32": (2048, 1024, 2816)},
          "combine_q": {"lite": (2048, 8, 2, 3072), "lite_shared_input": (2048, 6, 0, 576), "odd": (255, 3, 1, 41),
                        "wide32": (1024, 4, 0, 100)},
          "vup_o": {"lite": (0,), "lite_strided": (1,)}}
WAITS = {"mlp": ((), (0,), (1,), (2,)), "combine_q": ((), (0,)), "vup_o": ((), (0,), (1,))}


def _mla_dims():
    d = model("lite").dims
    return d["heads"], d["kv_lora_rank"], d["qk_nope_head_dim"], d["v_head_dim"], d["hidden"]


def _member(m, op, attrs, inputs, weights, outputs, dtype) -> KernelLaunch:
    G, nid = single_op_graph(m, op, attrs, inputs, weights, outputs=outputs, phase="decode")
    return next(s for s in family_for_op(op).lower(nid, G, Options(dtype=dtype)) if isinstance(s, KernelLaunch))


def _members(name: str, dtype: str, shape: str) -> list:
    """mlp: x -> o_proj -> y; (y, res) -> h, s; h -> gate_up_silu -> g; g -> down -> z.
    combine_q: (eo, w, [shared], res) -> h, s; h -> q."""
    m = model("lite")
    if name == "mlp":
        K, D, I = SHAPES[name][shape]
        return [
            _member(m, "linear", {"out_dim": D}, {"x": act(K)}, {"weight": "wo"}, ["y"], dtype),
            _member(m, "fused_add_rms_norm", {}, {"y": act(D), "res": act(D)}, {"weight": "wn"}, ["h", "s"], dtype),
            _member(m, "gate_up_silu", {"out_dim": I}, {"h": act(D)}, {"gate": "wg", "up": "wu"}, ["g"], dtype),
            _member(m, "linear", {"out_dim": D}, {"g": act(I)}, {"weight": "wd"}, ["z"], dtype),
        ]
    if name == "vup_o":
        H, C, N, V, D = _mla_dims()
        return [
            _member(m, "mla_v_up", {}, {"o_lat": act(H, C)}, {"kv_b": "kvb"}, ["o"], dtype),
            _member(m, "linear", {"out_dim": D}, {"o": act(H * V)}, {"weight": "wo"}, ["y"], dtype),
            _member(m, "fused_add_rms_norm", {}, {"y": act(D), "res": act(D)}, {"weight": "wn"}, ["h", "s"], dtype),
        ]
    D, K, S, Q = SHAPES[name][shape]
    ins = {"eo": TType((f"T*{K}", D), "act"), "w": TType(("T", K), "f32"), **({} if S else {"shared": act(D)}),
           "res": act(D)}
    return [
        _member(m, "moe_combine_residual_rms_norm", {"shared_experts": S} if S else {}, ins, {"weight": "wn"},
                ["h", "s"], dtype),
        _member(m, "linear", {"out_dim": Q}, {"h": act(D)}, {"weight": "wq"}, ["q"], dtype),
    ]


def segment_of(members: list, ctas: int = 1):
    """(codegen/segments.py's Segment for `members`, one run of launches, and its launch)."""
    plan = PhasePlan("decode", steps=members, nodes={s.nodes[0]: NodeInfo(None, ()) for s in members})
    (seg,) = segments.find(plan)
    assert seg.steps == tuple(range(len(members)))
    return seg, segment_family.launch(members, [segments.body(s) for s in members], seg.waits, lead=seg.lead,
                                      gate=None, pdl=True, ctas=ctas)


@functools.lru_cache(maxsize=None)
def chain(name: str, dtype: str, shape: str, ctas: int = 1, first: int | None = None):
    """(the members' launches in plan order, the segment's launch at `ctas` CTAs an SM); `first`: only
    the chain's first members (mlp's first two: o_proj and the residual add + RMSNorm)."""
    members = _members(name, dtype, shape)[:first]
    seg, launch = segment_of(members, ctas)
    assert first is not None or seg.waits == WAITS[name]
    return members, launch


def inputs(name, dtype, shape, T, gen):
    if name == "mlp":
        K, D, I = SHAPES[name][shape]
        values = {"x": rand((T, K), dtype, gen=gen, scale=3.0), "res": rand((T, D), dtype, gen=gen)}
        weights = {"wo": rand((D, K), dtype, gen=gen, scale=K ** -0.5), "wn": rand((D,), dtype, gen=gen) + 1,
                   "wg": rand((I, D), dtype, gen=gen, scale=D ** -0.5),
                   "wu": rand((I, D), dtype, gen=gen, scale=D ** -0.5),
                   "wd": rand((D, I), dtype, gen=gen, scale=I ** -0.5)}
        return values, weights
    if name == "vup_o":
        H, C, N, V, D = _mla_dims()
        (lead,) = SHAPES[name][shape]
        o_lat = rand((T, H, C + 8 * lead), dtype, gen=gen)[:, :, lead:lead + C]
        values = {"o_lat": o_lat, "res": rand((T, D), dtype, gen=gen)}
        weights = {"kvb": rand((H * (N + V), C), dtype, gen=gen, scale=0.1),
                   "wo": rand((D, H * V), dtype, gen=gen, scale=(H * V) ** -0.5), "wn": rand((D,), dtype, gen=gen) + 1}
        return values, weights
    D, K, S, Q = SHAPES[name][shape]
    w = torch.rand(T, K, generator=gen) * (2.0 / K)   # routing weights summing to about 1, the shared pairs 1
    if S:
        w[:, K - S:] = 1.0
    w[0, 0] = 0.0                                      # a pair of weight 0 is skipped (its row may be unwritten)
    values = {"eo": rand((T * K, D), dtype, gen=gen), "w": w.cuda(), "res": rand((T, D), dtype, gen=gen)}
    if not S:
        values["shared"] = rand((T, D), dtype, gen=gen)
    weights = {"wn": rand((D,), dtype, gen=gen) + 1, "wq": rand((Q, D), dtype, gen=gen, scale=D ** -0.5)}
    return values, weights


def outputs(name, dtype, shape, T):
    if name == "mlp":
        K, D, I = SHAPES[name][shape]
        return {"y": empty_out((T, D), dtype), "h": empty_out((T, D), dtype), "s": empty_out((T, D), dtype),
                "g": empty_out((T, I), dtype), "z": empty_out((T, D), dtype)}
    if name == "vup_o":
        H, C, N, V, D = _mla_dims()
        return {"o": empty_out((T, H * V), dtype), "y": empty_out((T, D), dtype), "h": empty_out((T, D), dtype),
                "s": empty_out((T, D), dtype)}
    D, K, S, Q = SHAPES[name][shape]
    return {"h": empty_out((T, D), dtype), "s": empty_out((T, D), dtype), "q": empty_out((T, Q), dtype)}


def sizes(name, shape, T) -> dict:
    return {"T": T, "SMS": 132, **({"NP": T * SHAPES[name][shape][1]} if name == "combine_q" else {})}
