"""Prefill kernel timings at DeepSeek-V2-Lite dims (a script, not a test).

    python3 -m bench.perf_prefill [--batch 32] [--seqlen 512] [--families moe,attn,...]
                                      [--attn-variants v2,v2_m128n32w32s]
                                      [--route-tokens 257,2048,16384] [--route-variants default,gemv,align0]
                                      [--gemm-variants wgmma,64x3] [--wgmma-shapes 32x512,1x2048]

Builds one-node graphs of the prefill phase's generated kernels (the same lowering the
bundle uses), runs them through KernelRunner on random bf16 tensors at T = batch * seqlen
and times every launch as a CUDA graph of a few launches of it (runtime.timing.graph_us: no host
cost per launch, so a launch of a few us shows its device time, not the ~30 us an eager launch
costs the host); a big-T spot check against torch follows for the tensor-core paths and the
router logits (the property tests in test_kernels_*.py cover the edges at small T).

The route (--families route) runs at each --route-tokens T (default: batch * seqlen) under each
--route-variants entry, each with its own KernelRunner (kernel names repeat across variants):
  default          the lowering as shipped (T > 256: router GEMM, top-k, one-CTA align)
  gemv             tuning route.gemm_above=none: the GEMV for the logits at every T (before the GEMM)
  alignP           tuning moe.align_parallel_above=P: count / scan / scatter above P pairs (align0: always)
The router GEMM's tile is not a tuning knob (moe_route's GEMM_* constants), so it has no variant here.
Each running launch is timed alone, then the route's launches together ("route total", one graph
node each, as a prefill step runs them).  Choosing moe.align_parallel_above: run default and align0
over --route-tokens 257,512,1024,2048,4096,8192,16384 and set it to the largest T*K at which the
one-CTA align is still the faster (the parallel form's three launches against the one).

Every variant is a codegen.tuning.Tuning in the compile options (Options(tuning=...)): the
attention's --attn-variants are attention.prefill_tile, --gemm-variants BKxSTAGES are
moe.gemm_bk / moe.gemm_stages (with moe.decode_wgmma=false and moe.prefill_wgmma_above=none, so
the mma.sync launch they shape is the one timed: add 32x4 for the default's), 'wgmma' sets moe.prefill_wgmma_above (none for the mma.sync launch).

Router GEMM prediction (V2-Lite, E 64, D 2048, H200 at ~1.8 GHz: 132 SMs x 128 fp32 lanes): its
inner loop is 512 FFMA in 644 instructions a stage (ptxas, sm_90), so the issue rate caps it at
~80% of the FMA peak.  T = 16384: 256 tiles, two CTAs an SM, 2 T E D = 4.3 GFLOP -> ~90-110 us
(569 us with the GEMV).  T = 2048: 32 tiles x 4 splits of D = 128 CTAs, 0.54 GFLOP -> ~12-16 us
with the split's sum (GEMV ~70 us).  T = 257: 5 tiles x 8 splits -> ~5 us.

Roofline predictions at T = 16384 (32 x 512), K = 6 so NP = 98304 pairs; ceilings taken as
~700 TFLOP/s dense bf16 on tensor cores (mma.sync reaches maybe 60-70% of it), ~60 TFLOP/s
fp32 on CUDA cores and ~4 TB/s HBM:
  mla_prefill_attention   causal 512 per prompt, H 16, DK 192, V 128:
                          32*16 * (512*513/2) * (192 + 128) * 2 = 43 GFLOP -> 61 us at 700 TF;
                          bytes: q 101 MB + kv 134 MB + out 67 MB = 302 MB -> 75 us.  ~0.1 ms
                          (the fp32 CUDA-core kernel is bounded by ~60 TF fp32 -> >= 0.7 ms)
  moe_gate_up_silu        NP * 2 * (2 * 1408) * 2048 = 1.13 TFLOP -> 1.6 ms at 700 TF (weights
                          738 MB -> 0.18 ms, so compute-bound);  ~2.5 ms with mma.sync
  moe_gate_up             same FLOPs, two outputs: 1.6 ms
  moe_down                NP * 2 * 2048 * 1408 = 0.57 TFLOP -> 0.8 ms;  ~1.2 ms with mma.sync
  moe_route gemm          T * 64 * 2048 * 2 = 4.3 GFLOP fp32 -> 70 us (x: 67 MB -> 17 us)
  moe_route topk          logits 4 MB read: a few us
  moe_route align         98k pairs, two smem atomics each, one CTA: ~50-100 us (latency-bound;
                          measured 90.6 us, docs/PERF_NOTES.md); count / scan / scatter over 48
                          chunks: ~3 launches of a few us each
  moe_combine_residual    eo 403 MB + 2 x 67 MB in + 67 MB out = 604 MB -> 0.15 ms
  rms_norm / fused_add    67 MB in + 67 MB out (x2 for fused) -> 34 / 67 us
The whole prefill then wants ~26 MoE layers x ~4 ms + attention ~27 x 0.3 ms ≈ 110 ms of
generated kernels next to the cuBLAS linears.
"""
from __future__ import annotations

