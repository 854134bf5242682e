"""What the decode attention's split merge costs four ways (a script, not a test).

    python3 -m bench.probe_merge [--clusters 1,8,32] [--launches 200]

perf_phases puts ~3.4 us of the b=1 attention's ~8 between "partials in place" and "columns merged"
(PERF_NOTES v32): 8 splits of a cluster each merge a 64-column span of 16 heads from the 8 partials
(fp32, 32 KB a CTA) in distributed shared memory.  This probe isolates that step in a kernel of
the attention's shape (8-CTA clusters, 256 threads, one CTA an SM) and times it by %globaltimer,
from "every CTA's partial in its shared memory" to "every output column stored", four ways:
  pull     the attention's merge today: 16 threads load the (max, sum)s from the peers (two trips),
           weights to shared memory, a barrier, every thread loads its columns from the 8 peers;
  one-trip every thread loads its head's (max, sum) and columns from the 8 peers at once
           (mla_decode.cuh's DSG_DECODE_MERGE_ONE_TRIP, f9b1bd6: refuted in the step and
           removed, PERF_NOTES v32);
  l2       every CTA stores its partial to a global workspace, a cluster barrier (release /
           acquire: it orders global memory too), every thread loads its columns from L2;
  push     every CTA stores each peer's column span into that peer's shared memory
           (st.shared::cluster, no reply to wait for), a cluster barrier, a local merge.
"merged" is the latest CTA's last store; "free" adds the barrier after which no peer reads the
CTA's shared memory (pull and one-trip need it before they exit; l2 and push do not).

With --evict, a kernel of ~EVICT_INSTRUCTIONS straight-line instructions runs on every SM before
each merge launch: the merge then starts with its code out of the SMs' instruction caches (in L2),
as a decode step's kernels do, each run once a layer between nine others.  It also times a
kernel of STRAIGHT_INSTRUCTIONS independent instructions run once, warm and cold: what fetching
cold code costs a kernel whose instructions each run once (b=1's kernels: one tile, one pass).
"""
from __future__ import annotations

import argparse
import sys

import torch

from codegen.nvrtc import compile_cubin
from runtime.cuda_driver import I32, I64, LoadedModule, launch

S, HG, C, THREADS = 8, 16, 512, 256
SPAN = C // S
SMEM = 224000                       # one CTA an SM, as the attention
REC = 2 * HG + HG * C               # floats of a workspace record: (max, sum) per head, then [HG][C]
MODES = ["pull", "one-trip", "l2", "push"]
EVICT_INSTRUCTIONS = 24000          # ~384 KB of code: past an SM's instruction caches

EVICT_SRC = ("extern \"C\" __global__ void evict(float* p, float a, float b) {\n  float x = p[threadIdx.x];\n"
             + "".join(f'  asm volatile("fma.rn.f32 %0, %0, %1, %2;" : "+f"(x) : "f"(a), "f"(b + {k}.f));\n'
                       for k in range(EVICT_INSTRUCTIONS))
             + "  p[threadIdx.x] = x;\n}\n")

