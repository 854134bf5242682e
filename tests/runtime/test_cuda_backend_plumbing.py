"""The cuda backend's step plumbing on the CPU, through a real bundle's manifest: buffer plan,
views, library calls, cache binding.

A bundle is compiled with `compile_bundle` (NVRTC works without a GPU) and read back with
`load_bundle`, exactly as the GPU path does; then the compiler's entry points are made to raise,
so the backend provably runs from the manifest alone.  The kernels are replaced by a stub runner
that computes each node with its reference op and writes the result into the buffers the backend
allocated (as a kernel would), so everything the backend itself does — allocate or alias each
value, run the library calls, bind each launch to its layer's cache, group a node's launches — is
checked against the reference backend.
"""
from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
import torch

import codegen.bundle as bundle_mod
import codegen.lower
import codegen.nvrtc
import ir.graph
import ir.passes
from codegen.bundle import compile_bundle, load_bundle
from codegen.nvrtc import nvrtc_version
from ir.context import StepContext
from ir.graph import node_view
from ir.ops import OPS
from runtime import SamplingParams
import runtime.cuda_backend as cuda_backend
from runtime.cuda_backend import CudaBackend
from runtime.reference_backend import ReferenceBackend
from tiny_engine import ROOT, compiled, make_engine, prompts


class ReferenceKernels:
    """Stands in for KernelRunner: one run_all per node, results written into the given buffers."""

    def __init__(self, graphs):
        self.graphs = graphs
        self.phase = None
        self.step: StepContext | None = None
        self.calls = 0

    def run_all(self, launches, *, values, weights, ctx, sizes, workspaces=None):
        nid = launches[0].nodes[0]
        assert all(l.nodes[0] == nid for l in launches), "a node's launches must come together"
        self.run_node(nid, values, weights)
        self.calls += 1
        return {}

    def run_node(self, nid, values, weights):
        G = self.graphs[self.phase]
        data = G.nodes[nid]
        ins = []
        for v in data["inputs"]:
            x = values[v]
            if isinstance(x, dict):   # routing buffers, as the reference ops want them
                K = int(str(G.graph["values"][v].shape[0]).split("*")[1])
                x = {"order": x["order"].long(), "offsets": x["offsets"].long(), "top_k": K}
            ins.append(x)
        w = {role: weights[name] for role, name in data["weights"].items()}
        outs = OPS[data["op"]].run(node_view(G, nid), ins, w, self.step)
        for name, out in zip(data["outputs"], outs):
            buf = values[name]
            if isinstance(buf, dict):
                buf["order"].copy_(out["order"])
                buf["offsets"].copy_(out["offsets"])
            elif G.graph["values"][name].dtype != "state":
                assert buf.shape == out.shape, f"{nid}: buffer {tuple(buf.shape)} for a {tuple(out.shape)} result"
                buf.copy_(out)


H100_SMS = 132   # the device fact a step's workspaces are sized by, given here where no GPU is


class SteppedCuda(CudaBackend):
    """CudaBackend with the stub kernels; forward() tells the stub which step it runs."""

    def forward(self, phase, ids, ctx):
        self.runner.phase, self.runner.step = phase, ctx
        return self._forward(phase, ids, ctx, self._meta(ctx, ids.device), {**self._sizes(ctx), "SMS": H100_SMS})


def _forbid(*_, **__):
    raise AssertionError("running a bundle must not run the compiler")


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    model, _ = compiled()
    out = tmp_path_factory.mktemp("plumbing")
    return compile_bundle(model.spec, out / "bundle", dtype="fp32", block_size=4, cache_dir=out / "cache").path


