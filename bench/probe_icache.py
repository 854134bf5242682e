"""How much code an SM keeps warm between kernels (a script, not a test).

    python3 -m bench.probe_icache [--sizes 4,8,...] [--rotate 4,8,...] [--kernels 10] [--spread 1,8,32,all]
                                      [--gaps 8,32,128] [--warm 8,16,32] [--spin-us 20]

PERF_NOTES v32 measured what code fetched cold costs (~104 SM cycles a KB, probe_merge.py) and
found that at b=1 the instructions a kernel executes once are fetched cold: a decode layer runs ten
kernels, each once, and a step runs 27 layers.  Whether a kernel's code is still there when the
next layer runs it again depends on how much code the SM's instruction caches keep and on how much
the other nine kernels execute in between.  Five tables:

  sweep    one kernel of N KB of straight-line code (independent FFMAs, each run once), run after
           the evictor (cold) and then again (warm if its N KB stayed): the knee where the second
           run stops being faster is the caches' capacity for one kernel's code;
  rotate   K kernels of M KB each (distinct code, K * M KB in all) run in turn, five rounds, as a
           decode layer runs its kernels: the last round's cycles a KB against the sweep's warm and
           cold rates say whether K * M KB of code executed a layer stays warm from one layer to
           the next.  Again with kernels of 8 CTAs, as b=1's attention runs: are they warm on
           whichever SMs the next round's CTAs land on;
  spread   one 32 KB kernel cold on 1, 8, 32 and every SM at once (all fetching the same lines): is
           the cold rate a latency each SM pays, or a shared fetch path the SMs queue on (b=1's
           attention runs 8 CTAs, its linears and experts every SM);
  gaps     32 KB executed in blocks of B instructions, each followed by B instructions behind a
           branch not taken: is code a kernel jumps over fetched anyway (the prefetcher runs ahead
           in address order), and what does a jump to a cold target cost;
  warm     a PDL dependent whose N KB after its wait run cold, against the same code run once
           before the wait too (a first trip of a rolled loop while the primary still runs, on the
           same SMs): does a warm pass before the wait take the cold fetch off the critical path.
           b=1's kernels reach their waits 0.2-18 us before their predecessors end (v29's chain
           map: the combine ~10 us, v_up ~3, the attention ~2.7, o ~1.8).

Every kernel runs one CTA an SM (160 KB of dynamic shared memory), 4 warps, and times its body by
the SM's clock64; each cell is the median CTA, then the median over 20 repeats.  If the rotation's
last round is warm up to some total, a layer whose executed code fits that total runs warm, and
cutting executed code below it pays for every kernel of the layer, not only the cut one.
"""
from __future__ import annotations

import argparse
import sys

import torch

from codegen.nvrtc import compile_cubin
from bench.probe_merge import EVICT_SRC
from runtime.cuda_driver import I32, I64, LoadedModule, launch

INSTR_BYTES = 16                    # one sm_90 SASS instruction
SMEM = 160 * 1024                   # one CTA an SM
THREADS = 128
REPEATS = 20
ROUNDS = 5


def straight_kernel(name: str, kb: int, salt: int) -> str:
    """A kernel whose body is kb KB of independent straight-line FFMAs (8 chains), timed by clock64.
    `salt` makes each kernel's constants, and so its code, its own."""
    n = kb * 1024 // INSTR_BYTES
    body = "".join(f'  asm volatile("fma.rn.f32 %0, %0, %1, %0;" : "+f"(x{k % 8}) : "f"(a));\n' for k in range(n))
    return (f'extern "C" __global__ void {name}(float* p, long long* t, float a) {{\n'
            f"  float x0 = p[0] + {salt}.f, x1 = p[1], x2 = p[2], x3 = p[3], x4 = p[4], x5 = p[5], x6 = p[6],"
            " x7 = p[7];\n"
            "  __syncthreads();\n  const long long c0 = clock64();\n"
            + body +
            "  const long long c1 = clock64();\n"
            "  if (threadIdx.x == 0) t[blockIdx.x] = c1 - c0;\n"
            "  p[8 + threadIdx.x] = x0 + x1 + x2 + x3 + x4 + x5 + x6 + x7;\n}\n")


