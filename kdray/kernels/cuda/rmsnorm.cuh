// The normalising half of an RMSNorm row, shared by rmsnorm.cu and peer_all_reduce.cu (which must round alike: the
// peer kernel's fused norm equals rmsnorm of the reduced rows bit for bit). A row is spread over the block: thread t
// holds vectors j = t + i * blockDim.x, i < NV, of VEC elements each.
#pragma once
#include "dtype.cuh"

#ifndef VEC
#define VEC 8
#endif
#define NV 4  // vectors per thread at most

struct __align__(VEC * sizeof(elem_t)) vec_t {
  elem_t v[VEC];
};

// ss += the squares of a's elements, in order: this thread's part of the row's sum of squares.
__device__ __forceinline__ void add_squares(float& ss, const vec_t& a) {
#pragma unroll
  for (int e = 0; e < VEC; ++e) ss += to_f(a.v[e]) * to_f(a.v[e]);
}

struct __align__(2 * sizeof(elem_t)) pair_t {
  elem_t a, b;
};

// out = w * to_t(s * rsqrt(mean(s^2) + eps)) for this thread's vectors s[i] of the row (ss: its sum of squares; every
// thread of the block calls this). out_k_row (or null): the same row again in the INT4 expert kernels' k order
// (w4a16_moe.cu: in each 128-k chunk, position 16 s + 8 h + 2 c + i holds k = 32 c + 8 (s >> 1) + 2 (s & 1) + h +
// 4 i), which the MoE's gate/up GEMM reads; VEC == 8 and dim % 128 == 0 (the caller checks). Vector j (k 8 j ..
// 8 j + 7, c = (j >> 2) & 3, q = j & 3 of its chunk) goes out as 4 pairs (k 8 j + r, + 4) at 32 q + 16 (r >> 1) +
// 8 (r & 1) + 2 c.
__device__ __forceinline__ void rmsnorm_store(const vec_t (&s)[NV], float ss, int dim, float eps,
                                              const elem_t* __restrict__ weight, elem_t* __restrict__ out_row,
                                              elem_t* __restrict__ out_k_row = nullptr) {
  const float r = rsqrtf(block_sum(ss) / dim + eps);
  const vec_t* wv = reinterpret_cast<const vec_t*>(weight);
  vec_t* o = reinterpret_cast<vec_t*>(out_row);
  const int nvec = dim / VEC;
#pragma unroll
  for (int i = 0; i < NV; ++i) {
    const int j = threadIdx.x + i * blockDim.x;
    if (j < nvec) {
      const vec_t w = wv[j];
      vec_t y;
#pragma unroll
      for (int e = 0; e < VEC; ++e) y.v[e] = to_t(to_f(w.v[e]) * to_f(to_t(to_f(s[i].v[e]) * r)));
      o[j] = y;
#if VEC == 8
      if (out_k_row != nullptr) {
        pair_t* ok = reinterpret_cast<pair_t*>(out_k_row + 128 * (j >> 4) + 32 * (j & 3) + 2 * ((j >> 2) & 3));
#pragma unroll
        for (int r = 0; r < 4; ++r) ok[8 * (r >> 1) + 4 * (r & 1)] = pair_t{y.v[r], y.v[r + 4]};
      }
#endif
    }
  }
}
