// Tiles of the tensor-core attention kernels (tree_verify_attention.cu, prefill_attention.cu): 64-row query tiles and
// 64-key tiles in 128B-swizzled shared memory, S = Q K^T and O += P V on wgmma (sm_90a) or mma.sync (elsewhere, or
// with ATTN_MMA_SYNC defined; both share every layout), and the CTA -> (sequence, tile) lookup.
#pragma once
#include <cuda_bf16.h>

#include "wgmma.cuh"

#if defined(__CUDA_ARCH_FEAT_SM90_ALL) && !defined(ATTN_MMA_SYNC)
#define ATTN_WGMMA 1
#endif

#ifndef INFINITY  // NVRTC has no <math.h>
#define INFINITY __int_as_float(0x7f800000)
#endif

typedef __nv_bfloat16 bf16;
typedef unsigned int u32;
typedef unsigned long long u64;

constexpr int BM = 64;  // rows per CTA
constexpr int BN = 64;  // keys per tile

// ---------------------------------------------------------------------------------------------------
// Batch bookkeeping.

// CTA index -> (sequence b, TR-row tile within it); sequence b has ceil(q_len * G / TR) tiles.
// Each warp scans cu_q 32 sequences at a time, so every thread gets the same answer.
template <int TR = BM>
__device__ __forceinline__ bool find_tile(const int* cu_q, int B, int G, int index, int& b, int& tile) {
  const int lane = threadIdx.x & 31;
  int base = 0;
  for (int b0 = 0; b0 < B; b0 += 32) {
    const int n = b0 + lane < B ? ((cu_q[b0 + lane + 1] - cu_q[b0 + lane]) * G + TR - 1) / TR : 0;
    int incl = n;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
      const int v = __shfl_up_sync(0xffffffffu, incl, d);
      if (lane >= d) incl += v;
    }
    const int total = __shfl_sync(0xffffffffu, incl, 31);
    if (index < base + total) {
      const int hit = __ffs(__ballot_sync(0xffffffffu, base + incl > index)) - 1;
      b = b0 + hit;
      tile = index - base - __shfl_sync(0xffffffffu, incl - n, hit);
      return true;
    }
    base += total;
  }
  return false;
}

// Sequence holding query row t (largest b with cu_q[b] <= t), or -1 past the last sequence.
__device__ __forceinline__ int seq_of(const int* cu_q, int B, int t) {
  if (t >= cu_q[B]) return -1;
  int lo = 0, hi = B - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (cu_q[mid] <= t) lo = mid; else hi = mid - 1;
  }
  return lo;
}

// ---------------------------------------------------------------------------------------------------
// Shared-memory and tensor-core primitives.

// Byte offset of 16-byte chunk c of row r in a 64-row tile stored as [c / 8][row][128 B], 128B swizzle.
__device__ __forceinline__ u32 swz(int r, int c) { return ((c >> 3) << 13) + (r << 7) + (((c ^ r) & 7) << 4); }

// (cp_async16, cp_async_commit and cp_async_wait: wgmma.cuh.)
// Arrives on the mbarrier at bar once this thread's cp.async copies so far have landed (counted in its init count).
__device__ __forceinline__ void cp_async_mbar_arrive(u32 bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}

__device__ __forceinline__ u32 pack_bf16(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<u32*>(&v);
}

