// Sigmoid top-k routing (moe_route.cuh); see kernels/moe_route.py. EPL = ceil(E / 32), a compile-time define.
#include "moe_route.cuh"

#ifndef EPL
#define EPL 12
#endif
#define WARPS 4

// Launch: grid (ceil(T / 4)), block (128): a warp per token.
extern "C" __global__ void __launch_bounds__(128) moe_route(const float* __restrict__ logits,  // [T, E]
                                                            const float* __restrict__ bias,    // [E]
                                                            long long* __restrict__ ids,       // [T, k]
                                                            float* __restrict__ weights,       // [T, k]
                                                            int T, int E, int k, int n_group, int topk_group,
                                                            int renormalize, float scale, int e0, int n_local) {
  __shared__ float grouped[WARPS][EPL * 32];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const long long t = (long long)blockIdx.x * WARPS + warp;
  if (t >= T) return;  // whole warps only: nothing below synchronises the block
  int id;
  float w;
  route_token<EPL>(logits + t * E, bias, E, k, n_group, topk_group, renormalize, scale, e0, n_local, grouped[warp],
                   id, w);
  if (lane < k) {
    ids[t * k + lane] = id;
    weights[t * k + lane] = w;
  }
}
