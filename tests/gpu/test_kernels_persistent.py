"""Property tests: a persistent decode segment (codegen/segments.py, templates/include/segment.cuh) gives
bit for bit what the kernel-per-op launches of its members give.

The members are a decode layer's tail as V2-Lite's dense layer runs it: o_proj (a skinny linear), the
residual add + RMSNorm, the fused gate + up + SwiGLU and the down projection; four launches, one
segment.  The task bodies call the members' own device functions in their own summation order, so
the outputs must be equal, not close.  Hypothesis draws the dtype, the widths (V2-Lite's and odd
ones), T (1..16, the skinny range) and the inputs; each example runs the segment on grids of 1, 2, 3
and 132 CTAs (one CTA runs every task in order; a few CTAs wait on each other; 132 is an H100's SMs,
one CTA each), twice (the counters reset themselves), and replays it from a CUDA graph on new
inputs.  The engine's decode step with segments on gives exactly the logits it gives with them off.

A planted mutant (tests/gpu/test_mutants.py) drops the last member's waits: the down projection then
reads the SwiGLU output before gate_up_silu's tiles have written it (a slow producer: 10944-wide rows)."""
from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
from hypothesis import example, given, strategies as st

from harness import GPU_MARKS
from kernel_cases import act, empty_out, kernel_test, model, rand, runner, single_op_graph

from codegen import segments
from codegen.families import family_for_op
from codegen.families import segment as segment_family
from codegen.kernel import KernelLaunch, Options
from codegen.plan import NodeInfo, PhasePlan

pytestmark = GPU_MARKS
SETTINGS = kernel_test(12)
GRIDS = (1, 2, 3, 132)
# (K of o_proj's input, D hidden, I the MLP's width): V2-Lite's dense layer, odd widths, fp32's. A norm joins
# a segment of its block size: D's rows must take 256 threads (16-bit 2048, fp32 1024, odd 225..256)
SHAPES = {"lite": (2048, 2048, 10944), "odd": (41, 255, 53), "wide32": (2048, 1024, 2816)}
CASES = [("bf16", "lite"), ("fp16", "lite"), ("bf16", "odd"), ("fp16", "odd"), ("fp32", "odd"), ("fp32", "wide32")]


def _member(m, op, attrs, inputs, weights, outputs, dtype) -> KernelLaunch:
    G, nid = single_op_graph(m, op, attrs, inputs, weights, outputs=outputs, phase="decode")
    return next(s for s in family_for_op(op).lower(nid, G, Options(dtype=dtype)) if isinstance(s, KernelLaunch))


@functools.lru_cache(maxsize=None)
def chain(dtype: str, shape: str):
    """(the members' launches in plan order, the segment's launch) of x -> o_proj -> y; (y, res) ->
    h, s; h -> gate_up_silu -> g; g -> down -> z."""
    K, D, I = SHAPES[shape]
    m = model("lite")
    members = [
        _member(m, "linear", {"out_dim": D}, {"x": act(K)}, {"weight": "wo"}, ["y"], dtype),
        _member(m, "fused_add_rms_norm", {}, {"y": act(D), "res": act(D)}, {"weight": "wn"}, ["h", "s"], dtype),
        _member(m, "gate_up_silu", {"out_dim": I}, {"h": act(D)}, {"gate": "wg", "up": "wu"}, ["g"], dtype),
        _member(m, "linear", {"out_dim": D}, {"g": act(I)}, {"weight": "wd"}, ["z"], dtype),
    ]
    plan = PhasePlan("decode", steps=members, nodes={s.nodes[0]: NodeInfo(None, ()) for s in members})
    (seg,) = segments.find(plan)
    assert seg.steps == (0, 1, 2, 3) and seg.waits == ((), (0,), (1,), (2,))
    launch = segment_family.launch(members, [segments.body(s) for s in members], seg.waits, lead=seg.lead,
                                   gate=None, pdl=True)
    return members, launch


def inputs(dtype, shape, T, gen):
    K, D, I = SHAPES[shape]
    values = {"x": rand((T, K), dtype, gen=gen, scale=3.0), "res": rand((T, D), dtype, gen=gen)}
    weights = {"wo": rand((D, K), dtype, gen=gen, scale=K ** -0.5), "wn": rand((D,), dtype, gen=gen) + 1,
               "wg": rand((I, D), dtype, gen=gen, scale=D ** -0.5), "wu": rand((I, D), dtype, gen=gen, scale=D ** -0.5),
               "wd": rand((D, I), dtype, gen=gen, scale=I ** -0.5)}
    return values, weights


