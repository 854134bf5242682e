"""The MoE kernel families against the ops' reference semantics (ir/ops/moe.py).

Hypothesis draws shapes (T from 1 to thousands, odd dims: D 41/45, M 15/37, E 1/7/1024, K 1..8,
every routing method, biases partly negative) and dtypes; each example lowers a one-node graph
with its family, runs the kernel(s) on poisoned outputs and compares with the op's `run` in fp32
on the CPU.  `misalign` moves some operands one element past an aligned allocation (contiguous,
but the base is not 16-byte aligned): the kernels' run-time fallbacks to element accesses (and the
tensor-core GEMM handing its experts to the GEMV) must give the same results.  Fixed regression
cases sit beside each test as @example.

Routing: the router logits (launch 1's workspace) within fp32 tolerance of x.float() @ gate.T;
the kernel's ids equal to route_ref's (on the kernel's own logits, and on the op reference's),
where a differing pick is accepted only between selection values tied to fp32 rounding and
the kernel's still come in descending order; weights on the rows whose ids match; the routing
plan a permutation of the pairs grouped by expert with the reference's offsets (order inside
an expert's segment is free).

Prints "EXAMPLES <family> <n> worst_err <x>" per family, x = the largest
|kernel - ref| / (atol + rtol |ref|) seen (1.0 is the tolerance edge), with the per-dtype
largest absolute error.
"""
from __future__ import annotations

import dataclasses

import os
import sys
from collections import defaultdict

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import (GPU_MARKS, TORCH_DTYPES, assert_strict, kernel_test, poison,  # noqa: E402
                     shifted, single_op_graph, tiny_model, tolerance)

from codegen import families  # noqa: E402
from codegen.families import _moe  # noqa: E402
from codegen.kernel import Options  # noqa: E402
from codegen.tuning import MoeTuning, Tuning  # noqa: E402
from ir.graph import node_view  # noqa: E402
from ir.ops import OPS, TType  # noqa: E402
from ir.ops.core import rms_norm_ref  # noqa: E402
from ir.ops.moe import align_ref, route_ref  # noqa: E402

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import example, given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

pytestmark = GPU_MARKS
DEV = "cuda"
DTYPES = ("bf16", "fp16", "fp32")
TOKENS = (1, 2, 5, 33, 128, 300)

# family -> dtype -> [examples, worst normalised error, worst absolute error]
STATS: dict = defaultdict(lambda: defaultdict(lambda: [0, 0.0, 0.0]))
REL: dict = defaultdict(lambda: defaultdict(float))    # family -> dtype -> worst norm-wise relative error


def _settings(n):
    return kernel_test(n)


@pytest.fixture(scope="module")
def runner(pytestconfig):
    from runtime.launcher import KernelRunner
    r = KernelRunner()
    yield r
    r.close()
    capman = pytestconfig.pluginmanager.getplugin("capturemanager")
    lines = []
    for fam in sorted(STATS):
        per = STATS[fam]
        n = sum(v[0] for v in per.values())
        worst = max(v[1] for v in per.values())
        detail = " ".join(f"{dt}:n={v[0]},max_abs={v[2]:.3g},norm={v[1]:.3g},rel={REL[fam][dt]:.3g}"
                          for dt, v in sorted(per.items()))
        lines.append(f"EXAMPLES {fam} {n} worst_err {worst:.3g}  ({detail})")
    if capman is not None:
        with capman.global_and_fixture_disabled():
            print("\n" + "\n".join(lines))
    else:
        print("\n" + "\n".join(lines))


def _record(fam: str, dtype: str, actual: torch.Tensor, expected: torch.Tensor, tol_dtype=None) -> None:
    """Compare within the harness tolerance of `tol_dtype` (default: `dtype`) and log the error."""
    rtol, atol = tolerance(tol_dtype or dtype)
    a, b = actual.detach().float().cpu(), expected.detach().float().cpu()
    assert a.shape == b.shape, (fam, a.shape, b.shape)
    assert not torch.isnan(a).any(), f"{fam} {dtype}: unwritten (poisoned) or NaN elements"
    diff = (a - b).abs()
    norm = (diff / (atol + rtol * b.abs())).max().item() if diff.numel() else 0.0
    st_ = STATS[fam][dtype]
    st_[0] += 1
    st_[1] = max(st_[1], norm)
    st_[2] = max(st_[2], diff.max().item() if diff.numel() else 0.0)
    torch.testing.assert_close(a, b, rtol=rtol, atol=atol, msg=lambda m: f"{fam} {dtype}: {m}")
    rel = assert_strict(a, b, tol_dtype or dtype, f"{fam} {dtype}")
    REL[fam][dtype] = max(REL[fam][dtype], rel)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# Which operands sit one element past an aligned base (see the module docstring).
MISALIGN = ("none", "none", "none", "inputs", "weights", "outputs", "all")


def _moved(misalign: str, role: str) -> bool:
    return misalign == "all" or misalign == role


# Decode's wgmma off: these tests hold the GEMV and the mma launch to their references (they serve
# fp32, odd KD and targets other than 9.0); test_kernels_moe_wgmma_skinny.py holds the default
# decode path.
TUNING = Tuning(moe=MoeTuning(decode_wgmma=False))


def _lower(G, nid, dtype, tuning=TUNING):
    fam = families.family_for_op(G.nodes[nid]["op"])
    assert fam is not None, G.nodes[nid]["op"]
    return fam.lower(nid, G, Options(dtype=dtype, tuning=tuning))


def _random_ids(T, E, K, g) -> torch.Tensor:
    """K distinct experts per token, skewed so some experts get many pairs and some none."""
    logits = torch.randn(T, E, generator=g) + torch.linspace(0, 2, E)[torch.randperm(E, generator=g)]
    return logits.topk(K, dim=1).indices


def _check_routing(order: torch.Tensor, offsets: torch.Tensor, ids: torch.Tensor, E: int) -> None:
    """order is a permutation of the pairs, grouped by ascending expert; offsets as the reference."""
    flat = ids.reshape(-1).cpu()
    ref = align_ref(flat.view(ids.shape), E)
    order, offsets = order.cpu().long(), offsets.cpu().long()
    assert torch.equal(offsets, ref["offsets"]), f"offsets {offsets.tolist()} != {ref['offsets'].tolist()}"
    assert torch.equal(torch.sort(order).values, torch.arange(flat.numel())), "order is not a permutation of the pairs"
    assert torch.equal(flat[order], torch.sort(flat).values), "order does not group the pairs by expert"


