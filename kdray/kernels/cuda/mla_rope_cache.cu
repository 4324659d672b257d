// MLA latent-cache write fused with RMSNorm and rotary; see kernels/mla_rope_cache.py.
// Per token t (one block): cache row slots[t] = [w * to_t(c * rsqrt(mean(c^2) + eps)), rope(k_pe)] where
// kv_a[t] = [c (L), k_pe (R)], and q_out[t, h] = rope(q_pe[t, h]) for every head h (q_out may alias q_pe); with
// rows_out, the same row also to rows_out[t] (a prompt's keys for the plain prefill, without a gather from the cache).
// rope (DeepSeek, interleaved pairs, de-interleaved output as HF writes it): for pair p < R/2,
// y[p] = x[2p] cos[t, p] - x[2p+1] sin[t, p], y[R/2 + p] = x[2p+1] cos[t, p] + x[2p] sin[t, p].
// A slot outside [0, n_rows) writes no cache row.
// With w_uk, blocks T.. of the grid also write the absorbed queries, q_lat[t, h] = q_nope[t, h] w_uk[h]
// (absorb_queries), so that no GEMM launch of its own sits between q_b_proj and the attention.
// R even, R / 2 <= 32 (a lane ropes one pair of each of its warp's rows).
#include "dtype.cuh"
#include "griddep.cuh"

#ifndef NOPE
#define NOPE 128  // query-key dims without rope, a multiple of 16
#endif
#define ABSORB_TOKENS 8  // tokens per absorb block (ABSORB_TOKENS in kernels/mla_rope_cache.py)
#define ROPE_THREADS 128  // a token block (ROPE_THREADS in kernels/mla_rope_cache.py): 4 warps, as the absorb blocks
#define ROPE_BATCH 4      // loads in flight per thread
static_assert(ROPE_THREADS == 128, "an absorb block is 4 warps of 16 latent columns");

// Absorb block j (blocks T.. of the grid): head h, 64 columns of L from c0 and ABSORB_TOKENS tokens from
// ABSORB_TOKENS tg. Warp w takes columns c0 + 16 w .. + 16; lane 2 g + half holds rows g NOPE/16 .. + NOPE/16 of
// w_uk[h] at columns + 8 half .. + 8, read before the dependency wait (a weight: final before the pass began), and the
// 16 lanes of a column group add their partial sums by shuffles. fp32 sums, one rounding. L % 16 == 0, 16-byte
// aligned rows and column groups.
__device__ __forceinline__ void absorb_queries(const elem_t* __restrict__ q_nope, long long n_tok, long long n_head,
                                               const elem_t* __restrict__ w_uk, long long w_head,
                                               elem_t* __restrict__ q_lat, long long l_tok, long long l_head, int T,
                                               int H, int L, int j) {
  constexpr int KR = NOPE / 16;
  const int col_blocks = (L + 63) / 64, h = j / col_blocks % H, tg = j / (col_blocks * H);
  const int lane = threadIdx.x & 31, g = lane >> 1;
  const int c = j % col_blocks * 64 + 16 * (threadIdx.x >> 5) + 8 * (lane & 1);
  griddep_launch_dependents();
  if (c >= L) {  // whole warps: L % 16 == 0
    griddep_wait();
    return;
  }
  vec8 w[KR];
#pragma unroll
  for (int r = 0; r < KR; ++r)
    w[r] = *reinterpret_cast<const vec8*>(w_uk + h * w_head + (long long)(g * KR + r) * L + c);
  griddep_wait();
#pragma unroll
  for (int i = 0; i < ABSORB_TOKENS; ++i) {
    const int t = tg * ABSORB_TOKENS + i;
    if (t >= T) break;
    const elem_t* qn = q_nope + t * n_tok + h * n_head + g * KR;
    float acc[8] = {};
#pragma unroll
    for (int r = 0; r < KR; ++r) {
      const float q = to_f(qn[r]);
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[e] = fmaf(q, to_f(w[r].v[e]), acc[e]);
    }
#pragma unroll
    for (int o = 2; o < 32; o <<= 1)
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[e] += __shfl_xor_sync(0xffffffffu, acc[e], o);
    if (g == 0) {
      vec8 out;
#pragma unroll
      for (int e = 0; e < 8; ++e) out.v[e] = to_t(acc[e]);
      *reinterpret_cast<vec8*>(q_lat + t * l_tok + h * l_head + c) = out;
    }
  }
}

