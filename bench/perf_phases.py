"""Where a decode step's time goes inside its kernels, from marks the kernels write themselves (a
script, not a test).

    python3 -m bench.perf_phases [--cases 1x512,1x4096] [--steps 30] [--window 15,80] [--pdl both]

DeepSeek-V2-Lite (random bf16 weights, as `dsgraph bench`), its kernels compiled with -DDSG_PHASES=1
(templates/include/phases.cuh) into a bundle cache of this run's own, decode steps replayed from
their CUDA graph with PDL on, as the bench runs them, and then off (each kernel launched after the
one before has ended: what bench's per-family rates time, each kernel's own work).  After each step every module's mark tables
are read: per CTA, the global timer (ns, one clock for all SMs) and the SM's cycle counter when
thread 0 called pdl_wait(), when it returned, when the CTA triggered its dependents, when its last
warp reached the kernel's end, and the kernel's own marks (4-7).  Each launch overwrites its
module's rows, so a step leaves the last launch of each kernel: the last decode layer's.

Per kernel of that layer, in the order they start their work (medians over the steps, us), each
against the kernel before it (its last CTA's exit, `prev`):
  entered the first CTA's first instruction after prev, where the kernel marks it (the decode
          attention: with PDL off, its launch; `called` - `entered`, its pre-wait chain);
  called  the first CTA's pdl_wait() call after prev (negative: its pre-wait work was issued
          before prev ended);
  waited  the first CTA's return from pdl_wait() after prev: what a boundary costs once the
          kernel before has ended (grid completion, memory flush, the dependent's release);
  spread  the last CTA's return after the first's;
  work    the kernel's last exit after its first return;
  adds    its last exit after prev: its share of the step's chain (`perf_replay.py` print_chain
          measures the same from the profiler's timeline).
Then each kernel's own marks after its first return (the latest CTA's, and the first's): the
decode attention's queries landed (4), tiles done (5), partials in place (6), columns merged (7);
the route's logits issued (4), a tile's last CTA (5), the aligning CTA's top-k done (6);
gate_up_silu / down's walks starting (4).  The global timer's resolution is printed first: the
figures are only as fine as it is (a cycle-counter view of the same marks follows, per kernel, for
the CTA that exits last).
"""
from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import tempfile


MARKS = 9                     # phases.cuh: a table row (its CTAS rows: the table's size)
WAIT_CALL, WAITED, TRIGGER, EXIT = range(4)
OWN = range(4, 8)             # the kernel's own marks
ENTRY = 8                     # thread 0's first instruction, where the kernel marks it
OWN_MARKS = {
    "mla_decode_attention": {4: "queries landed", 5: "tiles done", 6: "partials in place", 7: "columns merged"},
    "moe_route": {4: "logits issued", 5: "a tile's last CTA", 6: "top-k done"},
    "moe_gate_up_silu": {4: "walk starts"},
    "moe_down": {4: "walk starts"},
}


def with_phase_marks() -> None:
    """Compile every kernel of this process with -DDSG_PHASES=1, into a cache of its own (the bundle
    cache keys on the compiler's sources, not on NVRTC options)."""
    os.environ["DSGRAPH_CACHE_DIR"] = tempfile.mkdtemp(prefix="dsgraph_phases_")
    import codegen.nvrtc as nvrtc
    plain = nvrtc.compile_cubin

    def compile_marked(source, kernel_name, *, options=(), **kw):
        return plain(source, kernel_name, options=(*options, "-DDSG_PHASES=1"), **kw)
    nvrtc.compile_cubin = compile_marked


