"""MLA decode kernel timings at DeepSeek-V2-Lite dims (a script, not a test).

    python3 tests/gpu/perf_decode.py [--cases 1x512,32x512,64x4096,128x4096]
    python3 tests/gpu/perf_decode.py --absorb 1,8,32,64,128,256 [--absorb-variants cc,mma,...]

Builds one-node graphs of mla_decode_attention (split + combine), mla_decode_query and
mla_v_up (the same lowering the bundle uses), runs them through KernelRunner on random bf16
tensors (decode: one token per sequence, context `ctx`, paged cache with permuted 64-row
pages) and times every launch with CUDA events over 50 launches captured in one CUDA graph; prints us / launch and
achieved GB/s of the bytes each must read. A spot check against torch (fp32) follows for
attention (first and last token) and the two GEMMs.

--absorb times only mla_decode_query and mla_v_up at those token counts, once per variant
(ABSORB_VARIANTS: cc = the CUDA-core kernels, mma = the tensor-core defaults, the rest tensor-core
tilings), one row per (kernel, T, variant) and a summary table.

Bytes per layer: attention B * ctx * 576 * 2 (the cache; 302 MB at 64 x 4096 -> 92 us at
3.3 TB/s); decode_query / v_up the 2 MB of W_UK / W_UV plus activations.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from harness import single_op_graph  # noqa: E402

import ir  # noqa: E402
from codegen.families import family_for_op  # noqa: E402
from codegen.kernel import Options  # noqa: E402
from ir.ops import TType  # noqa: E402
from runtime.launcher import KernelRunner  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEV = "cuda"
DT = torch.bfloat16
BS = 64
ITERS = 50


def lite():
    return ir.load_spec(os.path.join(ROOT, "model_specs", "deepseek_v2_lite.yaml")).model


def lower(G, nid):
    return family_for_op(G.nodes[nid]["op"]).lower(nid, G, Options(dtype="bf16", block_size=BS))


def rand(*shape, scale=1.0):
    return (torch.randn(*shape, device=DEV) * scale).to(DT)


def time_us(fn, iters=ITERS):
    """us per call of fn: `iters` calls captured into one CUDA graph (no host cost per launch,
    like the engine's graph replay), replayed and timed with CUDA events (median of 3)."""
    fn()
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        fn()
        stream.synchronize()
        with torch.cuda.graph(g, stream=stream):
            for _ in range(iters):
                fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    g.replay()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(3):
        s.record()
        g.replay()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e) * 1e3 / iters)
    return sorted(times)[1]


def row(name, B, ctx, us, nbytes):
    print(f"{name:<34} B={B:<4} ctx={ctx:<5} {us:9.2f} us  {nbytes / us / 1e3:8.1f} GB/s", flush=True)


def relerr(a, b):
    a, b = a.float(), b.float()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-6)).item()


def bench_attention(runner, m, B, L):
    d = m.dims
    H, C, R = d["heads"], d["kv_lora_rank"], d["qk_rope_head_dim"]
    T = B
    G, nid = single_op_graph(m, "mla_decode_attention", {},
                             {"q_lat": TType(("T", H, C), "act"), "q_rot": TType(("T", H, R), "act"),
                              "kv": TType(("cache",), "state")}, {}, phase="decode")
    pages = L // BS
    nblocks = B * pages + 3
    cache = rand(nblocks, BS, C + R)
    tables = torch.randperm(nblocks, device=DEV)[:B * pages].view(B, pages).to(torch.int32)
    ctx = {"kv_cache": cache, "block_tables": tables,
           "context_lens": torch.full((B,), L, dtype=torch.int32, device=DEV),
           "query_start": torch.arange(B + 1, dtype=torch.int32, device=DEV),
           "positions": torch.full((B,), L - 1, dtype=torch.int64, device=DEV),
           "slot_mapping": torch.zeros(B, dtype=torch.int64, device=DEV)}
    qbuf = rand(T, H, C + R)
    q_lat, q_rot = qbuf[..., :C], qbuf[..., C:]
    out = torch.full((T, H, C), float("nan"), device=DEV, dtype=DT)
    kw = dict(values={"q_lat": q_lat, "q_rot": q_rot, "out": out}, ctx=ctx,
              sizes={"T": T, "B": B, "MAXQ": 1, "MAXCTX": L, "NP": T, "W": pages})
    launches = lower(G, nid)
    ws = runner.run_all(launches, **kw)
    nbytes = B * L * (C + R) * 2
    total = 0.0
    for la in launches:
        us = time_us(lambda: runner.run(la, workspaces=ws, **kw))
        total += us
        row(la.name.split("__")[-1] if la.name.endswith("combine") else "attention split", B, L, us, nbytes)
    row("attention total", B, L, total, nbytes)
    scale = G.graph["model"].softmax_scale
    errs = []
    for t in (0, T - 1):
        rows = cache[tables[t].long()].reshape(-1, C + R)[:L].float()
        q = torch.cat([q_lat[t], q_rot[t]], -1).float()
        p = torch.softmax(q @ rows.T * scale, -1)
        errs.append(relerr(out[t], p @ rows[:, :C]))
    print(f"    attention spot check vs torch: max rel err {max(errs):.2e}", flush=True)
    return total


