// y[m, n] = sum_k x[m, k] * w[n, k] for a few rows of x (M_ROWS <= 8): a weight-streaming GEMV with K split
// across the blocks of a thread-block cluster; see kernels/skinny_linear.py. Grouped (a batched GEMV, skinny_bmm):
// output rows [g R, g R + R) read x row g of each token and rows [0, R) of weight group g (R = group_rows; groups
// w_pitch weight rows apart).
//
// Launch: grid (ceil(N / ROWS_PER_BLOCK), S), cluster (1, S, 1) with S = CLUSTER <= 8, ROWS_PER_BLOCK = WARPS * RPW,
// 32 * WARPS threads; K % (S * 256) == 0, KS = K / S; grouped, R % RPW == 0. Each warp streams RPW weight rows over
// its block's K slice, 16 bytes per lane per row and step (one 256-element step per warp), and keeps fp32 sums for
// its RPW x M_ROWS outputs. With S == 1 the warps write y. With S > 1 every block of a cluster puts its partial sums
// in its shared memory and the cluster's first block adds the S partials in split order (read through distributed
// shared memory) and writes y: no global round trip, no tickets (H200, alone: q_b 4.8 -> 3.8 us, the router 5.7 ->
// 4.4 against partials in global memory summed by the block that took a row group's last ticket). y is rounded once
// from fp32, as an fp32-accumulating GEMM rounds, or left in fp32 with OUT_F32. With ACCUMULATE, y += x w^T: y's
// value is added to the fp32 sum before that rounding (as a GEMM's beta = 1 does). With X_PARTIALS = P (grouped, 16-bit
// x), x holds P unmerged split partials of each of its rows, [P][M_ROWS * G][K] (the MLA attention's, each normalised
// by its own sum), and x_ml their (max in log2 units, sum) pairs [P][M_ROWS * G]: each element of x is their merge,
// computed and rounded as the attention's own merge (SplitMerge in tree_verify_attention.cu) computes and rounds it,
// so y has the same bits as after that merge; a partial of sum 0 adds nothing.
#include "dtype.cuh"
#include "griddep.cuh"

#ifndef M_ROWS
#define M_ROWS 1
#endif
#ifndef CLUSTER
#define CLUSTER 1
#endif
#ifndef X_PARTIALS
#define X_PARTIALS 0
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
__device__ __forceinline__ float out_f(out_t v) { return v; }
#else
typedef elem_t out_t;
__device__ __forceinline__ out_t to_out(float v) { return to_t(v); }
__device__ __forceinline__ float out_f(out_t v) { return to_f(v); }
#endif

// With ACCUMULATE, the value of y that a sum adds to, read at the kernel's start (after the dependency wait): read
// just before the store, its latency stood at the end of every warp (K2 1x0: +0.1 ms a pass on an H100).
struct Prior {
#ifdef ACCUMULATE
  float v = 0.f;
  __device__ __forceinline__ void load(const out_t* y) { v = out_f(*y); }
  __device__ __forceinline__ float add_to(float sum) const { return sum + v; }
#else
  __device__ __forceinline__ void load(const out_t*) {}
  __device__ __forceinline__ float add_to(float sum) const { return sum; }
#endif
};

// A weight vector: read once, so it skips L1 (ld.global.nc.L1::no_allocate).
__device__ __forceinline__ vec8 load_stream(const elem_t* p) {
  int4 r;
  asm volatile("ld.global.nc.L1::no_allocate.v4.s32 {%0, %1, %2, %3}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
               : "l"(p));
  return *reinterpret_cast<vec8*>(&r);
}

#if CLUSTER > 1  // clusters: sm_90 and later (kernels/skinny_linear.py launches CLUSTER 1 elsewhere)
#include "cluster.cuh"
#define CLUSTER_DIMS __cluster_dims__(1, CLUSTER, 1)
#else
#define CLUSTER_DIMS
#endif

