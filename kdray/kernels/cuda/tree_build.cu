// tree_build: DDTree draft trees on the GPU, from raw draft logits, in two kernels (see tree_build.py
// for the exact semantics both follow bit for bit).
//
// tree_topk   grid (B*L,), block (TOPK_THREADS,), dynamic smem CAP*8 bytes.
//             One block per (sequence, depth) row streams the logits once: the reproducible
//             log-sum-exp (fp32 polynomial terms, fp64 sums) and the top-K tokens by (logit desc, id
//             asc). Tokens at or above a lower bound of the K-th best logit (from the threads' running
//             maxima, or a radix select over the buffer) go to a shared-memory candidate buffer, which
//             is shrunk whenever it could overflow; an exact radix select and a bitonic sort finish
//             the row. Writes logp/ids [B, L, kmax].
// tree_select grid (B,), block (SELECT_THREADS,),
//             dynamic smem 8*32*NSLOT + 4*L*kmax + 20*(max_nodes+1) bytes.
//             Warp 0 runs Algorithm 1 (best-first) with one heap slot per node (the node's next
//             child) in shared memory, NSLOT slots per lane and each lane's best in a register;
//             then the block writes the tree tensors.

#include "griddep.cuh"

typedef unsigned int u32;
typedef unsigned long long u64;

#ifndef DTYPE  // logits: 0 fp32, 1 bf16, 2 fp16
#define DTYPE 1
#endif
#ifndef ALIGNED  // every row starts on 16 bytes and holds whole 16-byte vectors
#define ALIGNED 1
#endif
#ifndef CAP  // candidate buffer entries: TILE + room for at least kmax survivors
#define CAP 12288
#endif
#ifndef NSLOT  // heap slots per lane: ceil((max_nodes + 1) / 32)
#define NSLOT 9
#endif

#define FULL 0xFFFFFFFFu
#define TOPK_THREADS 512
#define VEC_ELEMS (DTYPE == 0 ? 4 : 8)  // elements per 16-byte load
#define EPT (2 * VEC_ELEMS)             // elements per thread per tile (two loads)
#define TILE (TOPK_THREADS * EPT)
#define X_LOW (DTYPE == 0 ? 32 : (DTYPE == 1 ? 48 : 40))  // key bits [X_LOW, 32) are fixed by the sign
#define COMPACT_UNROLL 4
#define NEG_INF __int_as_float(0xff800000)
#define SELECT_THREADS 256
#define MAX_DEPTH 64

static_assert(CAP > TILE, "the candidate buffer must hold a tile plus the survivors");

// The reproducible normaliser's constants (tree_build.py: LOG2E, ROUND, EXP2_POLY, Y_MIN).
#define LOG2E_F 1.4426950216293335f
#define ROUND_F 12582912.0f
#define Y_MIN_F -1000.0f
#define C0 1.0f
#define C1 0.6931470036506653f
#define C2 0.24022242426872253f
#define C3 0.05550733581185341f
#define C4 0.009671512991189957f
#define C5 0.0013264722656458616f

// Unsigned total order of fp32 bit patterns (larger key = larger float; -0 below +0).
__device__ __forceinline__ u32 ordered(float x) {
  const u32 b = __float_as_uint(x);
  return b ^ ((b >> 31) ? 0xFFFFFFFFu : 0x80000000u);
}

__device__ __forceinline__ float from_ordered(u32 o) {
  return __uint_as_float((o & 0x80000000u) ? (o ^ 0x80000000u) : ~o);
}

// 2^(x log2 e) as in tree_build.log_normalizer: every fp32 step rounded once (no contraction).
__device__ __forceinline__ double exp2_term(float x) {
  const float y = fmaxf(__fmul_rn(x, LOG2E_F), Y_MIN_F);
  const float t = __fadd_rn(y, ROUND_F);
  const float f = __fadd_rn(y, -__fadd_rn(t, -ROUND_F));
  float p = C5;
  p = __fadd_rn(__fmul_rn(p, f), C4);
  p = __fadd_rn(__fmul_rn(p, f), C3);
  p = __fadd_rn(__fmul_rn(p, f), C2);
  p = __fadd_rn(__fmul_rn(p, f), C1);
  p = __fadd_rn(__fmul_rn(p, f), C0);
  // p * 2^n as an fp64 built from the bits (p in [0.7, 1.5); n = rint(y) from t's bits): exact, no conversion
  const u32 pb = __float_as_uint(p), n = __float_as_uint(t) - 0x4B400000u;
  return __hiloint2double((int)((pb >> 3) + ((n + 896u) << 20)), (int)(pb << 29));
}

