// Programmatic dependent launch (sm_90+). Inside a CUDA graph capture, kernels/cuda_module.launch lets a kernel be
// launched while the kernel ahead of it on the stream still runs: its blocks take free room on the SMs and stop in
// griddep_wait() until the kernels ahead have finished and their writes are visible. So every kernel calls
// griddep_wait() before it reads or writes memory that other work touches; the one exception is memory its caller
// declares final before the kernel ahead began (tree attention's early_prefix: the block table and the cache's prefix
// rows within a model pass), which may be read first. griddep_launch_dependents() lets the kernel after this one be
// launched. Both are no-ops in a plain launch and before sm_90.
#pragma once

__device__ __forceinline__ void griddep_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void griddep_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// The usual start of a kernel: the next kernel may be launched now (its launch overlaps this one), then wait for
// the kernels ahead.
__device__ __forceinline__ void griddep_begin() {
  griddep_launch_dependents();
  griddep_wait();
}