import argparse
import dataclasses

import torch

from bench.perf_decode import lite
from tests.gpu.harness import single_op_graph
from runtime.timing import graph_us

import ir
from codegen.families import family_for_op
from codegen.kernel import Options
from codegen.tuning import DEFAULT_TUNING, Tuning, TuningError
from ir.ops import TType
from runtime.launcher import KernelRunner

DEV = "cuda"
DT = torch.bfloat16


def tuned(section: str, **knobs) -> Tuning:
    """The default tuning with some knobs of one section changed; SystemExit (one line) on a value
    the tuning refuses."""
    try:
        return dataclasses.replace(DEFAULT_TUNING, **{section: dataclasses.replace(getattr(DEFAULT_TUNING, section),
                                                                                   **knobs)})
    except TuningError as e:
        raise SystemExit(f"perf_prefill: {e}") from None


def lower(G, nid, dtype="bf16", tuning: Tuning = DEFAULT_TUNING):
    return family_for_op(G.nodes[nid]["op"]).lower(nid, G, Options(dtype=dtype, tuning=tuning))


def rand(*shape, scale=1.0, dtype=DT):
    return (torch.randn(*shape, device=DEV) * scale).to(dtype)


def time_launch(runner, launch, kw, budget_s=0.05):
    """ms per launch: a few launches captured in one CUDA graph, replayed and timed with events
    (runtime.timing.graph_us), as many as fit ~budget_s of device time (3 to 20)."""
    runner.run(launch, **kw)                       # compile + warm up
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    runner.run(launch, **kw)
    e.record()
    torch.cuda.synchronize()
    one = max(s.elapsed_time(e), 1e-3)             # an upper bound (host launch cost included)
    iters = int(max(3, min(20, budget_s * 1e3 / one)))
    return graph_us(lambda: runner.run(launch, **kw), iters) / 1e3


def routing(T, E, K, device=None):
    """Uniform random top-K of E per token, grouped by expert (order, offsets) on the GPU."""
    device = device or DEV
    ids = torch.rand(T, E, device=device).topk(K, dim=1).indices
    flat = ids.reshape(-1)
    order = torch.sort(flat, stable=True).indices.to(torch.int32)
    counts = torch.bincount(flat, minlength=E)
    offsets = torch.zeros(E + 1, dtype=torch.int32, device=device)
    offsets[1:] = torch.cumsum(counts, 0)
    return ids, order, offsets


def relerr(a, b):
    a, b = a.float(), b.float()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-6)).item()


ROWS = []


def report(name, ms, predict_us, note=""):
    ROWS.append((name, ms, predict_us, note))
    print(f"{name:<58} {ms * 1e3:>11.1f} us   roofline ~{predict_us:>7.0f} us  {note}", flush=True)