// Element e (0 .. VEC_ELEMS-1, a compile-time constant after unrolling) of one 16-byte load.
__device__ __forceinline__ float element(const uint4& v, int e) {
#if DTYPE == 0
  return __uint_as_float(e == 0 ? v.x : e == 1 ? v.y : e == 2 ? v.z : v.w);
#else
  const int q = e >> 1;
  const u32 w = q == 0 ? v.x : q == 1 ? v.y : q == 2 ? v.z : v.w;
  const u32 half = (e & 1) ? (w >> 16) : (w & 0xFFFFu);
#if DTYPE == 1
  return __uint_as_float(half << 16);
#else
  float f;
  asm("{ .reg .b16 h; cvt.u16.u32 h, %1; cvt.f32.f16 %0, h; }" : "=f"(f) : "r"(half));
  return f;
#endif
#endif
}

// Loads this thread's two vectors of tile `t`: elements t*TILE + (h*TOPK_THREADS + tid)*VEC_ELEMS + e.
__device__ __forceinline__ void load_tile(const void* row, int V, int t, uint4 (&v)[2]) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int base = t * TILE + (h * TOPK_THREADS + (int)threadIdx.x) * VEC_ELEMS;
#if ALIGNED
    v[h] = base < V ? __ldcs(reinterpret_cast<const uint4*>(row) + base / VEC_ELEMS) : make_uint4(0, 0, 0, 0);
#else
    u32 w[4] = {0, 0, 0, 0};
#pragma unroll
    for (int e = 0; e < VEC_ELEMS; ++e) {
      if (base + e >= V) break;
#if DTYPE == 0
      w[e] = __ldg(reinterpret_cast<const u32*>(row) + base + e);
#else
      w[e >> 1] |= (u32)__ldg(reinterpret_cast<const unsigned short*>(row) + base + e) << ((e & 1) * 16);
#endif
    }
    v[h] = make_uint4(w[0], w[1], w[2], w[3]);
#endif
  }
}

struct TopkShared {
  u64 maxima[TOPK_THREADS];  // keys of the threads' running maxima
  u32 hist[256];
  u64 rep[256];  // some key of each histogram bin
  double red[TOPK_THREADS / 32];
  u32 red_min[TOPK_THREADS / 32];
  int sel[3];  // chosen bin, candidates above it, candidates in it
  int count;   // candidates in the buffer
  int fresh;   // compaction output counter
  u32 kth;     // ordered logit of the K-th largest thread maximum
  float lse;
};

// Radix select over buf[0, count): a (pos, thr) with {k : (k >> pos) >= thr} holding exactly K keys, or,
// when `exact` is false, at least K keys once the logit is resolved and at most `limit` of them.
// Digits of 8 bits: the logit part from bit 63 down to X_LOW, then the id part (low 8*id_digits bits).
__device__ int radix_select(const u64* buf, int count, int K, bool exact, int limit, int id_digits,
                            TopkShared& sh, int& pos, u64& thr) {
  const int tid = threadIdx.x, lane = tid & 31;
  const int nx = (64 - X_LOW) / 8, ndig = nx + id_digits;
  int need = K, above_all = 0, size = K;
  u64 pre = 0;
  pos = 64;
  for (int r = 0; r < ndig; ++r) {
    const int s = r < nx ? 56 - 8 * r : 8 * (ndig - 1 - r);
    for (int i = tid; i < 256; i += TOPK_THREADS) sh.hist[i] = 0;
    __syncthreads();
    for (int i0 = 0; i0 < count; i0 += TOPK_THREADS) {
      const int i = i0 + tid;
      const u64 k = i < count ? buf[i] : 0;
      const bool in = i < count && (pos >= 64 || (k >> pos) == (pre >> pos));
      const u32 d = in ? (u32)(k >> s) & 255u : 256u + lane;  // idle lanes get distinct dummies
      const u32 peers = __match_any_sync(FULL, d);
      if (in && lane == __ffs(peers) - 1) {
        atomicAdd(&sh.hist[d], __popc(peers));
        sh.rep[d] = k;
      }
    }
    __syncthreads();
    if (tid < 32) {  // the bin holding the need-th largest key, scanning from the top
      u32 h[8], local = 0;
#pragma unroll
      for (int e = 0; e < 8; ++e) local += h[e] = sh.hist[lane * 8 + e];
      u32 incl = local;  // keys in bins of lanes >= this one
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const u32 y = __shfl_down_sync(FULL, incl, o);
        if (lane + o < 32) incl += y;
      }
      u32 acc = incl - local;
      if (acc < (u32)need && (u32)need <= incl) {
#pragma unroll
        for (int e = 7; e >= 0; --e) {
          if (acc + h[e] >= (u32)need) {
            sh.sel[0] = lane * 8 + e;
            sh.sel[1] = acc;
            sh.sel[2] = h[e];
            break;
          }
          acc += h[e];
        }
      }
    }
    __syncthreads();
    const int bin = sh.sel[0], in_bin = sh.sel[2];
    need -= sh.sel[1];
    above_all += sh.sel[1];
    pre = sh.rep[bin];
    pos = s;
    __syncthreads();  // sel and rep are read before the next round rewrites them
    if (in_bin == need || (!exact && r == nx - 1 && above_all + in_bin <= limit)) {
      size = above_all + in_bin;
      break;
    }
  }
  thr = pre >> pos;
  return size;
}

