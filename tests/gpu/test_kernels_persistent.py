"""Property tests: a persistent decode segment (codegen/segments.py, templates/include/segment.cuh) gives
bit for bit what the kernel-per-op launches of its members give.

The chains (CHAINS):
- mlp: a decode layer's tail as V2-Lite's dense layer runs it: o_proj (a skinny linear), the residual
  add + RMSNorm, the fused gate + up + SwiGLU and the down projection; four launches, one segment.
- combine_q: a MoE layer's combine + residual + RMSNorm (moe_combine_residual_rms_norm; with shared
  experts among the pairs or a shared input) and the next layer's q projection that reads its h.
- vup_o: the attention's tail at V2-Lite's MLA widths: the tensor-core V up-projection (mla_v_up, its
  3-D grid as one task index; o_lat contiguous or a strided, unaligned view), o_proj and the residual
  add + RMSNorm.
The task bodies call the members' own device functions in their own summation order, so the outputs
must be equal, not close.  Hypothesis draws the chain, the dtype, the widths (V2-Lite's and odd ones),
T (1..16, the skinny range) and the inputs; each example runs the segment on grids of 1, 2, 3 and 132
CTAs (one CTA runs every task in order; a few CTAs wait on each other; 132 is an H100's SMs, one CTA
each; with persistent.ctas_per_sm=2 also 264, two an SM), twice (the counters reset themselves), and replays it from a CUDA graph on new inputs.  The
engine's decode step with segments on gives exactly the logits it gives with them off.

Planted mutants (tests/gpu/test_mutants.py) drop the last member's waits: mlp's down projection then
reads the SwiGLU output before gate_up_silu's tiles have written it (a slow producer: 10944-wide rows);
combine_q's q projection reads h before the combine's tasks have written it; vup_o's o_proj reads the
V up-projection's output before its tasks have written it."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import example, given, strategies as st

from harness import GPU_MARKS
from kernel_cases import kernel_test, runner
from segment_chains import chain, inputs, outputs, sizes

pytestmark = GPU_MARKS
SETTINGS = kernel_test(12)
GRIDS = (1, 2, 3, 132)
# persistent.ctas_per_sm=2: also 264 CTAs, two an H100 SM, all resident at once (the kernel's launch bounds)
GRIDS_AT = {1: GRIDS, 2: GRIDS + (264,)}
CASES = [("mlp", "bf16", "lite"), ("mlp", "fp16", "lite"), ("mlp", "bf16", "odd"), ("mlp", "fp16", "odd"),
         ("mlp", "fp32", "odd"), ("mlp", "fp32", "wide32"),
         ("combine_q", "bf16", "lite"), ("combine_q", "fp16", "lite_shared_input"), ("combine_q", "bf16", "odd"),
         ("combine_q", "fp32", "wide32"), ("vup_o", "bf16", "lite"), ("vup_o", "fp16", "lite"),
         ("vup_o", "bf16", "lite_strided")]


def per_op(members, values, weights, T, case):
    name, dtype, shape = case
    outs = outputs(*case, T)
    for launch in members:
        runner().run_all([launch], values={**values, **outs}, weights=weights, sizes=sizes(name, shape, T))
    torch.cuda.synchronize()
    return outs


def assert_equal(got, want, what):
    for name in want:
        assert torch.equal(got[name], want[name]), f"{what}: {name} differs from the kernel-per-op launches"


@SETTINGS
@given(case=st.sampled_from(CASES), T=st.integers(1, 16), seed=st.integers(0, 2**31))
@example(case=("mlp", "bf16", "lite"), T=1, seed=1)
@example(case=("mlp", "bf16", "lite"), T=16, seed=2)
@example(case=("mlp", "fp32", "odd"), T=9, seed=3)
@example(case=("combine_q", "bf16", "lite"), T=1, seed=5)
@example(case=("combine_q", "bf16", "odd"), T=16, seed=6)
@example(case=("vup_o", "bf16", "lite"), T=1, seed=8)
@example(case=("vup_o", "bf16", "lite_strided"), T=16, seed=9)
@pytest.mark.parametrize("ctas", (1, 2))
def test_segment_equals_the_launches_it_replaces(ctas, case, T, seed):
    name, dtype, shape = case
    members, launch = chain(*case, ctas)
    values, weights = inputs(*case, T, torch.Generator().manual_seed(seed))
    want = per_op(members, values, weights, T, case)
    for grid in GRIDS_AT[ctas]:
        forced = dataclasses.replace(launch, grid=(str(grid), 1, 1))
        for run in range(2):     # the second launch finds the counters the first one reset
            got = outputs(*case, T)
            runner().run_all([forced], values={**values, **got}, weights=weights, sizes=sizes(name, shape, T))
            torch.cuda.synchronize()
            assert_equal(got, want, f"{grid} CTAs, run {run + 1}")


@SETTINGS
@given(case=st.sampled_from(CASES), T=st.integers(1, 16), seed=st.integers(0, 2**31))
@example(case=("mlp", "bf16", "lite"), T=1, seed=4)
@example(case=("combine_q", "bf16", "lite"), T=1, seed=7)
@example(case=("vup_o", "bf16", "lite"), T=1, seed=10)
@pytest.mark.parametrize("ctas", (1, 2))
def test_segment_replays_in_a_cuda_graph(ctas, case, T, seed):
    """Captured once, replayed on new inputs written into the captured buffers: each replay equals
    the kernel-per-op launches on those inputs (a counter left unreset would hang or skip tasks)."""
    name, dtype, shape = case
    members, launch = chain(*case, ctas)
    gen = torch.Generator().manual_seed(seed)
    values, weights = inputs(*case, T, gen)
    got = outputs(*case, T)
    at = sizes(name, shape, T)
    runner().run_all([launch], values={**values, **got}, weights=weights, sizes=at)   # loads the module
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        runner().run_all([launch], values={**values, **got}, weights=weights, sizes=at)
    for replay in range(3):
        fresh, _ = inputs(*case, T, gen)
        for k, t in fresh.items():
            values[k].copy_(t)
        for t in got.values():
            t.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert_equal(got, per_op(members, values, weights, T, case), f"replay {replay + 1}")


def _same_logits(on, off, prompts):
    for graphs in (False, True):
        on.backend.use_graphs = off.backend.use_graphs = graphs
        for a, b in zip(on.logits(prompts, decode_after=2), off.logits(prompts, decode_after=2)):
            assert torch.isfinite(b).all()
            assert torch.equal(a, b), f"segments on and off differ (decode graphs {'on' if graphs else 'off'})"


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
    _same_logits(on, off, [[3, 17, 5, 22, 9, 41, 7], [11], [8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18]])


# V2-Lite's widths where the segments' members see them (hidden 2048: the norms take the skinny linears'
# 256 threads; its MLA dims: the tensor-core attention chain), few heads, experts and layers
LITE_WIDTHS = dict(hidden=2048, heads=2, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                   intermediate=1408, moe_intermediate=64, experts=8, shared_experts=2, top_k=6, layers=3)


def test_engine_decode_with_segments_gives_the_same_logits_at_v2_lite_widths():
    """bf16 at V2-Lite's widths (random weights): the V up-projections join o_proj's runs, the MoE layers'
    combine + norm the next q (the last one the lm head); the logits equal those with segments off,
    eager and replayed."""
    from runtime import Engine
    from codegen.tuning import parse_tune
    from harness import tiny_spec
    kw = dict(backend="cuda", device="cuda", dtype=torch.bfloat16, block_size=64, num_blocks=16, max_seq_len=256)
    off = Engine.from_spec(tiny_spec(**LITE_WIDTHS), seed=3, **kw)
    on = Engine.from_spec(off.spec, weights=off.backend.weights, tuning=parse_tune(["persistent.segments=true"]), **kw)
    kinds = {m["kind"] for la in on.backend.plans["decode"].launches if la.family == "segment"
             for m in la.params["members"]}
    assert {"combine_norm", "v_up"} <= kinds
    _same_logits(on, off, [[3, 17, 5, 22, 9, 41, 7], [11], [8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18] * 6])
