// y[m, n] = sum_k x[m, k] * w[n, k] for a few rows of x (up to 128) on the tensor cores (sm_90a wgmma); see
// kernels/skinny_linear.py. Where skinny_linear.cu streams a token or two's weights through FMAs, this kernel
// streams them through wgmma with the weights as the A operand (64 weight rows a block) and x's rows as B (N = NX,
// x's rows rounded up to a multiple of 8), so a few rows cost the tensor cores little and the weights cross HBM
// once; cuBLAS at these shapes splits K into a GEMM plus a reduce kernel.
//
// Launch: grid (ceil(N / 64), S), cluster (1, S, 1) with S = CLUSTER <= 8, 128 threads (one warpgroup), dynamic
// shared memory 1024 + STAGES * STAGE bytes (skinny_linear.wgmma_smem); K % (64 S) == 0, N % 4 == 0, 1 <= M <= NX.
// Block (t, s) streams weight rows [64 t, 64 t + 64) over K slice s in stages of 64 k through a ring of STAGES
// cp.async buffers (128B-swizzled, the canonical K-major wgmma layout: 16-byte chunk c of row r at c ^ (r & 7)),
// each stage's weights [64][64 k] beside x's rows [NX][64 k]; rows of x past M are never loaded (their accumulator
// columns are never stored), weight rows past N read row N - 1 (never stored). The ring's first weight stages load
// before the dependency wait: w must not be written by the kernels ahead (a model's weights). At the end every
// block puts its fp32 partial sums [NX][64] in its shared memory; the cluster's blocks each add a share of the S
// partials in split order (distributed shared memory) and write y: the same sums on every call. y is rounded once
// from fp32 (or left in fp32 with OUT_F32); with ACCUMULATE, y's value joins the fp32 sum before that rounding (a
// GEMM's beta = 1).
#include "cluster.cuh"
#include "dtype.cuh"
#include "griddep.cuh"
#if DTYPE == 2
#define WGMMA_AB "f16"
#endif
#include "wgmma.cuh"

#ifndef NX
#define NX 64
#endif
#ifndef CLUSTER
#define CLUSTER 1
#endif
#ifndef STAGES
#define STAGES 6
#endif

constexpr int W_BYTES = 64 * 128;           // a stage's weights: 64 rows x 64 k
constexpr int STAGE = W_BYTES + NX * 128;   // + x's rows: a multiple of 1024 (the swizzle atom)
constexpr int PART_PITCH = 68;              // floats per x row of the partial sums: 64 + 4 (conflict-free stores)
constexpr int XI = (NX + 15) / 16;          // x chunks per thread and stage (16 rows per pass of 128 threads)
static_assert(NX % 8 == 0 && NX <= 128 && STAGES >= 3, "NX: a multiple of 8 up to 128; at least 3 stages");
static_assert(NX * PART_PITCH * 4 <= STAGES * STAGE, "the partial sums reuse the ring");

#ifdef OUT_F32
typedef float out_t;
#else
typedef elem_t out_t;
#endif

// Four consecutive outputs of one row: read (with ACCUMULATE) and written.
__device__ __forceinline__ float4 load4(const out_t* p) {
#ifdef OUT_F32
  return *reinterpret_cast<const float4*>(p);
#else
  const uint2 u = *reinterpret_cast<const uint2*>(p);
  const elem_t* e = reinterpret_cast<const elem_t*>(&u);
  return make_float4(to_f(e[0]), to_f(e[1]), to_f(e[2]), to_f(e[3]));
#endif
}
__device__ __forceinline__ void store4(out_t* p, float4 v) {
#ifdef OUT_F32
  *reinterpret_cast<float4*>(p) = v;
#else
  uint2 u;
  elem_t* e = reinterpret_cast<elem_t*>(&u);
  e[0] = to_t(v.x), e[1] = to_t(v.y), e[2] = to_t(v.z), e[3] = to_t(v.w);
  *reinterpret_cast<uint2*>(p) = u;
#endif
}

