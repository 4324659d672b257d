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
//            m16n8k16 elsewhere or with ATTN_MMA_SYNC defined; both share every layout. With several
//            splits (flash-decoding) each CTA writes its partial to the workspace and tva_combine merges
//            them (out = sum_s w_s O_s / sum_s w_s), spread over the GPU; or, compiled with TVA_CLUSTER
//            (sm_90a), the splits merge inside the kernel: see cluster_merge below.
// tva_simt_*  any head dims, fp32 or bf16: one CTA per row on the CUDA cores (correctness fallback).
#include <cuda_bf16.h>

#include "griddep.cuh"
#include "attention_tile.cuh"
#ifndef TVA_CLUSTER
#define TVA_CLUSTER 1
#endif
#if TVA_CLUSTER > 1
#include "cluster.cuh"
#endif
// TVA_UNMERGED (with TVA_CLUSTER): each cluster leaves its merged partial in the workspace (cluster c at split c, as
// when several clusters merge), a tile's idle clusters mark theirs empty (max -inf, sum 0), and no cluster merges them:
// the kernel after this one does, as it loads them (skinny_linear.cu's X_PARTIALS).
#ifdef TVA_UNMERGED
static_assert(TVA_CLUSTER > 1, "TVA_UNMERGED leaves the partials of clusters");
constexpr bool kUnmerged = true;
#else
constexpr bool kUnmerged = false;
#endif

// Does query row `mrow` (its tree_mask words) see cache position prefix + jj? (jj < 0: the prefix.)
__device__ __forceinline__ bool visible(const int* mrow, int jj, int tree_n) {
  return jj < 0 || (jj < tree_n && ((__ldg(mrow + (jj >> 5)) >> (jj & 31)) & 1));
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

#if TVA_CLUSTER > 1
// A running merge of split partials for 8 value columns of one row: out = sum_s w_s O_s / sum_s w_s, each O_s
// normalised by its own sum, (m_s, l_s) = (max in log2 units, sum), w_s = l_s 2^(m_s - max_s m_s); partials are
// added N at a time, all of a round's loads in flight.
struct SplitMerge {
  float mx = -INFINITY, wsum = 0.f, acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};

  // Adds partials 0 .. n - 1 (n <= N); load(s, ml, v) gives partial s's (max, sum) and its 8 bf16 columns.
  template <int N, class Load>
  __device__ __forceinline__ void add(int n, Load load) {
    float2 ml[N];
    uint4 v[N];
#pragma unroll
    for (int s = 0; s < N; ++s)
      if (s < n) load(s, ml[s], v[s]);
    float nm = mx;
#pragma unroll
    for (int s = 0; s < N; ++s)
      if (s < n) nm = fmaxf(nm, ml[s].x);
    const float mu = nm == -INFINITY ? 0.f : nm;  // no visible key yet: keep exp2 finite
    const float f = exp2f(mx - mu);                // the merged part's factor (0 while it is empty)
    wsum *= f;
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[i] *= f;
#pragma unroll
    for (int s = 0; s < N; ++s) {
      if (s >= n) continue;
      const float w = ml[s].y * exp2f(ml[s].x - mu);
      fma_bf16x8(acc, w, v[s]);
      wsum += w;
    }
    mx = nm;
  }

  // The merged columns, normalised, as 16 bytes at dst; returns their (max, sum).
  __device__ __forceinline__ float2 store(bf16* dst) const {
    store_bf16x8(dst, acc, wsum > 0.f ? 1.f / wsum : 0.f);
    return make_float2(mx, wsum);
  }
};

// The key splits of a tile merge inside the kernel, with no tva_combine launch: the grid's splits are TVA_CLUSTER-
// block clusters. Each split's rows (staged at smem, normalised, row_bytes apart) and (max, sum) pairs (ml_sm) stay
// in its shared memory; block `rank` of a cluster merges the cluster's splits for its 1 / TVA_CLUSTER of the value
// columns, reading them through distributed shared memory. With one cluster holding keys that is the output; with
// more, each cluster writes its merged partial to the workspace (cluster c at split c) and takes a ticket (`ticket`,
// zero before the launch and left zero), and the cluster that takes the last one merges the clusters' partials, each
// block its columns. An idle split (no keys: empty loop) counts with sum 0.
template <int DV, int THREADS, class OutRow>
__device__ __forceinline__ void cluster_merge(const unsigned char* smem, int row_bytes, const float2* ml_sm, int* flag,
                                              bf16* __restrict__ out, bf16* __restrict__ ws_o,
                                              float2* __restrict__ ws_ml, int* ticket, int rows, long long rows_total,
                                              int cl, int clusters, OutRow out_row) {
  constexpr int CH = DV / 8 / TVA_CLUSTER;  // 16-byte column chunks a block merges
  static_assert(DV % (8 * TVA_CLUSTER) == 0, "each block of a cluster merges whole 16-byte chunks");
  const unsigned rank = cluster_rank();
  cluster_sync();  // every split's rows and (max, sum) pairs are staged
  const bool keep = kUnmerged || clusters > 1;  // the cluster's partial goes to the workspace
  bf16* const dst = keep ? ws_o + cl * rows_total * DV : out;
  for (int it = threadIdx.x; it < rows * CH; it += THREADS) {
    const int r = it / CH, c = rank * CH + it % CH;
    const uint4* part = reinterpret_cast<const uint4*>(smem + o_swz(r, c, row_bytes));
    SplitMerge merge;
    merge.add<TVA_CLUSTER>(TVA_CLUSTER, [&](int s, float2& ml, uint4& v) {
      ml = ld_cluster(ml_sm + r, s);
      v = ld_cluster(part, s);
    });
    const float2 ml = merge.store(dst + out_row(r) * DV + c * 8);
    if (keep && c == 0) ws_ml[cl * rows_total + out_row(r)] = ml;
  }
  if (clusters == 1 || kUnmerged) {
    cluster_sync();  // no block leaves (its shared memory) before the others have read it
    return;
  }
  __threadfence();  // this cluster's partial is visible to every block before its ticket
  cluster_sync();   // ... and the cluster's peers are done reading this block's shared memory
  if (rank == 0 && threadIdx.x == 0) {
    const int last = atomicAdd(ticket, 1) == clusters - 1;
    if (last) *ticket = 0;  // every cluster has taken its ticket: ready for the next launch
#pragma unroll
    for (int b = 0; b < TVA_CLUSTER; ++b) st_cluster(flag, b, last);
  }
  cluster_sync();  // the flags are written
  if (!*flag) return;
  __threadfence();
  for (int it = threadIdx.x; it < rows * CH; it += THREADS) {
    const int r = it / CH, c = rank * CH + it % CH;
    const long long row = out_row(r);
    SplitMerge merge;
    for (int s0 = 0; s0 < clusters; s0 += TVA_CLUSTER)
      merge.add<TVA_CLUSTER>(min(TVA_CLUSTER, clusters - s0), [&](int s, float2& ml, uint4& v) {
        ml = __ldcg(ws_ml + (s0 + s) * rows_total + row);
        v = __ldcg(reinterpret_cast<const uint4*>(ws_o + ((s0 + s) * rows_total + row) * DV + c * 8));
      });
    merge.store(out + row * DV + c * 8);
  }
}
#endif

