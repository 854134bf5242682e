"""Each b=1 decode kernel's executed code footprint, from Nsight Compute's source counters (a
script, not a test).

    python3 -m bench.perf_footprint [--out DIR] [--case 1x512] [--kernels 40] [--skip 0]

PERF_NOTES v32: an H200 fetches code that is not in its SMs' instruction caches at ~104 SM cycles
a KB, and at b=1 a decode layer's kernels each run once between nine others, so the instructions a
kernel executes (not the ones it holds) are what a step pays to fetch.  This runs one eager decode
step of DeepSeek-V2-Lite (random bf16 weights, as `dsgraph bench`) under

    ncu --clock-control none --section SourceCounters -k regex:<dsgraph's kernels> --launch-count N

(the first N of dsgraph's launches: the embedding, the dense layer 0 and the first MoE layers),
exports the source page (`--page source --print-source sass --csv`: every SASS instruction with
its execution count summed over the launch's warps) and prints, per kernel, its static size, what
it executed (KB of instructions with a nonzero count), and of that what ran at most once a warp
(its count at most the kernel's first instruction's, which every warp runs once: straight-line
code, fetched cold unless it stayed in the caches), then the sum over the kernels a MoE layer runs.

The kernels are compiled with -lineinfo into a bundle cache under DIR; the report, the CSVs and the
cubins stay in DIR, so the addresses can be attributed to template lines afterwards on any machine
(`nvdisasm --print-line-info-inline` on DIR/cubins/<kernel>.cubin: the CSV's addresses minus its
first row's are the cubin's offsets).
"""
from __future__ import annotations

import argparse
import collections
import csv
import glob
import io
import os
import shutil
import subprocess
import sys
import tempfile

from codegen.paths import REPO_ROOT


INSTR_BYTES = 16
# dsgraph's kernel names (codegen/kernel.py: family__params); torch's own kernels are left out
KERNELS = "regex:^(embedding|rms_norm|fused_add_rms_norm|linear_skinny|mla_|moe_|rope_|add__|silu_)"


def child(out: str, case: str) -> int:
    """One eager decode step, its kernels compiled with -lineinfo into DIR's own bundle cache."""
    os.environ["DSGRAPH_CACHE_DIR"] = os.path.join(out, "cache")
    import codegen.nvrtc as nvrtc
    plain = nvrtc.compile_cubin

    def with_lines(source, kernel_name, *, options=(), **kw):
        return plain(source, kernel_name, options=(*options, "-lineinfo"), **kw)
    nvrtc.compile_cubin = with_lines

    import torch

    from runtime.bench import _decode_ctx, decode_engine
    batch, ctx = (int(v) for v in case.split("x"))
    eng = decode_engine([(batch, ctx)])
    eng.backend.use_graphs = False            # every kernel launched, so ncu sees each one
    with torch.inference_mode():
        _, step, ids = _decode_ctx(eng, batch, ctx)
        eng.backend.forward("decode", ids, step)
    torch.cuda.synchronize()
    cub = os.path.join(out, "cubins")
    os.makedirs(cub, exist_ok=True)
    for f in glob.glob(os.path.join(out, "cache", "**", "*.cubin"), recursive=True):
        shutil.copy(f, cub)
    return 0


def sections(text: str) -> list[list[dict]]:
    """The source page's CSV: one table per profiled launch, each starting at its "Address" header
    row ("# Address" in some ncu versions); rows are {column: value}, in address order."""
    out, hdr = [], None
    for r in csv.reader(io.StringIO(text)):
        if r and r[0].strip().lstrip("#").strip() == "Address":
            hdr = [c.strip() for c in r]
            out.append([])
            continue
        if hdr and len(r) == len(hdr) and r[0].strip().lower().startswith("0x"):
            out[-1].append(dict(zip(hdr, r)))
    return out


def executed_column(row: dict) -> str:
    """The warp-level execution count's column: "Instructions Executed" (not the thread-level or
    predicated-on counts beside it)."""
    if "Instructions Executed" in row:
        return "Instructions Executed"
    for k in row:
        if "Instructions Executed" in k and not any(w in k for w in ("Thread", "Predicated", "Not")):
            return k
    raise KeyError(f"no instruction count among the source page's columns: {sorted(row)}")


def launch_names(text: str) -> list[str]:
    """Kernel names of the raw page's CSV, one a profiled launch, in order."""
    rows = list(csv.reader(io.StringIO(text)))
    for i, r in enumerate(rows):
        if "Kernel Name" in r:
            k = r.index("Kernel Name")
            return [x[k] for x in rows[i + 1:] if len(x) > k and x[k] and x[k] != "Kernel Name"
                    and not x[0].startswith("(")]   # the units row under the header has no name
    return []


def count(v: str) -> int:
    v = v.replace(",", "").strip()
    return int(float(v)) if v not in ("", "-") else 0


def footprint(rows: list[dict]) -> tuple[int, int, int]:
    """(instructions, executed, executed at most once a warp) of one launch's table."""
    if not rows:
        return 0, 0, 0
    col = executed_column(rows[0])
    n = [count(r.get(col, "")) for r in rows]
    entry = n[0] if n else 0                # the kernel's first instruction: once a warp
    executed = sum(1 for x in n if x > 0)
    once = sum(1 for x in n if 0 < x <= entry)
    return len(n), executed, once


