// y[m, n] = sum_k x[m, k] * w[n, k] for a few rows of x (M_ROWS <= 8): a weight-streaming GEMV with K split
// across blocks; see kernels/skinny_linear.py.
//
// Launch: grid (ceil(N / ROWS_PER_BLOCK), S), ROWS_PER_BLOCK = WARPS * RPW, 32 * WARPS threads; K % (S * 256) == 0,
// KS = K / S. Each warp streams RPW weight rows over its block's K slice, 16 bytes per lane per row and step (one
// 256-element step per warp), and keeps fp32 sums for its RPW x M_ROWS outputs. With S == 1 the warps write y.
// With S > 1 each block writes its partial sums to work[S, M_ROWS, N], takes a ticket of its row group, and the
// block that takes the last one adds the S partials (read through L2) and writes y, then zeroes the ticket for the
// next launch. y is rounded once from fp32, as an fp32-accumulating GEMM rounds, or left in fp32 with OUT_F32.
#include "dtype.cuh"
#include "griddep.cuh"

#ifndef M_ROWS
#define M_ROWS 1
#endif
#define WARPS 8
// Weight rows per warp (each x load serves RPW rows) and K steps unrolled. H200, K2 TP8 shard at one row
// (results/skinny-linear-rows-per-warp-2026-12-03-h200-session20.txt): 2 rows x 4 steps against 4 x 2, a_proj
// 12.2 -> 10.6 us, o_proj 7.6 -> 5.6 (its 448 row groups fill the GPU unsplit: no partial sums). The unroll does
// not put four steps of loads in flight: ptxas issues each step's loads just before its FMAs (SASS), and
// software-pipelining them was slower in the pass
// (results/skinny-linear-down-loads-ahead-not-kept-2026-12-03-h200-session23.txt).
#define RPW 2
constexpr int k_unroll = 4;
#define ROWS_PER_BLOCK (WARPS * RPW)

#ifdef OUT_F32
typedef float out_t;
__device__ __forceinline__ out_t to_out(float v) { return v; }
#else
typedef elem_t out_t;
__device__ __forceinline__ out_t to_out(float v) { return to_t(v); }
#endif

// A weight vector: read once, so it skips L1 (ld.global.nc.L1::no_allocate).
__device__ __forceinline__ vec8 load_stream(const elem_t* p) {
  int4 r;
  asm volatile("ld.global.nc.L1::no_allocate.v4.s32 {%0, %1, %2, %3}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
               : "l"(p));
  return *reinterpret_cast<vec8*>(&r);
}

extern "C" __global__ void __launch_bounds__(WARPS * 32)
    skinny_linear(const elem_t* __restrict__ x,       // [M_ROWS, K], rows contiguous
                  const elem_t* __restrict__ w,       // [N, K], rows contiguous
                  out_t* __restrict__ y,              // [M_ROWS, N]
                  float* __restrict__ work,           // [S, M_ROWS, N] (S > 1)
                  unsigned int* __restrict__ tickets,  // [gridDim.x], zero between launches (S > 1)
                  int N, int K) {
  griddep_begin();
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int S = gridDim.y, KS = K / S, k0 = blockIdx.y * KS;
  const int row0 = blockIdx.x * ROWS_PER_BLOCK + warp * RPW;
  float acc[RPW][M_ROWS];
#pragma unroll
  for (int r = 0; r < RPW; ++r)
#pragma unroll
    for (int m = 0; m < M_ROWS; ++m) acc[r][m] = 0.f;

#pragma unroll k_unroll
  for (int k = k0 + lane * 8; k < k0 + KS; k += 256) {
    vec8 wv[RPW];
#pragma unroll
    for (int r = 0; r < RPW; ++r) {
      const int n = min(row0 + r, N - 1);  // rows past N read row N-1 and are never written
      wv[r] = load_stream(w + (long long)n * K + k);
    }
#pragma unroll
    for (int m = 0; m < M_ROWS; ++m) {
      const vec8 xv = *reinterpret_cast<const vec8*>(x + (long long)m * K + k);
      float xf[8];
#pragma unroll
      for (int e = 0; e < 8; ++e) xf[e] = to_f(xv.v[e]);
#pragma unroll
      for (int r = 0; r < RPW; ++r)
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[r][m] = fmaf(to_f(wv[r].v[e]), xf[e], acc[r][m]);
    }
  }
#pragma unroll
  for (int r = 0; r < RPW; ++r)
#pragma unroll
    for (int m = 0; m < M_ROWS; ++m)
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) acc[r][m] += __shfl_xor_sync(0xffffffffu, acc[r][m], o);

  if (lane == 0) {
#pragma unroll
    for (int r = 0; r < RPW; ++r) {
      const int n = row0 + r;
      if (n >= N) continue;
#pragma unroll
      for (int m = 0; m < M_ROWS; ++m) {
        if (S == 1)
          y[(long long)m * N + n] = to_out(acc[r][m]);
        else
          work[((long long)blockIdx.y * M_ROWS + m) * N + n] = acc[r][m];
      }
    }
  }
  if (S == 1) return;

  __shared__ bool last;
  __threadfence();  // this block's partials are visible before its ticket is
  __syncthreads();
  if (threadIdx.x == 0) last = atomicAdd(&tickets[blockIdx.x], 1u) == (unsigned)(S - 1);
  __syncthreads();
  if (!last) return;
  __threadfence();
  for (int i = threadIdx.x; i < ROWS_PER_BLOCK * M_ROWS; i += WARPS * 32) {
    const int m = i / ROWS_PER_BLOCK, n = blockIdx.x * ROWS_PER_BLOCK + i % ROWS_PER_BLOCK;
    if (n >= N) continue;
    float t = 0.f;
    for (int s = 0; s < S; ++s) t += __ldcg(work + ((long long)s * M_ROWS + m) * N + n);
    y[(long long)m * N + n] = to_out(t);
  }
  if (threadIdx.x == 0) tickets[blockIdx.x] = 0u;
}