// Keeps the keys with (k >> pos) >= thr at the front of buf (any order); returns how many.
__device__ int compact(u64* buf, int count, int pos, u64 thr, TopkShared& sh) {
  const int tid = threadIdx.x, lane = tid & 31;
  if (tid == 0) sh.fresh = 0;
  __syncthreads();
  for (int i0 = 0; i0 < count; i0 += TOPK_THREADS * COMPACT_UNROLL) {
    u64 v[COMPACT_UNROLL];
    bool keep[COMPACT_UNROLL];
#pragma unroll
    for (int r = 0; r < COMPACT_UNROLL; ++r) {
      const int i = i0 + r * TOPK_THREADS + tid;
      v[r] = i < count ? buf[i] : 0;
      keep[r] = i < count && (v[r] >> pos) >= thr;
    }
    __syncthreads();  // this chunk is read; writes land below its end, never in unread chunks
#pragma unroll
    for (int r = 0; r < COMPACT_UNROLL; ++r) {
      const u32 ballot = __ballot_sync(FULL, keep[r]);
      int base = 0;
      if (lane == 0 && ballot) base = atomicAdd(&sh.fresh, __popc(ballot));
      base = __shfl_sync(FULL, base, 0);
      if (keep[r]) buf[base + __popc(ballot & ((1u << lane) - 1))] = v[r];
    }
  }
  __syncthreads();
  return sh.fresh;
}

// Smallest admitted logit after a selection at (pos, thr): a lower bound of the K-th best logit, strict
// once the logit is resolved (later tiles hold larger ids, so their logit ties lose). Admitting by a
// float compare can only admit more (-0 and +0 compare equal), never less.
__device__ __forceinline__ float admit_floor(int pos, u64 thr) {
  const u32 x = (u32)((thr << pos) >> 32);
  return from_ordered(pos <= X_LOW ? x + 1 : x);
}

// One tile of one thread: adds the normaliser terms to acc and returns the tile's largest logit.
// CHECK: the tile runs past V (elements beyond it add nothing).
template <bool CHECK>
__device__ __forceinline__ float tile_terms(const uint4 (&v)[2], int t, int V, double& acc) {
  float xmax = NEG_INF;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int base = t * TILE + (h * TOPK_THREADS + (int)threadIdx.x) * VEC_ELEMS;
#pragma unroll
    for (int e = 0; e < VEC_ELEMS; ++e) {
      const float x = element(v[h], e);
      if (CHECK) {
        const bool valid = base + e < V;
        acc += valid ? exp2_term(x) : 0.0;
        xmax = valid ? fmaxf(xmax, x) : xmax;
      } else {
        acc += exp2_term(x);
        xmax = fmaxf(xmax, x);
      }
    }
  }
  return xmax;
}

// Bitmask of this thread's logits in tile t that are >= admit_min (and below V).
template <bool CHECK>
__device__ __forceinline__ u32 tile_admit(const uint4 (&v)[2], int t, int V, float admit_min) {
  u32 admit = 0;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int base = t * TILE + (h * TOPK_THREADS + (int)threadIdx.x) * VEC_ELEMS;
#pragma unroll
    for (int e = 0; e < VEC_ELEMS; ++e)
      if ((!CHECK || base + e < V) && element(v[h], e) >= admit_min) admit |= 1u << (h * VEC_ELEMS + e);
  }
  return admit;
}

