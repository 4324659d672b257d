// The MoE's prep work (kernels/w4a16_moe.py), shared by moe_prep (w4a16_moe.cu) and moe_route_prep (moe_route.cu):
// a 1024-thread block sorts the (token, slot) pairs by expert; the other blocks permute x.
#pragma once

// Exclusive prefix sum over a 1024-thread block; *total gets the sum. sums: 33 ints of shared memory.
__device__ int block_exclusive_scan(int v, int* sums, int* total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int incl = v;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    int n = __shfl_up_sync(0xffffffffu, incl, o);
    if (lane >= o) incl += n;
  }
  if (lane == 31) sums[warp] = incl;
  __syncthreads();
  if (warp == 0) {
    int s = sums[lane], si = s;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      int n = __shfl_up_sync(0xffffffffu, si, o);
      if (lane >= o) si += n;
    }
    sums[lane] = si - s;
    if (lane == 31) sums[32] = si;
  }
  __syncthreads();
  const int r = sums[warp] + incl - v;
  *total = sums[32];
  __syncthreads();
  return r;
}

// Blocks first.. of the grid, a thread per 16-byte piece: x_perm [T, Hp] (Hp = H rounded up to 128) = x in the
// logical k order (see w4a16_moe.cu), zero past H (the launch has no such blocks for the families that read x as it
// is).
__device__ __forceinline__ void moe_permute_x(const uint4* __restrict__ x, uint4* __restrict__ x_perm, int T, int H,
                                              int first) {
  const int pieces = (H + 127) / 128 * 16, stride = (gridDim.x - first) * blockDim.x;  // 16-byte pieces per row
  for (int i = (blockIdx.x - first) * blockDim.x + threadIdx.x; i < T * pieces; i += stride) {
    // Piece u = 2 s + h of a chunk holds, as word c, k (32c + 8(s>>1) + 2(s&1) + h, +4) of the chunk: half h of
    // words (s & 1) and (s & 1) + 2 of the chunk's 8-group 4c + (s >> 1).
    const int t = i / pieces, p = i % pieces, u = p & 15, s = u >> 1;
    unsigned w[4];
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const int g = p - u + 4 * c + (s >> 1);
      const uint4 v = 8 * g < H ? x[(size_t)t * (H / 8) + g] : make_uint4(0u, 0u, 0u, 0u);
      w[c] = __byte_perm(s & 1 ? v.y : v.x, s & 1 ? v.w : v.z, u & 1 ? 0x7632 : 0x5410);
    }
    x_perm[i] = make_uint4(w[0], w[1], w[2], w[3]);
  }
}

#define SORT_BATCH 8  // ids in flight per thread of the sort

// ids[i0 + b * blockDim.x] -> id[b] (-1 past slots), all loads issued before any is used.
template <typename Id>
__device__ __forceinline__ void load_ids(const Id* ids, int i0, int slots, long long (&id)[SORT_BATCH]) {
#pragma unroll
  for (int b = 0; b < SORT_BATCH; ++b) {
    const int i = i0 + b * blockDim.x;
    id[b] = i < slots ? (long long)ids[i] : -1;
  }
}

// f(id, slot) for the kept ids (0 <= id < E) of slots [s0, s1), by a block. The ids are read SORT_BATCH per thread at
// a time: read one at a time, each id waited out a global load (H200, K2 TP8: moe_prep 67 -> 49 us at 4096 x 8
// slots, 264 -> 203 at 16384).
template <typename Id, class F>
__device__ __forceinline__ void for_kept_ids(const Id* ids, int s0, int s1, int E, F f) {
  for (int i0 = s0 + threadIdx.x; i0 < s1; i0 += SORT_BATCH * blockDim.x) {
    long long id[SORT_BATCH];
    load_ids(ids, i0, s1, id);
#pragma unroll
    for (int b = 0; b < SORT_BATCH; ++b)
      if (id[b] >= 0 && id[b] < E) f((int)id[b], i0 + b * blockDim.x);
  }
}

// count[id] += 1 for the kept ids of slots [s0, s1).
template <typename Id>
__device__ __forceinline__ void count_ids(const Id* ids, int s0, int s1, int E, int* count) {
  for_kept_ids(ids, s0, s1, E, [&](int id, int) { atomicAdd(&count[id], 1); });
}

// sorted_slot[cursor[id]++] = slot for the kept ids of slots [s0, s1).
template <typename Id>
__device__ __forceinline__ void place_ids(const Id* ids, int s0, int s1, int E, int* cursor,
                                          int* __restrict__ sorted_slot) {
  for_kept_ids(ids, s0, s1, E, [&](int id, int slot) { sorted_slot[atomicAdd(&cursor[id], 1)] = slot; });
}

