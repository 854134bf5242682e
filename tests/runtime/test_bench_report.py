"""The bench's derived figures, from a recorded row (no GPU)."""
from __future__ import annotations

import pytest

from runtime.bench import _print_table, decode_bytes, expert_gemm_flops, expert_gemm_rate, routed_expert_rate

DIMS = {"hidden": 2048, "heads": 16, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128,
        "v_head_dim": 128, "experts": 64, "top_k": 6, "moe_intermediate": 1408, "intermediate": 10944,
        "layers": 27, "q_lora_rank": 0, "shared_experts": 2, "vocab": 102400}


def test_routed_expert_rate_is_touched_expert_bytes_over_the_two_expert_families():
    need = decode_bytes(DIMS, 1, 128, 512)
    row = {"bytes": need, "breakdown": {"families": {
        "moe_gate_up_silu": {"ms": 6.0, "launches": 52}, "moe_down": {"ms": 2.0, "launches": 52},
        "cublas/torch": {"ms": 5.0, "launches": 100}}}}
    r = routed_expert_rate(row)
    assert r["ms"] == pytest.approx(8.0)
    assert r["bytes_per_s"] == pytest.approx(need["routed_experts"] / 8e-3)
    # b=128 touches nearly all 64 experts: ~28.8 GB of expert weights a step at V2-Lite's shape
    assert 27e9 < need["routed_experts"] < 29e9


def test_expert_gemm_rate_is_the_expert_flops_over_each_familys_time(capsys):
    """Prefill 32x512 at V2-Lite: 16384 tokens x 6 pairs x 26 MoE layers; gate + up is twice down."""
    flops = expert_gemm_flops(DIMS, 1, 32 * 512)
    assert flops["moe_gate_up_silu"] == 16384 * 6 * 26 * 2 * 2816 * 2048 == 2 * flops["moe_down"]
    row = {"batch": 32, "length": 512, "tokens_per_s": 114.7e3, "expert_flops": flops,
           "breakdown": {"launches": 565, "kernel_ms": 147.7, "families": {
               "moe_gate_up_silu": {"ms": 51.13, "launches": 26}, "moe_down": {"ms": 25.51, "launches": 26}}}}
    r = expert_gemm_rate(row)
    assert r["moe_gate_up_silu"]["flops_per_s"] == pytest.approx(flops["moe_gate_up_silu"] / 51.13e-3)
    assert 570e12 < r["moe_down"]["flops_per_s"] < 590e12
    row["expert_gemms"] = r
    _print_table({"gpu": "H200", "date": "2026-12-02", "copy_bandwidth_GBps": 4250.0, "layers": 27,
                  "decode": [], "prefill": [row]})
    out = capsys.readouterr().out
    assert "moe_gate_up_silu 51.13 ms 577 TFLOP/s; moe_down 25.51 ms 578 TFLOP/s" in out
    assert expert_gemm_rate({"expert_flops": flops}) is None


def test_rates_come_from_the_pdl_free_profile_where_the_row_has_one():
    """With PDL a kernel's wait for its predecessor counts in its profiled time; the bench's
    routed-expert and linear rates use each kernel's own device time (device_breakdown) where
    the row has it, the step's profile otherwise."""
    from runtime.bench import linear_bytes, linear_rate
    need = decode_bytes(DIMS, 1, 32, 512)
    pdl = {"families": {"moe_gate_up_silu": {"ms": 6.0, "launches": 26}, "moe_down": {"ms": 3.0, "launches": 26},
                        "cublas/torch": {"ms": 1.5, "launches": 245}}}
    own = {"families": {"moe_gate_up_silu": {"ms": 4.5, "launches": 26}, "moe_down": {"ms": 2.5, "launches": 26},
                        "cublas/torch": {"ms": 1.2, "launches": 245}}}
    row = {"batch": 32, "bytes": need, "breakdown": pdl, "device_breakdown": own, "linear_bytes": linear_bytes(DIMS, 1)}
    assert routed_expert_rate(row)["ms"] == pytest.approx(7.0)
    assert linear_rate(row)["ms"] == pytest.approx(1.2)
    del row["device_breakdown"]
    assert routed_expert_rate(row)["ms"] == pytest.approx(9.0)
    assert linear_rate(row)["ms"] == pytest.approx(1.5)


