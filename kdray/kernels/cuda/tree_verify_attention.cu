// Tree-verify attention kernels; the contract and the torch reference are in
// kdray/kernels/tree_verify_attention.py.
//
// tva_mma_*  bf16 tensor-core kernels. One CTA owns 64 rows ((query, head) pairs of one sequence and
//            one KV head) and one split of that sequence's key range. Q stays in shared memory; the key
//            (and value) tiles of 64 cache rows stream through a 2-stage cp.async ring. Every tile is
//            stored as [64-column chunk][row][128 bytes] with the 128B swizzle (16-byte chunk c of row r
//            at c ^ (r % 8)), which is both conflict-free for ldmatrix and the canonical layout of the
//            wgmma descriptors. Warpgroup 0 computes S = Q K^T (64 x 64) and the online softmax; each of
//            the NWG warpgroups accumulates O for DV / NWG value columns, P and the rescale factors
//            reaching the other warpgroup through shared memory. Products: wgmma on sm_90a, mma.sync
//            m16n8k16 elsewhere or with TVA_MMA_SYNC defined; both share every layout. With several
//            splits (flash-decoding) each CTA writes its partial to the workspace and tva_combine merges
//            them (out = sum_s w_s O_s / sum_s w_s), spread over the GPU.
// tva_simt_*  any head dims, fp32 or bf16: one CTA per row on the CUDA cores (correctness fallback).
#include <cuda_bf16.h>

#include "griddep.cuh"
#include "wgmma.cuh"

#if defined(__CUDA_ARCH_FEAT_SM90_ALL) && !defined(TVA_MMA_SYNC)
#define TVA_WGMMA 1
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
// Batch bookkeeping shared by all kernels.

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