# Variants of the absorbed projections: module constants of the two families, set while lowering.
ABSORB_VARIANTS = {
    "cc": dict(query=dict(TENSOR_CORES=False), v_up=dict(TENSOR_CORES=False)),
    "mma": dict(query={}, v_up={}),
    "mma_balanced": dict(query=dict(TC_BALANCED=True), v_up=dict(TC_BALANCED=True)),
    "mma_regcap": dict(query=dict(TC_MAX_REGS=128), v_up=dict(TC_MAX_REGS=80)),
    "mma_balanced_regcap": dict(query=dict(TC_BALANCED=True, TC_MAX_REGS=128),
                                v_up=dict(TC_BALANCED=True, TC_MAX_REGS=80)),
}


def lower_variant(G, nid, family: str, variant: str | None):
    """Lower with the variant's family constants in force (restored afterwards)."""
    import importlib
    mod = importlib.import_module(f"codegen.families.{'mla_decode_query' if family == 'query' else 'mla_v_up'}")
    overrides = ABSORB_VARIANTS[variant][family] if variant else {}
    saved = {k: getattr(mod, k) for k in overrides}
    try:
        for k, v in overrides.items():
            setattr(mod, k, v)
        return lower(G, nid)
    finally:
        for k, v in saved.items():
            setattr(mod, k, v)


def bench_query(runner, m, T, variant=None):
    d = m.dims
    H, N, R, V, C = d["heads"], d["qk_nope_head_dim"], d["qk_rope_head_dim"], d["v_head_dim"], d["kv_lora_rank"]
    G, nid = single_op_graph(m, "mla_decode_query", {"pairs": "adjacent", "output": "interleaved"},
                             {"q_nope": TType(("T", H, N), "act"), "q_pe": TType(("T", H, R), "act")},
                             {"kv_b": "kvb"}, phase="decode")
    qb = rand(T, H, N + R)
    kv_b = rand(H * (N + V), C, scale=0.1)
    out = torch.full((T, H, C + R), float("nan"), device=DEV, dtype=DT)
    kw = dict(values={"q_nope": qb[..., :N], "q_pe": qb[..., N:], "out": out}, weights={"kvb": kv_b},
              ctx={"positions": torch.arange(T, dtype=torch.int64, device=DEV)}, sizes={"T": T})
    (la,) = lower_variant(G, nid, "query", variant)
    us = time_us(lambda: runner.run(la, **kw))
    row("mla_decode_query" + (f" [{variant}]" if variant else ""), T, 0, us, H * N * C * 2 + T * H * (N + R + C + R) * 2)
    wuk = kv_b.view(H, N + V, C)[:, :N].float()
    ref = torch.einsum("thn,hnc->thc", qb[..., :N].float(), wuk)
    print(f"    decode_query spot check: max rel err {relerr(out[..., :C], ref):.2e}", flush=True)
    return us


def bench_v_up(runner, m, T, variant=None):
    d = m.dims
    H, N, V, C = d["heads"], d["qk_nope_head_dim"], d["v_head_dim"], d["kv_lora_rank"]
    G, nid = single_op_graph(m, "mla_v_up", {}, {"o_lat": TType(("T", H, C), "act")}, {"kv_b": "kvb"},
                             phase="decode")
    o_lat = rand(T, H, C)
    kv_b = rand(H * (N + V), C, scale=0.1)
    out = torch.full((T, H * V), float("nan"), device=DEV, dtype=DT)
    kw = dict(values={"o_lat": o_lat, "out": out}, weights={"kvb": kv_b}, sizes={"T": T})
    (la,) = lower_variant(G, nid, "v_up", variant)
    us = time_us(lambda: runner.run(la, **kw))
    row("mla_v_up" + (f" [{variant}]" if variant else ""), T, 0, us, H * V * C * 2 + T * H * (C + V) * 2)
    wuv = kv_b.view(H, N + V, C)[:, N:].float()
    ref = torch.einsum("thc,hvc->thv", o_lat.float(), wuv).reshape(T, H * V)
    print(f"    v_up spot check: max rel err {relerr(out, ref):.2e}", flush=True)
    return us


def bench_absorb(runner, m, tokens, variants):
    """mla_decode_query and mla_v_up at each token count, once per variant; a summary table."""
    res = {}
    for T in tokens:
        for v in variants:
            res["query", T, v] = bench_query(runner, m, T, v)
            res["v_up", T, v] = bench_v_up(runner, m, T, v)
    print(f"\n{'us per launch':<18}" + "".join(f"{v:>11}" for v in variants), flush=True)
    for fam in ("query", "v_up"):
        for T in tokens:
            print(f"{fam + ' T=' + str(T):<18}" + "".join(f"{res[fam, T, v]:>11.2f}" for v in variants), flush=True)
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="1x512,32x512,64x4096,128x4096")
    ap.add_argument("--absorb", default=None, help="token counts: time only decode_query / v_up variants")
    ap.add_argument("--absorb-variants", default=",".join(ABSORB_VARIANTS))
    args = ap.parse_args()
    m = lite()
    runner = KernelRunner()
    if args.absorb:
        bench_absorb(runner, m, [int(t) for t in args.absorb.split(",")], args.absorb_variants.split(","))
        return
    for case in args.cases.split(","):
        B, L = map(int, case.split("x"))
        bench_attention(runner, m, B, L)
        bench_query(runner, m, B)
        bench_v_up(runner, m, B)


if __name__ == "__main__":
    main()