def gapped_kernel(name: str, kb: int, block: int) -> str:
    """kb KB of executed FFMAs in blocks of `block` instructions, each followed by a block of the same
    size behind a branch that is not taken at run time (`skip` is 0): the kernel holds 2 kb KB."""
    n = kb * 1024 // INSTR_BYTES

    def fmas(lo: int, operand: str) -> str:
        return "".join(f'  asm volatile("fma.rn.f32 %0, %0, %1, %0;" : "+f"(x{k % 8}) : "f"({operand}));\n'
                       for k in range(lo, lo + block))
    parts = []
    for lo in range(0, n, block):
        parts.append(fmas(lo, "a"))
        parts.append("  if (skip) {\n" + fmas(lo, "b") + "  }\n")
    return (f'extern "C" __global__ void {name}(float* p, long long* t, float a, float b, int skip) {{\n'
            "  float x0 = p[0], x1 = p[1], x2 = p[2], x3 = p[3], x4 = p[4], x5 = p[5], x6 = p[6], x7 = p[7];\n"
            "  __syncthreads();\n  const long long c0 = clock64();\n"
            + "".join(parts) +
            "  const long long c1 = clock64();\n"
            "  if (threadIdx.x == 0) t[blockIdx.x] = c1 - c0;\n"
            "  p[8 + threadIdx.x] = x0 + x1 + x2 + x3 + x4 + x5 + x6 + x7;\n}\n")


_loaded: dict[str, dict] = {}


def load(kernels: list[tuple[str, int]], arch: str, tag: str) -> dict:
    if tag in _loaded:
        return _loaded[tag]
    src = "".join(straight_kernel(name, kb, i) for i, (name, kb) in enumerate(kernels))
    mod = LoadedModule.load(compile_cubin(src, tag, arch=arch, headers={}).cubin, tag)
    _loaded[tag] = {name: mod.function(name, SMEM) for name, _ in kernels}
    return _loaded[tag]


class Runner:
    def __init__(self, arch: str):
        self.sms = torch.cuda.get_device_properties(0).multi_processor_count
        self.stream = torch.cuda.current_stream().cuda_stream
        self.junk = torch.zeros(1024, device="cuda")
        self.evict = LoadedModule.load(compile_cubin(EVICT_SRC, "evict", arch=arch, headers={}).cubin,
                                       "probe_icache_evict").function("evict")
        self.times: dict[str, torch.Tensor] = {}

    def evictor(self) -> None:
        launch(self.evict, (2 * self.sms, 1, 1), (32, 1, 1), 0, [I64(self.junk.data_ptr()), 1.0001, 0.5], self.stream)

    def run(self, name: str, func, ctas: int | None = None, extra: tuple = ()) -> None:
        ctas = ctas or self.sms
        t = self.times.setdefault(name, torch.zeros(self.sms, dtype=torch.int64, device="cuda"))
        t[ctas:].zero_()
        launch(func, (ctas, 1, 1), (THREADS, 1, 1), SMEM,
               [I64(self.junk.data_ptr()), I64(t.data_ptr()), 1.0001, *extra], self.stream)

    def cycles(self, name: str, ctas: int | None = None) -> float:
        return self.times[name][:ctas or self.sms].double().median().item()


def median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def sweep(r: Runner, sizes: list[int], arch: str) -> dict[int, tuple[float, float]]:
    funcs = load([(f"sweep_{kb}", kb) for kb in sizes], arch, "probe_icache_sweep")
    print(f"# sweep: one kernel of N KB run after the evictor (cold), then again; SM cycles a KB (median CTA, "
          f"median of {REPEATS})")
    print(f"{'N KB':>6} {'cold':>8} {'again':>8}  again/cold")
    rates = {}
    for kb in sizes:
        name = f"sweep_{kb}"
        cold, again = [], []
        for _ in range(REPEATS):
            r.evictor()
            r.run(name, funcs[name])
            torch.cuda.synchronize()
            cold.append(r.cycles(name) / kb)
            r.run(name, funcs[name])
            torch.cuda.synchronize()
            again.append(r.cycles(name) / kb)
        rates[kb] = (median(cold), median(again))
        print(f"{kb:>6} {rates[kb][0]:>8.0f} {rates[kb][1]:>8.0f}  {rates[kb][1] / rates[kb][0]:>9.2f}", flush=True)
    return rates