SRC = r"""
#define S 8
#define HG 16
#define C 512
#define CP (C + 8)
#define SPAN (C / S)
#define REC (2 * HG + HG * C)
__device__ __forceinline__ unsigned long long gtime() {
  unsigned long long t; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); return t;
}
__device__ __forceinline__ unsigned rank() { unsigned r; asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r)); return r; }
__device__ __forceinline__ unsigned map_rank(unsigned a, unsigned r) {
  unsigned o; asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(o) : "r"(a), "r"(r)); return o;
}
__device__ __forceinline__ void csync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}
__device__ __forceinline__ float ldc(unsigned a) {
  float v; asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(a) : "memory"); return v;
}
__device__ __forceinline__ float2 ld2c(unsigned a) {
  float2 v; asm volatile("ld.shared::cluster.v2.f32 {%0,%1}, [%2];" : "=f"(v.x), "=f"(v.y) : "r"(a) : "memory"); return v;
}
__device__ __forceinline__ float4 ld4c(unsigned a) {
  float4 v;
  asm volatile("ld.shared::cluster.v4.f32 {%0,%1,%2,%3}, [%4];" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "r"(a) : "memory");
  return v;
}
__device__ __forceinline__ void st2c(unsigned a, float2 v) {
  asm volatile("st.shared::cluster.v2.f32 [%0], {%1,%2};" :: "r"(a), "f"(v.x), "f"(v.y) : "memory");
}
__device__ __forceinline__ void st4c(unsigned a, float4 v) {
  asm volatile("st.shared::cluster.v4.f32 [%0], {%1,%2,%3,%4};" :: "r"(a), "f"(v.x), "f"(v.y), "f"(v.z), "f"(v.w) : "memory");
}
__device__ __forceinline__ void weigh(const float* m, const float* l, float* w) {
  float M = -1e30f, L = 0.f;
  for (int i = 0; i < S; ++i) M = fmaxf(M, m[i]);
  for (int i = 0; i < S; ++i) L += l[i] * exp2f(m[i] - M);
  for (int i = 0; i < S; ++i) w[i] = exp2f(m[i] - M) / L;
}
__device__ __forceinline__ float4 fma4(float w, float4 x, float4 a) {
  return make_float4(fmaf(w, x.x, a.x), fmaf(w, x.y, a.y), fmaf(w, x.z, a.z), fmaf(w, x.w, a.w));
}

extern "C" __global__ void __cluster_dims__(8, 1, 1) __launch_bounds__(256, 1)
merge(float* __restrict__ out, float* __restrict__ ws, unsigned long long* __restrict__ times, int mode, int iter) {
  extern __shared__ __align__(16) char smem[];
  float2* ml = reinterpret_cast<float2*>(smem);                 // [HG] this split's (max, sum)
  float* acc = reinterpret_cast<float*>(smem + HG * 8);         // [HG][CP] this split's partial
  float* wts = acc + HG * CP;                                   // [S][HG]
  float* recv = wts + S * HG;                                   // push: [S][HG][SPAN]
  float2* recv_ml = reinterpret_cast<float2*>(recv + S * HG * SPAN);   // push: [S][HG]
  const int tid = threadIdx.x, s = (int)rank(), cl = blockIdx.x / S;
  for (int i = tid; i < HG * CP; i += 256) acc[i] = (float)((i * 7 + s * 13 + cl) % 101) * 0.01f;
  if (tid < HG) ml[tid] = make_float2(0.25f * ((s * 5 + tid) % 7), 1.f + s + 0.1f * tid);
  __syncthreads();
  csync();                      // every CTA's partial in place, the CTAs aligned
  unsigned long long t0 = gtime();
  const unsigned own = (unsigned)__cvta_generic_to_shared(smem);
  unsigned peer[S];
  for (int i = 0; i < S; ++i) peer[i] = map_rank(own, i);
  const int hh = tid / (SPAN / 4), c = s * SPAN + 4 * (tid % (SPAN / 4));   // 256 threads = 16 heads x 16 quads
  float4 a = make_float4(0.f, 0.f, 0.f, 0.f);
  if (mode == 0) {
    if (tid < HG) {
      float m[S], l[S], w[S];
      for (int i = 0; i < S; ++i) m[i] = ldc(peer[i] + tid * 8);
      for (int i = 0; i < S; ++i) l[i] = ldc(peer[i] + tid * 8 + 4);
      weigh(m, l, w);
      for (int i = 0; i < S; ++i) wts[i * HG + tid] = w[i];
    }
    __syncthreads();
    for (int i = 0; i < S; ++i) a = fma4(wts[i * HG + hh], ld4c(peer[i] + HG * 8 + (hh * CP + c) * 4), a);
  } else if (mode == 1) {
    float m[S], l[S], w[S];
    float4 x[S];
    for (int i = 0; i < S; ++i) {
      const float2 v = ld2c(peer[i] + hh * 8);
      m[i] = v.x; l[i] = v.y;
      x[i] = ld4c(peer[i] + HG * 8 + (hh * CP + c) * 4);
    }
    weigh(m, l, w);
    for (int i = 0; i < S; ++i) a = fma4(w[i], x[i], a);
  } else if (mode == 2) {
    float* mine = ws + (long long)(cl * S + s) * REC;
    for (int i = tid; i < HG * C / 4; i += 256) {
      const int h = i / (C / 4), q = i % (C / 4);
      reinterpret_cast<float4*>(mine + 2 * HG)[i] = *reinterpret_cast<const float4*>(acc + h * CP + 4 * q);
    }
    if (tid < HG) reinterpret_cast<float2*>(mine)[tid] = ml[tid];
    csync();
    float m[S], l[S], w[S];
    float4 x[S];
    for (int i = 0; i < S; ++i) {
      const float* rec = ws + (long long)(cl * S + i) * REC;
      const float2 v = __ldcg(reinterpret_cast<const float2*>(rec) + hh);
      m[i] = v.x; l[i] = v.y;
      x[i] = __ldcg(reinterpret_cast<const float4*>(rec + 2 * HG + hh * C + c));
    }
    weigh(m, l, w);
    for (int i = 0; i < S; ++i) a = fma4(w[i], x[i], a);
  } else {
    const unsigned rbase = (unsigned)__cvta_generic_to_shared(recv), mbase = (unsigned)__cvta_generic_to_shared(recv_ml);
    for (int e = tid; e < S * HG * SPAN / 4; e += 256) {
      const int j = e / (HG * SPAN / 4), r = e % (HG * SPAN / 4), h = r / (SPAN / 4), q = r % (SPAN / 4);
      st4c(map_rank(rbase + ((s * HG + h) * SPAN + 4 * q) * 4, j),
           *reinterpret_cast<const float4*>(acc + h * CP + j * SPAN + 4 * q));
    }
    if (tid < S * HG) st2c(map_rank(mbase + (s * HG + tid % HG) * 8, tid / HG), ml[tid % HG]);
    csync();
    float m[S], l[S], w[S];
    for (int i = 0; i < S; ++i) { const float2 v = recv_ml[i * HG + hh]; m[i] = v.x; l[i] = v.y; }
    weigh(m, l, w);
    for (int i = 0; i < S; ++i)
      a = fma4(w[i], *reinterpret_cast<const float4*>(recv + (i * HG + hh) * SPAN + (c - s * SPAN)), a);
  }
  *reinterpret_cast<float4*>(out + ((long long)cl * HG + hh) * C + c) = a;
  __syncthreads();
  unsigned long long t1 = gtime();
  if (mode < 2) csync();        // peers may still read this CTA's shared memory
  __syncthreads();
  unsigned long long t2 = gtime();
  if (tid == 0) {
    unsigned long long* row = times + ((long long)iter * gridDim.x + blockIdx.x) * 3;
    row[0] = t0; row[1] = t1; row[2] = t2;
  }
}
"""