@pytest.mark.slow
def test_backend_runs_the_manifest_and_matches_the_reference_backend(bundle, monkeypatch):
    model, weights = compiled()
    for mod, name in ((ir.passes, "run_pipeline"), (ir.graph, "build_graph"), (codegen.lower, "lower_graph"),
                      (codegen.nvrtc, "compile_cubin"), (bundle_mod, "plan_spec"), (bundle_mod, "compile_bundle")):
        monkeypatch.setattr(mod, name, _forbid)
    loaded = load_bundle(bundle, arch="sm_90", nvrtc_version=nvrtc_version(), dtype="fp32", block_size=4)
    backend = SteppedCuda.from_bundle(loaded, weights, dtype=torch.float32, top_k=model.spec.dims["top_k"])
    assert sorted(backend.runner._cubins) == sorted(loaded.manifest["kernels"])   # the bundle's CUBINs
    stub = backend.runner = ReferenceKernels(model.graphs)
    ours = make_engine(backend_impl=backend)
    ref = make_engine()
    assert isinstance(ref.backend, ReferenceBackend)
    ps = prompts([1, 3, 4, 5, 9])
    for a, b in zip(ours.logits(ps, decode_after=2), ref.logits(ps, decode_after=2)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    # generate: the prefill's head runs on each sequence's last row only (StepContext.logit_rows)
    sp = SamplingParams(max_new_tokens=4, ignore_eos=True, return_logits=True)
    for a, b in zip(ours.generate(ps, sp), ref.generate(ps, sp)):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(a.logits, b.logits, rtol=1e-5, atol=1e-5)
    assert stub.calls > 0


@pytest.mark.slow
@pytest.mark.parametrize("cap", [1, 5, 7])
def test_chunked_prefill_and_mixed_steps_run_the_manifest_and_match_the_reference(bundle, cap):
    """max_num_batched_tokens on the cuda backend: prompts prefill in chunks that attend to the rows
    earlier chunks cached, while the running sequences decode (a decode step beside each chunk's
    step: CudaBackend.mixed_steps); the context gather's launch gets each sequence's packed context
    start (key_start) and TK rows, and the logits and tokens equal the unchunked reference run's."""
    model, weights = compiled()
    loaded = load_bundle(bundle, arch="sm_90", nvrtc_version=nvrtc_version(), dtype="fp32", block_size=4)
    backend = SteppedCuda.from_bundle(loaded, weights, dtype=torch.float32, top_k=model.spec.dims["top_k"])
    stub = backend.runner = ReferenceKernels(model.graphs)
    gathers = []
    run_all = stub.run_all

    def spy(launches, *, ctx, sizes, **kw):
        if launches[0].family == "mla_gather_context":
            gathers.append((ctx["key_start"].tolist(), sizes["TK"], stub.step))
        return run_all(launches, ctx=ctx, sizes=sizes, **kw)
    stub.run_all = spy
    phases, forward = [], backend.forward
    backend.forward = lambda phase, ids, ctx: phases.append((phase, ctx.context_lens != ctx.query_lens)) or \
        forward(phase, ids, ctx)
    ps = prompts([3, 17, 2, 9], seed=11)
    sp = SamplingParams(max_new_tokens=5, ignore_eos=True, return_logits=True)
    ref = make_engine().generate(ps, sp)
    engine = make_engine(backend_impl=backend, max_num_batched_tokens=cap)
    for a, b in zip(engine.generate(ps, sp), ref):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(a.logits, b.logits, rtol=1e-5, atol=1e-5)
    for starts, tk, step in gathers:
        assert starts == step.key_starts() and tk == starts[-1] == sum(step.context_lens)
    assert any(tk > step.num_tokens for _, tk, step in gathers), "no step attended to a cached prefix"
    first_decode = next(i for i, (phase, _) in enumerate(phases) if phase == "decode")
    assert any(phase == "prefill" and prefix for phase, prefix in phases[first_decode:]), \
        "no chunk ran after decoding began"
    assert engine.tables.free_blocks == engine.tables.allocator.num_blocks
    for a, b in zip(make_engine(backend_impl=backend, max_num_batched_tokens=cap).logits(ps), make_engine().logits(ps)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_linears_run_the_skinny_kernel_up_to_its_token_count_and_cublas_above(bundle, monkeypatch):
    """A linear node carries both steps (codegen/families/linear_skinny.py); each step runs exactly
    one of them, by T: the kernel through T = SKINNY_MAX_TOKENS, the library call from the next
    token on, and the head's logit rows come out right either way."""
    from codegen.families.linear_skinny import SKINNY_MAX_TOKENS
    model, weights = compiled()
    loaded = load_bundle(bundle, arch="sm_90", nvrtc_version=nvrtc_version(), dtype="fp32", block_size=4)
    backend = SteppedCuda.from_bundle(loaded, weights, dtype=torch.float32, top_k=model.spec.dims["top_k"])
    backend.runner = ReferenceKernels(model.graphs)
    # (the kv_b GEMM over the prefill attention's TK context rows is cuBLAS at every T: not these)
    linear_nodes = {s.node for p in loaded.plans.values() for s in p.library_calls
                    if s.op in ("linear", "multi_linear", "gate_up_silu") and s.from_tokens > 1}
    assert {s.op for p in loaded.plans.values() for s in p.library_calls} >= {"multi_linear", "gate_up_silu"}
    kernel_ran, library_ran = [], []
    run_all = ReferenceKernels.run_all

    def spy_kernels(self, launches, **kw):
        kernel_ran.append(launches[0].nodes[0])
        return run_all(self, launches, **kw)
    linear, swiglu = CudaBackend._linear, CudaBackend._gate_up_silu

    def spy_library(self, call, env, rows=None):
        library_ran.append(call.node)
        if call.op == "gate_up_silu":
            return swiglu(self, call, env)
        return linear(self, call, env, rows=rows)
    monkeypatch.setattr(ReferenceKernels, "run_all", spy_kernels)
    monkeypatch.setattr(CudaBackend, "_linear", spy_library)            # the head
    for op in ("linear", "multi_linear", "gate_up_silu"):                 # the others
        monkeypatch.setitem(cuda_backend._ALLOCATING, op, spy_library)
    ours, ref = make_engine(backend_impl=backend), make_engine()
    for lens in ([SKINNY_MAX_TOKENS], [SKINNY_MAX_TOKENS + 1], [2, 3]):
        kernel_ran.clear()
        library_ran.clear()
        ps = prompts(lens, seed=len(lens))
        for a, b in zip(ours.logits(ps), ref.logits(ps)):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        by_kernel = sum(lens) <= SKINNY_MAX_TOKENS
        assert set(kernel_ran if by_kernel else library_ran) >= linear_nodes & set(model.graphs["prefill"])
        assert not (set(library_ran if by_kernel else kernel_ran) & linear_nodes), lens
    # a short prompt's generate: the head runs in the kernel on every row, then the last rows are kept
    sp = SamplingParams(max_new_tokens=3, ignore_eos=True, return_logits=True)
    ps = prompts([2, 3], seed=5)
    for a, b in zip(ours.generate(ps, sp), ref.generate(ps, sp)):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(a.logits, b.logits, rtol=1e-5, atol=1e-5)


def test_loading_a_bundle_imports_no_graph_machinery(bundle):
    """The runtime side of a bundle (load, plans, backend) never imports networkx."""
    code = ("import sys; from codegen.bundle import load_bundle; from codegen.nvrtc import nvrtc_version; "
            "import runtime.cuda_backend, runtime.engine; "
            f"b = load_bundle({str(bundle)!r}, arch='sm_90', nvrtc_version=nvrtc_version()); "
            "assert b.plans['decode'].steps; "
            "assert 'networkx' not in sys.modules, 'networkx was imported'; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=str(ROOT))
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


class WrongPlan(SteppedCuda):
    """The backend with a planted wrong memory plan: slot `late` put on top of slot `early` while
    `early` is still to be read."""

    def plant(self, phase: str, early: str, late: str) -> None:
        arena_plan = self.arena_plans[phase]
        right = arena_plan.layout

        def wrong(sizes, act_itemsize, key=None):
            placed = right(sizes, act_itemsize, key)
            return dataclasses.replace(placed, offsets={**placed.offsets, late: placed.offsets[early]})
        arena_plan.layout = wrong


def _alias_victims(plan):
    """Two values live together, the second made while the first is still to be read by a later node."""
    values = [s for s in plan.arena if "/" not in s.name]   # not workspaces: the stub kernels use none
    for a in values:
        for b in values:
            if a.first < b.first < a.last and a.shape == b.shape and a.dtype == b.dtype == "act":
                return a, b
    raise AssertionError("the tiny model has no two values live together")


def test_the_step_runs_on_aliased_buffers_and_a_wrong_plan_changes_the_logits(bundle):
    """Values share the arena (the plan is much smaller than one buffer per value) and the logits
    still equal the reference backend's (the first test); a planted plan that puts a value on top
    of one still live is an overlap `overlaps` names, and it changes the logits."""
    from codegen.memplan import overlaps
    model, weights = compiled()
    loaded = load_bundle(bundle, arch="sm_90", nvrtc_version=nvrtc_version(), dtype="fp32", block_size=4)
    sizes = {"T": 9, "NP": 9 * 3, "B": 2, "MAXQ": 5, "MAXCTX": 5, "TK": 9, "W": 2, "SMS": H100_SMS}
    assert loaded.plans["prefill"].arena, "the manifest carries the arena's slots"
    arena_plan = CudaBackend.from_bundle(loaded, weights, dtype=torch.float32,
                                         top_k=model.spec.dims["top_k"]).arena_plans["prefill"]
    placed = arena_plan.layout(sizes, 4)
    assert placed.total * 3 < arena_plan.unplanned_bytes(sizes, 4)
    names = [s.name for s in arena_plan.slots]
    assert overlaps(arena_plan.slots, [placed.nbytes[n] for n in names], [placed.offsets[n] for n in names]) is None

    ps = prompts([4, 5])
    ref = make_engine().logits(ps)
    early, late = _alias_victims(loaded.plans["prefill"])
    backend = WrongPlan.from_bundle(loaded, weights, dtype=torch.float32, top_k=model.spec.dims["top_k"])
    backend.runner = ReferenceKernels(model.graphs)
    backend.plant("prefill", early.name, late.name)
    wrong = backend.arena_plans["prefill"].layout(sizes, 4)
    assert overlaps(arena_plan.slots, [wrong.nbytes[n] for n in names],
                    [wrong.offsets[n] for n in names]) is not None
    ours = make_engine(backend_impl=backend).logits(ps)
    assert any(not torch.allclose(a, b, rtol=1e-3, atol=1e-3) for a, b in zip(ours, ref)), \
        f"{late.name} written over {early.name} while it is live, and the logits did not change"