__device__ __forceinline__ void ldsm_x4(u32 (&r)[4], u32 addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
#ifndef ATTN_WGMMA
__device__ __forceinline__ void ldsm_x4_t(u32 (&r)[4], u32 addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
// d[4] += A[16x16] B[16x8], bf16 in, fp32 accumulate.
__device__ __forceinline__ void mma16816(float* d, const u32 (&a)[4], u32 b0, u32 b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
#endif

// Accumulator layout (wgmma m64nN and mma.sync alike): warp w of a warpgroup owns rows 16w + g and
// 16w + g + 8 (g = lane / 4); d[4j + e] is column 8j + 2(lane % 4) + (e & 1) of row 16w + g + 8(e >> 1).

// s[32] = Q K^T for this warp's 16 rows x the 64 keys of the tile (warpgroup 0 calls it).
template <int DK>
__device__ __forceinline__ void qk_tile(float (&s)[32], u32 sQ, u32 sK, int wq, int lane) {
#pragma unroll
  for (int i = 0; i < 32; ++i) s[i] = 0.f;
#ifdef ATTN_WGMMA
  (void)wq; (void)lane;
  const u64 dq = wg_desc(sQ, 16, 1024), dk = wg_desc(sK, 16, 1024);
  wg_fence();
#pragma unroll
  for (int ks = 0; ks < DK / 16; ++ks) {
    const u32 off = (ks >> 2) * 8192 + (ks & 3) * 32;  // 64-column chunk, then 16 columns inside it
    wgmma_ss(s, wg_desc_add(dq, off), wg_desc_add(dk, off), ks > 0);
  }
  wg_commit();
  wg_wait_all();
  wg_pin(s);
#else
#pragma unroll
  for (int ks = 0; ks < DK / 16; ++ks) {
    u32 a[4];
    ldsm_x4(a, sQ + swz(16 * wq + (lane & 15), 2 * ks + (lane >> 4)));
#pragma unroll
    for (int jj = 0; jj < 4; ++jj) {
      u32 bk[4];
      ldsm_x4(bk, sK + swz(16 * jj + ((lane >> 4) << 3) + (lane & 7), 2 * ks + ((lane >> 3) & 1)));
      mma16816(s + 8 * jj, a, bk[0], bk[1]);
      mma16816(s + 8 * jj + 4, a, bk[2], bk[3]);
    }
  }
#endif
}

#ifdef ATTN_WGMMA
// Issues o[NW / 2] += P V[:, c0 : c0 + NW] (pv_tile's product) as one wgmma group, after the caller's wg_fence;
// o and p stay untouched until a wg_wait retires it.
template <int NW>
__device__ __forceinline__ void pv_issue(float (&o)[NW / 2], const u32 (&p)[4][4], u32 sV, int c0) {
  const u64 dv = wg_desc(sV + (c0 / 64) * 8192, 8192, 1024);
#pragma unroll
  for (int ks = 0; ks < 4; ++ks)  // 16 keys = two 8-row groups (SBO); 64 value columns per chunk (LBO)
    wgmma_rs<1>(o, p[ks], wg_desc_add(dv, ks * 2048));
  wg_commit();
}
#endif

// o[NW / 2] += P V[:, c0 : c0 + NW] for this warp's 16 rows; p[ks] holds keys 16ks..16ks+15 as A fragments.
template <int NW>
__device__ __forceinline__ void pv_tile(float (&o)[NW / 2], const u32 (&p)[4][4], u32 sV, int c0, int lane) {
#ifdef ATTN_WGMMA
  (void)lane;
  wg_pin(o);
  wg_fence();
  pv_issue<NW>(o, p, sV, c0);
  wg_wait_all();
  wg_pin(o);
#else
#pragma unroll
  for (int ks = 0; ks < 4; ++ks) {
#pragma unroll
    for (int jj = 0; jj < NW / 16; ++jj) {
      u32 bv[4];
      ldsm_x4_t(bv, sV + swz(16 * ks + ((lane >> 3) & 1) * 8 + (lane & 7), c0 / 8 + 2 * jj + (lane >> 4)));
      mma16816(o + 8 * jj, p[ks], bv[0], bv[1]);
      mma16816(o + 8 * jj + 4, p[ks], bv[2], bv[3]);
    }
  }
#endif
}

// Byte offset of 16-byte chunk c of row r in a staged [64][row_bytes] output tile: the chunk index XORed with r % 8,
// so that the 8 rows a warp's accumulator store touches fall in different banks.
__device__ __forceinline__ u32 o_swz(int r, int c, int row_bytes) { return r * row_bytes + ((c ^ (r & 7)) << 4); }

// The online softmax over one tile: s[32] (this thread's scores of its rows r0 and r0 + 8, masked ones -INFINITY) ->
// P as the A fragments of pv_tile, the running maxima m (log2 units) and sums l (this thread's columns only; quad_sum
// adds the quad's at the end), and alpha, each row's factor for the O accumulated so far.
__device__ __forceinline__ void softmax_tile(float (&s)[32], float (&m)[2], float (&l)[2], float (&alpha)[2],
                                             u32 (&p)[4][4], float scale_log2) {
  float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
  for (int i = 0; i < 32; ++i) mx[(i >> 1) & 1] = fmaxf(mx[(i >> 1) & 1], s[i]);
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    mx[e] = fmaxf(mx[e], __shfl_xor_sync(0xffffffffu, mx[e], 1));
    mx[e] = fmaxf(mx[e], __shfl_xor_sync(0xffffffffu, mx[e], 2));
    const float m_new = fmaxf(m[e], mx[e] * scale_log2);
    const float m_use = m_new == -INFINITY ? 0.f : m_new;  // no visible key yet: keep exp2 finite
    alpha[e] = exp2f(m[e] - m_use);
    m[e] = m_new;
    mx[e] = m_use;
  }
  float sum[2] = {0.f, 0.f};
#pragma unroll
  for (int i = 0; i < 32; ++i) {
    const int e = (i >> 1) & 1;
    s[i] = exp2f(fmaf(s[i], scale_log2, -mx[e]));
    sum[e] += s[i];
  }
#pragma unroll
  for (int e = 0; e < 2; ++e) l[e] = l[e] * alpha[e] + sum[e];
#pragma unroll
  for (int ks = 0; ks < 4; ++ks) {
    p[ks][0] = pack_bf16(s[8 * ks + 0], s[8 * ks + 1]);
    p[ks][1] = pack_bf16(s[8 * ks + 2], s[8 * ks + 3]);
    p[ks][2] = pack_bf16(s[8 * ks + 4], s[8 * ks + 5]);
    p[ks][3] = pack_bf16(s[8 * ks + 6], s[8 * ks + 7]);
  }
}

// The row sums of softmax_tile, added over the quad that shares each row.
__device__ __forceinline__ void quad_sum(float (&l)[2]) {
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    l[e] += __shfl_xor_sync(0xffffffffu, l[e], 1);
    l[e] += __shfl_xor_sync(0xffffffffu, l[e], 2);
  }
}

// This thread's output rows r0 and r0 + 8 (value columns c0 .. c0 + NW - 1), each divided by its sum l (0 where it is
// 0: no visible key), into a staged [64][row_bytes] bf16 tile at smem (o_swz), for 16-byte stores of its rows.
template <int NW>
__device__ __forceinline__ void stage_rows(unsigned char* smem, const float (&o)[NW / 2], const float (&l)[2], int r0,
                                           int t4, int c0, int row_bytes) {
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    const int r = r0 + 8 * e;
    const float inv = l[e] > 0.f ? 1.f / l[e] : 0.f;
#pragma unroll
    for (int j = 0; j < NW / 8; ++j)
      *reinterpret_cast<u32*>(smem + o_swz(r, c0 / 8 + j, row_bytes) + 4 * t4) =
          pack_bf16(o[4 * j + 2 * e] * inv, o[4 * j + 2 * e + 1] * inv);
  }
}