def rotate(r: Runner, sizes: list[int], k: int, arch: str, ctas: int | None = None) -> None:
    print(f"# rotate: {k} distinct kernels of M KB run in turn on {ctas or 'every SM'} CTAs, {ROUNDS} rounds "
          f"(evictor first); the last round's SM cycles a KB (median kernel of the median CTA, median of {REPEATS})")
    print(f"{'M KB':>6} {'total KB':>9} {'round 1':>8} {'last':>8}  last/round 1")
    for kb in sizes:
        names = [f"rot{kb}_{i}" for i in range(k)]
        funcs = load([(n, kb) for n in names], arch, f"probe_icache_rot{kb}")
        first, last = [], []
        for _ in range(REPEATS):
            r.evictor()
            for rnd in range(ROUNDS):
                for n in names:
                    r.run(n, funcs[n], ctas)
                torch.cuda.synchronize()
                got = median([r.cycles(n, ctas) / kb for n in names])
                if rnd == 0:
                    first.append(got)
            last.append(got)
        f, l = median(first), median(last)
        print(f"{kb:>6} {kb * k:>9} {f:>8.0f} {l:>8.0f}  {l / f:>11.2f}", flush=True)


def spread(r: Runner, kb: int, ctas: list[int], arch: str) -> None:
    funcs = load([(f"spread_{kb}", kb)], arch, "probe_icache_spread")
    name = f"spread_{kb}"
    print(f"# spread: one kernel of {kb} KB run cold on C CTAs (one an SM) at once, all fetching the same code; SM "
          f"cycles a KB")
    print(f"{'CTAs':>6} {'cold':>8}")
    for c in ctas:
        got = []
        for _ in range(REPEATS):
            r.evictor()
            r.run(name, funcs[name], c)
            torch.cuda.synchronize()
            got.append(r.cycles(name, c) / kb)
        print(f"{c:>6} {median(got):>8.0f}", flush=True)


def gaps(r: Runner, kb: int, blocks: list[int], arch: str) -> None:
    print(f"# gaps: {kb} KB executed in blocks of B instructions, each followed by B not executed (a branch "
          f"over them); cold, SM cycles an executed KB (the sweep's straight {kb} KB is B = 0)")
    print(f"{'B':>6} {'cold':>8} {'again':>8}")
    src = "".join(gapped_kernel(f"gaps_{b}", kb, b) for b in blocks)
    mod = LoadedModule.load(compile_cubin(src, "probe_icache_gaps", arch=arch, headers={}).cubin, "probe_icache_gaps")
    for b in blocks:
        name = f"gaps_{b}"
        func = mod.function(name, SMEM)
        cold, again = [], []
        for _ in range(REPEATS):
            r.evictor()
            for out in (cold, again):
                r.run(name, func, extra=(0.5, I32(0)))
                torch.cuda.synchronize()
                out.append(r.cycles(name) / kb)
        print(f"{b:>6} {median(cold):>8.0f} {median(again):>8.0f}", flush=True)


def warm_pass_kernel(name: str, kb: int, warm: bool) -> str:
    """A PDL dependent whose body (kb KB of FFMAs) runs after griddepcontrol.wait, timed from the
    wait's return to its end; with `warm`, the same code runs once before the wait too (a rolled
    two-trip loop: one copy of the body, its first trip while the primary still runs)."""
    n = kb * 1024 // INSTR_BYTES
    body = "".join(f'    asm volatile("fma.rn.f32 %0, %0, %1, %0;" : "+f"(x{k % 8}) : "f"(a));\n' for k in range(n))
    return (f'extern "C" __global__ void {name}(float* p, long long* t, float a) {{\n'
            "  float x0 = p[0], x1 = p[1], x2 = p[2], x3 = p[3], x4 = p[4], x5 = p[5], x6 = p[6], x7 = p[7];\n"
            "  long long c0 = 0;\n#pragma unroll 1\n"
            f"  for (int pass = {0 if warm else 1}; pass < 2; ++pass) {{\n"
            '    if (pass == 1) { asm volatile("griddepcontrol.wait;" ::: "memory"); c0 = clock64(); }\n'
            + body + "  }\n"
            "  const long long c1 = clock64();\n"
            "  if (threadIdx.x == 0) t[blockIdx.x] = c1 - c0;\n"
            "  p[8 + threadIdx.x] = x0 + x1 + x2 + x3 + x4 + x5 + x6 + x7;\n}\n")