def test_no_breakdown_no_rate():
    assert routed_expert_rate({"bytes": {"routed_experts": 1.0}}) is None
    assert routed_expert_rate({"bytes": {"routed_experts": 1.0}, "breakdown": {"families": {}}}) is None


def test_table_prints_kernels_per_layer_and_the_routed_expert_rate(capsys):
    need = decode_bytes(DIMS, 1, 128, 512)
    row = {"batch": 128, "context": 512, "ms": 14.5, "floor_ms": 7.8, "fraction_of_bandwidth": 0.54, "bytes": need,
           "breakdown": {"launches": 591, "kernel_ms": 13.5, "families": {
               "moe_gate_up_silu": {"ms": 5.55, "launches": 52}, "moe_down": {"ms": 2.87, "launches": 52}}}}
    row["routed_experts"] = routed_expert_rate(row)
    _print_table({"gpu": "H200", "date": "2026-12-01", "copy_bandwidth_GBps": 4218.0, "layers": 27,
                  "decode": [row], "prefill": []})
    out = capsys.readouterr().out
    assert "591 kernels (21.9 a layer)" in out
    assert "8.42 ms   3.42 TB/s" in out


def test_kernels_are_attributed_to_their_family_or_the_libraries():
    from runtime.bench import family_of
    assert family_of("moe_gate_up_silu__bf16__e64_k6__m1408_d2048__mma") == "moe_gate_up_silu"
    assert family_of("mla_decode_attention__bf16__h16") == "mla_decode_attention"
    # cuBLAS's split-K reduce has "__" in its template arguments, but is the library's
    assert family_of("void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16>(...)") == "cublas/torch"
    assert family_of("nvjet_tst_64x8_64x16_4x1_v_bz_splitK_TNT") == "cublas/torch"


@pytest.mark.slow
@pytest.mark.parametrize("spec_file", ["deepseek_v2_lite.yaml", "deepseek_v2.yaml", "deepseek_v3.yaml"])
def test_linear_bytes_are_the_decode_graphs_linear_weights(spec_file):
    """linear_bytes is what the decode graph's linear ops (and the multi_linears and gate_up_silus
    that fused sibling ones) bind, weight by weight: without the shared experts, which run in the
    grouped expert ops (fuse_shared_experts)."""
    from codegen.paths import MODEL_SPECS_DIR
    from ir.graph import build_graph
    from ir.passes import run_pipeline
    from ir.spec import load_spec
    from runtime.bench import linear_bytes
    spec = load_spec(str(MODEL_SPECS_DIR / spec_file))
    G = run_pipeline(build_graph(spec, "decode"))
    info = G.graph["weights"]
    want = 0
    for _, d in G.nodes(data=True):
        if d.get("op") in ("linear", "multi_linear", "gate_up_silu"):
            for name in d["weights"].values():
                rows, cols = info[name].shape
                want += rows * cols * 2
    dims = {k: (v or 0) for k, v in spec.dims.items()}
    assert linear_bytes(dims, spec.plan.first_k_dense_replace, shared=False) == want
    assert all(d["attrs"]["shared_experts"] == dims["shared_experts"] for _, d in G.nodes(data=True)
               if d["op"] == "moe_route")


def test_the_expert_rate_counts_the_shared_experts_where_they_run_in_the_expert_kernels():
    need = decode_bytes(DIMS, 1, 1, 512)
    row = {"batch": 1, "bytes": need, "device_breakdown": {"families": {"moe_gate_up_silu": {"ms": 0.5, "launches": 26},
                                                                        "moe_down": {"ms": 0.25, "launches": 26}}}}
    alone = routed_expert_rate(row)
    together = routed_expert_rate({**row, "shared_in_experts": True})
    assert alone["bytes"] == need["routed_experts"]
    assert together["bytes"] == need["routed_experts"] + need["shared_experts"]
    assert together["bytes_per_s"] == pytest.approx(together["bytes"] / 0.75e-3)