// CTA index -> (sequence b, 64-row tile within it); sequence b has ceil(q_len * G / 64) tiles.
// Each warp scans cu_q 32 sequences at a time, so every thread gets the same answer.
__device__ __forceinline__ bool find_tile(const int* cu_q, int B, int G, int index, int& b, int& tile) {
  const int lane = threadIdx.x & 31;
  int base = 0;
  for (int b0 = 0; b0 < B; b0 += 32) {
    const int n = b0 + lane < B ? ((cu_q[b0 + lane + 1] - cu_q[b0 + lane]) * G + BM - 1) / BM : 0;
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

// Does query row `mrow` (its tree_mask words) see cache position prefix + jj? (jj < 0: the prefix.)
__device__ __forceinline__ bool visible(const int* mrow, int jj, int tree_n) {
  return jj < 0 || (jj < tree_n && ((__ldg(mrow + (jj >> 5)) >> (jj & 31)) & 1));
}

// ---------------------------------------------------------------------------------------------------
// Shared-memory and tensor-core primitives.

// Byte offset of 16-byte chunk c of row r in a 64-row tile stored as [c / 8][row][128 B], 128B swizzle.
__device__ __forceinline__ u32 swz(int r, int c) { return ((c >> 3) << 13) + (r << 7) + (((c ^ r) & 7) << 4); }

// 16-byte global -> shared copy; zero-fills the destination when !valid.
__device__ __forceinline__ void cp_async16(u32 dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_group 0;\n" ::: "memory"); }

__device__ __forceinline__ u32 pack_bf16(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<u32*>(&v);
}

#ifndef TVA_WGMMA
__device__ __forceinline__ void ldsm_x4(u32 (&r)[4], u32 addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
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
#ifdef TVA_WGMMA
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

// o[NW / 2] += P V[:, c0 : c0 + NW] for this warp's 16 rows; p[ks] holds keys 16ks..16ks+15 as A fragments.
template <int NW>
__device__ __forceinline__ void pv_tile(float (&o)[NW / 2], const u32 (&p)[4][4], u32 sV, int c0, int lane) {
#ifdef TVA_WGMMA
  (void)lane;
  const u64 dv = wg_desc(sV + (c0 / 64) * 8192, 8192, 1024);
  wg_pin(o);
  wg_fence();
#pragma unroll
  for (int ks = 0; ks < 4; ++ks)  // 16 keys = two 8-row groups (SBO); 64 value columns per chunk (LBO)
    wgmma_rs<1>(o, p[ks], wg_desc_add(dv, ks * 2048));
  wg_commit();
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

// ---------------------------------------------------------------------------------------------------
// The tensor-core kernel body. Shared memory (bytes; the host computes the same sum):
//   Q [BM x DK] | 2 stages of (K [BN x DK], V [BN x DV] unless V_IN_K) | NWG > 1: P 8 KiB, factors 1 KiB.
template <int DK, int DV, bool V_IN_K, int NWG>
struct MmaCfg {
  static constexpr int DVW = DV / NWG, TPR = 128 / BN;  // TPR: loader threads per row
  static constexpr int Q_BYTES = BM * DK * 2, K_BYTES = BN * DK * 2;
  static constexpr int STAGE_BYTES = K_BYTES + (V_IN_K ? 0 : BN * DV * 2);
  static constexpr int X_OFF = Q_BYTES + 2 * STAGE_BYTES;
  static constexpr int O_ROW_BYTES = DV * 2;  // the output tile, staged over Q and the stages after the loop
  static_assert(DK % 64 == 0 && DVW % 64 == 0 && (!V_IN_K || DV <= DK), "unsupported head dims");
  static_assert(BM * O_ROW_BYTES <= X_OFF, "the staged output tile must fit below the P exchange");
};

// Key tiles per split of a sequence of nb key tiles when the grid has n_splits: every split CTA busy. tva_combine
// recomputes it.
__device__ __forceinline__ int tiles_per_split(int nb, int n_splits) { return max(1, (nb + n_splits - 1) / n_splits); }

// Byte offset of 16-byte chunk c of row r in a staged [64][row_bytes] output tile: the chunk index XORed with r % 8,
// so that the 8 rows a warp's accumulator store touches fall in different banks.
__device__ __forceinline__ u32 o_swz(int r, int c, int row_bytes) { return r * row_bytes + ((c ^ (r & 7)) << 4); }

template <int DK, int DV, bool V_IN_K, int NWG>
__device__ __forceinline__ void tva_mma_body(
    const bf16* __restrict__ q, const bf16* __restrict__ kv, const int* __restrict__ block_table,
    const int* __restrict__ prefix_lens, const int* __restrict__ cu_q, const int* __restrict__ tree_mask,
    bf16* __restrict__ out, bf16* __restrict__ ws_o, float2* __restrict__ ws_ml, int B,
    int T, int Hq, int Hkv, int page_shift, int max_pages, int Qmax, int W, int row_stride, int v_off,
    float scale_log2, int n_splits, int early_prefix) {
  using C = MmaCfg<DK, DV, V_IN_K, NWG>;
  extern __shared__ __align__(1024) unsigned char smem[];
  const int tid = threadIdx.x, lane = tid & 31, wg = tid >> 7, wq = (tid >> 5) & 3;
  const int G = Hq / Hkv, kvh = blockIdx.z, split = blockIdx.y;
  // early_prefix: the batch's metadata and its prefix rows were final before the kernel ahead began, so this CTA
  // finds its work and starts copying its first tile's prefix rows while that kernel still runs.
  if (!early_prefix) griddep_wait();
  int b, tile;
  if (!find_tile(cu_q, B, G, blockIdx.x, b, tile)) return;
  const int q0 = cu_q[b], q_len = cu_q[b + 1] - q0, prefix = prefix_lens[b], n_keys = prefix + q_len;
  // This tile's key tiles are cut into `used` runs of `per`; grid splits past them have nothing to do.
  const int rows = min(BM, q_len * G - tile * BM), nb = (n_keys + BN - 1) / BN;
  const int per = tiles_per_split(nb, n_splits), used = (nb + per - 1) / per;
  if (split >= used) return;
  int kb = split * per;
  const int kb_end = min(kb + per, nb);

  const u32 sQ = smem_u32(smem), sKV = sQ + C::Q_BYTES;
  const int* bt = block_table + (long long)b * max_pages;
  const int page_mask = (1 << page_shift) - 1;
  auto page_of = [&](int p) { return p < n_keys ? __ldg(bt + (p >> page_shift)) : 0; };
  // Cache position p (zeros past the last key) into row r of a stage; threads s, s + tpr, ... of the row copy it.
  auto load_kv = [&](int p, int r, int s, int tpr, int stage, int page) {
    const bool ok = p < n_keys;
    const bf16* row = kv + (((long long)page << page_shift) + (p & page_mask)) * row_stride;
    const u32 dst = sKV + stage * C::STAGE_BYTES;
    for (int c = s; c < DK / 8; c += tpr) cp_async16(dst + swz(r, c), row + kvh * DK + c * 8, ok);
    if (!V_IN_K)
      for (int c = s; c < DV / 8; c += tpr)
        cp_async16(dst + C::K_BYTES + swz(r, c), row + v_off + kvh * DV + c * 8, ok);
  };
  // Every thread copies the first key tile and Q (fr: its row, fs of TPR0 threads); only the tile's rows are read
  // of Q: the rows past them stay unset, and their results, each row's own, are never stored.
  constexpr int TPR0 = NWG * 128 / BN;
  const int fr = tid / TPR0, fs = tid % TPR0, fp = kb * BN + fr;
  const bool fp_early = early_prefix && fp < prefix;
  if (fp_early) load_kv(fp, fr, fs, TPR0, 0, page_of(fp));
  if (early_prefix) griddep_wait();  // (without early_prefix the CTA waited before finding its work)
  if (fr < rows) {
    const int gr = tile * BM + fr;
    const bf16* src = q + ((long long)(q0 + gr / G) * Hq + kvh * G + gr % G) * DK;
    for (int c = fs; c < DK / 8; c += TPR0) cp_async16(sQ + swz(fr, c), src + c * 8, true);
  }
  if (!fp_early) load_kv(fp, fr, fs, TPR0, 0, page_of(fp));
  // The last warpgroup copies the later tiles (with NWG > 1 it would otherwise idle while warpgroup 0 computes S),
  // TPR consecutive threads a row, looking up the next tile's page one tile ahead.
  const bool loader = wg == NWG - 1;
  const int lr = (tid & 127) / C::TPR, sub = tid % C::TPR;
  int page_next = loader ? page_of((kb + 1) * BN + lr) : 0;
  cp_async_commit();

  // This thread's two rows: the query each one belongs to (clamped for padding rows) and its mask row.
  const int g = lane >> 2, t4 = lane & 3, r0 = 16 * wq + g;
  const int tree_n = min(q_len, Qmax);
  const int* mrow[2];
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    const int i = min((tile * BM + r0 + 8 * e) / G, tree_n - 1);
    mrow[e] = tree_mask + ((long long)b * Qmax + i) * W;
  }
  const int c0 = wg * C::DVW;  // this warpgroup's first value column
  u32* p_x = reinterpret_cast<u32*>(smem + C::X_OFF);                // [16][128] P fragments
  float* f_x = reinterpret_cast<float*>(smem + C::X_OFF + 128 * 16 * 4);  // [2][128] row factors

  float o[C::DVW / 2];
#pragma unroll
  for (int i = 0; i < C::DVW / 2; ++i) o[i] = 0.f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};

  for (int n = 0; kb < kb_end; ++n, ++kb) {
    const int st = n & 1;
    cp_async_wait_all();
#ifdef TVA_WGMMA
    fence_proxy_async();  // cp.async wrote through the generic proxy; wgmma reads through the async one
#endif
    __syncthreads();  // tile kb visible; everyone is done with tile kb - 1, whose stage is refilled next
    if (loader && kb + 1 < kb_end) {
      load_kv((kb + 1) * BN + lr, lr, sub, C::TPR, st ^ 1, page_next);
      page_next = page_of((kb + 2) * BN + lr);
    }
    cp_async_commit();
    const u32 sK = sKV + st * C::STAGE_BYTES, sV = V_IN_K ? sK : sK + C::K_BYTES;

    u32 p[4][4];
    float alpha[2];
    if (wg == 0) {
      float s[32];
      qk_tile<DK>(s, sQ, sK, wq, lane);
      if ((kb + 1) * BN > prefix) {  // the tile reaches the tree (or past the last key): apply the mask
#pragma unroll
        for (int j = 0; j < 8; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e)
            if (!visible(mrow[e >> 1], kb * BN + 8 * j + 2 * t4 + (e & 1) - prefix, tree_n)) s[4 * j + e] = -INFINITY;
      }
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
      if (NWG > 1) {
#pragma unroll
        for (int i = 0; i < 16; ++i) p_x[i * 128 + tid] = p[i >> 2][i & 3];
        f_x[tid] = alpha[0];
        f_x[128 + tid] = alpha[1];
      }
    }
    if (NWG > 1) {
      __syncthreads();  // P of tile kb ready for the other warpgroups
      if (wg != 0) {
        const int x = tid & 127;
#pragma unroll
        for (int i = 0; i < 16; ++i) p[i >> 2][i & 3] = p_x[i * 128 + x];
        alpha[0] = f_x[x];
        alpha[1] = f_x[128 + x];
      }
    }
    if (__any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f)) {  // most tiles leave the maxima alone
#pragma unroll
      for (int i = 0; i < C::DVW / 2; ++i) o[i] *= alpha[(i >> 1) & 1];
    }
    pv_tile<C::DVW>(o, p, sV, c0, lane);
  }

  // Row sums: quad-reduce in warpgroup 0, then hand them to the others.
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    l[e] += __shfl_xor_sync(0xffffffffu, l[e], 1);
    l[e] += __shfl_xor_sync(0xffffffffu, l[e], 2);
  }
  if (NWG > 1) {
    __syncthreads();  // the other warpgroups have read the last factors
    if (wg == 0) {
      f_x[tid] = l[0];
      f_x[128 + tid] = l[1];
    }
    __syncthreads();
    if (wg != 0) {
      l[0] = f_x[tid & 127];
      l[1] = f_x[128 + (tid & 127)];
    }
  }

  // The tile's rows, each normalised by its own sum, go through shared memory (over Q and the stages: every
  // warp is past its last product) so that each row leaves as 16-byte stores of consecutive columns: to the output
  // when one split holds all the keys, else to this split's partial, with its (max, sum), for tva_combine.
  __syncthreads();
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    const int r = r0 + 8 * e;
    const float inv = l[e] > 0.f ? 1.f / l[e] : 0.f;  // a split may hold no key this row sees
#pragma unroll
    for (int j = 0; j < C::DVW / 8; ++j)
      *reinterpret_cast<u32*>(smem + o_swz(r, c0 / 8 + j, C::O_ROW_BYTES) + 4 * t4) =
          pack_bf16(o[4 * j + 2 * e] * inv, o[4 * j + 2 * e + 1] * inv);
  }
  const long long rows_total = (long long)T * Hq;
  auto out_row = [&](int r) {  // output row of tile row r (< rows)
    const int gr = tile * BM + r;
    return (long long)(q0 + gr / G) * Hq + kvh * G + gr % G;
  };
  bf16* const dst = used == 1 ? out : ws_o + split * rows_total * DV;
  if (used > 1 && wg == 0 && t4 == 0) {
#pragma unroll
    for (int e = 0; e < 2; ++e)
      if (r0 + 8 * e < rows) ws_ml[split * rows_total + out_row(r0 + 8 * e)] = make_float2(m[e], l[e]);
  }
  __syncthreads();
  constexpr int CH = DV / 8;  // 16-byte chunks per row
  for (int it = tid; it < rows * CH; it += NWG * 128) {
    const int r = it / CH, c = it % CH;
    *reinterpret_cast<uint4*>(dst + out_row(r) * DV + c * 8) =
        *reinterpret_cast<const uint4*>(smem + o_swz(r, c, C::O_ROW_BYTES));
  }
}