def _selection(logits: torch.Tensor, bias, a: dict) -> torch.Tensor:
    """The values route_ref ranks for its top-k (scores; masked scores; masked biased scores)."""
    T, E = logits.shape
    G = a["groups"]
    scores = logits.float().softmax(-1) if a["scoring"] == "softmax" else logits.float().sigmoid()
    if a["method"] == "greedy":
        return scores
    if a["method"] == "group_limited_greedy":
        choice, gs, fill = scores, scores.view(T, G, E // G).max(-1).values, 0.0
    else:
        choice = scores + (bias.float() if bias is not None else 0.0)
        gs, fill = choice.view(T, G, E // G).topk(2, dim=-1)[0].sum(-1), float("-inf")
    keep = torch.zeros_like(gs).scatter_(1, gs.topk(a["topk_groups"], dim=-1)[1], 1).bool()
    return choice.masked_fill(~keep.repeat_interleave(E // G, dim=1), fill)


def _check_ids(ids_k: torch.Tensor, ids_r: torch.Tensor, sel: torch.Tensor, what: str) -> torch.Tensor:
    """ids equal to the reference's, except where near-tied selection values (fp32 rounding
    apart) make either pick right; the kernel's values must still come in descending order.
    Returns the rows that match exactly."""
    ids_k = ids_k.cpu()
    assert ids_k.min() >= 0 and ids_k.max() < sel.shape[1], f"expert ids out of range: {ids_k}"
    srt = ids_k.sort(dim=1).values
    assert (srt[:, 1:] != srt[:, :-1]).all(), f"an expert chosen twice for one token: {ids_k}"
    vk, vr = sel.gather(1, ids_k), sel.gather(1, ids_r)
    ok = torch.isclose(vk, vr, rtol=1e-5, atol=1e-6) | (vk == vr)
    bad = (~ok.all(dim=1)).nonzero().flatten()
    assert bad.numel() == 0, (f"ids differ from {what} beyond near-ties, token {bad[0].item()}: "
                              f"{ids_k[bad[0]].tolist()} vs {ids_r[bad[0]].tolist()} "
                              f"(values {vk[bad[0]].tolist()} vs {vr[bad[0]].tolist()})")
    return (ids_k == ids_r).all(dim=1)


# -- routing -----------------------------------------------------------------------------

ROUTE_CASES = [
    # (scoring, method, E, groups, topk_groups, K choices)
    ("softmax", "greedy", 1, 1, 1, (1,)),
    ("softmax", "greedy", 7, 1, 1, (1, 3, 7)),
    ("softmax", "greedy", 8, 1, 1, (1, 3)),
    ("softmax", "greedy", 64, 1, 1, (6,)),
    ("sigmoid", "greedy", 12, 1, 1, (3,)),
    ("softmax", "group_limited_greedy", 12, 4, 2, (3, 6)),
    ("softmax", "group_limited_greedy", 160, 8, 3, (6,)),
    ("sigmoid", "noaux_tc", 12, 4, 2, (3,)),
    ("sigmoid", "noaux_tc", 64, 8, 4, (6, 8)),
    ("sigmoid", "noaux_tc", 256, 8, 4, (8,)),
    ("softmax", "greedy", 1024, 1, 1, (8,)),                 # MAX_EXPERTS: 32 scores per lane
    ("sigmoid", "noaux_tc", 1024, 32, 4, (8,)),
]


@st.composite
def route_cases(draw):
    scoring, method, E, G, TG, ks = draw(st.sampled_from(ROUTE_CASES))
    return {
        "dtype": draw(st.sampled_from(DTYPES)), "T": draw(st.sampled_from(TOKENS)),
        "D": draw(st.sampled_from((40, 41, 45, 64, 256))), "E": E, "K": draw(st.sampled_from(ks)),
        "attrs": {"scoring": scoring, "method": method, "groups": G, "topk_groups": TG,
                  "norm_topk_prob": draw(st.booleans()), "routed_scaling_factor": draw(st.sampled_from((1.0, 2.5)))},
        "bias": method == "noaux_tc" and draw(st.sampled_from((True, True, False))),
        "misalign": draw(st.sampled_from(MISALIGN)), "seed": draw(st.integers(0, 2**31 - 1)),
        # shared experts (fuse_shared_experts); the route serves E + S <= _moe.MAX_EXPERTS
        "S": draw(st.sampled_from((0, 0, 1, 2))) if E + 2 <= _moe.MAX_EXPERTS else 0,
    }


def _route_case(dtype, T, D, E, K, scoring="softmax", method="greedy", G=1, TG=1, bias=False, misalign="none",
                S=0):
    """A fixed routing case (for @example); S shared experts after the K routed ones."""
    return {"dtype": dtype, "T": T, "D": D, "E": E, "K": K,
            "attrs": {"scoring": scoring, "method": method, "groups": G, "topk_groups": TG,
                      "norm_topk_prob": True, "routed_scaling_factor": 2.5},
            "bias": bias, "misalign": misalign, "seed": 13, "S": S}


@dataclasses.dataclass
class RouteProblem:
    """One moe_route node, its inputs, and its poisoned outputs on the device."""
    case: dict
    attrs: dict
    G: object
    nid: str
    x: torch.Tensor              # [T, D] act, on the CPU
    gate: torch.Tensor           # [E, D] fp32
    bias: object                 # [E] fp32 or None
    values: dict                 # kernel values: x on the device and the poisoned outputs
    weights: dict

    @property
    def names(self):
        return self.G.nodes[self.nid]["outputs"]

    @property
    def pairs(self) -> int:
        """Pairs a token: K routed, then the S shared experts'."""
        return self.case["K"] + self.case.get("S", 0)

    @property
    def sizes(self):
        """T and NP; SMS too where the case sets it (else the runner reads the device's)."""
        sizes = {"T": self.case["T"], "NP": self.case["T"] * self.pairs}
        if self.case.get("sms"):
            sizes["SMS"] = self.case["sms"]
        return sizes

    def poison(self, workspaces=None) -> None:
        ids_name, w_name, r_name = self.names
        for name in (ids_name, w_name, f"{r_name}.order", f"{r_name}.offsets"):
            poison(self.values[name])
        for t in (workspaces or {}).values():
            poison(t)

    def new_x(self, seed: int) -> None:
        """Fresh activations in the same device buffer (as a replayed graph sees them)."""
        self.x = torch.randn(self.x.shape, generator=_gen(seed)).to(self.x.dtype)
        self.values["x"].copy_(self.x.to(DEV))


def _route_problem(case) -> RouteProblem:
    """`case["ties"]`: every odd expert a copy of the even one before it (gate row and bias), so
    their selection values tie exactly."""
    dtype, T, D, E, K, S = case["dtype"], case["T"], case["D"], case["E"], case["K"], case.get("S", 0)
    attrs = {**case["attrs"], "top_k": K, "num_experts": E, "shared_experts": S}
    wt = {"gate": "router.weight"}
    if case["bias"]:
        wt["bias"] = "router.bias"
    G, nid = single_op_graph(tiny_model(), "moe_route", attrs, {"x": TType(("T", D), "act")}, wt)
    ids_name, w_name, r_name = G.nodes[nid]["outputs"]
    g = _gen(case["seed"])
    x = torch.randn(T, D, generator=g).to(TORCH_DTYPES[dtype])
    gate = torch.randn(E, D, generator=g) / D ** 0.5 * 2.0      # logits ~ N(0, 4): picks well apart
    bias = torch.randn(E, generator=g) * 0.5 if case["bias"] else None   # partly negative
    if case.get("ties"):
        gate[1::2] = gate[0:E - 1:2]
        if bias is not None:
            bias[1::2] = bias[0:E - 1:2]
    mis = case.get("misalign", "none")
    weights = {"router.weight": shifted(gate.to(DEV), _moved(mis, "weights"))}
    if bias is not None:
        weights["router.bias"] = bias.to(DEV)
    values = {
        "x": shifted(x.to(DEV), _moved(mis, "inputs")),
        ids_name: poison(torch.empty(T, K + S, dtype=torch.int64, device=DEV)),
        w_name: poison(torch.empty(T, K + S, dtype=torch.float32, device=DEV)),
        f"{r_name}.order": poison(torch.empty(T * (K + S), dtype=torch.int32, device=DEV)),
        f"{r_name}.offsets": poison(torch.empty(E + S + 1, dtype=torch.int32, device=DEV)),
    }
    return RouteProblem(case, attrs, G, nid, x, gate, bias, values, weights)


def _group_near_tie(logits: torch.Tensor, bias, a: dict) -> torch.Tensor:
    """Tokens whose group selection is near-tied at its edge (the TG-th best group score within
    _check_ids' tolerance of the next): logits a few ulps apart (the kernel's, summed in another
    order) may keep either group, and so a different set of experts, each set right for its logits.
    Only the methods that select groups; greedy never."""
    T, E = logits.shape
    G, TG = a["groups"], a["topk_groups"]
    if a["method"] == "greedy" or TG >= G:
        return torch.zeros(T, dtype=torch.bool)
    scores = logits.float().softmax(-1) if a["scoring"] == "softmax" else logits.float().sigmoid()
    if a["method"] == "group_limited_greedy":
        gs = scores.view(T, G, E // G).max(-1).values
    else:
        choice = scores + (bias.float() if bias is not None else 0.0)
        gs = choice.view(T, G, E // G).topk(2, dim=-1)[0].sum(-1)
    top = gs.topk(TG + 1, dim=-1).values
    return torch.isclose(top[:, TG - 1], top[:, TG], rtol=1e-5, atol=1e-6)


def _check_route(p: RouteProblem, logits: torch.Tensor) -> None:
    """The logits within fp32 tolerance of x.float() @ gate.T; ids equal to route_ref's on the
    kernel's own logits and on the op reference's (up to near-ties of experts, and of groups on the
    op reference's: _group_near_tie), weights on the rows whose ids match; the routing plan a permutation of the pairs grouped by expert.  With exact ties
    (case["ties"]) the kernel takes the lower index first, and the weights are compared on every
    row whose ids match up to the tied copies.  With S shared experts every token's last S pairs
    are experts 0..S-1 of weight 1 exactly, the routed experts numbered from S, and the plan groups
    them with the routed pairs."""
    dtype, E, K, S = p.case["dtype"], p.case["E"], p.case["K"], p.case.get("S", 0)
    ids_name, w_name, r_name = p.names
    logits = logits.cpu()
    _record("moe_route.logits", dtype, logits, p.x.float() @ p.gate.T, tol_dtype="fp32")
    ids_all, w_all = p.values[ids_name].cpu(), p.values[w_name].cpu()
    assert not torch.isnan(w_all).any(), "routing weights unwritten (poisoned)"
    T = ids_all.shape[0]
    assert (ids_all[:, K:] == torch.arange(S).expand(T, S)).all(), "shared experts' ids"
    assert (w_all[:, K:] == 1.0).all(), "shared experts' weights"
    ids_k, w_k = ids_all[:, :K] - S, w_all[:, :K]
    # against route_ref on the kernel's own logits, then against the op reference itself
    ids_same, w_same = route_ref(logits, p.bias, p.attrs)
    sel = _selection(logits, p.bias, p.attrs)
    same = _check_ids(ids_k, ids_same, sel, "route_ref(kernel logits)")
    if p.case.get("ties"):
        vk = sel.gather(1, ids_k)
        tied = vk[:, 1:] == vk[:, :-1]
        assert (ids_k[:, 1:] > ids_k[:, :-1])[tied].all(), "exactly tied experts not taken lowest index first"
        same = ((ids_k // 2) == (ids_same // 2)).all(dim=1)        # an odd expert is its even one's copy
    if same.any():
        _record("moe_route", dtype, w_k[same], w_same[same], tol_dtype="fp32")
    ids_ref, w_ref, _ = OPS["moe_route"].run(node_view(p.G, p.nid), [p.x.float()],
                                             {"gate": p.gate, **({"bias": p.bias} if p.bias is not None else {})}, None)
    assert (ids_ref[:, K:] == ids_all[:, K:]).all() and (w_ref[:, K:] == 1.0).all(), "the op reference's shared pairs"
    # A token whose groups near-tie (on the op reference's logits) may keep the other group: its
    # ids were held above to route_ref on the kernel's own logits, exactly; here the rest.
    ref_logits = p.x.float() @ p.gate.T
    firm = ~_group_near_tie(ref_logits, p.bias, p.attrs)
    _check_ids(ids_k[firm], ids_ref[firm, :K] - S, _selection(ref_logits, p.bias, p.attrs)[firm], "the op reference")
    _check_routing(p.values[f"{r_name}.order"], p.values[f"{r_name}.offsets"], ids_all, E + S)

def _check_graph_replays(runner, launches, p, ws, seed: int) -> None:
    """The route captured in a CUDA graph and replayed twice on new activations, poisoned outputs
    and workspaces each time: whatever a launch keeps between runs (tickets) must reset itself."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        with torch.cuda.graph(graph, stream=stream):
            runner.run_all(launches, values=p.values, weights=p.weights, sizes=p.sizes, workspaces=ws)
    torch.cuda.current_stream().wait_stream(stream)
    for rep in range(2):
        p.new_x(seed + rep)
        p.poison(ws)
        graph.replay()
        torch.cuda.synchronize()
        _check_route(p, ws["router_logits"])



def _route_stages_running(launches, sizes_: dict) -> list[str]:
    from codegen import sizes
    from runtime.launcher import KernelRunner
    full = KernelRunner.step_sizes(sizes_, {})          # SMS: the router GEMM's split of D reads it
    return [la.stage for la in launches if 0 not in [sizes.evaluate(g, full) for g in la.grid]]


def _align_stages(NP: int) -> list[str]:
    """The alignment's running stages at NP pairs: one CTA up to moe.align_parallel_above, count /
    scan / scatter above."""
    ap = TUNING.moe.align_parallel_above
    return ["align"] if ap is None or NP <= ap else ["align_count", "align_scan", "align_scatter"]


def _three_launches(T: int, K: int) -> list[str]:
    """The stages of the three-launch route at T (above the fused bound): its logits from the GEMV
    while T <= route.gemm_above, from the GEMM above; then top-k and the alignment."""
    gt = TUNING.route.gemm_above
    return ["router_gemv" if gt is None or T <= gt else "router_gemm", "topk", *_align_stages(T * K)]


@given(case=route_cases())
@example(case=_route_case("bf16", 33, 41, 7, 3))
@example(case=_route_case("fp16", 1, 45, 1, 1, misalign="all"))
@example(case=_route_case("fp32", 300, 41, 1024, 8, "sigmoid", "noaux_tc", 32, 4, bias=True))
@example(case=_route_case("bf16", 2, 64, 64, 6, misalign="inputs"))
@example(case=_route_case("bf16", 300, 64, 64, 6, S=2))
@example(case=_route_case("fp32", 7000, 41, 12, 3, "sigmoid", "noaux_tc", 4, 2, bias=True, S=1))
@_settings(30)
def test_moe_route(runner, case):
    p = _route_problem(case)
    ws = runner.run_all(_lower(p.G, p.nid, case["dtype"]), values=p.values, weights=p.weights, sizes=p.sizes)
    _check_route(p, ws["router_logits"])


# The fused route (one launch while T <= route.fused_upto) at the shipped specs' routing:
# (name, scoring, method, E, groups, topk_groups, K, D, norm_topk_prob, routed_scaling_factor, bias)
FUSED_SHAPES = {
    "v2_lite": ("softmax", "greedy", 64, 1, 1, 6, 2048, False, 1.0, False),
    "v2": ("softmax", "group_limited_greedy", 160, 8, 3, 6, 5120, False, 16.0, False),
    "v3": ("sigmoid", "noaux_tc", 256, 8, 4, 8, 7168, True, 2.5, True),
    "odd": ("sigmoid", "noaux_tc", 12, 4, 2, 3, 41, True, 2.5, True),
    "e1024": ("softmax", "greedy", 1024, 1, 1, 8, 64, True, 1.0, False),   # 64 KB of top-k scratch
}


def _fused_tokens() -> tuple:
    """T at a token tile's edges (7, 8, 9) and the fused bound's (255, 256, 257 at its default)."""
    from codegen.families import moe_route
    ft = TUNING.route.fused_upto or 256
    return tuple(sorted({1, 2, 7, 8, 9, ft - 1, ft, ft + 1}))


# ... and for the router GEMM an odd E with an odd D (element staging, a partial last slice of D).
ROUTE_SHAPES = {**FUSED_SHAPES, "odd_e": ("softmax", "greedy", 7, 1, 1, 3, 1001, True, 1.0, False)}


# the shipped specs' shared experts (the route gives every token those pairs too)
SHAPE_SHARED = {"v2_lite": 2, "v2": 2, "v3": 1, "odd": 3}


def _shape_case(shape, dtype, T, *, ties=False, seed=17, misalign="none", shared=True):
    scoring, method, E, G, TG, K, D, norm, rsf, bias = ROUTE_SHAPES[shape]
    return {"dtype": dtype, "T": T, "D": D, "E": E, "K": K, "bias": bias, "ties": ties and (E // G) % 2 == 0,
            "attrs": {"scoring": scoring, "method": method, "groups": G, "topk_groups": TG,
                      "norm_topk_prob": norm, "routed_scaling_factor": rsf},
            "misalign": misalign, "seed": seed, "S": SHAPE_SHARED.get(shape, 0) if shared else 0}


@st.composite
def fused_cases(draw, tokens=None):
    return _shape_case(draw(st.sampled_from(sorted(FUSED_SHAPES))), draw(st.sampled_from(("bf16", "fp32"))),
                       draw(st.sampled_from(tokens or _fused_tokens())), ties=draw(st.booleans()),
                       seed=draw(st.integers(0, 2**31 - 1)), misalign=draw(st.sampled_from(MISALIGN)),
                       shared=draw(st.booleans()))


@given(case=fused_cases())
@example(case=_shape_case("v3", "bf16", 1))
@example(case=_shape_case("v3", "bf16", 256, ties=True))
@example(case=_shape_case("v2", "bf16", 9))
@example(case=_shape_case("v2_lite", "bf16", 257))
@example(case=_shape_case("v2_lite", "fp32", 8, ties=True, misalign="all"))
@_settings(20)
def test_moe_route_fused(runner, case):
    """At the bound's edges: the fused launch alone runs while T <= ROUTE_FUSED_TOKENS, the three
    launches alone above it, and both route like the reference (all three methods, biases partly
    negative, exact ties)."""
    from codegen.families import moe_route
    p = _route_problem(case)
    launches = _lower(p.G, p.nid, case["dtype"])
    ft = TUNING.route.fused_upto or None
    fused = ft is not None and case["T"] <= ft
    assert _route_stages_running(launches, p.sizes) == (["fused"] if fused else _three_launches(case["T"], p.pairs))
    ws = runner.run_all(launches, values=p.values, weights=p.weights, sizes=p.sizes)
    _check_route(p, ws["router_logits"])


@given(case=fused_cases(tokens=(1, 2, 9, 64, 256)))
@example(case=_shape_case("v3", "bf16", 1))
@example(case=_shape_case("v2_lite", "bf16", 9))
@_settings(6)
def test_moe_route_fused_runs_again_and_replays_in_a_graph(runner, case):
    """The fused launch's tickets reset themselves: it routes right when run twice in a row, after
    a launch of the same kernel at another T (another grid), and when captured in a CUDA graph and
    replayed twice, with new activations and poisoned outputs (and logits) before every run."""
    case = {**case, "misalign": "none"}
    p = _route_problem(case)
    launches = _lower(p.G, p.nid, case["dtype"])
    ws = None
    for rep in range(2):
        p.new_x(case["seed"] + rep)
        p.poison(ws)
        ws = runner.run_all(launches, values=p.values, weights=p.weights, sizes=p.sizes, workspaces=ws)
        _check_route(p, ws["router_logits"])
    other = _route_problem({**case, "T": 9 if case["T"] != 9 else 1, "seed": case["seed"] + 7})
    ws2 = runner.run_all(_lower(other.G, other.nid, case["dtype"]), values=other.values, weights=other.weights,
                         sizes=other.sizes)
    _check_route(other, ws2["router_logits"])
    _check_graph_replays(runner, launches, p, ws, case["seed"] + 100)


# The router GEMM: the three-launch route's logits above route.gemm_above (prefill sizes).
def _gemm_tokens() -> tuple:
    """T at the GEMM's lower edge (257 at the default bounds), between (1000), at a whole number of
    its token tiles (4096) and one past it (4097)."""
    from codegen.families import moe_route
    lo = max(TUNING.route.gemm_above or 0, TUNING.route.fused_upto)
    return (lo + 1, 1000, 4096, 4097)


def _gemm_case(shape, dtype, T, *, sms=None, ties=False, seed=19, misalign="none"):
    """`sms`: the SM count the split of D is sized for (None: the device's; 1: never split; 4096:
    the most splits the tickets and GEMM_SPLIT_MAX allow)."""
    return {**_shape_case(shape, dtype, T, ties=ties, seed=seed, misalign=misalign), "sms": sms}


@st.composite
def gemm_cases(draw, shapes=None, tokens=None, sms=(None, 1, 4096)):
    return _gemm_case(draw(st.sampled_from(shapes or sorted(ROUTE_SHAPES))), draw(st.sampled_from(DTYPES)),
                      draw(st.sampled_from(tokens or _gemm_tokens())), sms=draw(st.sampled_from(sms)),
                      ties=draw(st.booleans()), seed=draw(st.integers(0, 2**31 - 1)),
                      misalign=draw(st.sampled_from(MISALIGN)))


def _gemm_splits(runner, launches, sizes_: dict) -> int:
    from codegen import sizes
    (gemm,) = [la for la in launches if la.stage == "router_gemm"]
    return sizes.evaluate(gemm.grid[2], runner.step_sizes(sizes_, {}))


def _poisoned_workspaces(runner, launches, p: RouteProblem) -> dict:
    """Every workspace of the launches (the logits, the GEMM's partial sums), NaN-filled, so a
    partial or logit nobody wrote fails the check."""
    sizes = runner.step_sizes(p.sizes, {})
    ws = {}
    for la in launches:
        for name, t in runner.workspaces(la, values=p.values, weights=p.weights, ctx={}, sizes=sizes).items():
            ws.setdefault(name, poison(t))
    return ws


@given(case=gemm_cases())
@example(case=_gemm_case("v2_lite", "bf16", 257, sms=4096))          # the bound's edge, D in 8 splits
@example(case=_gemm_case("v2_lite", "bf16", 4096))                   # the device's split (2 on 132 SMs)
@example(case=_gemm_case("v3", "bf16", 4097, ties=True))
@example(case=_gemm_case("v2", "fp16", 1000, sms=1))
@example(case=_gemm_case("odd_e", "fp32", 1000, sms=4096, misalign="all"))
@example(case=_gemm_case("e1024", "bf16", 257, misalign="inputs"))
@_settings(16)
def test_moe_route_gemm(runner, case):
    """Above the GEMV's bound the router logits come from the tiled GEMM (split over D while its
    tiles are few): the logits within fp32 tolerance of x.float() @ gate.T, and the top-k ids and
    weights and the routing plan end to end against the reference op, with exact ties taken lowest
    index first; outputs and workspaces (logits, partial sums) poisoned first."""
    p = _route_problem(case)
    launches = _lower(p.G, p.nid, case["dtype"])
    assert _route_stages_running(launches, p.sizes) == ["router_gemm", "topk", *_align_stages(case["T"] * p.pairs)]
    S = _gemm_splits(runner, launches, p.sizes)
    assert S == 1 or case["sms"] != 1, S
    ws = runner.run_all(launches, values=p.values, weights=p.weights, sizes=p.sizes,
                        workspaces=_poisoned_workspaces(runner, launches, p))
    _check_route(p, ws["router_logits"])
    STATS["moe_route.gemm_splits"][f"S={S}"][0] += 1


@given(case=gemm_cases(shapes=("v2_lite", "odd_e", "v3"), tokens=(257, 1000, 2048), sms=(4096,)))
@example(case=_gemm_case("v2_lite", "bf16", 1000, sms=4096))
@_settings(4)
def test_moe_route_gemm_runs_again_and_replays_in_a_graph(runner, case):
    """The split GEMM's tickets reset themselves: it routes right when run twice in a row, after a
    launch of the same kernel at another T (another grid of tiles), and when captured in a CUDA graph
    and replayed twice, with new activations and poisoned outputs and workspaces before every run."""
    case = {**case, "misalign": "none"}
    p = _route_problem(case)
    launches = _lower(p.G, p.nid, case["dtype"])
    assert _gemm_splits(runner, launches, p.sizes) > 1
    ws = _poisoned_workspaces(runner, launches, p)
    for rep in range(2):
        p.new_x(case["seed"] + rep)
        p.poison(ws)
        runner.run_all(launches, values=p.values, weights=p.weights, sizes=p.sizes, workspaces=ws)
        _check_route(p, ws["router_logits"])
    other = _route_problem({**case, "T": 300 if case["T"] != 300 else 1000, "seed": case["seed"] + 7})
    other_launches = _lower(other.G, other.nid, case["dtype"])
    ws2 = runner.run_all(other_launches, values=other.values, weights=other.weights, sizes=other.sizes,
                         workspaces=_poisoned_workspaces(runner, other_launches, other))
    _check_route(other, ws2["router_logits"])
    _check_graph_replays(runner, launches, p, ws, case["seed"] + 100)


@given(case=route_cases())
@example(case=_route_case("fp32", 65, 41, 7, 7))
@example(case=_route_case("fp32", 5, 41, 1024, 8))
@example(case=_route_case("fp32", 2, 41, 1, 1))
@_settings(12)
def test_moe_topk(runner, case):
    T, E, K = case["T"], case["E"], case["K"]
    attrs = {**case["attrs"], "top_k": K}
    G, nid = single_op_graph(tiny_model(), "moe_topk", attrs, {"logits": TType(("T", E), "f32")},
                             {"bias": "router.bias"} if case["bias"] else {})
    ids_name, w_name = G.nodes[nid]["outputs"]
    g = _gen(case["seed"])
    logits = torch.randn(T, E, generator=g) * 2
    bias = torch.randn(E, generator=g) * 0.5 if case["bias"] else None
    values = {"logits": logits.to(DEV),
              ids_name: poison(torch.empty(T, K, dtype=torch.int64, device=DEV)),
              w_name: poison(torch.empty(T, K, dtype=torch.float32, device=DEV))}
    runner.run_all(_lower(G, nid, "fp32"), values=values,
                   weights={"router.bias": bias.to(DEV)} if bias is not None else {}, sizes={"T": T})
    ids_ref, w_ref = OPS["moe_topk"].run(node_view(G, nid), [logits], {"bias": bias} if bias is not None else {}, None)
    same = _check_ids(values[ids_name].cpu(), ids_ref, _selection(logits, bias, attrs), "the op reference")
    if same.any():
        _record("moe_topk", "fp32", values[w_name].cpu()[same], w_ref[same])


@given(T=st.sampled_from(TOKENS + (2048, 4097)), E=st.sampled_from((1, 7, 8, 12, 64, 256, 1024)),
       K=st.integers(1, 8), seed=st.integers(0, 2**31 - 1))
@example(T=4097, E=1024, K=8, seed=3)        # MAX_EXPERTS, NP = 32776 pairs through one 1024-thread CTA
@example(T=1, E=1, K=1, seed=0)
@example(T=300, E=7, K=7, seed=5)
@_settings(12)
def test_moe_align(runner, T, E, K, seed):
    K = min(K, E)
    G, nid = single_op_graph(tiny_model(), "moe_align", {"num_experts": E}, {"ids": TType(("T", K), "i64")}, {})
    (r_name,) = G.nodes[nid]["outputs"]
    ids = _random_ids(T, E, K, _gen(seed))
    values = {"ids": ids.to(DEV),
              f"{r_name}.order": poison(torch.empty(T * K, dtype=torch.int32, device=DEV)),
              f"{r_name}.offsets": poison(torch.empty(E + 1, dtype=torch.int32, device=DEV))}
    runner.run_all(_lower(G, nid, "bf16"), values=values, sizes={"T": T, "NP": T * K})
    _check_routing(values[f"{r_name}.order"], values[f"{r_name}.offsets"], ids, E)
    STATS["moe_align"]["int"][0] += 1


def _check_local_routing(values, r_name, ids, E):
    """offsets as align_ref's, and order[:offsets[E]] the pairs of ids in [0, E), each once, grouped
    by expert (pairs of id -1 are another rank's: no expert's)."""
    ref = align_ref(ids, E)
    offsets = values[f"{r_name}.offsets"].cpu().long()
    assert torch.equal(offsets, ref["offsets"]), f"offsets {offsets.tolist()} != {ref['offsets'].tolist()}"
    n = int(offsets[E])
    flat = ids.reshape(-1)
    order = values[f"{r_name}.order"].cpu().long()[:n]
    assert len(set(order.tolist())) == n and (flat[order] >= 0).all(), "order claims a pair twice or another rank's"
    assert torch.equal(flat[order], torch.sort(flat[flat >= 0]).values), "order does not group the local pairs"


@given(T=st.sampled_from((1, 5, 33, 300, 2048)), E=st.sampled_from((2, 7, 64)), K=st.integers(1, 8),
       seed=st.integers(0, 2**31 - 1))
@example(T=300, E=64, K=6, seed=1)
@_settings(8)
def test_moe_align_leaves_out_other_ranks_pairs(runner, T, E, K, seed):
    """Expert parallel: pairs of id -1 (another rank's expert, moe_local_experts) are no expert's;
    offsets as align_ref's, and order[:offsets[E]] the local pairs grouped by expert."""
    K = min(K, E)
    G, nid = single_op_graph(tiny_model(), "moe_align", {"num_experts": E}, {"ids": TType(("T", K), "i64")}, {})
    (r_name,) = G.nodes[nid]["outputs"]
    g = _gen(seed)
    ids = _random_ids(T, E, K, g)
    ids[torch.rand(T, K, generator=g) < 0.5] = -1
    values = {"ids": ids.to(DEV),
              f"{r_name}.order": poison(torch.empty(T * K, dtype=torch.int32, device=DEV)),
              f"{r_name}.offsets": poison(torch.empty(E + 1, dtype=torch.int32, device=DEV))}
    runner.run_all(_lower(G, nid, "bf16"), values=values, sizes={"T": T, "NP": T * K})
    _check_local_routing(values, r_name, ids, E)
    STATS["moe_align"]["int"][0] += 1


@given(T=st.sampled_from((1, 33, 300, 2048, 5000)), E=st.sampled_from((2, 7, 64, 160)), K=st.integers(1, 8),
       other_ranks=st.booleans(), seed=st.integers(0, 2**31 - 1))
@example(T=2048, E=64, K=6, other_ranks=False, seed=1)      # 12288 pairs: 6 chunks
@example(T=5000, E=160, K=6, other_ranks=True, seed=2)
@example(T=85, E=7, K=6, other_ranks=False, seed=3)         # 510 pairs: still the one CTA
@_settings(10)
def test_moe_align_parallel(runner, T, E, K, other_ranks, seed):
    """The count / scan / scatter alignment (moe_router.cuh 3b; above moe.align_parallel_above)
    switched on above 512 pairs: the same contract as the one-CTA align, with and without pairs
    of other ranks (id -1)."""
    K = min(K, E)
    G, nid = single_op_graph(tiny_model(), "moe_align", {"num_experts": E}, {"ids": TType(("T", K), "i64")}, {})
    launches = _lower(G, nid, "bf16", Tuning(moe=MoeTuning(decode_wgmma=False, align_parallel_above=512)))
    (r_name,) = G.nodes[nid]["outputs"]
    g = _gen(seed)
    ids = _random_ids(T, E, K, g)
    if other_ranks:
        ids[torch.rand(T, K, generator=g) < 0.5] = -1
    values = {"ids": ids.to(DEV),
              f"{r_name}.order": poison(torch.empty(T * K, dtype=torch.int32, device=DEV)),
              f"{r_name}.offsets": poison(torch.empty(E + 1, dtype=torch.int32, device=DEV))}
    assert [la.stage for la in launches] == ["", "count", "scan", "scatter"]
    runner.run_all(launches, values=values, sizes={"T": T, "NP": T * K})
    _check_local_routing(values, r_name, ids, E)
    STATS["moe_align"]["int"][0] += 1


# -- grouped experts -------------------------------------------------------------------------

@st.composite
def grouped_cases(draw):
    E = draw(st.sampled_from((1, 7, 8, 12, 64)))
    return {"dtype": draw(st.sampled_from(DTYPES)), "T": draw(st.sampled_from(TOKENS)), "E": E,
            "K": min(E, draw(st.sampled_from((1, 2, 3, 6, 8)))), "D": draw(st.sampled_from((40, 41, 45, 64, 136, 256))),
            "M": draw(st.sampled_from((15, 36, 37, 64, 72, 200))), "misalign": draw(st.sampled_from(MISALIGN)),
            "seed": draw(st.integers(0, 2**31 - 1))}


def _grouped_case(dtype, T, E, K, D, M, misalign="none"):
    return {"dtype": dtype, "T": T, "E": E, "K": K, "D": D, "M": M, "misalign": misalign, "seed": 7}


def _routing(T, E, K, g, ids=None):
    ids = _random_ids(T, E, K, g) if ids is None else ids
    ref = align_ref(ids, E)
    dev = {"order": ref["order"].to(DEV, torch.int32), "offsets": ref["offsets"].to(DEV, torch.int32)}
    return ref, dev


def _grouped(runner, op, case, lower=None):
    dtype, T, E, K, D, M = (case[k] for k in ("dtype", "T", "E", "K", "D", "M"))
    tdt = TORCH_DTYPES[dtype]
    g = _gen(case["seed"])
    ids = _ids_with_counts(case["counts"], K, g) if "counts" in case else None
    ref_r, dev_r = _routing(T, E, K, g, ids)
    r = TType((f"T*{K}", E), "routing")
    if op == "moe_down":
        G, nid = single_op_graph(tiny_model(), op, {"num_experts": E, "out_dim": D},
                                 {"a": TType((f"T*{K}", M), "act"), "R": r}, {"weight": "e.{expert}.down"})
        inp = torch.randn(T * K, M, generator=g).to(tdt)
        w = {"weight": (torch.randn(E, D, M, generator=g) / M ** 0.5).to(tdt)}
        names = {"weight": "e.*.down"}
        first = "a"
    else:
        G, nid = single_op_graph(tiny_model(), op, {"num_experts": E, "out_dim": M},
                                 {"x": TType(("T", D), "act"), "R": r},
                                 {"gate": "e.{expert}.gate", "up": "e.{expert}.up"})
        inp = torch.randn(T, D, generator=g).to(tdt)
        w = {"gate": (torch.randn(E, M, D, generator=g) / D ** 0.5).to(tdt),
             "up": (torch.randn(E, M, D, generator=g) / D ** 0.5).to(tdt)}
        names = {"gate": "e.*.gate", "up": "e.*.up"}
        first = "x"
    outs = G.nodes[nid]["outputs"]
    n_out = M if op != "moe_down" else D
    mis = case.get("misalign", "none")
    values = {first: shifted(inp.to(DEV), _moved(mis, "inputs")), "R": dev_r,
              **{o: poison(shifted(torch.empty(T * K, n_out, dtype=tdt, device=DEV), _moved(mis, "outputs")))
                 for o in outs}}
    runner.run_all((lower or _lower)(G, nid, dtype), values=values,
                   weights={names[k]: shifted(v.to(DEV), _moved(mis, "weights")) for k, v in w.items()},
                   sizes={"T": T, "NP": T * K})
    refs = OPS[op].run(node_view(G, nid), [inp.float(), ref_r], {k: v.float() for k, v in w.items()}, None)
    if op == "moe_gate_up_silu" and dtype != "fp32":
        refs = [_gate_up_silu_rounded(G, nid, inp, ref_r, w, tdt)]
    for o, ref in zip(outs, refs):
        _record(op, dtype, values[o], ref)


def _gate_up_silu_rounded(G, nid, inp, routing, w, tdt):
    """The reference rounded where the kernel (and transformers' bf16 expert) rounds: gate and up
    to the activation type, silu(gate) to it, then their product (moe_grouped.cuh GATE_UP_SILU)."""
    def rnd(t):
        return t.to(tdt).double()
    g, u = OPS["moe_gate_up"].run(node_view(G, nid), [inp.double(), routing], {k: v.double() for k, v in w.items()}, None)
    g, u = rnd(g), rnd(u)
    return rnd(torch.nn.functional.silu(g)) * u


@given(case=grouped_cases())
@example(case=_grouped_case("bf16", 5, 7, 3, 41, 15))
@example(case=_grouped_case("fp16", 1, 7, 2, 45, 37, "all"))
@example(case=_grouped_case("fp32", 33, 1, 1, 41, 37))
@example(case=_grouped_case("bf16", 2, 64, 6, 256, 64, "weights"))
@_settings(25)
def test_moe_gate_up_silu(runner, case):
    _grouped(runner, "moe_gate_up_silu", case)


@given(case=grouped_cases())
@example(case=_grouped_case("fp16", 33, 7, 3, 45, 15))
@example(case=_grouped_case("bf16", 2, 8, 8, 64, 36, "outputs"))
@_settings(10)
def test_moe_gate_up(runner, case):
    _grouped(runner, "moe_gate_up", case)


@given(case=grouped_cases())
@example(case=_grouped_case("bf16", 5, 7, 3, 41, 15))
@example(case=_grouped_case("fp32", 128, 7, 6, 45, 37, "all"))
@example(case=_grouped_case("fp16", 1, 64, 6, 64, 72, "inputs"))
@_settings(20)
def test_moe_down(runner, case):
    _grouped(runner, "moe_down", case)


@st.composite
def many_pairs_cases(draw):
    """Prefill-like: hundreds to thousands of pairs per expert, so the tensor-core GEMM path runs
    (experts with more than moe.gemm_threshold pairs), next to light experts on the GEMV path; row
    tiles with a partial last tile, odd dims (element loads), N not a multiple of the column tile."""
    E = draw(st.sampled_from((1, 3, 7, 8)))
    return {"dtype": draw(st.sampled_from(("bf16", "fp16"))), "T": draw(st.sampled_from((150, 700, 2048))),
            "E": E, "K": min(E, draw(st.sampled_from((1, 2, 6)))),
            "D": draw(st.sampled_from((40, 41, 45, 136, 256, 512))), "M": draw(st.sampled_from((15, 36, 37, 72, 200, 1408))),
            "misalign": draw(st.sampled_from(MISALIGN)), "seed": draw(st.integers(0, 2**31 - 1))}


@given(case=many_pairs_cases())
@example(case=_grouped_case("bf16", 700, 7, 2, 41, 15))     # odd KD (element loads) and odd N (element stores)
@example(case=_grouped_case("fp16", 2048, 3, 2, 45, 37))
@example(case=_grouped_case("bf16", 700, 3, 2, 256, 200, "inputs"))   # the GEMM refuses, the GEMV takes all
@_settings(8)
def test_moe_gate_up_silu_many_pairs(runner, case):
    _grouped(runner, "moe_gate_up_silu", case, lower=_lower_mma)


@given(case=many_pairs_cases())
@example(case=_grouped_case("fp16", 700, 7, 6, 45, 15))
@example(case=_grouped_case("bf16", 150, 1, 1, 136, 72, "outputs"))
@_settings(5)
def test_moe_gate_up_many_pairs(runner, case):
    _grouped(runner, "moe_gate_up", case, lower=_lower_mma)


@given(case=many_pairs_cases())
@example(case=_grouped_case("bf16", 700, 7, 2, 41, 15))     # KD = M = 15, N = D = 41
@example(case=_grouped_case("fp16", 2048, 3, 2, 45, 37))
@example(case=_grouped_case("bf16", 700, 3, 2, 256, 200, "weights"))
@_settings(8)
def test_moe_down_many_pairs(runner, case):
    _grouped(runner, "moe_down", case, lower=_lower_mma)


# Pair counts per expert around every boundary the kernels choose at: the GEMM threshold (2),
# the GEMV's pass width (8), the swapped tensor-core tiles (16 / 32 / 64 pairs), the 128-pair row
# tile, and experts never hit.  The token count picks the launch (the GEMV alone while
# T <= moe.gemv_upto = 8, else the one grid of light slots and tiles): both are drawn.
PAIR_COUNTS = (0, 1, 2, 3, 7, 8, 9, 16, 17, 31, 33, 63, 64, 65, 127, 129, 256)


def _ids_with_counts(counts, K, g) -> torch.Tensor:
    """ids [T, K] in which expert e has exactly counts[e] pairs and no token names an expert twice
    (as top-k routing guarantees; needs max(counts) <= T).  Pair i of the by-expert list goes to
    token i % T, slot i // T: an expert's run of at most T consecutive pairs lands on distinct
    tokens.  Tokens and slots are then shuffled."""
    T = sum(counts) // K
    assert max(counts) <= T and T * K == sum(counts), (counts, K)
    flat = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
    ids = flat.view(K, T).T.contiguous()
    ids = ids[torch.randperm(T, generator=g)]
    return ids[:, torch.randperm(K, generator=g)].contiguous()


@st.composite
def pair_count_cases(draw):
    """Every expert's pair count drawn from PAIR_COUNTS; the last expert takes the 0..K-1 pairs
    that make the total a whole number of tokens, and K is as large as distinct experts per
    token allow.  The tests lower with _lower_mma: a draw of more than 256 tokens would otherwise
    go to the prefill wgmma, which refuses these tests' misaligned weights (its own file tests it)."""
    E = draw(st.sampled_from((2, 3, 5, 8)))
    counts = [draw(st.sampled_from(PAIR_COUNTS)) for _ in range(E)]
    if sum(counts) == 0:
        counts[0] = 1
    # the largest K (<= E) for which every expert fits in distinct tokens; K = 1 always does
    for K in sorted({min(E, k) for k in (1, 2, 6, draw(st.sampled_from((2, 3, 6))))}, reverse=True):
        c = counts[:-1] + [counts[-1] + (-sum(counts)) % K]
        if max(c) <= sum(c) // K:
            counts = c
            break
    return {"dtype": draw(st.sampled_from(DTYPES)), "T": sum(counts) // K, "E": E, "K": K, "counts": counts,
            "D": draw(st.sampled_from((40, 41, 64, 136, 256))), "M": draw(st.sampled_from((15, 36, 37, 72, 200))),
            "misalign": draw(st.sampled_from(MISALIGN)), "seed": draw(st.integers(0, 2**31 - 1))}


def _counts_case(dtype, counts, K, D, M, misalign="none"):
    return {"dtype": dtype, "T": sum(counts) // K, "E": len(counts), "K": K, "counts": list(counts), "D": D, "M": M,
            "misalign": misalign, "seed": 11}


@given(case=pair_count_cases())
@example(case=_counts_case("bf16", (9, 16, 17, 33, 64, 65, 0, 4), 2, 256, 200))   # GEMV, all three swapped tiles, row tile
@example(case=_counts_case("fp16", (63, 0, 1, 129, 8, 31), 1, 41, 37))            # odd KD / N on the swapped tiles
@example(case=_counts_case("bf16", (17, 64, 5), 1, 136, 72, "inputs"))             # the GEMM refuses: light slots take all
@example(case=_counts_case("bf16", (8, 3, 5, 0, 8), 3, 256, 200))                 # T = 8: the GEMV alone, up to 8 pairs
@example(case=_counts_case("fp16", (1, 2, 9, 0, 12, 3, 2, 7), 2, 64, 37))         # T = 18: light slots beside tiles
@_settings(20)
def test_moe_gate_up_silu_pair_counts(runner, case):
    _grouped(runner, "moe_gate_up_silu", case, lower=_lower_mma)


@given(case=pair_count_cases())
@example(case=_counts_case("fp16", (9, 32, 33, 0), 2, 64, 37))
@_settings(8)
def test_moe_gate_up_pair_counts(runner, case):
    _grouped(runner, "moe_gate_up", case, lower=_lower_mma)


@given(case=pair_count_cases())
@example(case=_counts_case("bf16", (9, 16, 17, 33, 64, 65, 0, 4), 2, 256, 200))
@example(case=_counts_case("fp16", (63, 0, 1, 129, 8, 31), 1, 37, 41))            # N = D = 37: odd output columns
@example(case=_counts_case("bf16", (8, 3, 5, 0, 8), 3, 256, 200))                 # T = 8: the GEMV alone
@example(case=_counts_case("bf16", (1, 2, 9, 0, 12, 3, 2, 7), 2, 136, 41))        # T = 18: light slots beside tiles
@_settings(20)
def test_moe_down_pair_counts(runner, case):
    _grouped(runner, "moe_down", case, lower=_lower_mma)


def _lower_mma(G, nid, dtype):
    """The lowering with the mma.sync launch at every T above the GEMV (moe.prefill_wgmma_above off):
    the default hands prefill's token counts to the wgmma launch, which test_kernels_moe_wgmma.py
    covers, and whose TMA maps need 16-byte aligned weights (the runtime's allocations are; these
    tests' shifted views are not, and the mma.sync path is what serves them)."""
    return _lower(G, nid, dtype, Tuning(moe=MoeTuning(decode_wgmma=False, prefill_wgmma_above=None)))


# -- combine ---------------------------------------------------------------------------------

@st.composite
def combine_cases(draw, shared=False):
    """`shared`: draw S, the shared experts' pairs at the end of each token's K (0 .. min(3, K - 1))."""
    K = draw(st.integers(1, 8))
    return {"dtype": draw(st.sampled_from(DTYPES)), "T": draw(st.sampled_from(TOKENS)),
            "K": K, "D": draw(st.sampled_from((40, 41, 45, 64, 1000, 2048))),
            "misalign": draw(st.sampled_from(MISALIGN)), "seed": draw(st.integers(0, 2**31 - 1)),
            "other_ranks": draw(st.booleans()), "S": draw(st.integers(0, min(3, K - 1))) if shared else 0}


def _combine_case(dtype, T, K, D, misalign="none", other_ranks=False, S=0):
    return {"dtype": dtype, "T": T, "K": K, "D": D, "misalign": misalign, "seed": 11, "other_ranks": other_ranks,
            "S": S}


def _combine(runner, op, case):
    """K pairs a token; with S > 0 (the residual combines) the last S are the shared experts'
    (weight 1, as moe_route writes them) and there is no shared input."""
    dtype, T, K, D, S = case["dtype"], case["T"], case["K"], case["D"], case.get("S", 0)
    tdt = TORCH_DTYPES[dtype]
    g = _gen(case["seed"])
    types = {"eo": TType((f"T*{K}", D), "act"), "w": TType(("T", K), "f32")}
    # routing weights summing to about 1, as normalised routing makes them: the routed sum, the
    # shared output and the residual stay O(1), where rounding to bf16 costs ~2^-9 of each
    ins = [torch.randn(T * K, D, generator=g).to(tdt), torch.rand(T, K, generator=g) * (2.0 / K)]
    if S:
        ins[1][:, K - S:] = 1.0
    if case.get("other_ranks"):
        # expert parallel: another rank's pairs have weight 0 and rows nobody wrote (NaN here);
        # the combine must skip them, not multiply them
        gone = torch.rand(T, K, generator=g) < 0.4
        gone[:, K - S:] = False
        ins[1][gone] = 0.0
        ins[0][gone.reshape(-1)] = float("nan")
    norm = op == "moe_combine_residual_rms_norm"
    if op != "moe_combine":
        if not S:
            types.update(shared=TType(("T", D), "act"))
            ins.append(torch.randn(T, D, generator=g).to(tdt))
        types.update(residual=TType(("T", D), "act"))
        ins.append(torch.randn(T, D, generator=g).to(tdt))
    attrs = {"shared_experts": S} if S else {}
    G, nid = single_op_graph(tiny_model(), op, attrs, types, {"weight": "norm_w"} if norm else {})
    outs = G.nodes[nid]["outputs"]
    mis = case.get("misalign", "none")
    values = {name: shifted(t.to(DEV), _moved(mis, "inputs")) for name, t in zip(types, ins)}
    for o in outs:
        values[o] = poison(shifted(torch.empty(T, D, dtype=tdt, device=DEV), _moved(mis, "outputs")))
    nw = (torch.rand(D, generator=g) + 0.5).to(tdt)
    weights = {"norm_w": shifted(nw.to(DEV), _moved(mis, "weights"))} if norm else {}
    runner.run_all(_lower(G, nid, dtype), values=values, weights=weights, sizes={"T": T, "NP": T * K})
    if not norm:
        (ref,) = OPS[op].run(node_view(G, nid), [t.float() for t in ins], {}, None)
        _record(op, dtype, values[outs[0]], ref)
        return
    # s against the unrounded sum; h against rms_norm of the kernel's own (rounded) s, as the
    # unfused chain normalises the rounded sum: a 1% error in either fails
    (s_ref,) = OPS["moe_combine_residual"].run(node_view(G, nid), [t.float() for t in ins], {}, None)
    h, s = values[outs[0]], values[outs[1]]
    _record(op, dtype, s, s_ref)
    h_ref = rms_norm_ref(s.detach().cpu().float(), nw.float(), G.nodes[nid]["attrs"]["eps"])
    _record(op, dtype, h, h_ref)


@given(case=combine_cases())
@example(case=_combine_case("bf16", 33, 7, 41))
@example(case=_combine_case("fp32", 1, 1, 45, "all"))
@example(case=_combine_case("fp16", 5, 6, 2048, "outputs"))
@example(case=_combine_case("bf16", 33, 6, 2048, other_ranks=True))
@_settings(12)
def test_moe_combine(runner, case):
    _combine(runner, "moe_combine", case)


@given(case=combine_cases(shared=True))
@example(case=_combine_case("bf16", 300, 3, 41))
@example(case=_combine_case("fp16", 2, 8, 45, "inputs"))
@example(case=_combine_case("bf16", 128, 6, 2048, "all"))
@example(case=_combine_case("bf16", 33, 8, 2048, S=2))
@example(case=_combine_case("fp16", 5, 3, 45, "all", other_ranks=True, S=1))
@_settings(20)
def test_moe_combine_residual(runner, case):
    _combine(runner, "moe_combine_residual", case)


@given(case=combine_cases(shared=True))
@example(case=_combine_case("bf16", 1, 6, 2048))
@example(case=_combine_case("bf16", 1, 8, 2048, S=2))    # V2-Lite: every row of the token in flight
@example(case=_combine_case("bf16", 1, 8, 5120, S=2))    # V2 (640 threads): the same
@example(case=_combine_case("bf16", 1, 12, 2048, S=4))   # 13 rows: the routed rows in flight, then the rest
@example(case=_combine_case("bf16", 1, 9, 7168, S=1))    # V3 (896 threads): the routed rows 4 at a time
@example(case=_combine_case("fp32", 7, 9, 41, "inputs", S=3))
@example(case=_combine_case("bf16", 300, 3, 41))
@example(case=_combine_case("fp16", 2, 8, 45, "all"))
@example(case=_combine_case("fp32", 5, 6, 1000, "weights"))
@example(case=_combine_case("bf16", 33, 6, 2048, "outputs", other_ranks=True))
@_settings(20)
def test_moe_combine_residual_rms_norm(runner, case):
    _combine(runner, "moe_combine_residual_rms_norm", case)