def kb(n: int) -> float:
    return n * INSTR_BYTES / 1024


def report(names: list[str], tables: list[list[dict]]) -> None:
    if len(names) != len(tables):
        print(f"# {len(names)} launch names against {len(tables)} source tables: names by position may be off")
    per = collections.OrderedDict()
    for i, rows in enumerate(tables):
        name = names[i] if i < len(names) else f"launch{i}"
        per.setdefault(name, []).append(footprint(rows))
    print(f"{'kernel':<72} {'runs':>4} {'static KB':>9} {'exec KB':>8} {'once KB':>8}")
    layer = [0, 0, 0]
    for name, fps in per.items():
        static, execd, once = (sorted(f[j] for f in fps)[len(fps) // 2] for j in range(3))
        print(f"{name[:72]:<72} {len(fps):>4} {kb(static):>9.1f} {kb(execd):>8.1f} {kb(once):>8.1f}")
        if len(fps) >= 2:                  # run by every layer profiled: a MoE layer's kernels
            for j, v in enumerate((static, execd, once)):
                layer[j] += v
    print(f"{'a MoE layer (kernels run 2+ times above)':<72} {'':>4} {kb(layer[0]):>9.1f} {kb(layer[1]):>8.1f} "
          f"{kb(layer[2]):>8.1f}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(os.environ["OUT"], "footprint") if os.environ.get("OUT") else None,
                    help="where the report, CSVs and cubins go (default: $OUT/footprint, else a temporary directory)")
    ap.add_argument("--case", default="1x512", help="batch x context of the decode step")
    ap.add_argument("--kernels", type=int, default=40, help="dsgraph launches profiled")
    ap.add_argument("--skip", type=int, default=0,
                    help="dsgraph launches left out first (if ncu is slow: e.g. --skip 10 --kernels 20, the "
                         "first two MoE layers; their kernels then all count as a layer's)")
    ap.add_argument("--ncu", default=shutil.which("ncu") or "ncu")
    ap.add_argument("--timeout", type=int, default=420, help="seconds ncu may run")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--parse", action="store_true", help="only parse DIR's CSVs again")
    a = ap.parse_args()
    out = a.out or tempfile.mkdtemp(prefix="dsgraph_footprint_")
    os.makedirs(out, exist_ok=True)
    if a.child:
        return child(out, a.case)
    rep = os.path.join(out, "step")
    if not a.parse:
        cmd = [a.ncu, "--clock-control", "none", "--section", "SourceCounters", "-k", KERNELS,
               "--launch-skip", str(a.skip), "--launch-count", str(a.kernels), "-f", "-o", rep,
               sys.executable, "-m", "bench.perf_footprint", "--child", "--out", out, "--case", a.case]
        try:
            got = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout, cwd=REPO_ROOT)
        except subprocess.TimeoutExpired as e:
            text = "".join(x.decode(errors="replace") if isinstance(x, bytes) else x
                           for x in (e.stdout or "", e.stderr or ""))
            print(f"ncu ran past {a.timeout} s (try fewer --kernels); its last lines:\n" + text[-3000:])
            return 1
        with open(os.path.join(out, "ncu.log"), "w") as f:
            f.write(got.stdout + got.stderr)
        if got.returncode != 0 or not os.path.exists(rep + ".ncu-rep"):
            print(f"ncu failed ({got.returncode}); its last lines:\n" + (got.stdout + got.stderr)[-3000:])
            return 1
        for page, extra, name in (("raw", [], "raw.csv"), ("source", ["--print-source", "sass"], "source.csv")):
            got = subprocess.run([a.ncu, "--import", rep + ".ncu-rep", "--csv", "--page", page, *extra],
                                 capture_output=True, text=True)
            with open(os.path.join(out, name), "w") as f:
                f.write(got.stdout)
            if got.returncode != 0:
                print(f"ncu --import --page {page} failed ({got.returncode}): {got.stderr[-2000:]}")
                return 1
    names = launch_names(open(os.path.join(out, "raw.csv")).read())
    tables = sections(open(os.path.join(out, "source.csv")).read())
    if len(tables) < len(names) and not a.parse:
        # a source page of one launch only: export each launch's own (the import's filter options)
        tables = []
        for i in range(len(names)):
            got = subprocess.run([a.ncu, "--import", rep + ".ncu-rep", "--csv", "--page", "source",
                                  "--print-source", "sass", "--launch-skip", str(i), "--launch-count", "1"],
                                 capture_output=True, text=True)
            with open(os.path.join(out, f"source_{i:03d}.csv"), "w") as f:
                f.write(got.stdout)
            tables.extend(sections(got.stdout)[:1])
    elif len(tables) < len(names):
        tables = [t for i in range(len(names)) if os.path.exists(os.path.join(out, f"source_{i:03d}.csv"))
                  for t in sections(open(os.path.join(out, f"source_{i:03d}.csv")).read())[:1]]
    print(f"# {a.case}: {len(tables)} launches profiled; files in {out}")
    report(names, tables)
    return 0


if __name__ == "__main__":
    sys.exit(main())