#define TVA_MMA_ARGS                                                                                        \
  const bf16 *q, const bf16 *kv, const int *block_table, const int *prefix_lens, const int *cu_q,            \
      const int *tree_mask, bf16 *out, bf16 *ws_o, float2 *ws_ml, int B, int T, int Hq, int Hkv,             \
      int page_shift, int max_pages, int Qmax, int W, int row_stride, int v_off, float scale_log2, int n_splits, \
      int early_prefix
#define TVA_MMA_PASS                                                                                        \
  q, kv, block_table, prefix_lens, cu_q, tree_mask, out, ws_o, ws_ml, B, T, Hq, Hkv, page_shift, max_pages,   \
      Qmax, W, row_stride, v_off, scale_log2, n_splits, early_prefix

// MLA latent (576-dim keys, values = their first 512 columns, one KV head).
extern "C" __global__ void __launch_bounds__(256, 1) tva_mma_mla576(TVA_MMA_ARGS) {
  griddep_launch_dependents();  // tva_mma_body waits
  tva_mma_body<576, 512, true, 2>(TVA_MMA_PASS);
}
// GQA, head dim 64 / 128 (keys and values are separate cache columns).
extern "C" __global__ void __launch_bounds__(128) tva_mma_gqa64(TVA_MMA_ARGS) {
  griddep_launch_dependents();  // tva_mma_body waits
  tva_mma_body<64, 64, false, 1>(TVA_MMA_PASS);
}
extern "C" __global__ void __launch_bounds__(128) tva_mma_gqa128(TVA_MMA_ARGS) {
  griddep_launch_dependents();  // tva_mma_body waits
  tva_mma_body<128, 128, false, 1>(TVA_MMA_PASS);
}