// acc[0..7] += w x the 8 bf16 values in v (one split's 16 bytes of a row's partial).
__device__ __forceinline__ void fma_bf16x8(float (&acc)[8], float w, uint4 v) {
  const u32 h[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int c = 0; c < 4; ++c) {
    const float2 x = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&h[c]));
    acc[2 * c] = fmaf(w, x.x, acc[2 * c]);
    acc[2 * c + 1] = fmaf(w, x.y, acc[2 * c + 1]);
  }
}

// acc[0..7] x inv as 8 bf16 values: 16 bytes at dst.
__device__ __forceinline__ void store_bf16x8(bf16* dst, const float (&acc)[8], float inv) {
  *reinterpret_cast<uint4*>(dst) =
      make_uint4(pack_bf16(acc[0] * inv, acc[1] * inv), pack_bf16(acc[2] * inv, acc[3] * inv),
                 pack_bf16(acc[4] * inv, acc[5] * inv), pack_bf16(acc[6] * inv, acc[7] * inv));
}

// ---------------------------------------------------------------------------------------------------
// Split-K combine: out = sum_s w_s O_s / sum_s w_s with w_s = l_s 2^(m_s - max), over the `used` splits that hold
// keys of the row (tva_combine, mla_prefill_combine). Partials: ws_o [n_splits, rows_total, DV] bf16 (each normalised
// by its own row sum), ws_ml [n_splits, rows_total] = (running max in log2 units, row sum).
// One warp per (output row, VW value columns): VW / 8 lanes load one split's 16 bytes of those columns, so one
// warp-wide load covers 256 / VW splits, and every lane keeps NL loads in flight. The host picks VW (32 to 256) so
// that a few rows still spread over many warps: an SM pulls only tens of GB/s, so no SM may read many partials.
template <int VW>
__device__ __forceinline__ void combine_cols(const bf16* __restrict__ ws_o, const float2* __restrict__ ws_ml,
                                             bf16* __restrict__ out, float* __restrict__ m_sm,
                                             float* __restrict__ l_sm, long long rows_total, long long row, int col,
                                             int DV, int used) {
  constexpr int LPS = VW / 8, GROUPS = 32 / LPS, NL = 8;  // lanes per split, splits per load, loads in flight
  const int lane = threadIdx.x & 31, sub = lane % LPS, g = lane / LPS;
  float mx = -INFINITY;
  for (int s = lane; s < used; s += 32) {
    const float2 ml = __ldcg(ws_ml + s * rows_total + row);
    m_sm[s] = ml.x;
    l_sm[s] = ml.y;
    mx = fmaxf(mx, ml.x);
  }
#pragma unroll
  for (int x = 16; x > 0; x >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, x));
  if (mx == -INFINITY) mx = 0.f;
  __syncwarp();
  const bf16* src = ws_o + row * DV + col + sub * 8;
  float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f}, wsum = 0.f;
  for (int s0 = g; s0 < used; s0 += NL * GROUPS) {
    uint4 v[NL];
    float w[NL];
#pragma unroll
    for (int k = 0; k < NL; ++k) {
      const int s = s0 + k * GROUPS;
      const bool live = s < used;
      v[k] = live ? __ldcg(reinterpret_cast<const uint4*>(src + s * rows_total * DV)) : make_uint4(0, 0, 0, 0);
      w[k] = live ? l_sm[s] * exp2f(m_sm[s] - mx) : 0.f;
    }
#pragma unroll
    for (int k = 0; k < NL; ++k) {
      fma_bf16x8(acc, w[k], v[k]);
      wsum += w[k];
    }
  }