extern "C" __global__ void __cluster_dims__(1, CLUSTER, 1) __launch_bounds__(128)
    skinny_linear_wgmma(const elem_t* __restrict__ x,  // [M, K]
                        const elem_t* __restrict__ w,  // [N, K]
                        out_t* __restrict__ y,         // [M, N]
                        int M, int N, int K) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ unsigned char smem_raw[];
  const u32 base = (smem_u32(smem_raw) + 1023) & ~1023u;
  float* const part = reinterpret_cast<float*>(smem_raw + (base - smem_u32(smem_raw)));  // [NX][PART_PITCH]
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int n0 = blockIdx.x * 64, KS = K / CLUSTER, steps = KS / 64;
  const int c = tid & 7, r0 = tid >> 3;  // loader: chunk c of rows r0 + 16 i
  const elem_t* wsrc[4];
  u32 wdst[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int r = r0 + 16 * i;
    wsrc[i] = w + (long long)min(n0 + r, N - 1) * K + blockIdx.y * KS + 8 * c;
    wdst[i] = r * 128 + ((c ^ (r & 7)) << 4);
  }
  const elem_t* const xsrc = x + (long long)r0 * K + blockIdx.y * KS + 8 * c;
  const u32 xdst = W_BYTES + r0 * 128 + ((c ^ (r0 & 7)) << 4);  // + 16 rows (2048 bytes) a pass; r0 & 7 unchanged
  auto load_w = [&](int s) {
    const u32 st = base + (s % STAGES) * STAGE;
#pragma unroll
    for (int i = 0; i < 4; ++i) cp_async16(st + wdst[i], wsrc[i] + 64 * s, true);
  };
  auto load_x = [&](int s) {
    const u32 st = base + (s % STAGES) * STAGE;
#pragma unroll
    for (int i = 0; i < XI; ++i)
      if (r0 + 16 * i < M) cp_async16(st + xdst + 2048 * i, xsrc + (long long)16 * i * K + 64 * s, true);
  };

  griddep_launch_dependents();
  // The weights do not depend on the kernels ahead: the ring's first weight stages load before the dependency wait
  // (in a graph, while the kernel ahead still runs; K2's graphed shard pass at 8 and 17 tokens, H100: 1.8-1.9% less
  // time than with every load after the wait).
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s)
    if (s < steps) load_w(s);
  griddep_wait();
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < steps) load_x(s);
    cp_async_commit();  // group 0 holds every early weight stage: waiting for stage 0 waits for them all
  }
  float acc[NX / 2];
#pragma unroll
  for (int i = 0; i < NX / 2; ++i) acc[i] = 0.f;
  cp_async_wait<STAGES - 2>();  // stage 0
  fence_proxy_async();          // cp.async's writes (generic proxy), read by wgmma (async proxy)
  __syncthreads();
  for (int s = 0; s < steps; ++s) {
    // Step s: wgmma(s) joins wgmma(s - 1) in flight; once (s - 1) is done, its slot takes stage s + STAGES - 1.
    const u32 st = base + (s % STAGES) * STAGE;
    const u64 da = wg_desc(st, 16, 1024), db = wg_desc(st + W_BYTES, 16, 1024);
    wg_fence();
#pragma unroll
    for (int ks = 0; ks < 4; ++ks)  // k16 steps: + 32 bytes inside the 128-byte swizzled rows
      wgmma_ss(acc, wg_desc_add(da, 32 * ks), wg_desc_add(db, 32 * ks), s > 0 || ks > 0);
    wg_commit();
    wg_wait<1>();                    // wgmma(s - 1) is done
    cp_async_wait<STAGES - 3>();     // stage s + 1 has landed (this thread's copies)
    fence_proxy_async();
    __syncthreads();                 // ... everyone's; every warp is past wgmma(s - 1)
    if (s + STAGES - 1 < steps) load_w(s + STAGES - 1), load_x(s + STAGES - 1);
    cp_async_commit();
  }
  wg_wait<0>();
  wg_pin(acc);
  cp_async_wait<0>();
  __syncthreads();  // the ring is free: it takes the partial sums
  // acc[4 j + v]: weight row 16 warp + lane / 4 + 8 (v >> 1), x row 8 j + 2 (lane % 4) + (v & 1).
#pragma unroll
  for (int j = 0; j < NX / 8; ++j)
#pragma unroll
    for (int v = 0; v < 4; ++v)
      part[(8 * j + 2 * (lane & 3) + (v & 1)) * PART_PITCH + 16 * warp + (lane >> 2) + 8 * (v >> 1)] = acc[4 * j + v];
  cluster_sync();  // every block's partials are written
  // Units of 4 outputs (x row u / 16, weight rows 4 (u % 16) ..): block s of the cluster takes every S-th 128.
  for (int u = blockIdx.y * 128 + tid; u < M * 16; u += CLUSTER * 128) {
    const int m = u >> 4, n4 = 4 * (u & 15);
    const uint4* p = reinterpret_cast<const uint4*>(part + m * PART_PITCH + n4);  // 4 fp32 sums
    uint4 v[CLUSTER];
#pragma unroll
    for (int s = 0; s < CLUSTER; ++s) v[s] = ld_cluster(p, s);  // all S reads in flight
    float4 t = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int s = 0; s < CLUSTER; ++s)  // in split order
      t.x += __uint_as_float(v[s].x), t.y += __uint_as_float(v[s].y), t.z += __uint_as_float(v[s].z),
          t.w += __uint_as_float(v[s].w);
    if (n0 + n4 < N) {
      out_t* dst = y + (long long)m * N + n0 + n4;
#ifdef ACCUMULATE
      const float4 prior = load4(dst);
      t.x += prior.x, t.y += prior.y, t.z += prior.z, t.w += prior.w;
#endif
      store4(dst, t);
    }
  }
  cluster_sync();  // no block leaves (its shared memory) before the others have read it
#else
  __trap();  // the Python side launches this on sm_90 only
#endif
}