// The K-th largest of the threads' running maxima (K <= TOPK_THREADS): they are logits at distinct
// positions, so this is a lower bound of the K-th best logit seen. Block-wide; a 512-key select.
__device__ float maxima_floor(float tmax, int K, TopkShared& sh) {
  const int tid = threadIdx.x, lane = tid & 31;
  sh.maxima[tid] = (u64)ordered(tmax) << 32 | (u32)~tid;
  __syncthreads();
  int pos;
  u64 thr;
  radix_select(sh.maxima, TOPK_THREADS, K, true, 0, 2, sh, pos, thr);
  const u64 k = sh.maxima[tid];
  const u32 o = __reduce_min_sync(FULL, (k >> pos) >= thr ? (u32)(k >> 32) : 0xFFFFFFFFu);  // min selected
  if (lane == 0) sh.red_min[tid >> 5] = o;
  __syncthreads();
  if (tid < 32) {
    const u32 m = __reduce_min_sync(FULL, lane < TOPK_THREADS / 32 ? sh.red_min[lane] : 0xFFFFFFFFu);
    if (lane == 0) sh.kth = m;
  }
  __syncthreads();
  return from_ordered(sh.kth);
}

extern "C" __global__ void __launch_bounds__(TOPK_THREADS, 2)
tree_topk(const void* __restrict__ logits,  // [B, L, V] (DTYPE)
          const int* __restrict__ budgets,  // [B]
          float* __restrict__ out_logp,     // [B, L, kmax]
          int* __restrict__ out_ids,        // [B, L, kmax]
          int L, int V, int kmax, int max_nodes, int max_topk, int id_digits) {
  griddep_begin();
  extern __shared__ u64 buf[];  // [CAP] keys: ordered logit << 32 | ~id
  __shared__ TopkShared sh;
  const int row = blockIdx.x, b = row / L, tid = threadIdx.x, lane = tid & 31;
  int K = min(min(max(budgets[b], 0), max_nodes), V);
  if (max_topk > 0) K = min(K, max_topk);
  if (K == 0) return;
  const char* row_ptr = reinterpret_cast<const char*>(logits) + (size_t)row * V * (DTYPE == 0 ? 4 : 2);

  if (tid == 0) sh.count = 0;
  // Candidates: logits >= admit_min, a lower bound of the K-th best logit seen so far. While K fits the
  // thread count, the bound comes from the threads' running maxima (cheap); a radix select over the
  // buffer is the fallback whenever the buffer could still overflow.
  const bool by_maxima = K <= TOPK_THREADS;
  float admit_min = NEG_INF, tmax = NEG_INF;
  double acc = 0.0;
  const int tiles = (V + TILE - 1) / TILE, full_tiles = V / TILE;
  uint4 cur[2], nxt[2];
  load_tile(row_ptr, V, 0, cur);
  __syncthreads();
  for (int t = 0; t < tiles; ++t) {
    if (t + 1 < tiles) load_tile(row_ptr, V, t + 1, nxt);
    const bool full = t < full_tiles;
    const float xmax = full ? tile_terms<false>(cur, t, V, acc) : tile_terms<true>(cur, t, V, acc);
    tmax = fmaxf(tmax, xmax);
    if (t == 0 && by_maxima) admit_min = maxima_floor(tmax, K, sh);  // before tile 0 floods the buffer
    u32 admit = 0;
    if (xmax >= admit_min)  // rare once the bound has risen
      admit = full ? tile_admit<false>(cur, t, V, admit_min) : tile_admit<true>(cur, t, V, admit_min);
    if (__any_sync(FULL, admit)) {  // append this thread's admitted keys, one atomic per warp
      const int n = __popc(admit);
      int incl = n;
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const int y = __shfl_up_sync(FULL, incl, o);
        if (lane >= o) incl += y;
      }
      int at = 0;
      if (lane == 31) at = atomicAdd(&sh.count, incl);
      at = __shfl_sync(FULL, at, 31) + incl - n;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int base = t * TILE + (h * TOPK_THREADS + tid) * VEC_ELEMS;
#pragma unroll
        for (int e = 0; e < VEC_ELEMS; ++e)
          if (admit >> (h * VEC_ELEMS + e) & 1)
            buf[at++] = (u64)ordered(element(cur[h], e)) << 32 | (u32)~(base + e);
      }
    }
    if (__syncthreads_or(admit != 0)) {
      int count = sh.count;
      __syncthreads();  // every thread has read count before the next tile appends
      if (count > CAP - TILE && by_maxima) {  // raise the bound from the maxima; drop what falls below it
        const float bound = maxima_floor(tmax, K, sh);  // not admit_min: that one may exclude logit ties
        count = compact(buf, count, 32, ordered(bound), sh);
        admit_min = fmaxf(admit_min, bound);
      }
      if (count > CAP - TILE) {
        int pos;
        u64 thr;
        radix_select(buf, count, K, false, CAP - TILE, id_digits, sh, pos, thr);
        count = compact(buf, count, pos, thr, sh);
        admit_min = fmaxf(admit_min, admit_floor(pos, thr));
      }
      if (tid == 0) sh.count = count;
      __syncthreads();
    }
    cur[0] = nxt[0];
    cur[1] = nxt[1];
  }

  // log-sum-exp of the row: fp64 block sum of the per-thread sums
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) acc += __shfl_down_sync(FULL, acc, o);
  if (lane == 0) sh.red[tid >> 5] = acc;
  __syncthreads();
  if (tid < 32) {
    double s = lane < TOPK_THREADS / 32 ? sh.red[lane] : 0.0;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) s += __shfl_down_sync(FULL, s, o);
    if (lane == 0) sh.lse = __double2float_rn(log(s));
  }
  int count = sh.count;
  if (count > K) {  // the exact top K
    int pos;
    u64 thr;
    radix_select(buf, count, K, true, 0, id_digits, sh, pos, thr);
    count = compact(buf, count, pos, thr, sh);
  }
  int p2 = 1;
  while (p2 < count) p2 <<= 1;
  for (int i = count + tid; i < p2; i += TOPK_THREADS) buf[i] = 0;
  __syncthreads();
  for (int size = 2; size <= p2; size <<= 1) {  // bitonic sort, descending
    for (int stride = size >> 1; stride > 0; stride >>= 1) {
      for (int i = tid; i < (p2 >> 1); i += TOPK_THREADS) {
        const int lo = 2 * i - (i & (stride - 1)), hi = lo + stride;
        const u64 a = buf[lo], c = buf[hi];
        if ((a < c) == ((lo & size) == 0)) {
          buf[lo] = c;
          buf[hi] = a;
        }
      }
      __syncthreads();
    }
  }
  const float lse = sh.lse;
  for (int r = tid; r < K; r += TOPK_THREADS) {
    const u64 k = buf[r];
    out_logp[(size_t)row * kmax + r] = __fsub_rn(from_ordered((u32)(k >> 32)), lse);
    out_ids[(size_t)row * kmax + r] = (int)~(u32)k;
  }
}