def test_table_prints_the_linears_rate(capsys):
    from runtime.bench import linear_bytes, linear_rate
    row = {"batch": 1, "context": 512, "ms": 3.9, "floor_ms": 1.17, "fraction_of_bandwidth": 0.3,
           "bytes": decode_bytes(DIMS, 1, 1, 512), "linear_bytes": linear_bytes(DIMS, 1),
           "breakdown": {"launches": 565, "kernel_ms": 3.3, "families": {"cublas/torch": {"ms": 1.0, "launches": 191}}}}
    row["linears"] = linear_rate(row)
    assert row["linears"]["bytes_per_s"] == pytest.approx(row["linear_bytes"] / 1e-3)
    _print_table({"gpu": "H200", "date": "2026-12-01", "copy_bandwidth_GBps": 4200.0, "layers": 27,
                  "decode": [row], "prefill": []})
    out = capsys.readouterr().out
    tbps = row["linear_bytes"] / 1e-3 / 1e12
    assert f"1.00 ms  {tbps:5.2f} TB/s  ({tbps / 4.2 * 100:.0f}% of copy)" in out


def _k(pdl: bool, grid=(1, 1, 1)):
    from codegen.kernel import KernelLaunch
    return KernelLaunch(family="f", template="f.cu.j2", name="f", params={}, nodes=("n",), grid=grid,
                        block=(32, 1, 1), args=(), pdl=pdl)


def _lib(op: str, from_tokens: int = 1):
    from codegen.kernel import LibraryCall
    return LibraryCall(node="n", op=op, call=op, inputs=(), outputs=(), from_tokens=from_tokens)


def test_pdl_edges_count_the_pdl_launches_right_after_a_pdl_kernel():
    from codegen.plan import PhasePlan
    from runtime.bench import pdl_edges
    steps = [_k(True), _k(True),                  # the second overlaps the first
             _lib("split"), _k(True),             # a view launches nothing: overlaps too
             _lib("linear"), _k(True),            # after cuBLAS: PDL, not overlapped
             _lib("linear", from_tokens=17), _k(True),   # cuBLAS from 17 tokens on: not at T = 1
             _k(False), _k(True),                 # after a plain kernel: not overlapped
             _k(True, grid=("T - 1", 1, 1)),      # not launched at T = 1 ...
             _k(True)]                            # ... so this one follows the one before it
    edges = pdl_edges(PhasePlan("decode", steps=steps), {"T": 1})
    assert edges == {"kernels": 8, "pdl": 7, "overlapped": 4}


@pytest.mark.slow
def test_pdl_edges_of_a_v2_lite_decode_step():
    """Batch 1, V2-Lite: every kernel launch is PDL and follows a PDL kernel; with pdl off, nothing
    is PDL and the same kernels launch."""
    import dataclasses

    from codegen.bundle import plan_spec
    from codegen.kernel import DEFAULTS
    from codegen.paths import MODEL_SPECS_DIR
    from runtime.bench import pdl_edges
    spec = str(MODEL_SPECS_DIR / "deepseek_v2_lite.yaml")
    sizes = {"T": 1, "B": 1, "NP": 6, "MAXQ": 1, "MAXCTX": 512, "W": 128, "SMS": 132}
    on = pdl_edges(plan_spec(spec, DEFAULTS).plans["decode"], sizes)
    off = pdl_edges(plan_spec(spec, dataclasses.replace(DEFAULTS, pdl=False)).plans["decode"], sizes)
    assert off == {"kernels": on["kernels"], "pdl": 0, "overlapped": 0}
    assert on["kernels"] >= on["pdl"] >= on["overlapped"] >= 5 * 26
    # at T = 1 the linears are the skinny kernel (their cuBLAS calls run from 17 tokens on): every
    # kernel but the step's first follows a PDL kernel
    assert on["overlapped"] == on["kernels"] - 1


def test_table_prints_the_pdl_edges(capsys):
    row = {"batch": 1, "context": 512, "ms": 3.9, "floor_ms": 1.17, "fraction_of_bandwidth": 0.3,
           "pdl_edges": {"kernels": 374, "pdl": 266, "overlapped": 157}}
    _print_table({"gpu": "H200", "date": "2026-12-01", "copy_bandwidth_GBps": 4218.0, "layers": 27, "pdl": True,
                  "decode": [row], "prefill": []})
    out = capsys.readouterr().out
    assert "PDL on" in out and "374 kernels   266 PDL   157 after a PDL kernel" in out


