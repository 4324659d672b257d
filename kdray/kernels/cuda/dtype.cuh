// Element type of the elementwise kernels (rmsnorm, mla_rope_cache, silu_mul), chosen at compile time:
// DTYPE 0 float, 1 bfloat16, 2 half. Math runs in fp32; to_t rounds to nearest even, as torch's casts do.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#ifndef DTYPE
#define DTYPE 1
#endif

#if DTYPE == 0
typedef float elem_t;
__device__ __forceinline__ float to_f(float v) { return v; }
__device__ __forceinline__ elem_t to_t(float v) { return v; }
#elif DTYPE == 1
typedef __nv_bfloat16 elem_t;
__device__ __forceinline__ float to_f(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ elem_t to_t(float v) { return __float2bfloat16_rn(v); }
#else
typedef __half elem_t;
__device__ __forceinline__ float to_f(__half v) { return __half2float(v); }
__device__ __forceinline__ elem_t to_t(float v) { return __float2half_rn(v); }
#endif

// Eight elements, one 16-byte access in 16 bits (two in fp32).
struct __align__(16) vec8 {
  elem_t v[8];
};

// Sum over the block (any multiple of 32 threads up to 1024); every thread gets the total.
__device__ __forceinline__ float block_sum(float v) {
  __shared__ float partial[32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  __syncthreads();  // partial may still be read by a previous call
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  v = lane < warps ? partial[lane] : 0.f;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
