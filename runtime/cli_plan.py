"""`dsgraph plan`: size a tensor/expert-parallel deployment before buying it (runtime/planner.py
derives every figure; this file reads the options and prints the table).

    dsgraph plan [SPEC] [--gpus N[,N...]] [--dtype bf16|fp8] [--weights fp8] [--batch 32] [--context 4096]
                 [--gpu-mem 141] [--link-bw 360] [--net-bw 40] [--bench FILE] [--bw-fraction F] [--json]
                 [--memory]

Every degree asked for with --gpus (default: 1, 2, 4, ..., 64) is planned, and those the model refuses
are listed with their reasons.  When none of them fits, the table is followed by one error line with
the planner's numbers (exit status 2), which the table's notes then leave out.
"""
from __future__ import annotations

import argparse
import dataclasses
import json

from codegen.paths import DEFAULT_SPEC, SPEC_ARGUMENT, shipped_specs, spec_path

from . import planner
from .errors import InputError


def _degrees(text: str) -> tuple[int, ...]:
    try:
        out = tuple(int(t) for t in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N or N,N,... (whole numbers), got {text!r}") from None
    if any(n < 1 for n in out):
        raise argparse.ArgumentTypeError(f"GPU counts must be >= 1, got {text!r}")
    return out


def add_plan_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("spec", nargs="?", default=None,
                   help=f"{SPEC_ARGUMENT} ({', '.join(shipped_specs())}; default: {DEFAULT_SPEC.stem})")
    p.add_argument("--gpus", type=_degrees, default=None, metavar="N[,N...]",
                   help="GPU counts to plan (default: " + ", ".join(map(str, planner.DEFAULT_GPUS)) + ")")
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32", "fp8"),
                   help="weight, cache and activation dtype; fp8 is short for --dtype bf16 --weights fp8")
    p.add_argument("--weights", default=None, choices=("fp8",),
                   help="store the linears as DeepSeek-V3's FP8 checkpoints do (e4m3, a float32 scale per 128x128 "
                        "block; the rest in --dtype) (default: as the spec says)")
    p.add_argument("--batch", type=int, default=32, metavar="B", help="sequences decoded together")
    p.add_argument("--context", type=int, default=4096, metavar="L", help="tokens of context per sequence")
    p.add_argument("--gpu-mem", type=float, default=planner.GPU_MEM_GB, metavar="GB", help="memory per GPU")
    p.add_argument("--link-bw", type=float, default=planner.NVLINK_GBPS, metavar="GB/s",
                   help=f"effective all-reduce bandwidth per GPU within a node of {planner.GPUS_PER_NODE}")
    p.add_argument("--net-bw", type=float, default=planner.NET_GBPS, metavar="GB/s",
                   help="effective all-reduce bandwidth per GPU across nodes")
    p.add_argument("--bench", metavar="FILE", default=None,
                   help="measured figures: a `dsgraph bench` JSON (default: runtime/bench_h200.json, one H200)")
    p.add_argument("--bw-fraction", type=float, default=None, metavar="F",
                   help="share of copy bandwidth a decode step reaches (default: the nearest measured case)")
    p.add_argument("--json", action="store_true", help="print the plans as JSON instead of a table")
    p.add_argument("--memory", action="store_true",
                   help="also a step's planned activation memory (lowers the spec: a few seconds) and how many "
                        "sequences of the model's whole context fit")


def run_plan(args) -> int:
    """per-GPU memory, bytes per decode step and a step-time estimate on 1 to 64 GPUs"""
    from ir.spec import load_spec
    spec = load_spec(str(spec_path(args.spec or DEFAULT_SPEC)))
    dtype, weights = ("bf16", "fp8") if args.dtype == "fp8" else (args.dtype, args.weights)
    if weights is not None:
        from .convert import spec_in_format
        spec = spec_in_format(spec, None, weights)
    hw = planner.hardware(batch=args.batch, context=args.context, measured=planner.load_measured(args.bench),
                          gpu_mem_gb=args.gpu_mem, bw_fraction=args.bw_fraction, link_gbps=args.link_bw,
                          net_gbps=args.net_bw)
    # --gpus or the default list alike: a count the model cannot split is a "refused" row, the rest planned
    d = planner.plan_deployment(spec, args.gpus or planner.DEFAULT_GPUS, dtype=dtype, batch=args.batch,
                                context=args.context, hw=hw)
    fits = any(p.fits for p in d.plans)
    memory = memory_lines(spec, d, args.dtype) if args.memory else None
    if args.json:
        out = d.to_json()
        if memory is not None:
            out["memory"] = memory
        print(json.dumps(out, indent=1))
    else:
        # when nothing fits, why is the error line below: not a note under the table as well
        print("\n".join(table(d, misfit_notes=fits) + (["", *memory] if memory else [])))
    if not fits:
        raise InputError(nothing_fits(d))
    return 0