// The experts' rows in expert order, by a 1024-thread block: rows_of(e) rows each; cursor[e] = the expert's first row
// + skip(e); with write_passes, passes[0].x = pass count and passes[1 + p] = (expert, first row, rows <= mt, 0).
template <class Rows, class Skip>
__device__ __forceinline__ void plan_rows(Rows rows_of, Skip skip, int* cursor, int4* __restrict__ passes,
                                          bool write_passes, int E, int mt) {
  __shared__ int sums[33];
  // Each thread owns experts [e0, e1): row offsets and pass offsets by two block scans.
  const int tid = threadIdx.x, per = (E + blockDim.x - 1) / blockDim.x, e0 = min(E, tid * per),
            e1 = min(E, e0 + per);
  int rows = 0, npass = 0, total;
  for (int e = e0; e < e1; ++e) {
    const int c = rows_of(e);
    rows += c;
    npass += (c + mt - 1) / mt;
  }
  int row = block_exclusive_scan(rows, sums, &total);
  int p = block_exclusive_scan(npass, sums, &total);
  if (write_passes && tid == 0) passes[0] = make_int4(total, 0, 0, 0);
  for (int e = e0; e < e1; ++e) {
    const int c = rows_of(e);
    cursor[e] = row + skip(e);
    if (write_passes)
      for (int r0 = 0; r0 < c; r0 += mt) passes[1 + p++] = make_int4(e, row + r0, min(mt, c - r0), 0);
    row += c;
  }
}

// Block 0 (1024 threads): sorts the T*k (token, slot) pairs of ids [T, k] by expert into sorted_slot (-1 /
// out-of-range ids dropped) and writes passes[0].x = pass count, passes[1 + p] = (expert, first sorted row,
// rows <= mt, 0). sm: 2E ints of shared memory. Id: long long (global ids) or int (ids in shared memory).
template <typename Id>
__device__ __forceinline__ void moe_sort_slots(const Id* ids, int* sm, int* __restrict__ sorted_slot,
                                               int4* __restrict__ passes, int T, int k, int E, int mt) {
  int* count = sm;       // [E]
  int* cursor = sm + E;  // [E]
  for (int e = threadIdx.x; e < E; e += blockDim.x) count[e] = 0;
  __syncthreads();
  count_ids(ids, 0, T * k, E, count);
  __syncthreads();
  plan_rows([&](int e) { return count[e]; }, [](int) { return 0; }, cursor, passes, true, E, mt);
  __syncthreads();
  place_ids(ids, 0, T * k, E, cursor, sorted_slot);
}

// The sort split over S blocks for many slots (one block's shared-memory atomics took 45 of moe_prep's 55 us at
// 4096 x 8 slots on an H200): block b of the first launch counts slots [b chunk, b chunk + chunk) by expert into
// hist [S][E] (moe_count_slots); block b of the second reads every block's counts, so that its slots go after those
// of blocks < b within each expert, and places them (moe_place_slots). Same outputs as moe_sort_slots (an expert's
// rows in another order, as the atomics give any). sm: E ints.
__device__ __forceinline__ void moe_count_slots(const long long* ids, int* count, int* __restrict__ hist, int slots,
                                                int chunk, int E) {
  const int s0 = blockIdx.x * chunk;
  for (int e = threadIdx.x; e < E; e += blockDim.x) count[e] = 0;
  __syncthreads();
  count_ids(ids, s0, min(slots, s0 + chunk), E, count);
  __syncthreads();
  for (int e = threadIdx.x; e < E; e += blockDim.x) hist[(size_t)blockIdx.x * E + e] = count[e];
}

__device__ __forceinline__ void moe_place_slots(const long long* ids, const int* __restrict__ hist, int* cursor,
                                                int* __restrict__ sorted_slot, int4* __restrict__ passes, int slots,
                                                int chunk, int S, int E, int mt) {
  const int blk = blockIdx.x, s0 = blk * chunk;
  auto rows_in = [&](int e, int blocks) {  // expert e's rows in blocks [0, blocks)
    int c = 0;
    for (int j = 0; j < blocks; ++j) c += hist[j * E + e];
    return c;
  };
  plan_rows([&](int e) { return rows_in(e, S); }, [&](int e) { return rows_in(e, blk); }, cursor, passes, blk == 0,
            E, mt);
  __syncthreads();
  place_ids(ids, s0, min(slots, s0 + chunk), E, cursor, sorted_slot);
}

// moe_sort_slots for T * k <= 32 slots, by one warp and no block barrier: lane i holds slot i, its rank among the
// kept slots in (expert, slot) order is its sorted row, and lane r then reads sorted row r's expert back to mark where
// each pass starts. Same outputs as moe_sort_slots, with an expert's rows in slot order. sm: 32 ints.
__device__ __forceinline__ void moe_sort_slots_warp(const int* ids, int* sm, int* __restrict__ sorted_slot,
                                                    int4* __restrict__ passes, int slots, int E, int mt) {
  const int lane = threadIdx.x & 31;
  const int id = lane < slots ? ids[lane] : -1;
  const bool kept = id >= 0 && id < E;
  int rank = 0;
  for (int j = 0; j < slots; ++j) {
    const int other = __shfl_sync(0xffffffffu, id, j);
    rank += other >= 0 && other < E && (other < id || (other == id && j < lane));
  }
  const int rows = __popc(__ballot_sync(0xffffffffu, kept));
  if (kept) {
    sm[rank] = id;
    sorted_slot[rank] = lane;
  }
  __syncwarp();
  const int e = lane < rows ? sm[lane] : -1;
  const unsigned same = __match_any_sync(0xffffffffu, e);  // sorted rows of this expert: consecutive lanes
  const int first = __ffs(same) - 1, count = __popc(same);
  const bool starts = lane < rows && (lane - first) % mt == 0;
  const unsigned starts_mask = __ballot_sync(0xffffffffu, starts);
  if (starts)
    passes[1 + __popc(starts_mask & ((1u << lane) - 1))] = make_int4(e, lane, min(mt, count - (lane - first)), 0);
  if (lane == 0) passes[0] = make_int4(__popc(starts_mask), 0, 0, 0);
}