# The primary of the warm-pass table: lets its dependent launch at once, then keeps every SM busy
# for `cycles`: spinning on the clock, or (busy) running a 32 KB loop body of its own, as a
# streaming kernel before a decode kernel does.
PRIMARY_SRC = (
    'extern "C" __global__ void primary_spin(float* p, long long cycles) {\n'
    '  asm volatile("griddepcontrol.launch_dependents;");\n'
    "  const long long t0 = clock64();\n  while (clock64() - t0 < cycles) {}\n}\n"
    'extern "C" __global__ void primary_busy(float* p, long long cycles) {\n'
    '  asm volatile("griddepcontrol.launch_dependents;");\n'
    "  float x0 = p[0], x1 = p[1], x2 = p[2], x3 = p[3], x4 = p[4], x5 = p[5], x6 = p[6], x7 = p[7];\n"
    "  const long long t0 = clock64();\n  while (clock64() - t0 < cycles) {\n"
    + "".join(f'    asm volatile("fma.rn.f32 %0, %0, %0, %0;" : "+f"(x{k % 8}));\n' for k in range(2048))
    + "  }\n  p[16 + threadIdx.x] = x0 + x1 + x2 + x3 + x4 + x5 + x6 + x7;\n}\n")


def warm_pass(r: Runner, sizes: list[int], spin_us: float, arch: str) -> None:
    print(f"# warm pass: a PDL dependent's N KB after its wait, its primary busy {spin_us} us on every SM "
          f"(evictor first); SM cycles a KB from the wait's return, cold against a first trip of the same code "
          f"before the wait")
    kernels = [(f"warm{kb}_{w}", kb, w) for kb in sizes for w in (0, 1)]
    src = PRIMARY_SRC + "".join(warm_pass_kernel(n, kb, bool(w)) for n, kb, w in kernels)
    mod = LoadedModule.load(compile_cubin(src, "probe_icache_warm", arch=arch, headers={}).cubin, "probe_icache_warm")
    try:
        mhz = torch.cuda.clock_rate()            # the SM clock now (NVML)
    except Exception:  # noqa: BLE001 - no NVML: the H200's boost clock
        mhz = 1980
    cycles = int(spin_us * mhz)
    print(f"{'N KB':>6} {'primary':>8} {'cold':>8} {'warm pass':>10}")
    for kb in sizes:
        for prim in ("spin", "busy"):
            pf = mod.function(f"primary_{prim}")
            cells = []
            for w in (0, 1):
                name = f"warm{kb}_{w}"
                func = mod.function(name, SMEM)
                t = r.times.setdefault(name, torch.zeros(r.sms, dtype=torch.int64, device="cuda"))
                got = []
                for _ in range(REPEATS):
                    r.evictor()
                    launch(pf, (r.sms, 1, 1), (32, 1, 1), 0, [I64(r.junk.data_ptr()), I64(cycles)], r.stream)
                    launch(func, (r.sms, 1, 1), (THREADS, 1, 1), SMEM,
                           [I64(r.junk.data_ptr()), I64(t.data_ptr()), 1.0001], r.stream, pdl=True)
                    torch.cuda.synchronize()
                    got.append(r.cycles(name) / kb)
                cells.append(median(got))
            print(f"{kb:>6} {prim:>8} {cells[0]:>8.0f} {cells[1]:>10.0f}", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="4,8,16,24,32,48,64,96,128,192,256", help="sweep: KB of one kernel's code")
    ap.add_argument("--rotate", default="2,4,6,8,12,16,24", help="rotate: KB of each kernel's code")
    ap.add_argument("--kernels", type=int, default=10, help="rotate: kernels in turn (a decode layer runs ten)")
    ap.add_argument("--rotate-ctas", default="all,8",
                    help="rotate: CTAs a kernel (8: as b=1's attention, whose CTAs land on whichever SMs are free)")
    ap.add_argument("--spread", default="1,8,32,all", help="spread: CTAs fetching one 32 KB kernel at once")
    ap.add_argument("--gaps", default="8,32,128", help="gaps: instructions a block (32 KB executed)")
    ap.add_argument("--warm", default="8,16,32", help="warm pass: KB of the dependent's code after its wait")
    ap.add_argument("--spin-us", type=float, default=20.0, help="warm pass: how long the primary keeps the SMs")
    a = ap.parse_args()
    major, minor = torch.cuda.get_device_capability()
    arch = f"sm_{major}{minor}"
    r = Runner(arch)
    print(f"# {torch.cuda.get_device_name()}, {r.sms} SMs")
    sweep(r, [int(x) for x in a.sizes.split(",")], arch)
    for c in a.rotate_ctas.split(","):
        rotate(r, [int(x) for x in a.rotate.split(",")], a.kernels, arch, None if c == "all" else int(c))
    spread(r, 32, [r.sms if x == "all" else int(x) for x in a.spread.split(",")], arch)
    gaps(r, 32, [int(x) for x in a.gaps.split(",")], arch)
    warm_pass(r, [int(x) for x in a.warm.split(",")], a.spin_us, arch)
    return 0


if __name__ == "__main__":
    sys.exit(main())