def memory_lines(spec, d: planner.Deployment, dtype: str) -> list[str]:
    """What --memory adds: per GPU count, the sequences of the whole context that fit; then a step's
    planned activations (one GPU's plan; codegen/memplan.py)."""
    from codegen.bundle import plan_spec
    from codegen.kernel import DEFAULTS
    from codegen.memplan import peak_lines
    whole = spec.dims["max_positions"]
    lines = [f"{p.gpus:>4}: {p.full_context_seqs} sequence(s) of the whole {whole}-token context fit per GPU "
             f"beside the weights" for p in d.plans]
    sp = plan_spec(spec, dataclasses.replace(DEFAULTS, dtype=dtype))
    itemsize = {"bf16": 2, "fp16": 2, "fp32": 4}[dtype]
    return lines + [f"one GPU, {line}" for line in peak_lines(sp.plans, itemsize, context=d.context)]


def nothing_fits(d: planner.Deployment) -> str:
    """The one error line when no GPU count asked for fits: one plan's numbers, or which counts."""
    if len(d.plans) == 1:
        return planner.not_fitting(d, d.plans[0])
    asked = ", ".join(str(n) for n in sorted([p.gpus for p in d.plans] + list(d.refused)))
    if not d.plans:
        return f"{d.spec_name} runs on none of the GPU counts asked for ({asked}): each is refused, for the reason given"
    return (f"{d.spec_name} in {d.precision} fits on none of {', '.join(str(p.gpus) for p in d.plans)} GPUs "
            f"at batch {d.batch} x context {d.context} (the table says by how much)")


def _gb(n: float) -> str:
    return f"{n / planner.GB:.1f}"


def table(d: planner.Deployment, misfit_notes: bool = True) -> list[str]:
    """The human-readable plan: what was measured and assumed, one row per degree, then the notes
    (why a degree does not fit, unless not `misfit_notes`; why one is refused)."""
    hw = d.hardware
    lines = [
        f"{d.spec_name} in {d.precision}, batch {d.batch} x context {d.context}, {hw.gpu_mem / planner.GB:g} GB per GPU "
        f"(runtime/planner.py says how each figure is derived)",
        f"measured: copy bandwidth {hw.copy_bw / 1e12:.2f} TB/s; decode reached {hw.bw_fraction:.0%} of it "
        + (f"at {hw.fraction_source} ({hw.measured_on})" if hw.fraction_source != "given" else "(given)"),
        f"assumed:  all-reduce {hw.link_bw / planner.GB:g} GB/s + {hw.link_latency * 1e6:g} us within "
        f"{hw.gpus_per_node} GPUs, {hw.net_bw / planner.GB:g} GB/s + {hw.net_latency * 1e6:g} us beyond; "
        f"uniform expert routing",
        "",
    ]
    head = ("GPUs", "weights GB", "KV GB", "free GB", f"max batch@{d.context}", f"max ctx@{d.batch}",
            "read GB/step", "all-reduce MB", "step ms", "tokens/s")
    rows = [head]
    for p in d.plans:
        runs = p.fits
        rows.append((str(p.gpus), _gb(p.weights), _gb(p.kv_cache), _gb(p.free), str(p.max_batch or "-"),
                     str(p.max_context or "-"), _gb(p.read["total"]), f"{p.allreduce_bytes / 1e6:.1f}",
                     f"{p.step_ms:.2f}" if runs else "-", f"{p.tokens_per_s:,.0f}" if runs else "-"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
    misfits = [p for p in d.plans if not p.fits] if misfit_notes else []
    if misfits or d.refused:
        lines.append("")
    lines += [f"{p.gpus:>4}: {planner.not_fitting(d, p)}" for p in misfits]
    lines += [f"{n:>4}: refused: {'; '.join(r)}" for n, r in d.refused.items()]
    return lines


__all__ = ["add_plan_args", "run_plan", "table"]

