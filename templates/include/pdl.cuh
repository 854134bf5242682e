// Programmatic dependent launch (PDL) on Hopper: lets a kernel start while the one before it in
// the stream drains, so its launch latency and its weight prefetch overlap the previous tail.
//
// The contract every PDL-launched kernel keeps (the launcher sets the launch attribute only on
// kernels whose family declares PDL = True):
//  - every CTA calls pdl_wait() before its first read of anything another kernel writes
//    (activations, step metadata, workspaces, the KV cache) and before its first global write,
//    early-exiting CTAs included; reading weights before it is allowed (no kernel writes them).
//    A CTA that returned without waiting could let this grid complete before its predecessor,
//    and the kernel after it would then see the predecessor's writes unfinished.
//  - pdl_launch_dependents() may come anywhere after that: it only lets the next kernel's CTAs be
//    scheduled (they still wait for this grid to complete before touching its outputs).
// Both are no-ops when the kernel was launched without the attribute. Raw PTX, not
// cudaGridDependencySynchronize, because NVRTC builds without the device runtime.
#pragma once

namespace dsg {

__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

}  // namespace dsg
