"""How many thread-block clusters of 2 / 4 / 8 / 16 CTAs the device holds at once for a kernel
that takes a whole SM (one CTA per SM: ~224 KB of shared memory, as mla_decode_attention's
tensor-core split), from cuOccupancyMaxActiveClusters (a script, not a test).

    python3 -m bench.probe_clusters [--smem BYTES]

The GPCs' SM counts decide it: a cluster's CTAs share one GPC, so a GPC of n SMs holds
floor(n / S) clusters of S one-SM CTAs. mla_decode_attention's split policy depends on it.
"""
from __future__ import annotations

import argparse


import torch

from codegen.nvrtc import compile_cubin
from runtime.cuda_driver import LoadedModule, _driver, check

SRC = r'''
extern "C" __global__ void __launch_bounds__(256, 1) probe(float* p) {
  extern __shared__ float s[];
  if (p) p[threadIdx.x] = s[threadIdx.x];
}
'''


def max_clusters(func, size: int, smem: int) -> int:
    driver = _driver()
    config = driver.CUlaunchConfig()
    config.gridDimX, config.gridDimY, config.gridDimZ = size * 64, 1, 1
    config.blockDimX, config.blockDimY, config.blockDimZ = 256, 1, 1
    config.sharedMemBytes = smem
    attr = driver.CUlaunchAttribute()
    attr.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
    attr.value.clusterDim.x, attr.value.clusterDim.y, attr.value.clusterDim.z = size, 1, 1
    config.attrs = [attr]
    config.numAttrs = 1
    return int(check(driver.cuOccupancyMaxActiveClusters(func, config), "cuOccupancyMaxActiveClusters"))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--smem", type=int, default=224 * 1024)
    a = ap.parse_args()
    torch.cuda.init()
    major, minor = torch.cuda.get_device_capability()
    res = compile_cubin(SRC, "probe", arch=f"sm_{major}{minor}")
    mod = LoadedModule.load(res.cubin, "probe")
    driver = _driver()
    func = mod.function("probe", a.smem)
    try:
        check(driver.cuFuncSetAttribute(
            func, driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1), "nonportable")
    except Exception as e:  # noqa: BLE001
        print("non-portable cluster sizes:", e)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"{torch.cuda.get_device_name(0)}: {sms} SMs, {a.smem} B shared memory a CTA")
    for size in (1, 2, 4, 8, 16):
        try:
            n = max_clusters(func, size, a.smem)
            print(f"clusters of {size:2d}: {n:4d} at once ({n * size} CTAs)")
        except Exception as e:  # noqa: BLE001
            print(f"clusters of {size:2d}: {e}")


if __name__ == "__main__":
    main()