def test_the_linears_are_the_skinny_family_plus_cublas_each_with_its_rate(capsys):
    """Up to SKINNY_MAX_TOKENS a step's linears are the linear_skinny kernels (cuBLAS keeps torch's
    odd kernel), above it cuBLAS: the linear figure adds both, and the family that served the step
    gets the rate over the linears' weights."""
    from codegen.families.linear_skinny import SKINNY_MAX_TOKENS
    from runtime.bench import family_of, linear_bytes, linear_rate
    assert family_of("linear_skinny__bf16__k2048__o3072_576") == "linear_skinny"
    lb = linear_bytes(DIMS, 1)
    rows = []
    for batch, fams in ((1, {"linear_skinny": 0.6, "cublas/torch": 0.02}),
                        (SKINNY_MAX_TOKENS + 1, {"cublas/torch": 1.1})):
        row = {"batch": batch, "context": 512, "ms": 3.9, "floor_ms": 1.17, "fraction_of_bandwidth": 0.3,
               "bytes": decode_bytes(DIMS, 1, batch, 512), "linear_bytes": lb,
               "breakdown": {"launches": 500, "kernel_ms": 3.0,
                             "families": {f: {"ms": ms, "launches": 10} for f, ms in fams.items()}}}
        row["linears"] = linear_rate(row)
        rows.append(row)
    small, big = rows[0]["linears"], rows[1]["linears"]
    assert small["ms"] == pytest.approx(0.62) and small["bytes_per_s"] == pytest.approx(lb / 0.62e-3)
    assert small["families"]["linear_skinny"]["bytes_per_s"] == pytest.approx(lb / 0.6e-3)
    assert small["families"]["cublas/torch"]["bytes_per_s"] is None
    assert big["ms"] == pytest.approx(1.1) and big["families"]["cublas/torch"]["bytes_per_s"] == pytest.approx(lb / 1.1e-3)
    _print_table({"gpu": "H200", "date": "2026-12-02", "copy_bandwidth_GBps": 4200.0, "layers": 27,
                  "decode": rows, "prefill": []})
    out = capsys.readouterr().out
    assert f"linear_skinny 0.60 ms {lb / 0.6e-3 / 1e9:.0f} GB/s; cublas/torch 0.02 ms" in out
    assert f"cublas/torch 1.10 ms {lb / 1.1e-3 / 1e9:.0f} GB/s" in out


def test_bench_token_ids_are_the_same_every_run_and_differ_by_case():
    torch = pytest.importorskip("torch")
    from runtime.bench import _token_ids
    a = _token_ids(102400, (128,), 512)
    assert torch.equal(a, _token_ids(102400, (128,), 512))          # both arms of an A/B route alike
    assert not torch.equal(a, _token_ids(102400, (128,), 4096))
    assert a.shape == (128,) and 0 <= int(a.min()) and int(a.max()) < 102400


def test_bench_cases_from_the_command_line():
    import argparse

    from runtime.bench import DECODE_CASES, PREFILL_CASES, bench_cases, cases_arg
    from runtime.errors import InputError
    assert cases_arg("1x512, 192X512") == [(1, 512), (192, 512)]
    assert cases_arg("none") == []
    from runtime.bench import max_seq_len_for, prefill_cases_arg
    assert prefill_cases_arg("1x32768,2x9000") == [(1, 32768), (2, 9000)]   # a long prompt: prefill only
    with pytest.raises(argparse.ArgumentTypeError):
        prefill_cases_arg("1x32769")
    assert max_seq_len_for([(1, 32768)]) == 32768 and max_seq_len_for([(32, 512)]) == max_seq_len_for([]) == 8192
    for bad in ("1x", "x512", "1*512", "0x512", "257x512", "1x9000", "1x512,"):
        with pytest.raises(argparse.ArgumentTypeError):
            cases_arg(bad)
    ns = argparse.Namespace
    assert bench_cases(ns(quick=False, decode=None, prefill=None)) == (DECODE_CASES, PREFILL_CASES)
    assert bench_cases(ns(quick=True, decode=[(192, 512)], prefill=[])) == ([(192, 512)], [])
    with pytest.raises(InputError):
        bench_cases(ns(quick=False, decode=[], prefill=[]))


