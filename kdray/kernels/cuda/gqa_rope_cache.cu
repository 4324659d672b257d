// Llama-family rope of queries and keys in place, fused with the KV cache write; see kernels/gqa_rope_cache.py.
// Per token t (one block): q[t, h] = rope(q[t, h]) for every query head, k[t, g] = rope(k[t, g]) for every KV head,
// then cache row slots[t] = [k[t] (Hkv x D), v[t] (Hkv x D)]. rope (NeoX / Llama: the two halves), pair p < D/2:
// y[p] = x[p] cos[t, p] - x[D/2 + p] sin[t, p], y[D/2 + p] = x[D/2 + p] cos[t, p] + x[p] sin[t, p],
// each product rounded to the element type before the sum, as torch computes the unfused form (bit-equal to it).
// A slot outside [0, n_rows) writes no cache row.
// Launch: grid (T), block (128); D even. A lane reads and writes the same two elements of a row, so in place is safe.
#include "dtype.cuh"
#include "griddep.cuh"

__device__ __forceinline__ void rope_row(elem_t* x, const elem_t* cos, const elem_t* sin, int half, int lane) {
  for (int p = lane; p < half; p += 32) {
    const float x1 = to_f(x[p]), x2 = to_f(x[half + p]), c = to_f(cos[p]), s = to_f(sin[p]);
    const float a = to_f(to_t(__fmul_rn(x1, c))), b = to_f(to_t(__fmul_rn(x2, s)));
    const float e = to_f(to_t(__fmul_rn(x2, c))), f = to_f(to_t(__fmul_rn(x1, s)));
    x[p] = to_t(__fsub_rn(a, b));
    x[half + p] = to_t(__fadd_rn(e, f));
  }
}

extern "C" __global__ void gqa_rope_cache(elem_t* q, long long q_tok, long long q_head,          // [T, H, D]
                                          elem_t* k, long long k_tok, long long k_head,          // [T, Hkv, D]
                                          const elem_t* __restrict__ v, long long v_tok, long long v_head,
                                          const elem_t* __restrict__ cos, const elem_t* __restrict__ sin,  // [T, D/2]
                                          elem_t* __restrict__ cache, long long n_rows,          // [n_rows, 2, Hkv, D]
                                          const long long* __restrict__ slots,                   // [T]
                                          int H, int Hkv, int D) {
  griddep_begin();
  const long long t = blockIdx.x;
  const int half = D / 2, lane = threadIdx.x & 31, warps = blockDim.x >> 5;
  const elem_t* ct = cos + t * half;
  const elem_t* st = sin + t * half;
  for (int h = threadIdx.x >> 5; h < H + Hkv; h += warps)
    rope_row(h < H ? q + t * q_tok + h * q_head : k + t * k_tok + (h - H) * k_head, ct, st, half, lane);
  const long long slot = slots[t];
  if (slot < 0 || slot >= n_rows) return;  // the same for the whole block
  __syncthreads();  // every key is roped
  elem_t* row = cache + slot * 2LL * Hkv * D;
  for (int j = threadIdx.x; j < Hkv * D; j += blockDim.x) {
    const int g = j / D, d = j - g * D;
    row[j] = k[t * k_tok + g * k_head + d];
    row[Hkv * D + j] = v[t * v_tok + g * v_head + d];
  }
}