// ---------------------------------------------------------------------------------------------------
// Split-K combine: out = sum_s w_s O_s / sum_s w_s with w_s = l_s 2^(m_s - max), over the splits that hold keys of
// the row's sequence. Partials: ws_o [n_splits, T*Hq, DV] bf16 (each normalised by its own row sum), ws_ml
// [n_splits, T*Hq] = (running max in log2 units, row sum); a sequence whose keys took one split has its output.
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
      const u32 h[4] = {v[k].x, v[k].y, v[k].z, v[k].w};
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const float2 x = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&h[c]));
        acc[2 * c] = fmaf(w[k], x.x, acc[2 * c]);
        acc[2 * c + 1] = fmaf(w[k], x.y, acc[2 * c + 1]);
      }
      wsum += w[k];
    }
  }
#pragma unroll
  for (int x = LPS; x < 32; x <<= 1) {  // add the lanes that hold the same columns for other splits
#pragma unroll
    for (int c = 0; c < 8; ++c) acc[c] += __shfl_xor_sync(0xffffffffu, acc[c], x);
    wsum += __shfl_xor_sync(0xffffffffu, wsum, x);
  }
  if (g == 0) {
    const float inv = 1.f / wsum;
    *reinterpret_cast<uint4*>(out + row * DV + col + sub * 8) =
        make_uint4(pack_bf16(acc[0] * inv, acc[1] * inv), pack_bf16(acc[2] * inv, acc[3] * inv),
                   pack_bf16(acc[4] * inv, acc[5] * inv), pack_bf16(acc[6] * inv, acc[7] * inv));
  }
}

