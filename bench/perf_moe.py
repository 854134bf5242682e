"""Routed-expert (grouped MoE) kernel timings at DeepSeek-V2-Lite dims (a script, not a test).

    python3 -m bench.perf_moe [--pairs 1,2,4,8,9,12,16,32,64,65,128,256] [--batches 1,8,32,128,256]
                                  [--variants ts8_thr2_skinny64,ts0_wgs,thr0_skinny0]
                                  [--json PATH]
    python3 -m bench.perf_moe --compile-only      # no GPU: lower, render and NVRTC-compile every
                                                      # variant's kernels for --arch (default sm_90)

Builds one-node graphs of moe_gate_up_silu and moe_down (E experts, hidden D, expert
intermediate M, top-K read from model_specs/deepseek_v2_lite.yaml: 64, 2048, 1408, 6), lowers
them with their families (the same lowering the bundle uses: a "gemv" launch that takes every
expert while T <= ts, else one "mma" launch: experts with more than `thr` pairs on tensor cores,
the others on CUDA cores in the same grid), runs them through
KernelRunner on random bf16 tensors and times each family's launches together with CUDA events
over ITERS launches captured in one CUDA graph (median of 3 replays); each launch alone too.

Cases:
  c=<c>   every one of the E experts gets exactly c pairs: ids = a random permutation of
          repeat(arange(E), c) as [T, K], K = top_k when E*c % top_k == 0, else K = 1 (T = E*c)
  B=<B>   decode batch B: T = B tokens, each with top_k distinct experts drawn uniformly
          (the touched experts are counted and printed)
Variants, each a codegen.tuning.Tuning in the compile options (Options(tuning=...)), lowered as
the bundle lowers it (codegen/dispatch.py picks the launch that serves each T):
  [ts<n>_]thr<t>_skinny<s>[_sbk<k>_sst<n>]   the GEMV while T <= n (moe.gemv_upto; default its
          default), the mma launch above it with moe.gemm_threshold=t and moe.gemm_skinny=s (the
          largest row tile run in the swapped orientation; 0 turns it off), optionally the swapped
          tiles' K slice and ring depth (moe.skinny_bk, moe.skinny_stages); both wgmma launches off
          (moe.decode_wgmma=false, moe.prefill_wgmma_above=none).  thr0: the GEMV alone at every T
          (its launch without a token range; no mma launch).
  [ts<n>_]wgs   the GEMV while T <= n (moe.decode_wgmma_from; default its default), the decode
          wgmma + TMA launch (moe_wgmma_skinny.cuh) above it at every T (moe.prefill_wgmma_above
          past any case), with the lowering's one-token down launch where it has one.
  ffn     moe_expert_ffn's fused launch for both families (moe_expert_ffn.cuh; decode's default
          on sm_90a), with moe.expert_ffn_from=1, timed as one row (T <= moe.expert_ffn_upto).
The prefill wgmma launch is left out of every variant.  The _bulk variant (bulk-copy swapped
tiles) is gone: it lost and its code was deleted.  Every launch of a variant is renamed
<lowered name>__<variant>: KernelRunner keeps one compiled module per launch name, so distinct
launches must never share a name (checked below).

Correctness: outputs poisoned with NaN, one run, norm-wise relative error ||out - ref|| / ||ref||
against a torch fp32 reference on the GPU (BAD above 1e-2; the exit status is 1 if any).
Bytes: touched experts x weight bytes (gate_up 2*M*D*2, down D*M*2 per expert) plus the
activations read and the outputs written; rows print TB/s of the touched-weight bytes and of
all bytes.  A summary table follows (cases x variants: gate_up_silu + down us and weight TB/s).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
import time

import torch

from tests.gpu.harness import single_op_graph
from bench.perf_decode import lite
from runtime.timing import graph_us

from codegen import sizes as size_exprs
from codegen.families import family_for_op
from codegen.families import _moe
from codegen.kernel import Options
from codegen.tuning import DEFAULT_TUNING, Tuning, TuningError
from ir.ops import TType
from ir.ops.moe import align_ref
from runtime.launcher import KernelRunner

DEV = "cuda"
DT = torch.bfloat16
ITERS = 20
BAD_ERR = 1e-2
FAMILIES = ("moe_gate_up_silu", "moe_down")
SHORT = {"moe_gate_up_silu": "gate_up_silu", "moe_down": "down", "moe_expert_ffn": "ffn (both)"}
_VARIANT_RE = re.compile(r"^(?:ts(\d+)_)?thr(\d+)_skinny(\d+)(?:_sbk(\d+)_sst(\d+))?$")
_WGS_RE = re.compile(r"^(?:ts(\d+)_)?wgs$")   # the GEMV while T <= ts, the decode wgmma + TMA launch above
NO_PREFILL_WGMMA = 1 << 20  # moe.prefill_wgmma_above past every case: the decode wgmma serves them all
FFN = "ffn"              # the variant of moe_expert_ffn's one launch for both families


def dims(m) -> dict:
    d = m.dims
    return {"E": int(d["experts"]), "D": int(d["hidden"]), "M": int(d["moe_intermediate"]), "K": int(d["top_k"])}


# -- graphs, lowering, variants ------------------------------------------------------------

def graph(m, family: str, K: int):
    """A one-node graph of `family` with pair dim T*K (T is a runtime size)."""
    dm = dims(m)
    E, D, M = dm["E"], dm["D"], dm["M"]
    r = TType((f"T*{K}", E), "routing")
    if family == "moe_expert_ffn":
        return single_op_graph(m, "moe_expert_ffn", {"num_experts": E, "inner_dim": M, "out_dim": D},
                               {"x": TType(("T", D), "act"), "R": r},
                               {"gate": "e.{expert}.gate", "up": "e.{expert}.up", "down": "e.{expert}.down"})
    if family == "moe_down":
        return single_op_graph(m, "moe_down", {"num_experts": E, "out_dim": D},
                               {"a": TType((f"T*{K}", M), "act"), "R": r}, {"weight": "e.{expert}.down"})
    return single_op_graph(m, "moe_gate_up_silu", {"num_experts": E, "out_dim": M},
                           {"x": TType(("T", D), "act"), "R": r},
                           {"gate": "e.{expert}.gate", "up": "e.{expert}.up"})


@dataclasses.dataclass(frozen=True)
class Variant:
    name: str
    tuning: Tuning
    gemv_alone: bool = False     # thr0: the GEMV launch at every T, nothing else


def moe_tuning(**knobs) -> Tuning:
    """The default tuning with some moe knobs changed (TuningError, one line, on a bad value)."""
    return dataclasses.replace(DEFAULT_TUNING, moe=dataclasses.replace(DEFAULT_TUNING.moe, **knobs))


def parse_variant(v: str) -> Variant:
    """A --variants entry -> its Variant (see the module docstring); SystemExit (one line) on a bad
    spelling or a knob value the tuning refuses."""
    try:
        return _parse_variant(v)
    except TuningError as e:
        raise SystemExit(f"variant {v!r}: {e}") from None


def _parse_variant(v: str) -> Variant:
    m = DEFAULT_TUNING.moe
    if v == FFN:
        return Variant(v, moe_tuning(expert_ffn_from=1))
    mw = _WGS_RE.match(v)
    if mw is not None:
        ts = int(mw.group(1)) if mw.group(1) else m.decode_wgmma_from
        return Variant(v, moe_tuning(decode_wgmma=True, decode_wgmma_from=ts, prefill_wgmma_above=NO_PREFILL_WGMMA))
    mt = _VARIANT_RE.match(v)
    if mt is None:
        raise SystemExit(f"variant {v!r}: expected [ts<int>_]thr<int>_skinny<int>[_sbk<int>_sst<int>], "
                         f"[ts<int>_]wgs or ffn, e.g. ts8_thr2_skinny64")
    thr = int(mt.group(2))
    knobs = {"gemv_upto": int(mt.group(1)) if mt.group(1) else m.gemv_upto, "gemm_threshold": thr,
             "gemm_skinny": int(mt.group(3)), "decode_wgmma": False, "prefill_wgmma_above": None}
    if mt.group(4):
        knobs.update(skinny_bk=int(mt.group(4)), skinny_stages=int(mt.group(5)))
    return Variant(v, moe_tuning(**knobs), gemv_alone=thr == 0)


def variant_launches(launches, variant: Variant, family: str) -> list:
    """The lowered launches a variant times, renamed <name>__<variant>: the fused launch alone
    (ffn); the GEMV alone without its token range (thr0); else every launch but the prefill wgmma."""
    if family == "moe_expert_ffn":
        keep = [la for la in launches if la.stage == "fused"]
    elif variant.gemv_alone:
        keep = [dataclasses.replace(la, grid=(_moe.slots(la.params["E"]), *la.grid[1:]))
                for la in launches if la.stage == "gemv"]
    else:
        keep = [la for la in launches if la.stage != "wgmma"]
    if not keep:
        raise SystemExit(f"variant {variant.name}: the lowering of {family} gave none of its launches "
                         f"({[la.stage for la in launches]})")
    return [dataclasses.replace(la, name=f"{la.name}__{variant.name}") for la in keep]


class Kernels:
    """Lowered (and variant-applied) launches per (family, K, variant), lowered once each; checks
    that no two different launches share a name (the runner caches compiled modules by name)."""

    def __init__(self, m, runner: KernelRunner, arch: str = "sm_90"):
        self.m, self.runner, self.arch = m, runner, arch
        self._graphs: dict = {}
        self._launches: dict = {}
        self._by_name: dict = {}

    def base(self, family: str, K: int):
        if (family, K) not in self._graphs:
            self._graphs[(family, K)] = graph(self.m, family, K)
        return self._graphs[(family, K)]

    def get(self, family: str, K: int, variant: str) -> list:
        key = (family, K, variant)
        if key not in self._launches:
            v = parse_variant(variant)
            G, nid = self.base(family, K)
            lowered = family_for_op(G.nodes[nid]["op"]).lower(nid, G, Options(arch=self.arch, dtype="bf16",
                                                                               tuning=v.tuning))
            launches = variant_launches(lowered, v, family)
            for la in launches:
                ident = (la.template, json.dumps(la.params, sort_keys=True), tuple(la.args), la.grid, la.block,
                         la.smem)
                prev = self._by_name.setdefault(la.name, ident)
                if prev != ident:
                    raise SystemExit(f"two different launches named {la.name}: the runner would reuse one "
                                     f"compiled module for both")
            self.check_source(launches)
            self._launches[key] = launches
        return self._launches[key]

    def check_source(self, launches) -> None:
        """The rendered source declares the kernel under its launch name, and the mma launch's
        tuned params reach the template body (a warning where one does not change it)."""
        for la in launches:
            src = self.runner.source(la)
            if not re.search(rf"\b{re.escape(la.name)}\s*\(", src):
                raise SystemExit(f"rendered source of {la.name} does not declare a kernel of that name")
            probes = ([("thr", la.params["thr"] + 1), ("skinny", 0 if la.params["skinny"] else 64)]
                      if la.stage == "mma" else [])
            for key, other in probes:
                alt = dataclasses.replace(la, params={**la.params, key: other})
                if _body(self.runner.source(alt), la.name) == _body(src, la.name):
                    print(f"WARNING: param {key} does not change the rendered body of {la.name} "
                          f"(template ignores it?)", flush=True)


def _body(src: str, name: str) -> str:
    """The rendered source below its header (which lists the params), kernel name normalised."""
    return src.split("\n\n", 1)[-1].replace(name, "KERNEL")


def families_of(variant: str) -> tuple[str, ...]:
    """The families a variant's rows time: both, or the fused node's one launch."""
    return ("moe_expert_ffn",) if variant == FFN else FAMILIES


# -- cases ---------------------------------------------------------------------------------

def pair_case(dm: dict, c: int) -> dict:
    E, Km = dm["E"], dm["K"]
    K = Km if (E * c) % Km == 0 else 1
    T = E * c // K
    g = torch.Generator().manual_seed(1000 + c)
    flat = torch.arange(E).repeat(c)
    ids = flat[torch.randperm(E * c, generator=g)].view(T, K)
    return {"case": f"c={c}", "kind": "pairs", "c": c, "T": T, "K": K, "ids": ids}


def batch_case(dm: dict, B: int) -> dict:
    E, K = dm["E"], dm["K"]
    g = torch.Generator().manual_seed(2000 + B)
    ids = torch.rand(B, E, generator=g).topk(K, dim=1).indices      # K distinct experts per token
    return {"case": f"B={B}", "kind": "decode", "B": B, "T": B, "K": K, "ids": ids}


def finish_case(case: dict, E: int) -> dict:
    ids = case["ids"]
    counts = torch.bincount(ids.reshape(-1), minlength=E)
    case["NP"] = ids.numel()
    case["touched"] = int((counts > 0).sum())
    case["max_pairs"] = int(counts.max())
    # The row-tile bound is empty when T <= thr: it relies on no expert having more pairs than
    # there are tokens (distinct experts per token).  True of every case built here.
    assert case["max_pairs"] <= case["T"], case["case"]
    return case


# -- timing --------------------------------------------------------------------------------

def launch_is_empty(runner, la, sizes: dict) -> bool:
    full = runner.step_sizes(sizes, {})
    return 0 in tuple(size_exprs.evaluate(x, full) for x in la.grid)


# -- references ----------------------------------------------------------------------------

def expert_pairs(order, offsets):
    """(expert, its pairs) for every expert with pairs."""
    offs = offsets.tolist()
    for e in range(len(offs) - 1):
        if offs[e] < offs[e + 1]:
            yield e, order[offs[e]:offs[e + 1]]


def ref_gate_up_silu(x, wg, wu, order, offsets, K, NP, M):
    out = torch.empty(NP, M, dtype=torch.float32, device=DEV)
    for e, pairs in expert_pairs(order, offsets):
        xe = x[pairs // K].float()
        gate, up = xe @ wg[e].float().T, xe @ wu[e].float().T
        out[pairs] = torch.nn.functional.silu(gate) * up
    return out


def ref_down(a, wd, order, offsets, NP, D):
    out = torch.empty(NP, D, dtype=torch.float32, device=DEV)
    for e, pairs in expert_pairs(order, offsets):
        out[pairs] = a[pairs].float() @ wd[e].float().T
    return out


def rel_err(out, ref) -> float:
    if torch.isnan(out).any():
        return float("inf")
    den = ref.norm().item()
    num = (out.float() - ref).norm().item()
    return num / den if den > 0 else num


# -- main ----------------------------------------------------------------------------------

def ints(s: str) -> list[int]:
    return [int(v) for v in s.split(",") if v.strip()]


def compile_only(args, m, variants):
    dm = dims(m)
    runner = KernelRunner(arch=args.arch)
    kernels = Kernels(m, runner, args.arch)
    Ks = sorted({pair_case(dm, c)["K"] for c in ints(args.pairs)} | ({dm["K"]} if ints(args.batches) else set()))
    done = set()
    for v in variants:
        for fam in families_of(v):
            for K in Ks:
                for la in kernels.get(fam, K, v):
                    if la.name in done:
                        continue
                    t0 = time.time()
                    nbytes = len(runner.cubin(la))
                    done.add(la.name)
                    print(f"compiled {la.name:<72} grid {la.grid} {nbytes} B cubin {time.time() - t0:.1f} s",
                          flush=True)
    print(f"{len(done)} kernels for {args.arch}", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", default="1,2,4,8,9,12,16,32,64,65,128,256",
                    help="pairs per expert c (every expert gets exactly c pairs)")
    ap.add_argument("--batches", default="1,8,32,128,256", help="decode batches B (K distinct experts per token)")
    ap.add_argument("--variants", default="ts8_thr2_skinny64,ts0_wgs,thr0_skinny0",
                    help="comma-separated [ts<n>_]thr<t>_skinny<s>[_sbk<k>_sst<n>] (thr0: the GEMV alone), "
                         "[ts<n>_]wgs, ffn (see above)")
    ap.add_argument("--json", default=None, metavar="PATH", help="write every row as JSON to PATH")
    ap.add_argument("--compile-only", action="store_true",
                    help="no GPU: lower, render and compile every kernel with NVRTC for --arch, then stop")
    ap.add_argument("--arch", default="sm_90", help="target of --compile-only (default sm_90)")
    args = ap.parse_args()
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    for v in variants:
        parse_variant(v)
    m = lite()
    if args.compile_only:
        compile_only(args, m, variants)
        return 0
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU (or --compile-only)")
    torch.backends.cuda.matmul.allow_tf32 = False      # the fp32 reference stays fp32

    dm = dims(m)
    E, D, M = dm["E"], dm["D"], dm["M"]
    print(f"{torch.cuda.get_device_name()}: E={E} D={D} M={M} top_k={dm['K']} bf16, ITERS={ITERS}", flush=True)
    runner = KernelRunner()
    kernels = Kernels(m, runner)

    t0 = time.time()
    torch.manual_seed(0)
    wg = (torch.randn(E, M, D, device=DEV) / D ** 0.5).to(DT)
    wu = (torch.randn(E, M, D, device=DEV) / D ** 0.5).to(DT)
    wd = (torch.randn(E, D, M, device=DEV) / M ** 0.5).to(DT)
    weights = {"moe_gate_up_silu": {"e.*.gate": wg, "e.*.up": wu}, "moe_down": {"e.*.down": wd}}
    weights["moe_expert_ffn"] = {**weights["moe_gate_up_silu"], **weights["moe_down"]}
    per_expert = {"moe_gate_up_silu": 2 * M * D * 2, "moe_down": D * M * 2}
    per_expert["moe_expert_ffn"] = per_expert["moe_gate_up_silu"] + per_expert["moe_down"]

    cases = [finish_case(pair_case(dm, c), E) for c in ints(args.pairs)]
    cases += [finish_case(batch_case(dm, B), E) for B in ints(args.batches)]

    # compile every kernel up front (once per name), so compile time is visible on its own
    compiled = set()
    for v in variants:
        for fam in families_of(v):
            for K in sorted({c["K"] for c in cases}):
                for la in kernels.get(fam, K, v):
                    if la.name not in compiled:
                        t1 = time.time()
                        runner.module(la)
                        compiled.add(la.name)
                        print(f"compiled {la.name} ({time.time() - t1:.1f} s)", flush=True)
    print(f"setup + compile {time.time() - t0:.1f} s", flush=True)

    rows = []
    for case in cases:
        T, K, NP = case["T"], case["K"], case["NP"]
        ids = case["ids"]
        r = align_ref(ids, E)
        routing = {"order": r["order"].to(DEV, torch.int32), "offsets": r["offsets"].to(DEV, torch.int32)}
        order, offsets = r["order"].to(DEV), r["offsets"]
        x = torch.randn(T, D, device=DEV).to(DT)
        a = torch.randn(NP, M, device=DEV).to(DT)
        refs = {"moe_gate_up_silu": ref_gate_up_silu(x, wg, wu, order, offsets, K, NP, M),
                "moe_down": ref_down(a, wd, order, offsets, NP, D)}
        if FFN in variants:                              # a as the fused kernel stores it: rounded
            refs["moe_expert_ffn"] = ref_down(refs["moe_gate_up_silu"].to(DT), wd, order, offsets, NP, D)
        inputs = {"moe_gate_up_silu": {"x": x}, "moe_down": {"a": a}, "moe_expert_ffn": {"x": x}}
        act_bytes = {"moe_gate_up_silu": (T * D + NP * M) * 2, "moe_down": (NP * M + NP * D) * 2}
        act_bytes["moe_expert_ffn"] = act_bytes["moe_gate_up_silu"] + act_bytes["moe_down"]
        n_out = {"moe_gate_up_silu": M, "moe_down": D, "moe_expert_ffn": D}
        sizes = {"T": T, "NP": NP}
        head = (f"{case['case']:<7} T={T:<5} K={K} NP={NP:<6} experts={case['touched']:<2} "
                f"max_pairs={case['max_pairs']}")
        print(head, flush=True)
        for v in variants:
            for fam in families_of(v):
                launches = kernels.get(fam, K, v)
                out = torch.full((NP, n_out[fam]), float("nan"), device=DEV, dtype=DT)
                kw = dict(values={**inputs[fam], "R": routing, "out": out}, weights=weights[fam], sizes=sizes)
                ws = runner.run_all(launches, **kw)
                torch.cuda.synchronize()
                err = rel_err(out, refs[fam])

                def run_family(launches=launches, ws=ws, kw=kw):
                    for la in launches:
                        runner.run(la, workspaces=ws, **kw)

                us = graph_us(run_family, ITERS)
                stage_us = {}
                for la in launches:
                    if launch_is_empty(runner, la, sizes):
                        stage_us[la.stage] = 0.0
                    else:
                        stage_us[la.stage] = graph_us(lambda la=la: runner.run(la, workspaces=ws, **kw), ITERS)
                wbytes = case["touched"] * per_expert[fam]
                nbytes = wbytes + act_bytes[fam]
                bad = not err <= BAD_ERR
                rows.append({"case": case["case"], "kind": case["kind"], "T": T, "K": K, "NP": NP,
                             "touched": case["touched"], "max_pairs": case["max_pairs"], "variant": v,
                             "family": fam, "us": us, "stage_us": stage_us, "weight_bytes": wbytes,
                             "bytes": nbytes, "weight_TBps": wbytes / us / 1e6, "TBps": nbytes / us / 1e6,
                             "rel_err": err, "bad": bad, "kernels": [la.name for la in launches]})
                stages = " ".join(f"{k} {t:7.2f}" for k, t in stage_us.items())
                print(f"  {case['case']:<7} {v:<15} {SHORT[fam]:<13} {us:9.2f} us  [{stages}]  "
                      f"{wbytes / us / 1e6:5.2f} TB/s weights  {nbytes / us / 1e6:5.2f} TB/s all  "
                      f"err {err:.2e}{'  BAD' if bad else ''}", flush=True)
        del refs, x, a

    # summary: cases x variants, gate_up_silu + down
    print("\nsummary: gate_up_silu + down us (touched-weight TB/s)", flush=True)
    w = 22
    print(f"{'case':<8}{'T':>6}{'K':>3}{'experts':>8}  " + "".join(f"{v:>{w}}" for v in variants), flush=True)
    by = {(rw["case"], rw["variant"], rw["family"]): rw for rw in rows}
    for case in cases:
        cells = []
        for v in variants:
            pair = [by[(case["case"], v, fam)] for fam in families_of(v)]
            us = sum(p["us"] for p in pair)
            tb = sum(p["weight_bytes"] for p in pair) / us / 1e6
            flag = "!" if any(p["bad"] for p in pair) else " "
            cells.append(f"{us:9.1f} us ({tb:4.2f}){flag}")
        print(f"{case['case']:<8}{case['T']:>6}{case['K']:>3}{case['touched']:>8}  "
              + "".join(f"{c:>{w}}" for c in cells), flush=True)
    n_bad = sum(rw["bad"] for rw in rows)
    print(f"{len(rows)} rows, {n_bad} BAD (rel err > {BAD_ERR:g}; '!' in the table)", flush=True)

    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"device": torch.cuda.get_device_name(), "dims": dm, "iters": ITERS, "variants": variants,
                       "rows": rows}, f, indent=1)
        print(f"wrote {args.json}", flush=True)
    return 1 if n_bad else 0


if __name__ == "__main__":
    sys.exit(main())