STRAIGHT_INSTRUCTIONS = 8192       # 128 KB of code, each instruction run once

STRAIGHT_SRC = ("extern \"C\" __global__ void straight(float* p, long long* t, float a) {\n"
                "  float x0 = p[0], x1 = p[1], x2 = p[2], x3 = p[3], x4 = p[4], x5 = p[5], x6 = p[6], x7 = p[7];\n"
                "  __syncthreads();\n  const long long c0 = clock64();\n"
                + "".join(f'  asm volatile("fma.rn.f32 %0, %0, %1, %0;" : "+f"(x{k % 8}) : "f"(a));\n'
                          for k in range(STRAIGHT_INSTRUCTIONS))
                + "  const long long c1 = clock64();\n"
                "  if (threadIdx.x == 0) t[blockIdx.x] = c1 - c0;\n"
                "  p[8 + threadIdx.x] = x0 + x1 + x2 + x3 + x4 + x5 + x6 + x7;\n}\n")


def code_fetch(evict, junk, sms, stream, arch: str) -> None:
    straight = LoadedModule.load(compile_cubin(STRAIGHT_SRC, "straight", arch=arch, headers={}).cubin,
                                 "probe_straight").function("straight")
    t = torch.zeros(sms, dtype=torch.int64, device="cuda")
    rows = {}
    for cold in (False, True):
        got = []
        for _ in range(20):
            if cold:
                launch(evict, (2 * sms, 1, 1), (32, 1, 1), 0, [I64(junk.data_ptr()), 1.0001, 0.5], stream)
            else:
                launch(straight, (sms, 1, 1), (128, 1, 1), 0, [I64(junk.data_ptr()), I64(t.data_ptr()), 1.0001], stream)
            launch(straight, (sms, 1, 1), (128, 1, 1), 0, [I64(junk.data_ptr()), I64(t.data_ptr()), 1.0001], stream)
            torch.cuda.synchronize()
            got.append(t.double().median().item())
        rows[cold] = sorted(got)[len(got) // 2]
    print(f"# {STRAIGHT_INSTRUCTIONS} straight-line instructions ({STRAIGHT_INSTRUCTIONS * 16 // 1024} KB), "
          f"4 warps a CTA, one CTA an SM, SM cycles (median CTA): warm {rows[False]:.0f}, "
          f"cold {rows[True]:.0f}: {(rows[True] - rows[False]) / (STRAIGHT_INSTRUCTIONS * 16 / 1024):.0f} "
          f"cycles a cold KB")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clusters", default="1,8,32")
    ap.add_argument("--launches", type=int, default=200)
    ap.add_argument("--evict", type=int, default=1, help="0: warm caches only; 1: also with the evictor")
    a = ap.parse_args()
    major, minor = torch.cuda.get_device_capability()
    cubin = compile_cubin(SRC, "merge", arch=f"sm_{major}{minor}", headers={}).cubin
    func = LoadedModule.load(cubin, "probe_merge").function("merge", SMEM)
    n = a.launches
    stream = torch.cuda.current_stream().cuda_stream
    evict = None
    if a.evict:
        evict = LoadedModule.load(compile_cubin(EVICT_SRC, "evict", arch=f"sm_{major}{minor}", headers={}).cubin,
                                  "probe_evict").function("evict")
    junk = torch.zeros(1024, device="cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for ev in ([False, True] if evict else [False]):
        print(f"# {torch.cuda.get_device_name()}: us from partials in place, median over {n} launches "
              f"of the latest CTA; merged / free; {'code evicted before each launch' if ev else 'code warm'}")
        table(func, evict if ev else None, junk, sms, n, stream, a.clusters)
    if evict:
        code_fetch(evict, junk, sms, stream, f"sm_{major}{minor}")
    return 0


def table(func, evict, junk, sms, n, stream, clusters):
    print(f"{'clusters':>8} " + " ".join(f"{m:>16}" for m in MODES) + "   max |diff| vs pull")
    for ncl in (int(x) for x in clusters.split(",")):
        grid = ncl * S
        out = {m: torch.zeros(ncl * HG * C, device="cuda") for m in MODES}
        ws = torch.zeros(ncl * S * REC, device="cuda")
        cells, diffs = [], []
        for k, m in enumerate(MODES):
            times = torch.zeros(n * grid * 3, dtype=torch.int64, device="cuda")
            for it in range(n):
                if evict is not None:
                    launch(evict, (2 * sms, 1, 1), (32, 1, 1), 0, [I64(junk.data_ptr()), 1.0001, 0.5], stream)
                launch(func, (grid, 1, 1), (THREADS, 1, 1), SMEM,
                       [I64(out[m].data_ptr()), I64(ws.data_ptr()), I64(times.data_ptr()), I32(k), I32(it)],
                       stream, pdl=False)
            torch.cuda.synchronize()
            t = times.view(n, grid, 3).double()
            t0 = t[:, :, 0].min(dim=1).values
            merged = (t[:, :, 1].max(dim=1).values - t0).median().item() / 1e3
            free = (t[:, :, 2].max(dim=1).values - t0).median().item() / 1e3
            cells.append(f"{merged:>7.2f} / {free:>6.2f}")
            diffs.append((out[m] - out["pull"]).abs().max().item())
        print(f"{ncl:>8} " + " ".join(f"{c:>16}" for c in cells) + "   " + " ".join(f"{d:.1e}" for d in diffs),
              flush=True)


if __name__ == "__main__":
    sys.exit(main())
