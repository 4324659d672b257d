// Sigmoid top-k routing (moe_route.cuh), alone or folded into the MoE's prep; see kernels/moe_route.py and
// kernels/w4a16_moe.py. EPL = ceil(E / 32), a compile-time define.
#include "griddep.cuh"
#include "moe_prep.cuh"
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
  griddep_begin();
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

// moe_route then w4a16_moe's moe_prep in one launch, for T <= 32 tokens (w4a16_moe.py takes it to 12). Block 0:
// warp t routes token t (ids and weights as moe_route writes them, the ids also kept in shared memory), then the
// block sorts the routed slots over the n_local experts of this rank (moe_sort_slots; up to 32 slots warp 0 alone,
// the other warps gone: 6.2-6.4 -> 4.8-5.1 us at one token of the K2 TP8 shard on the H200); blocks 1..P permute x.
// Launch: grid (1 + P), block 1024, dynamic shared memory 4 T k + max(8 n_local, 128, n_group > 1 ? 4 T E : 0) bytes.
// One block per SM asked: ptxas then gives it 64 registers (EPL <= 22 without spills); left to aim at two, it
// spills from EPL = 8.
extern "C" __global__ void __launch_bounds__(1024, 1) moe_route_prep(
    const float* __restrict__ logits, const float* __restrict__ bias, long long* __restrict__ ids,
    float* __restrict__ weights, int T, int E, int k, int n_group, int topk_group, int renormalize, float scale,
    int e0, int n_local, const uint4* __restrict__ x, uint4* __restrict__ x_perm, int* __restrict__ sorted_slot,
    int4* __restrict__ passes, int H, int mt) {
  griddep_wait();  // the expert GEMMs are launched as this ends, not now: their blocks would take the SMs that the
                   // shared experts, on their own stream, use meanwhile
  if (blockIdx.x > 0) {
    moe_permute_x(x, x_perm, T, H, 1);
    return;
  }
  extern __shared__ int sm[];
  int* routed = sm;        // [T, k] ids
  int* work = sm + T * k;  // routing: [T, E] floats of group scratch; then sorting: [2 n_local]
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const bool warp_sort = T * k <= 32;
  if (warp_sort && warp >= T) return;  // the barrier below then waits for the routing warps only
  if (warp < T) {
    int id;
    float w;
    route_token<EPL>(logits + warp * E, bias, E, k, n_group, topk_group, renormalize, scale, e0, n_local,
                     reinterpret_cast<float*>(work) + warp * E, id, w);
    if (lane < k) {
      ids[warp * k + lane] = id;
      weights[warp * k + lane] = w;
      routed[warp * k + lane] = id;
    }
  }
  __syncthreads();
  if (!warp_sort)
    moe_sort_slots(routed, work, sorted_slot, passes, T, k, n_local, mt);
  else if (warp == 0)
    moe_sort_slots_warp(routed, work, sorted_slot, passes, T * k, n_local, mt);
}