def bench_attention(runner, m, B, L, variants=("v2",)):
    """The prefill attention at B prompts of L tokens, once per tensor-core variant (each lowered with
    the tuning attention.prefill_tile set to it; their kernel names differ, so one runner holds them
    all): time, TFLOP/s, and a spot check of two sequences against torch sdpa (the output is
    poisoned with NaN before each variant, so rows it leaves unwritten show)."""
    d = m.dims
    H, N, R, V, C = d["heads"], d["qk_nope_head_dim"], d["qk_rope_head_dim"], d["v_head_dim"], d["kv_lora_rank"]
    T = B * L
    G, nid = single_op_graph(m, "mla_prefill_attention", {},
                             {"q_nope": TType(("T", H, N), "act"), "q_rot": TType(("T", H, R), "act"),
                              "kv": TType(("T", H * (N + V)), "act"), "k_rot": TType(("T", R), "act")}, {})
    qbuf = rand(T, H, N + R)
    q_nope = qbuf[..., :N]
    q_rot = rand(T, H, R)
    kv = rand(T, H * (N + V))
    k_rot = rand(T, C + R)[:, C:]
    out = torch.full((T, H * V), float("nan"), device=DEV, dtype=DT)
    qs = (torch.arange(B + 1, dtype=torch.int32) * L).to(DEV)
    pos = torch.arange(L, dtype=torch.int64).repeat(B).to(DEV)
    ctx = {"query_start": qs, "positions": pos}
    kw = dict(values={"q_nope": q_nope, "q_rot": q_rot, "kv": kv, "k_rot": k_rot, "out": out}, ctx=ctx,
              sizes={"T": T, "B": B, "MAXQ": L, "MAXCTX": L, "NP": T})
    flops = B * H * (L * (L + 1) / 2) * (N + R + V) * 2
    byts = (T * H * (N + R) + T * H * (N + V) + T * H * V) * 2
    # the reference: two sequences against torch (fp32)
    scale = G.graph["model"].softmax_scale
    refs = {}
    for b in (0, B - 1):
        sl = slice(b * L, (b + 1) * L)
        q = torch.cat([q_nope[sl], q_rot[sl]], -1).float().transpose(0, 1)               # [H, L, DK]
        kvb = kv[sl].view(L, H, N + V).float()
        k = torch.cat([kvb[..., :N], k_rot[sl].float()[:, None, :].expand(L, H, R)], -1).transpose(0, 1)
        v = kvb[..., N:].transpose(0, 1)
        refs[b] = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    for variant in variants:
        launches = lower(G, nid, tuning=attention_variant(variant))
        out.fill_(float("nan"))
        for launch in launches:
            ms = time_launch(runner, launch, kw)
            report(launch.name, ms, max(flops / 700e12, byts / 4e12) * 1e6, f"{flops / ms / 1e9:.0f} TFLOP/s")
        errs = [relerr(out[b * L:(b + 1) * L].view(L, H, V).transpose(0, 1), ref) for b, ref in refs.items()]
        nan = torch.isnan(out).any().item()
        print(f"    {variant}: spot check vs torch sdpa: max rel err {max(errs):.2e}; unwritten/NaN: {nan}",
              flush=True)


def attention_variant(name: str) -> Tuning:
    """The tuning for an --attn-variants entry: v2 (the default tile) or a prefill_tile spelling."""
    return DEFAULT_TUNING if name == "v2" else tuned("attention", prefill_tile=name)


def route_variant(name: str) -> Tuning:
    """The tuning for a --route-variants entry (see the module docstring)."""
    if name == "default":
        return DEFAULT_TUNING
    if name == "gemv":
        return tuned("route", gemm_above=None)
    if name.startswith("align") and name[5:].isdigit():
        return tuned("moe", align_parallel_above=int(name[5:]))
    raise SystemExit(f"unknown route variant {name!r} (default, gemv, alignPAIRS)")


def gemm_variant(name: str) -> Tuning:
    """The tuning for a --gemm-variants BKxSTAGES entry: the mma.sync launch's K slice and ring depth,
    with both wgmma launches off so the mma.sync launch serves every T above the GEMV's."""
    try:
        bk, stages = (int(x) for x in name.split("x"))
    except ValueError:
        raise SystemExit(f"--gemm-variants {name!r}: expected BKxSTAGES (e.g. 64x3) or wgmma") from None
    return tuned("moe", gemm_bk=bk, gemm_stages=stages, decode_wgmma=False, prefill_wgmma_above=None)