def test_a_bad_bench_case_is_one_line_from_the_cli(capsys):
    from runtime.cli import main
    with pytest.raises(SystemExit) as e:
        main(["bench", "--decode", "999x512"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "batch must be 1..256" in err[-1]


def test_timeit_keeps_stepping_until_the_warm_up_time_has_passed(monkeypatch):
    """A case is timed only after `warm_s` seconds of untimed steps (the GPU's clocks settle: a b=1
    step right after the prefill cases read 2.05 ms at 1560 MHz against 2.00 steady, PERF_NOTES
    v29); the timed steps are exactly `iters` and the result their median."""
    import torch

    from runtime import bench
    now = [0.0]
    calls = []

    class Event:
        def __init__(self, enable_timing=False):
            self.t = None

        def record(self):
            self.t = now[0]

        def synchronize(self):
            pass

        def elapsed_time(self, end):
            return (end.t - self.t) * 1e3

    def step():   # each step takes 10 ms of "GPU" time; a warm step 20 ms (the clocks still low)
        calls.append(now[0])
        now[0] += 0.02 if now[0] < 0.3 else 0.01

    monkeypatch.setattr(bench.time, "perf_counter", lambda: now[0])
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    ms = bench._timeit(step, 5, warmup=2, warm_s=0.5)
    assert ms == pytest.approx(10.0)
    # 2 warm-up calls (to 0.04 s), then steps until 0.5 s more have passed (13 slow ones to 0.3 s,
    # 24 fast ones to 0.54 s), then the 5 timed
    assert len(calls) == 2 + 13 + 24 + 5
    assert calls[-5] == pytest.approx(0.54)
    now[0], calls[:] = 0.0, []
    assert bench._timeit(step, 3, warmup=1) == pytest.approx(20.0)   # no warm time: the slow steps
    assert len(calls) == 4


def test_mla_decode_times_are_per_layer_own_times_and_the_cache_rate(capsys):
    """Issue 14's MLA targets are a layer's: the attention's microseconds and its cache reads per
    second, the absorbed query's and v_up's microseconds, from the PDL-free profile."""
    from runtime.bench import mla_decode_times
    need = decode_bytes(DIMS, 1, 128, 4096)
    fams = {"mla_decode_attention": {"ms": 3.87, "launches": 27}, "mla_decode_query": {"ms": 0.169, "launches": 27},
            "mla_v_up": {"ms": 0.137, "launches": 27}}
    row = {"batch": 128, "context": 4096, "bytes": need, "breakdown": {"launches": 306, "kernel_ms": 13.3, "families": {
               "mla_decode_attention": {"ms": 9.0, "launches": 27}}},
           "device_breakdown": {"families": fams}}
    x = mla_decode_times(row)
    assert x["attention_us"] == pytest.approx(3870 / 27)
    assert x["query_us"] == pytest.approx(169 / 27) and x["v_up_us"] == pytest.approx(137 / 27)
    # 128 x 4096 rows of 576 bf16 over 27 layers: 16.3 GB of cache a step
    assert x["cache_bytes_per_s"] == pytest.approx(128 * 4096 * 576 * 2 * 27 / 3.87e-3)
    row["mla_decode"] = x
    _print_table({"gpu": "H200", "date": "2026-12-04", "copy_bandwidth_GBps": 4230.0, "layers": 27,
                  "decode": [{**row, "ms": 12.6, "floor_ms": 11.5, "fraction_of_bandwidth": 0.9}], "prefill": []})
    out = capsys.readouterr().out
    assert "MLA decode a layer" in out
    assert "attention  143.3 us (4.21 TB/s of cache)   query    6.3 us   v_up    5.1 us" in out
    assert mla_decode_times({"bytes": need, "breakdown": {"families": {}}}) is None


def test_a_gpu_too_small_for_the_full_bench_is_one_line(monkeypatch, tmp_path, capsys):
    """The full set needs more than an 80 GB H100 holds: torch's allocator report becomes one line."""
    import torch

    from runtime import bench
    from runtime.cli import main

    def oom(*args):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 352.00 MiB ...")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: type("P", (), {"total_memory": 79 * 2**30}))
    monkeypatch.setattr(bench, "_run_bench", oom)
    assert main(["bench", "--json", str(tmp_path / "b.json")]) != 0
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "ran out of GPU memory (79 GiB on this GPU)" in err and "--prefill none" in err


def _v2_lite_bench_memory():
    """(weights, the default cases' KV cache, the transformers side's need) in bytes, bf16."""
    import torch

    from codegen.paths import DEFAULT_SPEC
    from ir.spec import load_spec
    from runtime import bench
    from runtime.kv_cache import PagedLatentCache
    from runtime.memory import weight_bytes
    from runtime.model_loader import compile_graphs, weight_specs
    spec = load_spec(str(DEFAULT_SPEC))
    weights = weight_bytes(weight_specs(compile_graphs(spec).graphs), torch.bfloat16)
    blocks = bench.bench_num_blocks(bench.DECODE_CASES, bench.PREFILL_CASES, 64)
    cache = blocks * PagedLatentCache.bytes_per_block(spec.dims["layers"], 64, spec.model.cache_width, torch.bfloat16)
    hf_cases = [c for c in bench.HF_DECODE_CASES if c in bench.DECODE_CASES]
    need = weights + bench.hf_activation_bytes(spec.dims, bench.PREFILL_CASES, hf_cases)
    return weights, cache, need


@pytest.mark.parametrize("gpu_gib,where", [(79.1, "after_cache"), (139.8, "beside"), (40.0, "skip")])
def test_the_transformers_side_loads_where_the_measured_free_memory_says(gpu_gib, where):
    """The default cases on an 80 GB H100 (79.1 GiB to torch): the engine's weights and cache leave too
    little for a second copy of the weights, so the cache and graphs go first (they hold ~20 GB);
    an H200 holds both; a 40 GB GPU neither (one line, the engine's numbers kept)."""
    from runtime import bench
    weights, cache, need = _v2_lite_bench_memory()
    assert 30e9 < weights < 33e9 and cache > 15e9
    overhead = 2 << 30    # CUDA context, the arenas, the graphs' pool: what the engine holds beyond these
    free = int(gpu_gib * 2**30) - weights - cache - overhead
    got, why = bench.transformers_placement(free, cache + overhead // 2, need)
    assert got == where, why
    assert "\n" not in why and (got != "skip" or "--no-transformers" in why)


@pytest.mark.parametrize("cap", [None, 1, 7, 16, 40])
def test_bench_prefill_steps_chunk_as_the_engine_does_and_give_its_logits(cap):
    """dsgraph bench --max-num-batched-tokens: a case's prompts run in steps of at most `cap` tokens,
    every token once and in order, each chunk over the rows the earlier ones cached; the last step
    of each prompt gives the unchunked prefill's last-token logits (reference backend, fp32)."""
    import torch

    from runtime.bench import _prefill_steps, _release
    from tiny_engine import make_engine
    engine = make_engine(num_blocks=64)
    seq_ids, steps = _prefill_steps(engine, 3, 13, cap)
    assert all(cap is None or s.num_tokens <= cap for s, _ in steps)
    last = {}
    for step, ids in steps:
        out = engine.backend.forward("prefill", ids, step)
        assert out.shape[0] == step.num_seqs
        at = 0
        for q, c, b in zip(step.query_lens, step.context_lens, range(step.num_seqs)):
            assert step.positions[at:at + q].tolist() == list(range(c - q, c))
            at += q
            if c == 13:
                last.setdefault(len(last), out[b])
    assert len(last) == 3 and len(steps) == (1 if cap is None else -(-39 // cap))
    ref = make_engine(num_blocks=64)
    ref_ids, ((rstep, rids),) = _prefill_steps(ref, 3, 13, None)
    expect = ref.backend.forward("prefill", rids, rstep)
    for b in range(3):
        torch.testing.assert_close(last[b], expect[b], rtol=1e-5, atol=1e-5)
    _release(engine, seq_ids)
    assert engine.tables.free_blocks == engine.tables.allocator.num_blocks


def test_cases_past_the_specs_max_positions_are_one_line_and_the_rest_fit_its_cache(capsys, monkeypatch):
    """deepseek_tiny holds 4096 positions: a 1x8192 case is refused in one line before a GPU is looked for;
    cases within it build the engine with max_seq_len 4096 (the bench's usual 8192 would be refused)."""
    import torch

    from runtime import bench, engine
    from runtime.cli import main
    assert main(["bench", "--spec", "deepseek_tiny", "--decode", "1x512,2x8192", "--prefill", "1x5000"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "2x8192, 1x5000" in err and "max_positions=4096" in err

    built = {}

    class Built(Exception):
        pass

    def from_spec(spec, **kw):
        built.update(kw)
        raise Built

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bench, "copy_bandwidth", lambda: 3e12)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "a GPU")
    monkeypatch.setattr(engine.Engine, "from_spec", staticmethod(from_spec))
    with pytest.raises(Built):
        main(["bench", "--spec", "deepseek_tiny", "--decode", "1x512", "--prefill", "1x2048", "--no-transformers"])
    assert built["max_seq_len"] == 4096