// Dynamic shared memory: 4 warps x 2 x n_splits floats.
extern "C" __global__ void __launch_bounds__(128) tva_combine(const bf16* __restrict__ ws_o,
                                                              const float2* __restrict__ ws_ml, bf16* __restrict__ out,
                                                              const int* __restrict__ cu_q,
                                                              const int* __restrict__ prefix_lens, int B, int T,
                                                              int Hq, int DV, int n_splits, int vw) {
  griddep_begin();
  extern __shared__ float ml_sm[];
  const int warp = threadIdx.x >> 5, chunks = DV / vw;
  const long long rows_total = (long long)T * Hq, item = (long long)blockIdx.x * 4 + warp;
  const long long row = item / chunks;
  if (row >= rows_total) return;
  const int b = seq_of(cu_q, B, (int)(row / Hq));
  if (b < 0) return;
  const int nb = (prefix_lens[b] + cu_q[b + 1] - cu_q[b] + BN - 1) / BN;
  const int per = tiles_per_split(nb, n_splits), used = (nb + per - 1) / per;
  if (used == 1) return;
  float* m_sm = ml_sm + warp * 2 * n_splits;
  const int col = (int)(item % chunks) * vw;
  switch (vw) {
    case 32: combine_cols<32>(ws_o, ws_ml, out, m_sm, m_sm + n_splits, rows_total, row, col, DV, used); break;
    case 64: combine_cols<64>(ws_o, ws_ml, out, m_sm, m_sm + n_splits, rows_total, row, col, DV, used); break;
    case 128: combine_cols<128>(ws_o, ws_ml, out, m_sm, m_sm + n_splits, rows_total, row, col, DV, used); break;
    default: combine_cols<256>(ws_o, ws_ml, out, m_sm, m_sm + n_splits, rows_total, row, col, DV, used); break;
  }
}

// ---------------------------------------------------------------------------------------------------
// CUDA-core fallback: one CTA (4 warps) per output row; warp w takes keys w, w + 4, ...; DV <= 512.
__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(bf16 x) { return __bfloat162float(x); }
__device__ __forceinline__ void from_f(float* p, float v) { *p = v; }
__device__ __forceinline__ void from_f(bf16* p, float v) { *p = __float2bfloat16(v); }

