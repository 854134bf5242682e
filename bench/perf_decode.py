"""MLA decode kernel timings at DeepSeek-V2-Lite dims (a script, not a test).

    python3 -m bench.perf_decode [--cases 1x512,32x512,64x4096,128x4096,128x8192]
                                     [--variants w8s3c8,w8s2c8,w4s3c8,w8s3c4] [--attention-only]
                                     [--baseline DIR]
    python3 -m bench.perf_decode --absorb 1,8,32,64,128,256

Builds one-node graphs of mla_decode_attention (one launch a layer: G clusters of S = 1, 2, 4 or 8 KV
splits an item, merged on chip and, with G > 1, through L2), mla_decode_query and mla_v_up (the same lowering the bundle
uses), runs them through KernelRunner on random bf16 tensors (decode: one token per sequence,
context `ctx`, paged cache with permuted 64-row pages) and times every launch with CUDA events
over 50 launches captured in one CUDA graph; prints us / launch and achieved GB/s of the bytes
each must read. Attention is timed per variant, each a Tuning in the compile options
(Options(tuning=...): w<warps>s<ring stages>c<cluster = most splits> are attention.decode_warps,
decode_stages and decode_cluster; the first the default), "hot" (one
cache, L2-resident when small, as earlier PERF_NOTES measured) and, where the cache is under
256 MB, "cold" (launches rotate over copies of the cache that together exceed L2); each variant's
output is checked against torch (fp32, norm-wise per sequence, BAD above 1e-2). --baseline DIR
runs DIR/bench/perf_decode.py (a checkout of the code before, e.g. main) on the same cases
afterwards, for the old kernel's numbers in the same run.

--absorb times only mla_decode_query and mla_v_up (the tensor-core kernels the lowering ships) at
those token counts, one row per (kernel, T) and a summary table.  Their CUDA-core, balanced and
register-capped variants are gone: they lost and their switches were deleted.

Bytes per layer: attention B * ctx * 576 * 2 (the cache; 302 MB at 64 x 4096 -> 89 us at
3.4 TB/s); decode_query / v_up the 2 MB of W_UK / W_UV plus activations.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import re
import subprocess
import sys

import torch

from tests.gpu.harness import single_op_graph

import ir
from codegen.families import family_for_op
from codegen.kernel import Options
from codegen.tuning import DEFAULT_TUNING, Tuning
from codegen.paths import DEFAULT_SPEC
from ir.ops import TType
from runtime.launcher import KernelRunner
from runtime.timing import graph_us

DEV = "cuda"
DT = torch.bfloat16
BS = 64
ITERS = 50


def lite():
    return ir.load_spec(str(DEFAULT_SPEC)).model


def lower(G, nid, tuning: Tuning = DEFAULT_TUNING):
    return family_for_op(G.nodes[nid]["op"]).lower(nid, G, Options(dtype="bf16", block_size=BS, tuning=tuning))


def rand(*shape, scale=1.0):
    return (torch.randn(*shape, device=DEV) * scale).to(DT)


def row(name, B, ctx, us, nbytes):
    print(f"{name:<34} B={B:<4} ctx={ctx:<5} {us:9.2f} us  {nbytes / us / 1e3:8.1f} GB/s", flush=True)


def relerr(a, b):
    a, b = a.float(), b.float()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-6)).item()


_A = DEFAULT_TUNING.attention
ATTN_VARIANTS = f"w{_A.decode_warps}s{_A.decode_stages}c{_A.decode_cluster},w8s2c8,w4s3c8,w8s3c4"
COLD_BYTES = 256 << 20     # cold timing: one graph rotates over this many bytes of cache copies (L2: 60 MB)


def attention_variant(tag: str) -> Tuning:
    """w<warps>s<stages>c<cluster> -> the tuning with attention.decode_warps / decode_stages /
    decode_cluster set; SystemExit (one line) on a bad spelling or value."""
    from codegen.tuning import TuningError
    mt = re.fullmatch(r"w(\d+)s(\d+)c(\d+)", tag)
    if mt is None:
        raise SystemExit(f"variant {tag!r}: expected w<warps>s<stages>c<cluster>, e.g. w8s3c8")
    warps, stages, cluster = map(int, mt.groups())
    try:
        return dataclasses.replace(DEFAULT_TUNING, attention=dataclasses.replace(
            DEFAULT_TUNING.attention, decode_warps=warps, decode_stages=stages, decode_cluster=cluster))
    except TuningError as e:
        raise SystemExit(f"variant {tag!r}: {e}") from None


def bench_attention(runner, m, B, L, variants=(ATTN_VARIANTS.split(",")[0],)):
    """us per launch of every variant at B sequences x L context (hot and, for small caches, cold);
    returns {variant: (us hot, us cold or None, max error)}."""
    from codegen import sizes as size_exprs
    d = m.dims
    H, C, R = d["heads"], d["kv_lora_rank"], d["qk_rope_head_dim"]
    T = B
    G, nid = single_op_graph(m, "mla_decode_attention", {},
                             {"q_lat": TType(("T", H, C), "act"), "q_rot": TType(("T", H, R), "act"),
                              "kv": TType(("cache",), "state")}, {}, phase="decode")
    pages = L // BS
    nblocks = B * pages + 3
    nbytes = B * L * (C + R) * 2
    cache_bytes = nblocks * BS * (C + R) * 2
    copies = min(400, COLD_BYTES // cache_bytes) if 4 * cache_bytes <= COLD_BYTES else 1   # one graph walks them all
    caches = [rand(nblocks, BS, C + R) for _ in range(copies)]
    tables = torch.randperm(nblocks, device=DEV)[:B * pages].view(B, pages).to(torch.int32)
    ctx = {"kv_cache": caches[0], "block_tables": tables,
           "context_lens": torch.full((B,), L, dtype=torch.int32, device=DEV),
           "query_start": torch.arange(B + 1, dtype=torch.int32, device=DEV),
           "positions": torch.full((B,), L - 1, dtype=torch.int64, device=DEV),
           "slot_mapping": torch.zeros(B, dtype=torch.int64, device=DEV)}
    qbuf = rand(T, H, C + R)
    q_lat, q_rot = qbuf[..., :C], qbuf[..., C:]
    out = torch.full((T, H, C), float("nan"), device=DEV, dtype=DT)
    sizes = {"T": T, "B": B, "MAXQ": 1, "MAXCTX": L, "NP": T, "W": pages}
    full = runner.step_sizes(sizes, ctx)
    scale = G.graph["model"].softmax_scale
    results = {}
    for tag in variants:
        launches = lower(G, nid, attention_variant(tag))
        live = [la for la in launches if 0 not in tuple(size_exprs.evaluate(x, full) for x in la.grid)]
        (la,) = live
        S = la.params["cs"]
        Gs = size_exprs.evaluate(la.grid[0], full) // (T * -(-H // la.params["HG"]) * S)   # clusters an item
        kw = dict(values={"q_lat": q_lat, "q_rot": q_rot, "out": out}, ctx=ctx, sizes=sizes)
        out.fill_(float("nan"))
        runner.run(la, **kw)
        torch.cuda.synchronize()
        errs = []
        for t in sorted({0, T // 2, T - 1}):
            rows = caches[0][tables[t].long()].reshape(-1, C + R)[:L].float()
            q = torch.cat([q_lat[t], q_rot[t]], -1).float()
            ref = torch.softmax(q @ rows.T * scale, -1) @ rows[:, :C]
            o = out[t].float()
            errs.append(float("inf") if torch.isnan(o).any() else ((o - ref).norm() / ref.norm()).item())
        err = max(errs)
        hot = graph_us(lambda: runner.run(la, **kw))
        cold = None
        if copies > 1:
            calls = [dict(kw, ctx={**ctx, "kv_cache": c}) for c in caches]
            n = [0]

            def rotate():
                runner.run(la, **calls[n[0] % copies])
                n[0] += 1
            cold = graph_us(rotate, iters=copies)
        what = f"attention {tag} (S={S} G={Gs})"
        row(what + " hot", B, L, hot, nbytes)
        if cold is not None:
            row(what + f" cold x{copies}", B, L, cold, nbytes)
        print(f"    {tag}: max norm-wise error vs torch (tokens 0, T/2, T-1) {err:.2e}"
              f"{'  BAD' if not err <= 1e-2 else ''}", flush=True)
        results[tag] = (hot, cold, err)
    return results


def attention_table(all_results: dict, variants) -> None:
    """cases x variants: us hot (TB/s), and cold where timed."""
    print("\nmla_decode_attention, us per layer (TB/s of cache reads); cold = rotated caches")
    print(f"{'case':<12}" + "".join(f"{v:>26}" for v in variants))
    for (B, L), res in all_results.items():
        nbytes = B * L * 576 * 2
        cells = []
        for v in variants:
            hot, cold, err = res[v]
            t = cold if cold is not None else hot
            cell = f"{hot:.1f}" + (f"/{cold:.1f}c" if cold is not None else "") + f" ({nbytes / t / 1e6:.2f})"
            cells.append(cell + ("!" if not err <= 1e-2 else ""))
        print(f"{B}x{L:<10}" + "".join(f"{c:>26}" for c in cells))


def bench_query(runner, m, T):
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
    (la,) = lower(G, nid)
    us = graph_us(lambda: runner.run(la, **kw))
    row("mla_decode_query", T, 0, us, H * N * C * 2 + T * H * (N + R + C + R) * 2)
    wuk = kv_b.view(H, N + V, C)[:, :N].float()
    ref = torch.einsum("thn,hnc->thc", qb[..., :N].float(), wuk)
    print(f"    decode_query spot check: max rel err {relerr(out[..., :C], ref):.2e}", flush=True)
    return us


def bench_v_up(runner, m, T):
    d = m.dims
    H, N, V, C = d["heads"], d["qk_nope_head_dim"], d["v_head_dim"], d["kv_lora_rank"]
    G, nid = single_op_graph(m, "mla_v_up", {}, {"o_lat": TType(("T", H, C), "act")}, {"kv_b": "kvb"},
                             phase="decode")
    o_lat = rand(T, H, C)
    kv_b = rand(H * (N + V), C, scale=0.1)
    out = torch.full((T, H * V), float("nan"), device=DEV, dtype=DT)
    kw = dict(values={"o_lat": o_lat, "out": out}, weights={"kvb": kv_b}, sizes={"T": T})
    (la,) = lower(G, nid)
    us = graph_us(lambda: runner.run(la, **kw))
    row("mla_v_up", T, 0, us, H * V * C * 2 + T * H * (C + V) * 2)
    wuv = kv_b.view(H, N + V, C)[:, N:].float()
    ref = torch.einsum("thc,hvc->thv", o_lat.float(), wuv).reshape(T, H * V)
    print(f"    v_up spot check: max rel err {relerr(out, ref):.2e}", flush=True)
    return us


def bench_absorb(runner, m, tokens):
    """mla_decode_query and mla_v_up at each token count; a summary table."""
    res = {}
    for T in tokens:
        res["query", T] = bench_query(runner, m, T)
        res["v_up", T] = bench_v_up(runner, m, T)
    print(f"\n{'us per launch':<18}{'query':>11}{'v_up':>11}", flush=True)
    for T in tokens:
        print(f"{'T=' + str(T):<18}{res['query', T]:>11.2f}{res['v_up', T]:>11.2f}", flush=True)
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="1x512,32x512,64x4096,128x4096,128x8192")
    ap.add_argument("--variants", default=ATTN_VARIANTS,
                    help="decode attention variants w<warps>s<stages>c<cluster> (attention.decode_warps / "
                         "decode_stages / decode_cluster; first: the default)")
    ap.add_argument("--attention-only", action="store_true", help="time decode attention alone")
    ap.add_argument("--baseline", default=None, help="a checkout of the code before: run its perf_decode.py after")
    ap.add_argument("--absorb", default=None, help="token counts: time only decode_query / v_up variants")
    args = ap.parse_args()
    variants = args.variants.split(",")
    for v in variants:
        attention_variant(v)                 # a bad spelling stops here, before any GPU work
    m = lite()
    runner = KernelRunner()
    if args.absorb:
        bench_absorb(runner, m, [int(t) for t in args.absorb.split(",")])
        return
    attention = {}
    for case in args.cases.split(","):
        B, L = map(int, case.split("x"))
        attention[(B, L)] = bench_attention(runner, m, B, L, variants)
        if not args.attention_only:
            bench_query(runner, m, B)
            bench_v_up(runner, m, B)
    attention_table(attention, variants)
    if args.baseline:
        print(f"\nbaseline: {args.baseline}", flush=True)
        # an older checkout keeps the script under tests/gpu/
        old = os.path.join(args.baseline, "tests", "gpu", "perf_decode.py")
        cmd = [sys.executable, old] if os.path.exists(old) else [sys.executable, "-m", "bench.perf_decode"]
        subprocess.run(cmd + ["--cases", args.cases], cwd=args.baseline, check=False)


if __name__ == "__main__":
    main()
