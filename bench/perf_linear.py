"""Skinny linear (linear_skinny) timings at DeepSeek-V2-Lite's linear shapes, against cuBLAS
(a script, not a test).

    python3 -m bench.perf_linear [--tokens 1,2,4,8,16] [--shapes q+kv_a,o,...] [--json PATH]
                                     [--variants w8r1u4,w8r1u2,w8r1u8,w4r1u4,w8r2u2,w16r1u2,w8r1u4k2,w8r1u2k4]
    python3 -m bench.perf_linear --compile-only   # no GPU: lower, render and NVRTC-compile every
                                                      # variant at every shape, print registers / spills

Shapes (dims read from model_specs/deepseek_v2_lite.yaml; "per step": how many a decode step runs):
  q+kv_a          K=D  rows H*(N+R) + C+R   the fused MLA input projections (multi_linear, 27 a step)
  o               K=H*V rows D                                                  (27)
  shared swiglu   K=D  n M*S                the shared experts' gate + up + SwiGLU (gate_up_silu, 26)
  shared down     K=M*S rows D                                                  (26)
  dense swiglu    K=D  n I                  layer 0's FFN gate + up + SwiGLU      (1)
  dense down      K=I  rows D                                                   (1)
  lm_head         K=D  rows vocab                                                (1)
  q, kv_a         the two unfused (0 a step: to show what the fusion buys)

Variants w<warps>r<row tiles>u<unroll>[k<cluster>], each a Tuning in the compile options (Options(tuning=...):
linear.warps, row_tiles, unroll, ksplit; k2 / k4 split K over clusters of 2 / 4 CTAs; the first listed
is the default).  Each launch is timed over a CUDA graph of
ITERS-or-more launches (median of 3 replays) that cycles through enough copies of the weights to
exceed ~4x the 50-60 MB L2, so the weights come from HBM as in a decode step, where each layer's
weights are read once.  cuBLAS: torch.nn.functional.linear once per weight (what the runtime runs
above linear.skinny_upto tokens; the swiglu shapes add torch's silu(gate) * up), timed the same way.  Rows print us, weight TB/s and the fraction of the
measured device-to-device copy bandwidth; a summary per T sums a decode step's linears
(shape x per step) for the default, the best variant of each shape, and cuBLAS: issue 14's target
is >= 80% of the copy bandwidth.  Correctness: outputs poisoned, norm-wise relative error against
a torch fp32 reference (BAD above 1e-2; the exit status is 1 if any).
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import re
import sys

from bench.perf_decode import lite
from tests.gpu.harness import single_op_graph

from codegen.families import linear_skinny
from codegen.kernel import KernelLaunch, Options
from codegen.tuning import DEFAULT_TUNING, Tuning, TuningError
from ir.ops import TType

ITERS = 20
ROTATE_BYTES = 256 << 20       # weight copies cycled per graph: ~4x the L2
BAD_ERR = 1e-2
_T = DEFAULT_TUNING.linear   # the kernel's default shape (codegen/tuning.py)
DEFAULT_VARIANT = f"w{_T.warps}r{_T.row_tiles}u{_T.unroll}" + (f"k{_T.ksplit}" if _T.ksplit > 1 else "")
VARIANTS = f"{DEFAULT_VARIANT},w8r1u2,w8r1u8,w4r1u4,w8r2u2,w16r1u2,w8r1u4k2,w8r1u2k4"
_VARIANT_RE = re.compile(r"^w(\d+)r(\d+)u(\d+)(?:k(\d+))?$")


def shapes(m) -> dict:
    """name -> (K, weight rows, per decode step, silu: a gate_up_silu of rows [n, n])."""
    d = m.dims
    D, H, N, R, V, C = (d[k] for k in ("hidden", "heads", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                                       "kv_lora_rank"))
    I, MS, L = d["intermediate"], d["moe_intermediate"] * d["shared_experts"], d["layers"]
    return {"q+kv_a": (D, [H * (N + R), C + R], L, False), "o": (H * V, [D], L, False),
            "shared swiglu": (D, [MS, MS], L - 1, True), "shared down": (MS, [D], L - 1, False),
            "dense swiglu": (D, [I, I], 1, True), "dense down": (I, [D], 1, False),
            "lm_head": (D, [d["vocab"]], 1, False), "q": (D, [H * (N + R)], 0, False), "kv_a": (D, [C + R], 0, False)}


def parse_variant(v: str) -> Tuning:
    """w<warps>r<row tiles>u<unroll>[k<cluster>] -> the tuning with those linear knobs; SystemExit
    (one line) on a bad spelling or value."""
    mt = _VARIANT_RE.match(v)
    if not mt:
        raise SystemExit(f"variant {v!r} is not w<warps>r<row tiles>u<unroll>[k<cluster>]")
    w, r, u, k = mt.groups()
    try:
        return dataclasses.replace(DEFAULT_TUNING, linear=dataclasses.replace(
            DEFAULT_TUNING.linear, warps=int(w), row_tiles=int(r), unroll=int(u), ksplit=int(k or 1)))
    except TuningError as e:
        raise SystemExit(f"variant {v!r}: {e}") from None


def launch_for(m, K: int, rows: list[int], variant: str, dtype: str = "bf16",
               silu: bool = False) -> tuple[KernelLaunch, list[str]]:
    tuning = parse_variant(variant)
    if silu:
        G, nid = single_op_graph(m, "gate_up_silu", {"out_dim": rows[0]}, {"x": TType(("T", K), "act")},
                                 {"gate": "w0", "up": "w1"}, phase="decode")
    elif len(rows) == 1:
        G, nid = single_op_graph(m, "linear", {"out_dim": rows[0]}, {"x": TType(("T", K), "act")}, {"weight": "w0"},
                                 phase="decode")
    else:
        G, nid = single_op_graph(m, "multi_linear", {"out_dims": rows}, {"x": TType(("T", K), "act")},
                                 {f"weight{i}": f"w{i}" for i in range(len(rows))}, phase="decode")
    steps = linear_skinny.lower(nid, G, Options(dtype=dtype, tuning=tuning))
    (la,) = [s for s in steps if isinstance(s, KernelLaunch)]
    return la, G.nodes[nid]["outputs"]


def compile_only(m, names, variants, arch) -> int:
    bad = 0
    done = set()
    for name in names:
        K, rows, _, silu = shapes(m)[name]
        for v in variants:
            la, _ = launch_for(m, K, rows, v, silu=silu)
            if la.name in done:
                continue
            done.add(la.name)
            bad += compile_and_report(la, f"{name:<16} {v:<9} {la.name:<48}", arch)
    return 1 if bad else 0


def compile_and_report(la, label: str, arch: str) -> bool:
    """Compiles one launch's kernel with ptxas -v and prints `label` with its registers, shared memory and
    spills; whether it spills."""
    from codegen.nvrtc import compile_cubin
    from codegen.render import render_launch
    spills, info = ptxas_report(compile_cubin(render_launch(la), la.name, arch=arch,
                                              options=("--ptxas-options=-v",)).log)
    print(f"{label} {'SPILLS ' if spills else ''}{info}", flush=True)
    return spills


def ptxas_report(log: str) -> tuple[bool, str]:
    """(whether ptxas spilled, its registers / spill lines) from an NVRTC log of --ptxas-options=-v."""
    info = " ".join(line.split(":", 1)[-1].strip() for line in log.splitlines()
                    if "registers" in line or "spill" in line)
    return "0 bytes spill stores" not in log or "0 bytes spill loads" not in log, info


def time_cycled(fn, copies: int) -> float:
    """us per call of fn(i), i cycling over `copies` weight copies (so the weights come from DRAM, not
    L2): runtime.timing.graph_us over max(ITERS, copies) calls in one CUDA graph (median of 3 replays)."""
    from runtime.timing import graph_us
    calls = itertools.count()
    return graph_us(lambda: fn(next(calls) % copies), iters=max(ITERS, copies))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="1,2,4,8,16")
    ap.add_argument("--shapes", default="q+kv_a,o,shared swiglu,shared down,dense swiglu,dense down,lm_head,q,kv_a")
    ap.add_argument("--variants", default=VARIANTS)
    ap.add_argument("--json", default=None)
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--arch", default="sm_90")
    args = ap.parse_args()
    m = lite()
    names = [s for s in args.shapes.split(",") if s]
    variants = [v for v in args.variants.split(",") if v]
    for name in names:
        if name not in shapes(m):
            raise SystemExit(f"unknown shape {name!r} (one of {', '.join(shapes(m))})")
    for v in variants:
        parse_variant(v)
    if args.compile_only:
        return compile_only(m, names, variants, args.arch)

    import torch
    import torch.nn.functional as F

    from ir.ops.core import gate_up_silu_ref
    from runtime.bench import copy_bandwidth
    from runtime.launcher import KernelRunner
    runner = KernelRunner()
    bw = copy_bandwidth()
    print(f"device-to-device copy: {bw / 1e12:.2f} TB/s (80%: {0.8 * bw / 1e12:.2f})", flush=True)
    tokens = [int(t) for t in args.tokens.split(",")]
    results, bad = [], 0
    gen = torch.Generator(device="cuda").manual_seed(0)
    for name in names:
        K, rows, per_step, silu = shapes(m)[name]
        nbytes = sum(rows) * K * 2
        copies = max(1, min(64, math.ceil(ROTATE_BYTES / nbytes)))
        ws = [[torch.randn(n, K, device="cuda", generator=gen).mul_(K ** -0.5).to(torch.bfloat16) for n in rows]
              for _ in range(copies)]
        for T in tokens:
            x = torch.randn(T, K, device="cuda", generator=gen).to(torch.bfloat16)
            if silu:
                refs = [gate_up_silu_ref(x.float(), ws[0][0].float(), ws[0][1].float())]
                us_torch = time_cycled(lambda i: gate_up_silu_ref(x, ws[i][0], ws[i][1]), copies)
            else:
                refs = [x.float() @ w.float().T for w in ws[0]]
                us_torch = time_cycled(lambda i: [F.linear(x, w) for w in ws[i]], copies)
            row = {"shape": name, "K": K, "rows": rows, "per_step": per_step, "T": T, "bytes": nbytes,
                   "torch_us": us_torch, "kernel_us": {}}
            print(f"{name:<16} T={T:<3} cuBLAS    {us_torch:8.2f} us {nbytes / us_torch / 1e6:6.2f} TB/s "
                  f"({nbytes / us_torch * 1e6 / bw * 100:3.0f}%)", flush=True)
            for v in variants:
                if T > DEFAULT_TUNING.linear.skinny_upto:
                    continue   # the kernel's grid is 0 above: cuBLAS alone serves these token counts
                la, outs = launch_for(m, K, rows, v, silu=silu)
                ys = {o: torch.full((T, n), float("nan"), device="cuda", dtype=torch.bfloat16)
                      for o, n in zip(outs, rows)}
                weights = [{f"w{j}": w for j, w in enumerate(c)} for c in ws]
                runner.run(la, values={"x": x, **ys}, weights=weights[0], sizes={"T": T})
                torch.cuda.synchronize()
                err = max(float((ys[o].float() - r).norm() / r.norm()) for o, r in zip(outs, refs))
                if not err <= BAD_ERR:
                    bad += 1
                us = time_cycled(lambda i: runner.run(la, values={"x": x, **ys}, weights=weights[i], sizes={"T": T}),
                                 copies)
                row["kernel_us"][v] = us
                print(f"{name:<16} T={T:<3} {v:<9} {us:8.2f} us {nbytes / us / 1e6:6.2f} TB/s "
                      f"({nbytes / us * 1e6 / bw * 100:3.0f}%)  x{us_torch / us:4.2f} vs cuBLAS  "
                      f"err {err:.1e}{'  BAD' if not err <= BAD_ERR else ''}", flush=True)
            results.append(row)
        del ws
        torch.cuda.empty_cache()

    print("\na decode step's linears (shapes x per step), us and weight TB/s (% of copy):")
    print(f"{'T':<4}{'default ' + DEFAULT_VARIANT:>30}{'best variant per shape':>30}{'cuBLAS':>30}")
    for T in tokens:
        rows_t = [r for r in results if r["T"] == T and r["per_step"]]
        if not rows_t:
            continue
        nbytes = sum(r["bytes"] * r["per_step"] for r in rows_t)
        cols = [sum(r["kernel_us"].get(variants[0], math.nan) * r["per_step"] for r in rows_t),
                sum(min(r["kernel_us"].values(), default=math.nan) * r["per_step"] for r in rows_t),
                sum(r["torch_us"] * r["per_step"] for r in rows_t)]
        print(f"{T:<4}" + "".join(f"{us:>12.1f} us {nbytes / us / 1e6:5.2f} TB/s ({nbytes / us * 1e6 / bw * 100:3.0f}%)"
                                  for us in cols))
    best = {}
    for r in results:
        if not r["kernel_us"]:
            continue
        v = min(r["kernel_us"], key=r["kernel_us"].get)
        best.setdefault(r["shape"], []).append(f"T={r['T']}:{v}")
    print("\nbest variant per shape: " + "; ".join(f"{k} {' '.join(v)}" for k, v in best.items()))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"copy_bandwidth": bw, "variants": variants, "results": results}, fh, indent=1)
    if bad:
        print(f"\n{bad} launch(es) BAD (norm-wise error above {BAD_ERR})")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