template <typename T_>
__device__ __forceinline__ void tva_simt_body(const T_* __restrict__ q, const T_* __restrict__ kv,
                                              const int* __restrict__ block_table,
                                              const int* __restrict__ prefix_lens, const int* __restrict__ cu_q,
                                              const int* __restrict__ tree_mask, T_* __restrict__ out, int B,
                                              int Hq, int Hkv, int DK, int DV, int page_shift, int max_pages,
                                              int Qmax, int W, int row_stride, int v_off, float scale_log2) {
  extern __shared__ float fsm[];  // q row [DK] | per warp: m, l, o[DV]
  const int row = blockIdx.x, t = row / Hq, h = row % Hq, kvh = h / (Hq / Hkv);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int b = seq_of(cu_q, B, t);
  if (b < 0) return;
  const int q_len = cu_q[b + 1] - cu_q[b], i = t - cu_q[b], prefix = prefix_lens[b];
  const int tree_n = min(q_len, Qmax);
  const int* mrow = tree_mask + ((long long)b * Qmax + min(i, Qmax - 1)) * W;
  const int* bt = block_table + (long long)b * max_pages;
  for (int d = threadIdx.x; d < DK; d += blockDim.x) fsm[d] = to_f(q[(long long)row * DK + d]);
  __syncthreads();

  float m = -INFINITY, l = 0.f, o[16];
#pragma unroll
  for (int c = 0; c < 16; ++c) o[c] = 0.f;
  for (int p = warp; p < prefix + q_len; p += 4) {
    if (!visible(mrow, p - prefix, tree_n)) continue;
    const long long cache_row = ((long long)__ldg(bt + (p >> page_shift)) << page_shift) + (p & ((1 << page_shift) - 1));
    const T_* base = kv + cache_row * row_stride;
    float dot = 0.f;
    for (int d = lane; d < DK; d += 32) dot += fsm[d] * to_f(base[kvh * DK + d]);
#pragma unroll
    for (int x = 16; x > 0; x >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, x);
    const float s = dot * scale_log2, m_new = fmaxf(m, s), alpha = exp2f(m - m_new), pe = exp2f(s - m_new);
    l = l * alpha + pe;
    m = m_new;
#pragma unroll
    for (int c = 0; c < 16; ++c)
      if (lane + 32 * c < DV) o[c] = o[c] * alpha + pe * to_f(base[v_off + kvh * DV + lane + 32 * c]);
  }
  float* wsm = fsm + DK + warp * (DV + 2);
  if (lane == 0) { wsm[0] = m; wsm[1] = l; }
#pragma unroll
  for (int c = 0; c < 16; ++c)
    if (lane + 32 * c < DV) wsm[2 + lane + 32 * c] = o[c];
  __syncthreads();
  float mx = -INFINITY;
  for (int w = 0; w < 4; ++w) mx = fmaxf(mx, fsm[DK + w * (DV + 2)]);
  if (mx == -INFINITY) mx = 0.f;
  for (int d = threadIdx.x; d < DV; d += blockDim.x) {
    float acc = 0.f, lsum = 0.f;
    for (int w = 0; w < 4; ++w) {
      const float* part = fsm + DK + w * (DV + 2);
      const float f = exp2f(part[0] - mx);
      acc += f * part[2 + d];
      lsum += f * part[1];
    }
    from_f(out + (long long)row * DV + d, acc / lsum);
  }
}

#define TVA_SIMT_ARGS(T_)                                                                                   \
  const T_ *q, const T_ *kv, const int *block_table, const int *prefix_lens, const int *cu_q,                \
      const int *tree_mask, T_ *out, int B, int Hq, int Hkv, int DK, int DV, int page_shift, int max_pages, \
      int Qmax, int W, int row_stride, int v_off, float scale_log2
#define TVA_SIMT_PASS                                                                                        \
  q, kv, block_table, prefix_lens, cu_q, tree_mask, out, B, Hq, Hkv, DK, DV, page_shift, max_pages, Qmax, W, \
      row_stride, v_off, scale_log2

extern "C" __global__ void __launch_bounds__(128) tva_simt_f32(TVA_SIMT_ARGS(float)) {
  griddep_begin();
  tva_simt_body<float>(TVA_SIMT_PASS);
}
extern "C" __global__ void __launch_bounds__(128) tva_simt_bf16(TVA_SIMT_ARGS(bf16)) {
  griddep_begin();
  tva_simt_body<bf16>(TVA_SIMT_PASS);
}
