// The normalising half of an RMSNorm row, shared by rmsnorm.cu and peer_all_reduce.cu (which must round alike: the
// peer kernel's fused norm equals rmsnorm of the reduced rows bit for bit). A row is spread over the block: thread t holds vectors
// j = t + i * blockDim.x, i < NV, of VEC elements each.
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

// out = w * to_t(s * rsqrt(mean(s^2) + eps)) for this thread's vectors s[i] of the row (ss: its sum of squares; every
// thread of the block calls this).
__device__ __forceinline__ void rmsnorm_store(const vec_t (&s)[NV], float ss, int dim, float eps,
                                              const elem_t* __restrict__ weight, elem_t* __restrict__ out_row) {
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
    }
  }
}
