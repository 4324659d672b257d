// MLA latent-cache write fused with RMSNorm and rotary; see kernels/mla_rope_cache.py.
// Per token t (one block): cache row slots[t] = [w * to_t(c * rsqrt(mean(c^2) + eps)), rope(k_pe)] where
// kv_a[t] = [c (L), k_pe (R)], and q_out[t, h] = rope(q_pe[t, h]) for every head h (q_out may alias q_pe).
// rope (DeepSeek, interleaved pairs, de-interleaved output as HF writes it): for pair p < R/2,
// y[p] = x[2p] cos[t, p] - x[2p+1] sin[t, p], y[R/2 + p] = x[2p+1] cos[t, p] + x[2p] sin[t, p].
// A slot outside [0, n_rows) writes no cache row.
// Launch: grid (T), block (128); R even, R / 2 <= 32 (a warp ropes one row: all its reads precede its writes).
#include "dtype.cuh"
#include "griddep.cuh"

extern "C" __global__ void mla_rope_cache(const elem_t* __restrict__ kv_a, long long kv_stride,  // [T, L + R]
                                          const elem_t* __restrict__ weight,                    // [L]
                                          const elem_t* __restrict__ cos, const elem_t* __restrict__ sin,  // [T, R/2]
                                          const elem_t* q_pe, long long q_tok, long long q_head,   // [T, H, R]
                                          elem_t* q_out, long long o_tok, long long o_head,        // [T, H, R]
                                          elem_t* __restrict__ cache, long long n_rows,           // [n_rows, L + R]
                                          const long long* __restrict__ slots,                    // [T]
                                          int H, int L, int R, float eps) {
  griddep_begin();
  const long long t = blockIdx.x;
  const long long slot = slots[t];
  elem_t* row = slot >= 0 && slot < n_rows ? cache + slot * (L + R) : nullptr;
  const elem_t* src = kv_a + t * kv_stride;

  float ss = 0.f;
  for (int j = threadIdx.x; j < L; j += blockDim.x) {
    const float v = to_f(src[j]);
    ss += v * v;
  }
  const float r = rsqrtf(block_sum(ss) / L + eps);
  if (row != nullptr)
    for (int j = threadIdx.x; j < L; j += blockDim.x) row[j] = to_t(to_f(weight[j]) * to_f(to_t(to_f(src[j]) * r)));

  const int half = R / 2, lane = threadIdx.x & 31, warps = blockDim.x >> 5;
  const float c = lane < half ? to_f(cos[t * half + lane]) : 0.f;
  const float s = lane < half ? to_f(sin[t * half + lane]) : 0.f;
  for (int h = (int)(threadIdx.x >> 5) - 1; h < H; h += warps) {  // h = -1: k_pe into the cache row
    const elem_t* in = h < 0 ? src + L : q_pe + t * q_tok + h * q_head;
    elem_t* dst = h >= 0 ? q_out + t * o_tok + h * o_head : row != nullptr ? row + L : nullptr;
    float x1 = 0.f, x2 = 0.f;
    if (lane < half) {
      x1 = to_f(in[2 * lane]);
      x2 = to_f(in[2 * lane + 1]);
    }
    __syncwarp();
    if (lane < half && dst != nullptr) {
      dst[lane] = to_t(x1 * c - x2 * s);
      dst[half + lane] = to_t(x2 * c + x1 * s);
    }
  }
}