// Launch: grid (T + absorb blocks), block (ROPE_THREADS). Each thread issues its loads of a pass ROPE_BATCH at a time
// before it uses them (H100, K2 TP8, 4096 tokens: with one load waited out per loop turn the kernel took 30 us).
extern "C" __global__ void mla_rope_cache(const elem_t* __restrict__ kv_a, long long kv_stride,  // [T, L + R]
                                          const elem_t* __restrict__ weight,                    // [L]
                                          const elem_t* __restrict__ cos, const elem_t* __restrict__ sin,  // [T, R/2]
                                          const elem_t* q_pe, long long q_tok, long long q_head,   // [T, H, R]
                                          elem_t* q_out, long long o_tok, long long o_head,        // [T, H, R]
                                          elem_t* __restrict__ cache, long long n_rows,           // [n_rows, L + R]
                                          const long long* __restrict__ slots,                    // [T]
                                          elem_t* __restrict__ rows_out,  // [T, L + R] or null
                                          int H, int L, int R, float eps,
                                          const elem_t* __restrict__ q_nope, long long n_tok,  // [T, H, NOPE]
                                          long long n_head,
                                          const elem_t* __restrict__ w_uk, long long w_head,     // [H, NOPE, L]
                                          elem_t* __restrict__ q_lat, long long l_tok, long long l_head,  // [T, H, L]
                                          int T) {
  if (blockIdx.x >= T) {
    absorb_queries(q_nope, n_tok, n_head, w_uk, w_head, q_lat, l_tok, l_head, T, H, L, blockIdx.x - T);
    return;
  }
  griddep_begin();
  const long long t = blockIdx.x;
  const long long slot = slots[t];
  elem_t* row = slot >= 0 && slot < n_rows ? cache + slot * (L + R) : nullptr;
  elem_t* const own = rows_out != nullptr ? rows_out + t * (L + R) : nullptr;
  const elem_t* src = kv_a + t * kv_stride;
  constexpr int SPAN = ROPE_THREADS * ROPE_BATCH;  // latent values a pass's loop turn covers
  // The thread's u-th latent index of the loop turn at j0, and latent value j of p (0 past L).
  const auto index = [](int j0, int u) { return j0 + ROPE_THREADS * u + (int)threadIdx.x; };
  const auto load = [L](const elem_t* p, int j) { return j < L ? to_f(p[j]) : 0.f; };

  float ss = 0.f;
  for (int j0 = 0; j0 < L; j0 += SPAN) {
    float v[ROPE_BATCH];
#pragma unroll
    for (int u = 0; u < ROPE_BATCH; ++u) v[u] = load(src, index(j0, u));
#pragma unroll
    for (int u = 0; u < ROPE_BATCH; ++u) ss += v[u] * v[u];
  }
  const float r = rsqrtf(block_sum(ss) / L + eps);
  if (row != nullptr || own != nullptr)
    for (int j0 = 0; j0 < L; j0 += SPAN) {
      float v[ROPE_BATCH], w[ROPE_BATCH];
#pragma unroll
      for (int u = 0; u < ROPE_BATCH; ++u) {
        v[u] = load(src, index(j0, u));
        w[u] = load(weight, index(j0, u));
      }
#pragma unroll
      for (int u = 0; u < ROPE_BATCH; ++u) {
        if (index(j0, u) >= L) continue;
        const elem_t y = to_t(w[u] * to_f(to_t(v[u] * r)));
        if (row != nullptr) row[index(j0, u)] = y;
        if (own != nullptr) own[index(j0, u)] = y;
      }
    }

  // Rope: warp w's lane p < R/2 rotates pair p of rows h = w - 1, w - 1 + warps, .. (h = -1: k_pe into the cache row;
  // the others the queries), ROPE_BATCH rows' loads before their stores; q_out may alias q_pe, so the lanes meet
  // between the two.
  const int half = R / 2, lane = threadIdx.x & 31, warps = ROPE_THREADS / 32;
  if (lane >= half) return;
  const unsigned pairs = half == 32 ? 0xffffffffu : (1u << half) - 1u;  // the lanes still here
  const float c = to_f(cos[t * half + lane]), s = to_f(sin[t * half + lane]);
  for (int h0 = (int)(threadIdx.x >> 5) - 1; h0 < H; h0 += warps * ROPE_BATCH) {
    float x1[ROPE_BATCH], x2[ROPE_BATCH];
#pragma unroll
    for (int u = 0; u < ROPE_BATCH; ++u) {
      const int h = h0 + warps * u;
      const elem_t* in = h < 0 ? src + L : q_pe + t * q_tok + h * q_head;
      x1[u] = h < H ? to_f(in[2 * lane]) : 0.f;
      x2[u] = h < H ? to_f(in[2 * lane + 1]) : 0.f;
    }
    __syncwarp(pairs);
#pragma unroll
    for (int u = 0; u < ROPE_BATCH; ++u) {
      const int h = h0 + warps * u;
      if (h >= H) continue;
      const elem_t y1 = to_t(x1[u] * c - x2[u] * s), y2 = to_t(x2[u] * c + x1[u] * s);
      elem_t* dst = h >= 0 ? q_out + t * o_tok + h * o_head : row != nullptr ? row + L : nullptr;
      if (dst != nullptr) {
        dst[lane] = y1;
        dst[half + lane] = y2;
      }
      if (h < 0 && own != nullptr) {  // k_pe, into the token's own row as well
        own[L + lane] = y1;
        own[L + half + lane] = y2;
      }
    }
  }
}