extern "C" __global__ void CLUSTER_DIMS __launch_bounds__(WARPS * 32)
    skinny_linear(const elem_t* __restrict__ x,  // [M_ROWS, N / group_rows, K], rows contiguous
                  const elem_t* __restrict__ w,  // row j < group_rows of group g at (g * w_pitch + j) * K
                  out_t* __restrict__ y,         // [M_ROWS, N]
                  int N, int K, int group_rows, int w_pitch,
                  const float2* __restrict__ x_ml) {  // X_PARTIALS: [X_PARTIALS, M_ROWS * G] (else unused)
  griddep_begin();
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int KS = K / CLUSTER, k0 = blockIdx.y * KS, G = N / group_rows;
  const int row0 = blockIdx.x * ROWS_PER_BLOCK + warp * RPW;
  const int g = min(row0, N - 1) / group_rows;  // the group of the warp's rows (group_rows % RPW == 0 or G == 1)
  const elem_t* xg = x + (long long)g * K;
#if X_PARTIALS
  // Each row's partials' weights l_s 2^(m_s - max_s m_s) and the inverse of their sum
  float pw[M_ROWS][X_PARTIALS], pinv[M_ROWS];
#pragma unroll
  for (int m = 0; m < M_ROWS; ++m) {
    const float neg_inf = __int_as_float(0xff800000);
    float2 ml[X_PARTIALS];
    float mx = neg_inf, wsum = 0.f;
#pragma unroll
    for (int s = 0; s < X_PARTIALS; ++s) {
      ml[s] = x_ml[((long long)s * M_ROWS + m) * G + g];
      mx = fmaxf(mx, ml[s].x);
    }
    const float mu = mx == neg_inf ? 0.f : mx;  // no visible key: keep exp2 finite
#pragma unroll
    for (int s = 0; s < X_PARTIALS; ++s) {
      pw[m][s] = ml[s].y * exp2f(ml[s].x - mu);
      wsum += pw[m][s];
    }
    pinv[m] = wsum > 0.f ? 1.f / wsum : 0.f;
  }
#else
  (void)x_ml;
#endif
  float acc[RPW][M_ROWS];
#pragma unroll
  for (int r = 0; r < RPW; ++r)
#pragma unroll
    for (int m = 0; m < M_ROWS; ++m) acc[r][m] = 0.f;
  const elem_t* wr[RPW];
#pragma unroll
  for (int r = 0; r < RPW; ++r) {  // rows past N read row N-1 and are never written
    const int n = min(row0 + r, N - 1);
    wr[r] = w + ((long long)g * w_pitch + n - g * group_rows) * K;
  }
#if CLUSTER == 1
  Prior prior[RPW][M_ROWS];  // lane 0 writes the warp's rows
  if (lane == 0)
#pragma unroll
    for (int r = 0; r < RPW; ++r)
#pragma unroll
      for (int m = 0; m < M_ROWS; ++m)
        if (row0 + r < N) prior[r][m].load(y + (long long)m * N + row0 + r);
#else
  Prior prior;  // block 0's first ROWS_PER_BLOCK * M_ROWS threads write the cluster's rows
  const int pm = threadIdx.x / ROWS_PER_BLOCK, pn = blockIdx.x * ROWS_PER_BLOCK + threadIdx.x % ROWS_PER_BLOCK;
  if (blockIdx.y == 0 && threadIdx.x < ROWS_PER_BLOCK * M_ROWS && pn < N) prior.load(y + (long long)pm * N + pn);
#endif

  const int steps = KS / 256;
#pragma unroll k_unroll
  for (int i = 0, k = k0 + lane * 8; i < steps; ++i, k += 256) {
    vec8 wv[RPW];
#pragma unroll
    for (int r = 0; r < RPW; ++r) wv[r] = load_stream(wr[r] + k);
#pragma unroll
    for (int m = 0; m < M_ROWS; ++m) {
      float xf[8];
#if X_PARTIALS
      vec8 xv[X_PARTIALS];
#pragma unroll
      for (int s = 0; s < X_PARTIALS; ++s)
        xv[s] = *reinterpret_cast<const vec8*>(xg + ((long long)s * M_ROWS + m) * G * K + k);
#pragma unroll
      for (int e = 0; e < 8; ++e) xf[e] = 0.f;
#pragma unroll
      for (int s = 0; s < X_PARTIALS; ++s)
        if (pw[m][s] > 0.f)  // an empty partial's values are not written
#pragma unroll
          for (int e = 0; e < 8; ++e) xf[e] = fmaf(pw[m][s], to_f(xv[s].v[e]), xf[e]);
#pragma unroll
      for (int e = 0; e < 8; ++e) xf[e] = to_f(to_t(xf[e] * pinv[m]));
#else
      const vec8 xv = *reinterpret_cast<const vec8*>(xg + (long long)m * G * K + k);
#pragma unroll
      for (int e = 0; e < 8; ++e) xf[e] = to_f(xv.v[e]);
#endif
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

#if CLUSTER == 1
  if (lane == 0) {
#pragma unroll
    for (int r = 0; r < RPW; ++r) {
      const int n = row0 + r;
      if (n >= N) continue;
#pragma unroll
      for (int m = 0; m < M_ROWS; ++m) y[(long long)m * N + n] = to_out(prior[r][m].add_to(acc[r][m]));
    }
  }
#else
  __shared__ float part[M_ROWS][ROWS_PER_BLOCK];  // this block's partial sums
  if (lane == 0) {
#pragma unroll
    for (int r = 0; r < RPW; ++r)
#pragma unroll
      for (int m = 0; m < M_ROWS; ++m) part[m][warp * RPW + r] = acc[r][m];
  }
  cluster_sync();  // every block's partials are written
  if (blockIdx.y == 0 && threadIdx.x < ROWS_PER_BLOCK * M_ROWS) {
    const int i = threadIdx.x % ROWS_PER_BLOCK;
    float v[CLUSTER];
#pragma unroll
    for (int s = 0; s < CLUSTER; ++s) v[s] = ld_cluster(&part[pm][i], s);  // all S reads in flight
    float t = 0.f;
#pragma unroll
    for (int s = 0; s < CLUSTER; ++s) t += v[s];  // in split order, from 0, as the partials were always added
    if (pn < N) y[(long long)pm * N + pn] = to_out(prior.add_to(t));
  }
  cluster_sync();  // no block leaves (its shared memory) before the first block has read it
#endif
}
