"""moe_route timings at decode sizes: the fused launch against the three launches (a script, not a test).

    python3 -m bench.perf_route [--specs deepseek_v2_lite,deepseek_v3] [--tokens 1,8,32,128,256]
                                    [--bounds 256]

Takes the first moe_route node of each spec's decode graph (the pass pipeline's, so the routing
attributes are the spec's: V2-Lite softmax greedy E=64 K=6 D=2048; V3 sigmoid noaux_tc with bias,
E=256 K=8 groups 8/4 D=7168), lowers it twice -- with the tuning route.fused_upto=0 (the three
launches: router GEMV, top-k, align) and with route.fused_upto at each --bounds value (the fused
launch while T <= bound) -- and times each form with runtime.timing.graph_us: ITERS routes captured in one CUDA
graph, so the time per route includes the graph's per-kernel gaps as a decode step sees them.
Each launch of the three is timed alone too.  The fused outputs are checked against the three
launches' (same offsets, ids equal up to near-ties, weights within 1e-5).

Prediction (H200; the three launches cost ~6.7 us a layer at b=1 today, docs/PERF_NOTES.md: 0.174 ms
over 26 V2-Lite layers).  The fused launch removes two kernel boundaries (in a graph ~1-1.5 us
each: one grid's drain and the next one's start) and keeps the work's serial chain (GEMV, a warp's
top-k, one CTA's alignment), each link now a fence and an atomic ticket (~0.5 us) instead:
  T = 1    V2-Lite three ~6.5 us, fused ~4 us;   V3 three ~8 us, fused ~5 us
           (GEMV ~1.5-2 us: 32 / 128 CTAs of 16 / 57 KB of gate rows; top-k ~1 us; align ~1 us)
  T = 8    about T = 1's (one token tile)
  T = 128  V2-Lite three ~10 us, fused ~7 us: the GEMV is 512 CTAs re-reading gate rows and
           x tiles from L2 (~25 MB, ~4 us) in both; each tile's top-k overlaps the GEMV's tail;
           the fused align runs 768 pairs on 256 threads (~2 us) instead of 1024
  T = 256  the two within ~1-2 us of each other: the bound is where they cross; if the fused
           form loses at 256, lower route.fused_upto to the largest T where it wins.
So at b=1 a V2-Lite step's routing goes from ~0.17 ms to ~0.10 ms (26 layers), V3's from ~0.46
to ~0.29 ms (58 layers), and the route is one kernel of a layer instead of three.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys

import torch

from runtime.timing import graph_us

import ir
import ir.passes
from codegen import sizes as size_exprs
from codegen.families import moe_route
from codegen.kernel import Options
from codegen.tuning import DEFAULT_TUNING
from codegen.paths import MODEL_SPECS_DIR
from runtime.launcher import KernelRunner

DEV = "cuda"
DT = torch.bfloat16


def route_node(spec: str):
    """(G, nid) of the first moe_route node of the spec's decode graph."""
    G = ir.passes.run_pipeline(ir.build_graph(ir.load_spec(str(MODEL_SPECS_DIR / f"{spec}.yaml")),
                                              "decode"))
    nid = next(n for n, d in G.nodes(data=True) if d["op"] == "moe_route")
    return G, nid


def options(bound: int) -> Options:
    """The compile options with the fused launch serving T <= bound (0: the three launches always)."""
    t = DEFAULT_TUNING
    return Options(dtype="bf16", tuning=dataclasses.replace(t, route=dataclasses.replace(t.route, fused_upto=bound)))


def lower(G, nid, bound: int):
    return moe_route.lower(nid, G, options(bound))


def running(launches, sizes):
    return [la for la in launches if 0 not in [size_exprs.evaluate(g, sizes) for g in la.grid]]


def buffers(G, nid, T):
    data = G.nodes[nid]
    attrs = data["attrs"]
    (x,), (ids, w, r) = data["inputs"], data["outputs"]
    E, K = attrs["num_experts"], attrs["top_k"]
    D = G.graph["values"][x].shape[1]
    values = {x: torch.randn(T, D, device=DEV).to(DT), ids: torch.empty(T, K, dtype=torch.int64, device=DEV),
              w: torch.empty(T, K, dtype=torch.float32, device=DEV),
              f"{r}.order": torch.empty(T * K, dtype=torch.int32, device=DEV),
              f"{r}.offsets": torch.empty(E + 1, dtype=torch.int32, device=DEV)}
    weights = {data["weights"]["gate"]: torch.randn(E, D, device=DEV) / D ** 0.5 * 2.0}
    if "bias" in data["weights"]:
        weights[data["weights"]["bias"]] = torch.randn(E, device=DEV) * 0.5
    return values, weights, (ids, w, r), {"T": T, "NP": T * K}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--specs", default="deepseek_v2_lite,deepseek_v3")
    ap.add_argument("--tokens", default="1,8,32,128,256")
    ap.add_argument("--bounds", default=str(DEFAULT_TUNING.route.fused_upto or 256),
                    help="route.fused_upto values to time the fused launch under (each T <= bound)")
    a = ap.parse_args()
    torch.manual_seed(0)
    runner = KernelRunner()
    bad = 0
    print(f"# {torch.cuda.get_device_name()}", flush=True)
    for spec in a.specs.split(","):
        G, nid = route_node(spec)
        three = lower(G, nid, 0)
        for T in (int(t) for t in a.tokens.split(",")):
            values, weights, (ids, w, r), sizes = buffers(G, nid, T)
            sizes = runner.step_sizes(sizes, {}, values)      # SMS: the router GEMM (T > 256) reads it
            kw = dict(values=values, weights=weights, sizes=sizes)
            ws = runner.run_all(three, **kw)
            ref = {k: values[k].clone() for k in (ids, w, f"{r}.offsets")}
            t3 = graph_us(lambda: runner.run_all(three, **kw, workspaces=ws))
            parts = "  ".join(f"{la.stage} {graph_us(lambda la=la: runner.run(la, **kw, workspaces=ws)):.2f}"
                              for la in running(three, sizes))
            print(f"{spec:<17} T={T:<4} three launches {t3:7.2f} us   ({parts})", flush=True)
            for bound in (int(b) for b in a.bounds.split(",")):
                if T > bound:
                    continue
                fused = lower(G, nid, bound)
                assert [la.stage for la in running(fused, sizes)] == ["fused"]
                for k in ref:
                    values[k].fill_(-1)
                runner.run_all(fused, **kw, workspaces=ws)
                same_ids = (values[ids] == ref[ids]).all(dim=1).float().mean().item()
                ok = torch.equal(values[f"{r}.offsets"], ref[f"{r}.offsets"]) and same_ids > 0.99
                rows = (values[ids] == ref[ids]).all(dim=1)
                ok = ok and torch.allclose(values[w][rows], ref[w][rows], rtol=1e-5, atol=1e-6)
                bad += not ok
                tf = graph_us(lambda: runner.run_all(fused, **kw, workspaces=ws))
                print(f"{spec:<17} T={T:<4} fused (bound {bound:<4})  {tf:7.2f} us   {t3 / tf:5.2f}x   "
                      f"{'ok' if ok else 'BAD'} (ids equal on {same_ids:.1%} of tokens)", flush=True)
    runner.close()
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