// Heap key of a candidate (a child of node `slot`) as a non-negative finite double, so that doubles
// compare like the keys: higher fp32 score (-0 as +0) first, then the smaller parent. 0.0: no candidate.
__device__ __forceinline__ double heap_key(float score, int slot) {
  const u64 k = (u64)ordered(__fadd_rn(score, 0.0f)) << 30 | (u64)(0x3FFFFFFF - slot);
  return __longlong_as_double((long long)k);
}

extern "C" __global__ void __launch_bounds__(SELECT_THREADS)
tree_select(const float* __restrict__ logp_topk,      // [B, L, kmax]
            const int* __restrict__ ids_topk,         // [B, L, kmax]
            const int* __restrict__ budgets,          // [B]
            const long long* __restrict__ root_tokens,  // [B]
            long long* __restrict__ tokens,           // [B, N+1]
            int* __restrict__ parents,                // [B, N+1]
            int* __restrict__ depths,                 // [B, N+1]
            int* __restrict__ num_nodes,              // [B]
            u32* __restrict__ mask,                   // [B, N+1, W]
            int L, int V, int kmax, int max_nodes, int max_topk, int W) {
  griddep_begin();
  extern __shared__ double skey[];  // [NSLOT*32] heap slot j: node j's next child candidate (its key)
  __shared__ int s_num;
  const int b = blockIdx.x, tid = threadIdx.x, lane = tid & 31, N1 = max_nodes + 1;
  const int n_b = min(max(budgets[b], 0), max_nodes);
  int K = min(n_b, V);
  if (max_topk > 0) K = min(K, max_topk);
  float* lp = reinterpret_cast<float*>(skey + NSLOT * 32);     // [L, K] log-probs of the sequence
  int* n_par = reinterpret_cast<int*>(lp + (size_t)L * kmax);  // per node: parent, depth, rank, score
  int* n_depth = n_par + N1;
  int* n_rank = n_depth + N1;
  float* n_score = reinterpret_cast<float*>(n_rank + N1);
  int* slot_c = reinterpret_cast<int*>(n_score + N1);  // per node: rank of its next child candidate

  for (int i = tid; i < L * K; i += SELECT_THREADS) lp[i] = logp_topk[((size_t)b * L + i / K) * kmax + i % K];
  for (int i = tid; i < NSLOT * 32; i += SELECT_THREADS) skey[i] = 0.0;
  if (tid == 0) {
    n_par[0] = -1;
    n_depth[0] = 0;
    n_rank[0] = 0;
    n_score[0] = 0.0f;
    slot_c[0] = 0;
    s_num = 1;
  }
  __syncthreads();

  if (tid < 32 && n_b > 0 && K > 0 && L > 0) {
    // Slot j lives in lane j % 32; each lane keeps the best key of its slots in a register.
    double best = 0.0;
    if (lane == 0) best = skey[0] = heap_key(lp[0], 0);
    __syncwarp();
    int i = 0;
    for (; i < n_b; ++i) {
      const u64 bk = (u64)__double_as_longlong(best);
      const u32 hi = (u32)(bk >> 32), lo = (u32)bk;
      const u32 hmax = __reduce_max_sync(FULL, hi);
      if (hmax == 0) break;  // no candidates left
      u32 eq = __ballot_sync(FULL, hi == hmax);
      if (eq & (eq - 1)) {
        const u32 lmax = __reduce_max_sync(FULL, hi == hmax ? lo : 0u);
        eq = __ballot_sync(FULL, hi == hmax && lo == lmax);
      }
      const u64 key = (u64)hmax << 32 | __shfl_sync(FULL, lo, __ffs(eq) - 1);
      const int q = 0x3FFFFFFF - (int)(key & 0x3FFFFFFF);  // the popped candidate's parent
      const float score = from_ordered((u32)(key >> 30));
      const int c = slot_c[q], d = n_depth[q] + 1, m = i + 1;  // the new node m: rank c, depth d
      const double sib = c + 1 < K ? heap_key(__fadd_rn(n_score[q], lp[(d - 1) * K + c + 1]), q) : 0.0;
      const double child = d < L ? heap_key(__fadd_rn(score, lp[d * K]), m) : 0.0;
      if (lane == 0) {
        n_par[m] = q;
        n_depth[m] = d;
        n_rank[m] = c;
        n_score[m] = score;
        slot_c[q] = c + 1;
        slot_c[m] = 0;
        skey[q] = sib;
        skey[m] = child;
      }
      __syncwarp();
      if (lane == (q & 31) || lane == (m & 31)) {  // the two lanes whose slots changed: tournament max
        double v[NSLOT];
#pragma unroll
        for (int k = 0; k < NSLOT; ++k) v[k] = skey[lane + 32 * k];
#pragma unroll
        for (int stride = 1; stride < NSLOT; stride *= 2)
#pragma unroll
          for (int k = 0; k + stride < NSLOT; k += 2 * stride) v[k] = v[k + stride] > v[k] ? v[k + stride] : v[k];
        best = v[0];
      }
    }
    if (lane == 0) s_num = i + 1;
  }
  __syncthreads();

  const int num = s_num;
  if (tid == 0) num_nodes[b] = num;
  for (int i = tid; i < N1; i += SELECT_THREADS) {
    const size_t o = (size_t)b * N1 + i;
    long long tok = 0;
    int par = -1, dep = 0;
    if (i == 0) {
      tok = root_tokens[b];
    } else if (i < num) {
      dep = n_depth[i];
      par = n_par[i];
      tok = ids_topk[((size_t)b * L + dep - 1) * kmax + n_rank[i]];
    }
    tokens[o] = tok;
    parents[o] = par;
    depths[o] = dep;
    int anc[MAX_DEPTH], cnt = 0;  // i and its ancestors, decreasing
    for (int j = i;; j = n_par[j]) {
      anc[cnt++] = j;
      if (j == 0 || i >= num) break;
    }
    int k = cnt - 1;
    for (int w = 0; w < W; ++w) {
      u32 word = 0;
      for (; k >= 0 && (anc[k] >> 5) == w; --k) word |= 1u << (anc[k] & 31);
      mask[o * W + w] = word;
    }
  }
}