class MarkTables:
    """The two mark tables of every loaded module that has them (cuModuleGetGlobal)."""

    def __init__(self, runner):
        from cuda.bindings import driver

        from runtime.cuda_driver import check
        self.driver, self.check, self.tables = driver, check, {}
        for name, mod in runner._modules.items():
            if mod._module is None:
                continue
            ptrs = []
            for sym in (b"dsg_phase_ns", b"dsg_phase_clk"):
                err, ptr, size = driver.cuModuleGetGlobal(mod._module, sym)
                if err != driver.CUresult.CUDA_SUCCESS:
                    break
                ptrs.append((ptr, size))
            if len(ptrs) == 2:
                self.tables[name] = ptrs

    def clear(self) -> None:
        import torch
        torch.cuda.synchronize()
        for ptrs in self.tables.values():
            for ptr, size in ptrs:
                self.check(self.driver.cuMemsetD8(ptr, 0, size), "cuMemsetD8")
        torch.cuda.synchronize()

    def read(self) -> dict:
        """{kernel: (ns rows, clk rows)}: the rows of the CTAs that marked anything."""
        import torch
        torch.cuda.synchronize()
        out = {}
        for name, ptrs in self.tables.items():
            views = []
            for ptr, size in ptrs:
                buf = bytearray(size)
                self.check(self.driver.cuMemcpyDtoH(buf, ptr, size), "cuMemcpyDtoH")
                views.append(memoryview(buf).cast("Q"))
            ns, clk = views
            rows = [(list(ns[c * MARKS:(c + 1) * MARKS]), list(clk[c * MARKS:(c + 1) * MARKS]))
                    for c in range(len(ns) // MARKS) if any(ns[c * MARKS:(c + 1) * MARKS])]
            if rows:
                out[name] = rows
        return out


LAUNCH_SPAN_NS = 30_000   # a launch's CTAs all return from their waits within this (a layer is ~70 us)


def summarise(rows) -> dict | None:
    """One kernel's launch from its CTAs' rows: first / last of each mark (ns), and the cycle view
    of the CTA that exits last.  Rows an earlier launch of the step left (CTAs the last launch did
    not run: its grid was smaller) are dropped: their wait returned long before the last one's."""
    latest = max((ns[WAITED] for ns, _ in rows), default=0)
    if not latest:
        return None
    rows = [r for r in rows if r[0][WAITED] >= latest - LAUNCH_SPAN_NS]

    def col(k):
        return [ns[k] for ns, _ in rows if ns[k]]
    waited = col(WAITED)
    exits = col(EXIT)
    s = {"ctas": len(rows), "called": min(col(WAIT_CALL) or waited), "first": min(waited), "last": max(waited),
         "entered": min(col(ENTRY)) if col(ENTRY) else None,
         "exit": max(exits) if exits else max(max(ns) for ns, _ in rows), "has_exit": bool(exits),
         "own": {k: (min(col(k)), max(col(k))) for k in OWN if col(k)}}
    ns, clk = max(rows, key=lambda r: r[0][EXIT])
    s["cycles"] = {k: clk[k] - clk[WAITED] for k in range(MARKS) if clk[k] and clk[WAITED] and k != WAITED}
    return s


def timer_resolution(samples) -> str:
    values = sorted({v for sample in samples for rows in sample.values() for ns, _ in rows for v in ns if v})
    steps = [b - a for a, b in zip(values, values[1:]) if b > a]
    if not steps:
        return "no marks"
    whole_us = sum(1 for v in values if v % 1000 == 0) / len(values)
    return f"smallest step between marks {min(steps)} ns, {100 * whole_us:.0f}% of marks on a whole us"


def chain(sample: dict, window_us: tuple[float, float]) -> list:
    """The kernels of the last layer, in the order of their first wait return: those whose first
    wait returned from window_us[0] before the decode attention's to window_us[1] after it (the
    layer's q / kv_a linear and query come before it; the step's final norm and lm_head, ~100 us
    of reading at V2-Lite, after the layer, at the window's end); without an attention among the
    marks, the window before the step's last exit."""
    from runtime.bench import family_of
    ks = [(name, s) for name, s in ((n, summarise(r)) for n, r in sample.items()) if s]
    if not ks:
        return []
    att = [s["first"] for n, s in ks if family_of(n) == "mla_decode_attention"]
    if att:
        lo, hi = max(att) - window_us[0] * 1e3, max(att) + window_us[1] * 1e3
    else:
        hi = max(s["exit"] for _, s in ks)
        lo = hi - sum(window_us) * 1e3
    ks = [(n, s) for n, s in ks if lo <= s["first"] <= hi]
    return sorted(ks, key=lambda kv: kv[1]["first"])


def label(kernel: str) -> str:
    """A kernel's family and shape, short: linear_skinny's q / kv_a, o and lm_head differ by shape."""
    from runtime.bench import family_of
    fam = family_of(kernel)
    parts = [p for p in kernel[len(fam):].split("__") if p and p not in ("bf16", "fp16", "fp32")]
    return (fam + " " + " ".join(parts[:2]))[:44]


def report(samples: list, window_us: tuple[float, float], ghz: float | None) -> None:
    from runtime.bench import family_of
    per = collections.defaultdict(lambda: collections.defaultdict(list))
    order = collections.Counter()
    for sample in samples:
        ks = chain(sample, window_us)
        for i, (name, s) in enumerate(ks):
            order[name] += i
            d = per[name]
            if i:
                prev = ks[i - 1][1]["exit"]
                if s["entered"] is not None:
                    d["entered"].append((s["entered"] - prev) / 1e3)
                d["called"].append((s["called"] - prev) / 1e3)
                d["waited"].append((s["first"] - prev) / 1e3)
                d["adds"].append((s["exit"] - prev) / 1e3)
            d["spread"].append((s["last"] - s["first"]) / 1e3)
            d["work"].append((s["exit"] - s["first"]) / 1e3)
            d["ctas"].append(s["ctas"])
            d["has_exit"].append(s["has_exit"])
            for k, (lo, hi) in s["own"].items():
                d[f"own{k}"].append(((hi - s["first"]) / 1e3, (lo - s["first"]) / 1e3))
            for k, c in s["cycles"].items():
                d[f"cyc{k}"].append(c)
    names = sorted(per, key=lambda n: order[n] / max(1, len(per[n]["work"])))

    def med(v):
        return statistics.median(v) if v else float("nan")
    print(f"  {'kernel':<44}{'CTAs':>6}{'entered':>8}{'called':>8}{'waited':>8}{'spread':>8}{'work':>8}{'adds':>8}")
    for n in names:
        d = per[n]
        flag = "" if all(d["has_exit"]) else "  (no exit mark: its last mark)"
        entered = f"{med(d['entered']):>8.2f}" if d.get("entered") else f"{'-':>8}"
        print(f"  {label(n):<44}{med(d['ctas']):>6.0f}{entered}{med(d['called']):>8.2f}{med(d['waited']):>8.2f}"
              f"{med(d['spread']):>8.2f}{med(d['work']):>8.2f}{med(d['adds']):>8.2f}{flag}")
    print("  each kernel's marks after its first wait return, us: the latest CTA's (the first's); then the "
          "CTA that exits last, by its SM's clock")
    for n in names:
        d = per[n]
        labels = OWN_MARKS.get(family_of(n), {})
        own = [f"{labels.get(k, f'mark {k}')} {med([v[0] for v in d[f'own{k}']]):.2f}"
               f" ({med([v[1] for v in d[f'own{k}']]):.2f})"
               for k in OWN if d.get(f"own{k}")]
        cyc = []
        if ghz:
            cyc = [f"{name} {med(d[f'cyc{k}']) / ghz / 1e3:.2f}"
                   for k, name in ((ENTRY, "entry"), (WAIT_CALL, "wait called"), (TRIGGER, "trigger"),
                                   *((k, labels.get(k, f"mark {k}")) for k in OWN), (EXIT, "exit"))
                   if d.get(f"cyc{k}")]
        if own or cyc:
            print(f"  {label(n)}: " + "; ".join(own) + (" | clock: " + "; ".join(cyc) if cyc else ""))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="1x512,1x4096")
    ap.add_argument("--steps", type=int, default=30, help="decode steps read per case")
    ap.add_argument("--window", default="15,80",
                    help="us before,after the last decode attention's wait return whose kernels count "
                         "as the last layer's")
    ap.add_argument("--pdl", choices=("on", "off", "both"), default="both",
                    help="launch mode of the steps read (off: every kernel waits for the one before it, "
                         "so pdl_wait() returns at once and the marks time each kernel's own work)")
    a = ap.parse_args()
    with_phase_marks()

    import torch

    from runtime.bench import _decode_ctx, _release, decode_engine

    cases = [tuple(int(v) for v in c.split("x")) for c in a.cases.split(",")]
    eng = decode_engine(cases)
    be = eng.backend
    modes = {"on": [True], "off": [False], "both": [True, False]}[a.pdl]
    print(f"# {torch.cuda.get_device_name()}, decode graph replays, kernels with phase marks")
    with torch.inference_mode():
        for batch, ctx in cases:
            sids, step, ids = _decode_ctx(eng, batch, ctx)
            for pdl in modes:
                be.runner.pdl = pdl
                be.graphs_decode.graphs.clear()   # captured anew with this launch mode
                for _ in range(5):
                    be.forward("decode", ids, step)
                tables = MarkTables(be.runner)
                if not tables.tables:
                    print("no module has phase marks: were the kernels compiled with -DDSG_PHASES=1?")
                    return 1
                samples = []
                for _ in range(a.steps):
                    tables.clear()
                    be.forward("decode", ids, step)
                    samples.append(tables.read())
                try:
                    ghz = torch.cuda.clock_rate() / 1e3   # the SM clock now (NVML), MHz
                except Exception:   # noqa: BLE001 - the cycle view is a nicety
                    ghz = None
                print(f"\n{batch}x{ctx}, PDL {'on' if pdl else 'off'}: {len(tables.tables)} modules with marks; "
                      f"global timer: {timer_resolution(samples)}; SM clock {ghz or float('nan'):.2f} GHz after")
                report(samples, tuple(float(v) for v in a.window.split(",")), ghz)
            be.runner.pdl = True
            be.graphs_decode.graphs.clear()
            _release(eng, sids)
    return 0


if __name__ == "__main__":
    sys.exit(main())