def bench_route(m, T, variant="default"):
    """The route at T under a variant: each running launch alone, then all of them ("route total");
    the logits checked against torch (fp32) and the ids' alignment against torch's bincount."""
    d = m.dims
    E, K, D = d["experts"], d["top_k"], d["hidden"]
    attrs = {"top_k": K, "num_experts": E, "scoring": "softmax", "method": "greedy", "groups": 1,
             "topk_groups": 1, "norm_topk_prob": False, "routed_scaling_factor": 1.0}
    G, nid = single_op_graph(m, "moe_route", attrs, {"x": TType(("T", D), "act")}, {"gate": "router.weight"})
    ids, w, r = G.nodes[nid]["outputs"]
    x = rand(T, D)
    values = {"x": x, ids: torch.empty(T, K, dtype=torch.int64, device=DEV),
              w: torch.empty(T, K, dtype=torch.float32, device=DEV),
              f"{r}.order": torch.empty(T * K, dtype=torch.int32, device=DEV),
              f"{r}.offsets": torch.empty(E + 1, dtype=torch.int32, device=DEV)}
    gate = torch.randn(E, D, device=DEV) / D ** 0.5
    weights = {"router.weight": gate}
    launches = lower(G, nid, tuning=route_variant(variant))
    runner = KernelRunner()                # kernel names repeat across variants: a fresh module cache
    sizes = runner.step_sizes({"T": T, "NP": T * K}, {}, values)
    from codegen import sizes as size_exprs
    running = [la for la in launches if 0 not in [size_exprs.evaluate(g, sizes) for g in la.grid]]
    kw = dict(values=values, weights=weights, sizes=sizes)
    ws = runner.run_all(running, **kw)
    kw["workspaces"] = ws
    flops = T * E * D * 2
    predict = {"router_gemv": flops / 60e12, "router_gemm": flops / 60e12, "topk": T * E * 4 / 4e12,
               "align": 60e-6 * T / 16384}
    print(f"# route T={T} ({variant})", flush=True)
    for la in running:
        ms = time_launch(runner, la, kw)
        note = f"{flops / ms / 1e9:.1f} TFLOP/s" if la.stage.startswith("router_") else ""
        if la.stage == "router_gemm":
            note += f", {size_exprs.evaluate(la.grid[2], sizes)} splits of D"
        report(f"  {la.name}", ms, predict.get(la.stage, 0) * 1e6, note)
    total = graph_us(lambda: runner.run_all(running, **kw), 10) / 1e3
    report(f"  route total T={T} ({variant}, {len(running)} launches)", total, 0)
    runner.run_all(running, **kw)
    err = relerr(ws["router_logits"], x.float() @ gate.T)
    offsets = values[f"{r}.offsets"].long()
    counts = torch.bincount(values[ids].reshape(-1), minlength=E)
    aligned = torch.equal(offsets[1:] - offsets[:-1], counts) and int(offsets[-1]) == T * K
    print(f"    logits vs torch fp32: max rel err {err:.2e}; alignment matches the ids: {aligned}", flush=True)
    runner.close()


