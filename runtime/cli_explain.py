"""`dsgraph explain`: which kernel every op of a spec runs at a token count, and why.

    dsgraph explain model_specs/deepseek_v2_lite.yaml --tokens 1,48,300,16384 [--phase decode]
    dsgraph explain --knobs              the tuning knobs, their defaults and meaning
    dsgraph explain SPEC --tasks --batch 1,8,32   the decode step's task graph (codegen/tasks.py)
    dsgraph explain --weights w4a8 --tokens 1   the spec as `dsgraph bench --weights w4a8` compiles it

The answer is the lowering's own: the spec goes through the passes and the families (no NVRTC),
and at each token count the launches whose grids have work (codegen.sizes, with the step's sizes)
are the ones printed, each with the reason of the dispatch-table row that put it there
(codegen/dispatch.py).  Decode at T tokens is T sequences of --context tokens each; prefill at T
tokens is one prompt of T tokens.
"""
from __future__ import annotations

import argparse

from codegen.kernel import DEFAULTS
from codegen.paths import DEFAULT_SPEC

from .cli_args import add_tune_arg, tuning_of, whole_number

PHASES = ("prefill", "decode")


def tokens_arg(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected token counts like 1,48,300, got {text!r}") from None
    if not out or any(t < 1 for t in out):
        raise argparse.ArgumentTypeError(f"token counts must be whole numbers >= 1, got {text!r}")
    return out


def add_explain_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("spec", nargs="?", default=None, help=f"the model spec (default: model_specs/{DEFAULT_SPEC.name})")
    p.add_argument("--tokens", type=tokens_arg, default="1,48,300,16384", metavar="N,...",
                   help="token counts of a step")
    p.add_argument("--phase", choices=PHASES, default=None, help="only this phase (default: both)")
    p.add_argument("--arch", default=DEFAULTS.arch, help="NVRTC target, e.g. sm_90 or sm_80")
    p.add_argument("--dtype", default=DEFAULTS.dtype, choices=("bf16", "fp16", "fp32"), help="activation dtype")
    p.add_argument("--context", type=whole_number(1), default=512, metavar="C",
                   help="decode: each sequence's context length")
    p.add_argument("--sms", type=whole_number(1), default=132, metavar="N",
                   help="SMs of the GPU the grids are sized for (an H100 / H200 has 132)")
    from .bench import WEIGHTS
    p.add_argument("--weights", choices=WEIGHTS, default="bf16",
                   help="the weights' storage, as `dsgraph bench --weights` compiles the spec (fp8: V3's blocks; "
                        "w8a8 / w4a8: msModelSlim's int8 linears and int8 / packed int4 experts)")
    p.add_argument("--knobs", action="store_true", help="list the tuning knobs and exit")
    p.add_argument("--tasks", action="store_true",
                   help="summarise the decode step's task graph instead (codegen/tasks.py)")
    p.add_argument("--batch", type=tokens_arg, default="1", metavar="B,...",
                   help="with --tasks: the decode batch sizes (default: %(default)s)")
    add_tune_arg(p)


def run_explain(args) -> int:
    """print which kernel every op runs at a token count, and the dispatch table's reason"""
    from codegen.tuning import knobs
    tuning = tuning_of(args)
    if args.knobs:
        for name, (default, doc) in knobs().items():
            value = tuning.to_json()[name.split(".")[0]][name.split(".")[1]]
            mark = "" if value == default else f"  (set: {value})"
            print(f"{name:<32} {'none' if default is None else default!s:<16} {doc}{mark}")
        return 0
    if args.tasks:
        for line in task_lines(args.spec or str(DEFAULT_SPEC), batches=args.batch, arch=args.arch, dtype=args.dtype,
                               context=args.context, sms=args.sms, tuning=tuning):
            print(line)
        return 0
    for line in explain_lines(args.spec or str(DEFAULT_SPEC), tokens=args.tokens,
                              phases=(args.phase,) if args.phase else PHASES, arch=args.arch, dtype=args.dtype,
                              context=args.context, sms=args.sms, tuning=tuning, weights=args.weights):
        print(line)
    return 0


def explain_lines(spec, *, tokens, phases=PHASES, arch=DEFAULTS.arch, dtype=DEFAULTS.dtype, context=512,
                  sms=132, tuning=None, weights="bf16") -> list[str]:
    from codegen.bundle import check_block_size, plan_spec
    from codegen.kernel import KernelLaunch, Options
    from codegen.nvrtc import check_target
    from codegen.tuning import as_tuning
    check_target(arch)
    check_block_size(DEFAULTS.block_size)
    tuning = as_tuning(tuning)
    opts = Options(arch=arch, dtype=dtype, tuning=tuning)
    from .bench import bench_spec   # the spec with --weights' formats, as the bench compiles it
    sp = plan_spec(bench_spec(spec, weights), opts, strict=False)
    changed = tuning.changed()
    lines = [f"{sp.spec.name} ({spec}): {arch}, {dtype}, " + (f"--weights {weights}, " if weights != "bf16" else "")
             + "tuning "
             + (", ".join(f"{k}={v}" for k, v in changed.items()) if changed else "defaults")]
    for phase in phases:
        G, plan = sp.graphs[phase], sp.plans[phase]
        P = _pairs_per_token(G)
        per_node: dict = {}
        for step in plan.steps:
            for nid in (step.nodes if isinstance(step, KernelLaunch) else (step.node,)):
                per_node.setdefault(nid, []).append(step)
        for T in tokens:
            sizes = _sizes(phase, T, P, context, DEFAULTS.block_size, sms)
            lines.append("")
            lines.append(f"{phase}, T = {T}" + (f" ({T} sequences of {context} tokens)" if phase == "decode"
                                                 else " (one prompt)") + (f", NP = {T * P}" if P else ""))
            lines += _segment_lines(plan, sizes, T, opts)
            seen: dict = {}
            for nid, steps in per_node.items():
                op = G.nodes[nid]["op"]
                running = [s for s in steps if _runs(s, sizes, T)]
                key = (op, tuple(_name(s) for s in running))
                if key in seen:
                    seen[key][1] += 1
                    continue
                seen[key] = [nid, 1, op, running]
            for key, (nid, count, op, running) in seen.items():
                kernels = ", ".join(_name(s) for s in running) or "(nothing: no launch has work)"
                where = f"{nid}" + (f" (+{count - 1} alike)" if count > 1 else "")
                lines.append(f"  {op:<24} {where}")
                lines.append(f"    runs   {kernels}")
                why = _reason(op, running, T, opts, G.nodes[nid]["attrs"], G=G, nid=nid)
                if why:
                    lines.append(f"    why    {why}")
    return lines


def _segment_lines(plan, sizes: dict, T: int, opts) -> list[str]:
    """Where persistent segments run at T (codegen/segments.py): how many, and the launches they save."""
    from codegen import dispatch
    segs = [s for s in plan.launches if s.family == "segment" and _runs(s, sizes, T)]
    if not segs:
        return []
    after = sum(1 for s in plan.launches if _runs(s, sizes, T))
    members = sum(len(s.params["members"]) for s in segs)
    row = dispatch.select("segments", T, {"phase": plan.phase, "segments": True}, opts.tuning)
    lines = [f"  segments: {len(segs)} persistent launches run {members} members' tiles: "
             f"{after + members - len(segs)} launches -> {after}",
             f"    why    {row.variant} [tokens {row.span}]: {row.reason}"]
    if opts.tuning.persistent.ctas_per_sm != 1:
        two = sum("ctas" in s.params for s in segs)
        lines.append(f"    ctas   {opts.tuning.persistent.ctas_per_sm} an SM: {two} of {len(segs)}")
        lines += [f"    ctas   1 an SM: {s.name}: {s.params['ctas_refused']}"
                  for s in segs if "ctas_refused" in s.params]
    return lines


def task_lines(spec, *, batches, arch=DEFAULTS.arch, dtype=DEFAULTS.dtype, context=512, sms=132,
               tuning=None) -> list[str]:
    """The decode task graph at each batch size: tasks, dependencies, critical path, widest level, and
    the tasks per family (declared tiling, coarse, library)."""
    from codegen.bundle import check_block_size, plan_spec
    from codegen.families._dense_util import ELEM_BYTES
    from codegen.kernel import Options
    from codegen.nvrtc import check_target
    from codegen.tasks import build_task_graph, summary_lines
    from codegen.tuning import as_tuning
    check_target(arch)
    check_block_size(DEFAULTS.block_size)
    sp = plan_spec(spec, Options(arch=arch, dtype=dtype, tuning=as_tuning(tuning)), strict=False)
    lines = [f"{sp.spec.name} ({spec}): {arch}, {dtype}"]
    for b in batches:
        graph = build_task_graph(sp.plans["decode"], b, context=context, sms=sms, act_itemsize=ELEM_BYTES[dtype])
        lines += ["", *summary_lines(graph)]
    return lines


def _pairs_per_token(G) -> int:
    from ir.ops.moe import pairs_per_token
    for v in G.graph["values"].values():
        if getattr(v, "dtype", None) == "routing":
            P = pairs_per_token(v.shape[0])
            if P:
                return P
    return 0


def _sizes(phase: str, T: int, P: int, context: int, block_size: int, sms: int) -> dict:
    if phase == "decode":
        B, maxq, maxctx = T, 1, context
    else:
        B, maxq, maxctx = 1, T, T
    return {"T": T, "B": B, "NP": T * P, "MAXQ": maxq, "MAXCTX": maxctx, "TK": B * maxctx, "W": -(-maxctx // block_size), "SMS": sms}


def _runs(step, sizes: dict, T: int) -> bool:
    from codegen.kernel import KernelLaunch
    from codegen.sizes import evaluate
    if isinstance(step, KernelLaunch):
        return all(evaluate(g, sizes) > 0 for g in step.grid)
    return step.runs_at(T)


def _name(step) -> str:
    from codegen.kernel import KernelLaunch
    return step.name if isinstance(step, KernelLaunch) else f"library {step.call}"


def _reason(op: str, running: list, T: int, opts, attrs: dict, G=None, nid: str | None = None) -> str:
    """The reasons of the table rows behind the running launches ("variant [range]: why; ..."); with the graph
    G and the node nid, also who makes a reader's e4m3 rows and why mla_v_up does not (its pass's refusal)."""
    from codegen import dispatch
    from codegen.families import _moe_gemm_fp8
    from codegen.kernel import KernelLaunch
    if op not in dispatch.TABLES:
        return _norm_writes(running)
    wanted: dict = {}   # (table op, variant), in order
    for s in running:
        st = _moe_gemm_fp8.row_variant(s) if isinstance(s, KernelLaunch) else "library"
        if op in ("linear", "multi_linear", "gate_up_silu"):
            fmt = s.attrs.get("weight_format") if st == "library" else s.params.get("wfmt")
            if fmt == "int8_channel":   # the quantiser's launch and the int8 kernel are one row
                i8 = "int_mm" if st == "library" else "i8_wgmma" if s.family == "gemm_int8" else \
                    "skinny_wi8_xq" if "xq" in s.params else \
                    "skinny_wi8_chunks" if "chunk" in s.params else "skinny_wi8"
                wanted[(op, i8)] = 1
            else:
                wanted[(op, "library" if st == "library" else "fp8_wgmma" if s.family == "gemm_fp8" else
                         "skinny_fp8_chunks" if "chunk" in s.params else "skinny")] = 1
        elif op == "moe_expert_ffn":
            wanted[(op, "fused" if st == "fused" else "two_launch")] = 1
            if st != "fused" and s.family in dispatch.TABLES:   # and the grouped family's own row (the FP8
                wanted[(s.family, st)] = 1                        # activations' quantiser has none: gemm_fp8's)
        elif op == "mla_prefill_attention":
            wanted[(op, f"mma {s.params['tc2']['name']}" if "tc2" in s.params else "simt")] = 1
        elif op in ("mla_decode_attention", "mla_v_up"):
            fp8 = "_fp8" if s.params.get("fp8") else ""
            wanted[(op, "mma" + fp8 if s.params.get("mma") else "simt")] = 1
        elif op in ("mla_decode_prologue", "mla_decode_query"):
            if s.family == "mla_kv_cache_write":
                continue
            separate = any(getattr(o, "family", "") == "mla_kv_cache_write" for o in running)
            fp8 = "_fp8" if s.params.get("fp8") else ""
            wanted[(op, ("mma" if separate else "mma_kv") + fp8 if s.params.get("mma") else "simt")] = 1
        else:
            wanted[(op, st)] = 1
    known = {"dtype": opts.dtype}   # the facts read off the node here; the shape facts stay open
    wfmt = next((s.params["wfmt"] for s in running if isinstance(s, KernelLaunch) and "wfmt" in s.params), None)
    if wfmt is not None:
        known["weight_format"] = wfmt
    if op in ("linear", "multi_linear", "gate_up_silu"):
        known["precision"] = "fp32" if op == "linear" and attrs.get("precision") == "fp32" else "act"
    out: list = []
    for table_op, variant in wanted:
        table = dispatch.table(table_op, opts.tuning)
        row = next((r for case in table.cases if case.admits(known)   # the first case that admits the
                    for r in case.rows if r.variant == variant and r.covers(T)), None)  # known facts
        if row is not None:
            out.append(f"{variant} [{table.unit} {row.span}]: {row.reason}")
    read = {_norm_rows(s, "xq") for s in running if isinstance(s, KernelLaunch)}
    if "int8" in read:
        out.append("here x's int8 rows and scales come from the RMSNorm that makes x (linear.norm_int8), "
                   "not a quantiser launch")
    if "fp8" in read:
        v_up = G is not None and any(_rows_maker(G, s) == "mla_v_up" for s in running if isinstance(s, KernelLaunch))
        out.append("here x's e4m3 rows and scales come from " + (
            "mla_v_up, which makes x (linear.v_up_fp8; a CTA a head: its 128 columns are one group)" if v_up else
            "the RMSNorm that makes x (linear.norm_fp8)") + ", not a quantiser launch")
    if op == "multi_linear":
        out += _gemm_multi_note(running)
    if op == "mla_v_up":
        out += _v_up_rows(running, opts, attrs, G, nid)
    return "; ".join(out)


def _gemm_multi_note(running: list) -> list:
    """A multi_linear's one-byte GEMMs as one launch (linear.gemm_multi)."""
    from codegen.kernel import KernelLaunch
    fused = [s.params["parts"] for s in running if isinstance(s, KernelLaunch) and s.params.get("variant") == "multi"]
    return [f"here its {len(fused[0])} weights' GEMMs are one launch, each weight's CTAs walking its own launch's "
            f"tiles (linear.gemm_multi)"] if fused else []


def _rows_maker(G, launch) -> str | None:
    """The op of the node that makes the quantised rows a reader's xq binds, None: its own workspace."""
    from codegen.kernel import ValueRef
    from ir.graph import value_producers
    ref = next((a.ref for a in launch.args if a.name == "xq"), None)
    if not isinstance(ref, ValueRef) or ref.name not in value_producers(G):
        return None
    return G.nodes[value_producers(G)[ref.name]]["op"]


def _v_up_rows(running: list, opts, attrs: dict, G, nid: str | None) -> list[str]:
    """mla_v_up's why about o_proj's e4m3 rows: written here (the qf8 launch runs), or why not with the knob on."""
    if any("quant_f8" in s.params for s in running if hasattr(s, "params")):
        return ["here v_up also writes o's e4m3 rows and scales (linear.v_up_fp8): o_proj multiplies o FP8 x FP8 "
                "at this size, and a CTA holds a whole head (one 128-column group), so o_proj runs no quantiser"]
    if not opts.tuning.linear.v_up_fp8 or attrs.get("quant") or G is None:
        return []
    return [f"o_proj keeps its quantiser: {r}" for r in G.graph.get("refusals", []) if f"{nid} (mla_v_up)" in r]


def _norm_writes(running: list) -> str:
    """A norm's why: the FP8 x FP8 readers' rows it writes at this size (the int8 ones it writes at every T),
    and the MoE combine + norm's streaming launch where it runs."""
    from codegen.kernel import KernelLaunch
    out = []
    if any(isinstance(s, KernelLaunch) and _norm_rows(s, "hq") == "fp8" for s in running):
        out.append("here the RMSNorm also writes its output's e4m3 rows and scales (linear.norm_fp8): a reader "
                   "multiplies it FP8 x FP8 at this size")
    if any(isinstance(s, KernelLaunch) and "stream" in s.params for s in running):
        out.append("streamed (moe.combine_stream_above): CTAs the SMs hold at once, the next token's rows in "
                   "flight while this one's norm reduces")
    return "; ".join(out)


def _norm_rows(launch, arg: str) -> str | None:
    """The format ("int8", "fp8") of the quantised rows argument `arg` binds where it binds a norm's rows
    (graph values, ir/passes/norm_rows.py: a reader's xq, a norm's hq), else None (a quantiser workspace)."""
    from codegen.kernel import ValueRef
    for a in launch.args:
        if a.name == arg and isinstance(a.ref, ValueRef):
            return {".qi8": "int8", ".qf8": "fp8"}.get(a.ref.name[-4:])
    return None