#pragma unroll
  for (int x = LPS; x < 32; x <<= 1) {  // add the lanes that hold the same columns for other splits
#pragma unroll
    for (int c = 0; c < 8; ++c) acc[c] += __shfl_xor_sync(0xffffffffu, acc[c], x);
    wsum += __shfl_xor_sync(0xffffffffu, wsum, x);
  }
  if (g == 0) store_bf16x8(out + row * DV + col + sub * 8, acc, 1.f / wsum);
}

// combine_cols at the VW the host picked; m_sm and l_sm: n_splits floats each, this warp's own.
__device__ __forceinline__ void combine_row(const bf16* __restrict__ ws_o, const float2* __restrict__ ws_ml,
                                            bf16* __restrict__ out, float* __restrict__ m_sm, float* __restrict__ l_sm,
                                            long long rows_total, long long row, int col, int DV, int used, int vw) {
  switch (vw) {
    case 32: combine_cols<32>(ws_o, ws_ml, out, m_sm, l_sm, rows_total, row, col, DV, used); break;
    case 64: combine_cols<64>(ws_o, ws_ml, out, m_sm, l_sm, rows_total, row, col, DV, used); break;
    case 128: combine_cols<128>(ws_o, ws_ml, out, m_sm, l_sm, rows_total, row, col, DV, used); break;
    default: combine_cols<256>(ws_o, ws_ml, out, m_sm, l_sm, rows_total, row, col, DV, used); break;
  }
}