def outputs(dtype, shape, T):
    K, D, I = SHAPES[shape]
    return {"y": empty_out((T, D), dtype), "h": empty_out((T, D), dtype), "s": empty_out((T, D), dtype),
            "g": empty_out((T, I), dtype), "z": empty_out((T, D), dtype)}


def per_op(members, values, weights, T, dtype, shape):
    outs = outputs(dtype, shape, T)
    for launch in members:
        runner().run_all([launch], values={**values, **outs}, weights=weights, sizes={"T": T})
    torch.cuda.synchronize()
    return outs


def assert_equal(got, want, what):
    for name in want:
        assert torch.equal(got[name], want[name]), f"{what}: {name} differs from the kernel-per-op launches"


@SETTINGS
@given(case=st.sampled_from(CASES), T=st.integers(1, 16), seed=st.integers(0, 2**31))
@example(case=("bf16", "lite"), T=1, seed=1)
@example(case=("bf16", "lite"), T=16, seed=2)
@example(case=("fp32", "odd"), T=9, seed=3)
def test_segment_equals_the_launches_it_replaces(case, T, seed):
    dtype, shape = case
    members, launch = chain(dtype, shape)
    values, weights = inputs(dtype, shape, T, torch.Generator().manual_seed(seed))
    want = per_op(members, values, weights, T, dtype, shape)
    for grid in GRIDS:
        forced = dataclasses.replace(launch, grid=(str(grid), 1, 1))
        for run in range(2):     # the second launch finds the counters the first one reset
            got = outputs(dtype, shape, T)
            runner().run_all([forced], values={**values, **got}, weights=weights, sizes={"T": T, "SMS": 132})
            torch.cuda.synchronize()
            assert_equal(got, want, f"{grid} CTAs, run {run + 1}")


@SETTINGS
@given(case=st.sampled_from(CASES), T=st.integers(1, 16), seed=st.integers(0, 2**31))
@example(case=("bf16", "lite"), T=1, seed=4)
def test_segment_replays_in_a_cuda_graph(case, T, seed):
    """Captured once, replayed on new inputs written into the captured buffers: each replay equals
    the kernel-per-op launches on those inputs (a counter left unreset would hang or skip tasks)."""
    dtype, shape = case
    members, launch = chain(dtype, shape)
    gen = torch.Generator().manual_seed(seed)
    values, weights = inputs(dtype, shape, T, gen)
    got = outputs(dtype, shape, T)
    sizes = {"T": T, "SMS": 132}
    runner().run_all([launch], values={**values, **got}, weights=weights, sizes=sizes)   # loads the module
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        runner().run_all([launch], values={**values, **got}, weights=weights, sizes=sizes)
    for replay in range(3):
        fresh, _ = inputs(dtype, shape, T, gen)
        for name, t in fresh.items():
            values[name].copy_(t)
        for t in got.values():
            t.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert_equal(got, per_op(members, values, weights, T, dtype, shape), f"replay {replay + 1}")


def test_engine_decode_with_segments_gives_the_same_logits(tmp_path):
    """The tiny model's engine with persistent.segments on: the same logits as with it off, eager and
    replayed from decode graphs (a segment per dense MLP; the tiny model's norms are 32 threads wide, so
    they stay their own launches)."""
    from runtime import Engine
    from tests.e2e.hf_tiny import build
    from codegen.tuning import parse_tune
    path = build("v2_lite", tmp_path)
    kw = dict(backend="cuda", device="cuda", dtype=torch.float32, block_size=5, num_blocks=64, max_seq_len=128)
    off = Engine.from_pretrained(path, **kw)
    on = Engine.from_spec(off.spec, weights=off.backend.weights, tuning=parse_tune(["persistent.segments=true"]), **kw)
    assert any(la.family == "segment" for la in on.backend.plans["decode"].launches)
    prompts = [[3, 17, 5, 22, 9, 41, 7], [11], [8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18]]
    for graphs in (False, True):
        on.backend.use_graphs = off.backend.use_graphs = graphs
        for a, b in zip(on.logits(prompts, decode_after=2), off.logits(prompts, decode_after=2)):
            assert torch.equal(a, b), f"segments on and off differ (decode graphs {'on' if graphs else 'off'})"