template <int DK, int DV, bool V_IN_K, int NWG>
__device__ __forceinline__ void tva_mma_body(
    const bf16* __restrict__ q, const bf16* __restrict__ kv, const int* __restrict__ block_table,
    const int* __restrict__ prefix_lens, const int* __restrict__ cu_q, const int* __restrict__ tree_mask,
    bf16* __restrict__ out, bf16* __restrict__ ws_o, float2* __restrict__ ws_ml, int* __restrict__ tickets, int B,
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
  const long long rows_total = (long long)T * Hq;
  auto out_row = [&](int r) {  // output row of tile row r (< rows)
    const int gr = tile * BM + r;
    return (long long)(q0 + gr / G) * Hq + kvh * G + gr % G;
  };
#if TVA_CLUSTER > 1  // a cluster with a used split stays whole (its idle splits hold no keys); one split runs alone
  if (used == 1 ? split > 0 : split / TVA_CLUSTER * TVA_CLUSTER >= used) {
    const int cl = split / TVA_CLUSTER;  // unmerged: an idle cluster's first block marks its partial empty
    if (kUnmerged && split % TVA_CLUSTER == 0)  // (with one used split, split 0 is cluster 0's first block: it works)
      for (int r = tid; r < rows; r += NWG * 128) ws_ml[cl * rows_total + out_row(r)] = make_float2(-INFINITY, 0.f);
    return;
  }
#else
  if (split >= used) return;
#endif
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
    cp_async_wait<0>();
#ifdef ATTN_WGMMA
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
      softmax_tile(s, m, l, alpha, p, scale_log2);
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
  quad_sum(l);
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
  stage_rows<C::DVW>(smem, o, l, r0, t4, c0, C::O_ROW_BYTES);  // a split may hold no key a row sees
#if TVA_CLUSTER > 1
  if (used > 1) {
    float2* ml_sm = reinterpret_cast<float2*>(smem + C::X_OFF + 128 * 16 * 4);  // [BM] over the factors
    if (wg == 0 && t4 == 0) {
#pragma unroll
      for (int e = 0; e < 2; ++e) ml_sm[r0 + 8 * e] = make_float2(m[e], l[e]);
    }
    cluster_merge<DV, NWG * 128>(smem, C::O_ROW_BYTES, ml_sm, reinterpret_cast<int*>(smem + C::X_OFF), out, ws_o,
                                 ws_ml, tickets + (long long)blockIdx.x * gridDim.z + kvh, rows, rows_total,
                                 split / TVA_CLUSTER, (used + TVA_CLUSTER - 1) / TVA_CLUSTER, out_row);
    return;
  }
#endif
  bf16* const dst = used == 1 && !kUnmerged ? out : ws_o + split * rows_total * DV;
  if ((used > 1 || kUnmerged) && wg == 0 && t4 == 0) {
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
      const int *tree_mask, bf16 *out, bf16 *ws_o, float2 *ws_ml, int *tickets, int B, int T, int Hq, int Hkv, \
      int page_shift, int max_pages, int Qmax, int W, int row_stride, int v_off, float scale_log2, int n_splits, \
      int early_prefix
#define TVA_MMA_PASS                                                                                        \
  q, kv, block_table, prefix_lens, cu_q, tree_mask, out, ws_o, ws_ml, tickets, B, T, Hq, Hkv, page_shift,      \
      max_pages, Qmax, W, row_stride, v_off, scale_log2, n_splits, early_prefix

// MLA latent (576-dim keys, values = their first 512 columns, one KV head).
#if TVA_CLUSTER > 1
#define TVA_CLUSTER_DIMS __cluster_dims__(1, TVA_CLUSTER, 1)
#else
#define TVA_CLUSTER_DIMS
#endif
extern "C" __global__ void TVA_CLUSTER_DIMS __launch_bounds__(256, 1) tva_mma_mla576(TVA_MMA_ARGS) {
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
// Split-K combine (combine_cols, attention_tile.cuh) of the splits that hold keys of the row's sequence; a sequence
// whose keys took one split has its output. Dynamic shared memory: 4 warps x 2 x n_splits floats.
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
  combine_row(ws_o, ws_ml, out, m_sm, m_sm + n_splits, rows_total, row, col, DV, used, vw);
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