def bench_grouped(runner, m, T, which, tuning: Tuning = DEFAULT_TUNING):
    d = m.dims
    E, K, D, M = d["experts"], d["top_k"], d["hidden"], d["moe_intermediate"]
    NP = T * K
    ids, order, offsets = routing(T, E, K)
    r = TType((f"T*{K}", E), "routing")
    R = {"order": order, "offsets": offsets}
    if which == "moe_down":
        G, nid = single_op_graph(m, which, {"num_experts": E, "out_dim": D},
                                 {"a": TType((f"T*{K}", M), "act"), "R": r}, {"weight": "e.{expert}.down"})
        inp = rand(NP, M)
        weights = {"e.*.down": rand(E, D, M, scale=M ** -0.5)}
        first, n_out = "a", D
        flops = NP * 2 * D * M
    else:
        G, nid = single_op_graph(m, which, {"num_experts": E, "out_dim": M},
                                 {"x": TType(("T", D), "act"), "R": r},
                                 {"gate": "e.{expert}.gate", "up": "e.{expert}.up"})
        inp = rand(T, D)
        weights = {"e.*.gate": rand(E, M, D, scale=D ** -0.5), "e.*.up": rand(E, M, D, scale=D ** -0.5)}
        first, n_out = "x", M
        flops = NP * 2 * 2 * M * D
    outs = G.nodes[nid]["outputs"]
    values = {first: inp, "R": R, **{o: torch.full((NP, n_out), float("nan"), device=DEV, dtype=DT) for o in outs}}
    kw = dict(values=values, weights=weights, sizes={"T": T, "NP": NP})
    launches = lower(G, nid, tuning=tuning)
    total = 0.0
    for launch in launches:
        ms = time_launch(runner, launch, kw)
        total += ms
        report(launch.name, ms, flops / 700e12 * 1e6 / len(launches), f"{flops / ms / 1e9:.0f} TFLOP/s")
    if len(launches) > 1:
        report(f"  {which} total", total, flops / 700e12 * 1e6, f"{flops / total / 1e9:.0f} TFLOP/s")
    runner.run_all(launches, **kw)
    # spot check three experts against torch
    errs = []
    for e in (0, E // 2, E - 1):
        beg, end = offsets[e].item(), offsets[e + 1].item()
        pairs = order[beg:end].long()
        if which == "moe_down":
            ref = inp[pairs].float() @ weights["e.*.down"][e].float().T
            errs.append(relerr(values[outs[0]][pairs], ref))
        else:
            xe = inp[pairs // K].float()
            g = (xe @ weights["e.*.gate"][e].float().T)
            u = (xe @ weights["e.*.up"][e].float().T)
            if which == "moe_gate_up_silu":
                errs.append(relerr(values[outs[0]][pairs], torch.nn.functional.silu(g) * u))
            else:
                errs.append(max(relerr(values[outs[0]][pairs], g), relerr(values[outs[1]][pairs], u)))
    nan = any(torch.isnan(values[o]).any().item() for o in outs)
    print(f"    spot check vs torch: max rel err {max(errs):.2e}; unwritten/NaN: {nan}", flush=True)


def grouped_case(m, T, which):
    """One grouped-expert node at V2-Lite dims with uniform random routing of T tokens: (G, nid,
    kernel kwargs, FLOPs, a spot check of three experts against torch -> max rel err)."""
    d = m.dims
    E, K, D, M = d["experts"], d["top_k"], d["hidden"], d["moe_intermediate"]
    NP = T * K
    ids, order, offsets = routing(T, E, K)
    r = TType((f"T*{K}", E), "routing")
    if which == "moe_down":
        G, nid = single_op_graph(m, which, {"num_experts": E, "out_dim": D},
                                 {"a": TType((f"T*{K}", M), "act"), "R": r}, {"weight": "e.{expert}.down"})
        inp, weights, first, n_out = rand(NP, M), {"e.*.down": rand(E, D, M, scale=M ** -0.5)}, "a", D
        flops = NP * 2 * D * M
    else:
        G, nid = single_op_graph(m, which, {"num_experts": E, "out_dim": M},
                                 {"x": TType(("T", D), "act"), "R": r},
                                 {"gate": "e.{expert}.gate", "up": "e.{expert}.up"})
        inp = rand(T, D)
        weights = {"e.*.gate": rand(E, M, D, scale=D ** -0.5), "e.*.up": rand(E, M, D, scale=D ** -0.5)}
        first, n_out, flops = "x", M, NP * 2 * 2 * M * D
    outs = G.nodes[nid]["outputs"]
    values = {first: inp, "R": {"order": order, "offsets": offsets},
              **{o: torch.full((NP, n_out), float("nan"), device=DEV, dtype=DT) for o in outs}}

    def check() -> float:
        errs = []
        for e in (0, E // 2, E - 1):
            pairs = order[offsets[e].item():offsets[e + 1].item()].long()
            if which == "moe_down":
                ref = inp[pairs].float() @ weights["e.*.down"][e].float().T
            else:
                xe = inp[pairs // K].float()
                ref = torch.nn.functional.silu(xe @ weights["e.*.gate"][e].float().T) * (xe @ weights["e.*.up"][e].float().T)
            errs.append(relerr(values[outs[0]][pairs], ref))
        return max(errs)
    return G, nid, dict(values=values, weights=weights, sizes={"T": T, "NP": NP}), flops, outs, check


def bench_wgmma(m, shapes):
    """The wgmma + TMA grouped GEMM (built for sm_90a; above the tuning moe.prefill_wgmma_above in the
    lowering) against the mma.sync launch, per shape B x L: us, TFLOP/s, speed-up, and both against
    torch.  Each is lowered with its own tuning: the mma.sync launch with moe.prefill_wgmma_above=none,
    the wgmma launch with it at 8 (the mma launch's grid is 0 where wgmma takes over)."""
    runner = KernelRunner()           # builds the wgmma kernel for sm_90a (it requires it), the rest for sm_90
    for B, L in shapes:
        T = B * L
        print(f"# wgmma vs mma.sync at {B} x {L} = {T} tokens", flush=True)
        for which in ("moe_gate_up_silu", "moe_down"):
            G, nid, kw, flops, outs, check = grouped_case(m, T, which)
            mma, wg = wgmma_pair(G, nid)
            ms_mma = time_launch(runner, mma, kw)
            err_mma = check()
            for o in outs:
                kw["values"][o].fill_(float("nan"))
            ms_wg = time_launch(runner, wg, kw)
            err_wg = check()
            nan = any(torch.isnan(kw["values"][o]).any().item() for o in outs)
            report(f"  {which} mma.sync", ms_mma, flops / 700e12 * 1e6, f"{flops / ms_mma / 1e9:.0f} TFLOP/s")
            report(f"  {which} wgmma", ms_wg, flops / 700e12 * 1e6,
                   f"{flops / ms_wg / 1e9:.0f} TFLOP/s  x{ms_mma / ms_wg:.2f}")
            print(f"    spot check vs torch: mma.sync {err_mma:.2e}, wgmma {err_wg:.2e}; unwritten/NaN: {nan}",
                  flush=True)
    runner.close()


WGMMA_OFF, WGMMA_FROM_8 = tuned("moe", prefill_wgmma_above=None), tuned("moe", prefill_wgmma_above=8)


def wgmma_pair(G, nid):
    """(the mma.sync launch, the wgmma launch) of a grouped-expert node, each from its own tuning."""
    (mma,) = [la for la in lower(G, nid, tuning=WGMMA_OFF) if la.stage == "mma"]
    (wg,) = [la for la in lower(G, nid, tuning=WGMMA_FROM_8) if la.stage == "wgmma"]
    return mma, wg


def bench_small(runner, m, T):
    D, K = m.dims["hidden"], m.dims["top_k"]
    G, nid = single_op_graph(m, "rms_norm", {}, {"x": TType(("T", D), "act")}, {"weight": "w"})
    kw = dict(values={"x": rand(T, D), "out": torch.empty(T, D, device=DEV, dtype=DT)},
              weights={"w": rand(D) + 1}, sizes={"T": T})
    for launch in lower(G, nid):
        report(launch.name, time_launch(runner, launch, kw), T * D * 4 / 4e12 * 1e6)
    G, nid = single_op_graph(m, "fused_add_rms_norm", {}, {"x": TType(("T", D), "act"), "r": TType(("T", D), "act")},
                             {"weight": "w"})
    kw = dict(values={"x": rand(T, D), "r": rand(T, D), "out0": torch.empty(T, D, device=DEV, dtype=DT),
                      "out1": torch.empty(T, D, device=DEV, dtype=DT)}, weights={"w": rand(D) + 1}, sizes={"T": T})
    for launch in lower(G, nid):
        report(launch.name, time_launch(runner, launch, kw), T * D * 8 / 4e12 * 1e6)
    types = {"eo": TType((f"T*{K}", D), "act"), "w": TType(("T", K), "f32"),
             "shared": TType(("T", D), "act"), "residual": TType(("T", D), "act")}
    G, nid = single_op_graph(m, "moe_combine_residual", {}, types, {})
    (out,) = G.nodes[nid]["outputs"]
    kw = dict(values={"eo": rand(T * K, D), "w": torch.rand(T, K, device=DEV), "shared": rand(T, D),
                      "residual": rand(T, D), out: torch.empty(T, D, device=DEV, dtype=DT)},
              sizes={"T": T, "NP": T * K})
    for launch in lower(G, nid):
        report(launch.name, time_launch(runner, launch, kw), T * D * 2 * (K + 3) / 4e12 * 1e6)


def check_variants(attn, route, gemm) -> None:
    """Every variant's tuning made before any GPU work: a misspelt one stops the run at once."""
    for v in attn:
        attention_variant(v)
    for v in route:
        route_variant(v)
    for v in gemm:
        if v != "wgmma":
            gemm_variant(v)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seqlen", type=int, default=512)
    ap.add_argument("--families", default="attn,route,moe,small")
    ap.add_argument("--gemm-variants", default="",
                    help="extra configurations of the MoE tensor-core GEMM to time: (BK x stages) of the mma.sync "
                         "launch, e.g. 64x3,32x3 (measured at T=16384: 32x4 4.55 ms gate_up_silu, 64x3 4.76, 32x3 "
                         "4.60), and/or 'wgmma': the sm_90a wgmma + TMA launch beside mma.sync at --wgmma-shapes")
    ap.add_argument("--wgmma-shapes", default="32x512,1x2048",
                    help="batch x seqlen shapes the 'wgmma' variant is timed at")
    ap.add_argument("--align-parallel", type=int, default=None, metavar="PAIRS",
                    help="also time the route with the count / scan / scatter alignment above PAIRS pairs "
                         f"(the tuning moe.align_parallel_above, {DEFAULT_TUNING.moe.align_parallel_above} by "
                         "default): --route-variants alignPAIRS")
    ap.add_argument("--attn-variants", default="v2",
                    help="comma-separated tensor-core prefill attention variants to time, each lowered with "
                         "the tuning attention.prefill_tile set to it: v2 (MlaPrefillTC2 at "
                         "its default tile), v2_m<BM>n<BN>w<16|32><q|s>[b<CTAs>] (see mla_prefill_attention)")
    ap.add_argument("--route-tokens", default="", help="T values for the route (default: batch * seqlen)")
    ap.add_argument("--route-variants", default="default",
                    help="comma-separated: default, gemv, alignP (see the module docstring)")
    a = ap.parse_args()
    fams = set(a.families.split(","))
    route_names = a.route_variants.split(",")
    if a.align_parallel is not None:
        route_names.append(f"align{a.align_parallel}")
    variants = [v for v in a.gemm_variants.split(",") if v]
    check_variants(a.attn_variants.split(","), route_names, variants)
    torch.manual_seed(0)
    m = lite()
    T = a.batch * a.seqlen
    runner = KernelRunner()
    print(f"# {torch.cuda.get_device_name()}  T = {a.batch} x {a.seqlen} = {T}", flush=True)
    print(f"{'kernel':<58} {'time':>14}   {'prediction':>18}", flush=True)
    if "attn" in fams:
        bench_attention(runner, m, a.batch, a.seqlen, a.attn_variants.split(","))
    if "route" in fams:
        for t in ([int(v) for v in a.route_tokens.split(",")] if a.route_tokens else [T]):
            for v in route_names:
                bench_route(m, t, v)
    if "moe" in fams:
        for which in ("moe_gate_up_silu", "moe_gate_up", "moe_down"):
            bench_grouped(runner, m, T, which)
    if "small" in fams:
        bench_small(runner, m, T)
    runner.close()
    if "wgmma" in variants:
        variants.remove("wgmma")
        bench_wgmma(m, [tuple(int(x) for x in s.split("x")) for s in a.wgmma_shapes.split(",")])
    if "moe" in fams and variants:
        from codegen.families import _moe
        for v in variants:
            tuning = gemm_variant(v)
            bk, stages = tuning.moe.gemm_bk, tuning.moe.gemm_stages
            print(f"# MoE GEMM variant BK={bk} stages={stages} (smem {_moe.gemm_smem(bk, stages)} B)", flush=True)
            r = KernelRunner()              # kernel names repeat across variants: a fresh module cache
            for which in ("moe_gate_up_silu", "moe_down"):
                bench_grouped(r, m, T, which, tuning)
            r.close()


if __name__ == "__main__":
    main()
