// Routed-expert MoE over compressed-tensors INT4 weights (W4A16, group 32); see kernels/w4a16_moe.py.
//
// k order. In each 128-k chunk, thread c (= lane % 4) of an mma takes the chunk's k [32c, 32c + 32) of its
// weight row: one 16-byte packed load, one scale group, 4 words of 8 nibbles. The cheap dequant (lop3 with
// the bf16 exponent of 128) pairs nibble i with nibble i + 4 of a word, so word q yields the bf16x2 pairs
// (n0,n4) (n1,n5) (n2,n6) (n3,n7); k16 step s = 2q + j of the chunk takes b0b1 = pair 2j, b2b3 = pair 2j+1.
// Activations are stored in that mma order ("logical" k): position 16 s + 8 h + 2 c + i of a chunk holds
// k = 32 c + 8 (s >> 1) + 2 (s & 1) + h + 4 i, so one ldmatrix.x4 loads a whole A fragment. moe_prep writes
// x that way and the gate/up epilogue writes h that way; rows are padded to a multiple of 128.
//
// GEMM block: 8 warps stream one N tile (128 * NT weight rows) at a time over all of K, KC = 256 k per
// cp.async stage (128 contiguous bytes of each packed weight row, scales and the pass's activation rows), MT
// token rows per pass. Each thread reads a 16-byte packed piece per (weight row, 128 k) from shared memory,
// dequantizes it once in registers and feeds it to every m16 tile of the pass, so each used expert's weights
// cross HBM once.
// Gate and up rows of the same outputs sit in the same warp, so SiLU(gate) * up is formed in registers.
#include <cuda_bf16.h>

typedef unsigned int u32;

#define THREADS 256  // GEMM block: 8 warps
#define KC 256       // k per pipeline stage: 128 contiguous bytes of every packed weight row

__device__ __forceinline__ u32 smem_addr(const void* p) {
  u32 a;
  asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
  return a;
}

// 16 (or 4) bytes global -> shared address dst, bypassing registers; zero-filled when !valid.
__device__ __forceinline__ void cp_async16(u32 dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async4(u32 dst, const void* src, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 4 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

// The four 8x8 b16 matrices whose rows lanes 8i..8i+7 address -> a[i] (an m16k16 A fragment).
__device__ __forceinline__ void ldmatrix_x4(u32* a, u32 addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(a[0]), "=r"(a[1]), "=r"(a[2]), "=r"(a[3])
               : "r"(addr)
               : "memory");
}

// c[4] += A(16x16) * B(16x8), bf16 in, fp32 accumulate.
__device__ __forceinline__ void mma_bf16(float* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ u32 bf2_bits(__nv_bfloat162 v) { return *reinterpret_cast<u32*>(&v); }
__device__ __forceinline__ __nv_bfloat162 bits_bf2(u32 v) { return *reinterpret_cast<__nv_bfloat162*>(&v); }

// Word of 8 nibbles u_i -> 4 bf16x2 (q_j, q_{j+4}) * scale, q = u - 8.
__device__ __forceinline__ void dequant_word(u32 w, __nv_bfloat162 scale, u32* out) {
  const __nv_bfloat162 bias = bits_bf2(0x43084308u);  // 136 = 128 + 8
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    u32 t;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;\n" : "=r"(t) : "r"(w >> (4 * j)), "r"(0x000F000Fu), "r"(0x43004300u));
    out[j] = bf2_bits(__hmul2(__hsub2(bits_bf2(t), bias), scale));  // (128 + u) - 136 exact, then * scale
  }
}

__device__ __forceinline__ void red_add4(float* dst, float4 v) {
#if __CUDA_ARCH__ >= 900
  asm volatile("red.global.add.v4.f32 [%0], {%1,%2,%3,%4};\n" ::"l"(dst), "f"(v.x), "f"(v.y), "f"(v.z), "f"(v.w)
               : "memory");
#else
  atomicAdd(dst, v.x); atomicAdd(dst + 1, v.y); atomicAdd(dst + 2, v.z); atomicAdd(dst + 3, v.w);
#endif
}

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

// Launch: grid (1 + P), block 1024, dynamic shared memory 8 * E bytes.
// Block 0 sorts the T*k (token, slot) pairs by expert into sorted_slot (-1 / out-of-range ids dropped) and
// writes passes[0].x = pass count, passes[1 + p] = (expert, first sorted row, rows <= mt, 0).
// Blocks 1..P, a thread per 16-byte piece: x_perm [T, Hp] (Hp = H rounded up to 128) = x in the logical k
// order, zero past H; acc = 0.
extern "C" __global__ void __launch_bounds__(1024) moe_prep(
    const long long* __restrict__ topk_ids, const uint4* __restrict__ x, uint4* __restrict__ x_perm,
    float4* __restrict__ acc, int* __restrict__ sorted_slot, int4* __restrict__ passes, int T, int k, int E,
    int H, int mt) {
  if (blockIdx.x > 0) {
    const int pieces = (H + 127) / 128 * 16, stride = (gridDim.x - 1) * blockDim.x;  // 16-byte pieces per row
    for (int i = (blockIdx.x - 1) * blockDim.x + threadIdx.x; i < T * pieces; i += stride) {
      // Piece u = 2 s + h of a chunk holds, as word c, k (32c + 8(s>>1) + 2(s&1) + h, +4) of the chunk: half h of
      // words (s & 1) and (s & 1) + 2 of the chunk's 8-group 4c + (s >> 1).
      const int t = i / pieces, p = i % pieces, u = p & 15, s = u >> 1;
      u32 w[4];
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const int g = p - u + 4 * c + (s >> 1);
        const uint4 v = 8 * g < H ? x[(size_t)t * (H / 8) + g] : make_uint4(0u, 0u, 0u, 0u);
        w[c] = __byte_perm(s & 1 ? v.y : v.x, s & 1 ? v.w : v.z, u & 1 ? 0x7632 : 0x5410);
      }
      x_perm[i] = make_uint4(w[0], w[1], w[2], w[3]);
    }
    for (int i = (blockIdx.x - 1) * blockDim.x + threadIdx.x; i < T * H / 4; i += stride)
      acc[i] = make_float4(0.f, 0.f, 0.f, 0.f);
    return;
  }
  extern __shared__ int sm[];
  __shared__ int sums[33];
  int* count = sm;       // [E]
  int* cursor = sm + E;  // [E]
  const int slots = T * k, tid = threadIdx.x;
  for (int e = tid; e < E; e += blockDim.x) count[e] = 0;
  __syncthreads();
  for (int i = tid; i < slots; i += blockDim.x) {
    const long long id = topk_ids[i];
    if (id >= 0 && id < E) atomicAdd(&count[id], 1);
  }
  __syncthreads();
  // Each thread owns experts [e0, e1): row offsets and pass offsets by two block scans.
  const int per = (E + blockDim.x - 1) / blockDim.x, e0 = min(E, tid * per), e1 = min(E, e0 + per);
  int rows = 0, npass = 0, total;
  for (int e = e0; e < e1; ++e) {
    rows += count[e];
    npass += (count[e] + mt - 1) / mt;
  }
  int row = block_exclusive_scan(rows, sums, &total);
  int p = block_exclusive_scan(npass, sums, &total);
  if (tid == 0) passes[0] = make_int4(total, 0, 0, 0);
  for (int e = e0; e < e1; ++e) {
    const int c = count[e];
    cursor[e] = row;
    for (int r0 = 0; r0 < c; r0 += mt) passes[1 + p++] = make_int4(e, row + r0, min(mt, c - r0), 0);
    row += c;
  }
  __syncthreads();
  for (int i = tid; i < slots; i += blockDim.x) {
    const long long id = topk_ids[i];
    if (id >= 0 && id < E) sorted_slot[atomicAdd(&cursor[id], 1)] = i;
  }
}

// One GEMM of a pass: out[m, n] = sum_k A[m, k] * W[e][n, k] for the pass's rows m and the block's N tiles.
// A tile is BN = 128 * NT weight rows, two halves of HALF = 64 * NT rows; warp w owns the n8 tiles at rows
// j * HALF + 8 * (NT * w + t), j < 2, t < NT. A stage holds KC = 256 k (two 128-k mma chunks) of the tile:
// packed weights [BN][128 B], scales [BN][8 groups], activations [MT][512 B] (rows of lda = K rounded up to 128).
// MODE 0 (gate/up): A = x_perm rows of the pass's tokens, K = H, W = w13 (N = 2I); half 0 holds HALF gate rows
//   and half 1 the matching up rows, so h[row, n] = silu(gate) * up is formed in registers and stored bf16 in
//   the logical k order.
// MODE 1 (down): A = h rows, K = I, W = w2 (N = H); acc[token, n] += topk_weight * out (fp32 reductions).
// Launch: grid (max_passes, ceil(n_tiles / tpb)), block 256,
// shared STAGES * (BN * KC / 2 + BN * KC / 16 + MT * KC * 2) bytes.
template <int MODE, int MT, int NT, int STAGES>
__device__ __forceinline__ void moe_gemm(const __nv_bfloat16* __restrict__ a_src, const int* __restrict__ w_packed,
                                         const __nv_bfloat16* __restrict__ w_scale,
                                         const int* __restrict__ sorted_slot, const int4* __restrict__ passes,
                                         __nv_bfloat16* __restrict__ h_out, const float* __restrict__ topk_weights,
                                         float* __restrict__ acc_out, int k, int H, int I, int n_tiles, int tpb) {
  constexpr int BN = 128 * NT, HALF = BN / 2, MTILES = MT / 16;
  constexpr int W_ROW = KC / 2, S_ROW = KC / 16, A_ROW = KC * 2;  // bytes per row and stage
  constexpr int W_BYTES = BN * W_ROW, S_BYTES = BN * S_ROW, STAGE_BYTES = W_BYTES + S_BYTES + MT * A_ROW;
  constexpr int W_PER = BN * W_ROW / 16 / THREADS, S_PER = BN * S_ROW / 4 / THREADS, A_PER = MT * A_ROW / 16 / THREADS;
  constexpr int TILE_N = MODE == 0 ? HALF : BN;  // output columns per N tile
  extern __shared__ __align__(16) unsigned char smem[];
  if (blockIdx.x >= passes[0].x) return;
  const int4 pass = passes[1 + blockIdx.x];
  const int e = pass.x, row0 = pass.y, rows = pass.z;
  const int K = MODE == 0 ? H : I, N = MODE == 0 ? 2 * I : H, lda = (K + 127) / 128 * 128;
  const int tile0 = blockIdx.y * tpb, kt_per_tile = (K + KC - 1) / KC;
  const int n_stages = (min(tile0 + tpb, n_tiles) - tile0) * kt_per_tile;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, r = lane >> 2, c = lane & 3;
  const int half_off = MODE == 0 ? I : HALF;  // global row of half 1's first row, relative to half 0's
  const int* w_exp = w_packed + (size_t)e * N * (K / 8);
  const __nv_bfloat16* s_exp = w_scale + (size_t)e * N * (K / 32);

  // Loader: per stage each thread copies W_PER 16-byte pieces of packed weights (rows (tid >> 3) + 32 i, 32 k
  // at piece u = tid & 7), S_PER 4-byte pairs of scales (rows (tid >> 2) + 64 i, groups 2 (tid & 3) and + 1)
  // and A_PER 16-byte pieces of activations (rows (tid >> 5) + 8 i, 8 k at piece m = tid & 31). Swizzles keep
  // the warps' fragment reads free of bank conflicts: weight piece u of an odd row goes to slot u ^ 4;
  // activation piece m of row a goes to chunk m >> 4, slot (m & 15) ^ (a & 7).
  const int wu = tid & 7, su = tid & 3, am = tid & 31;
  const u32 s_base = smem_addr(smem);
  const u32 w_dst = (tid >> 3) * W_ROW + ((wu ^ (((tid >> 3) & 1) << 2)) * 16);
  const u32 s_dst = W_BYTES + (tid >> 2) * S_ROW + su * 4;
  const u32 a_dst = W_BYTES + S_BYTES + (tid >> 5) * A_ROW + (am >> 4) * 256 + (((am & 15) ^ (tid >> 5)) * 16);
  int a_off[A_PER];  // element offset of each activation piece in a_src, -1 past the pass's rows
#pragma unroll
  for (int i = 0; i < A_PER; ++i) {
    const int ar = (tid >> 5) + 8 * i;
    a_off[i] = ar < rows ? (MODE == 0 ? sorted_slot[row0 + ar] / k : row0 + ar) * lda + 8 * am : -1;
  }
  // ldmatrix.x4: lane l addresses row (l & 7) + 8 ((l >> 3) & 1) of the m16 tile, piece (2 s + (l >> 4)) ^ (l & 7)
  // of k-step s; the piece's low bit is the lane's own, the rest (bits 1-3) is added per step.
  const u32 a_lane = ((lane & 7) + 8 * ((lane >> 3) & 1)) * A_ROW + ((((lane >> 4) ^ lane) & 1) * 16);
  int w_off[W_PER], s_off[S_PER];  // offsets in the expert's weights / scales for the tile being loaded, -1 past N
  auto global_row = [&](int tile, int row) { return tile * TILE_N + (row >= HALF ? half_off : 0) + row % HALF; };
  int ld_kt = 0, ld_tile = tile0, ld_buf = 0;
  auto load_next_stage = [&]() {
    if (ld_kt == 0) {
#pragma unroll
      for (int i = 0; i < W_PER; ++i) {
        const int grow = global_row(ld_tile, (tid >> 3) + 32 * i);
        w_off[i] = grow < N ? grow * (K / 8) + 4 * wu : -1;
      }
#pragma unroll
      for (int i = 0; i < S_PER; ++i) {
        const int grow = global_row(ld_tile, (tid >> 2) + 64 * i);
        s_off[i] = grow < N ? grow * (K / 32) + 2 * su : -1;
      }
    }
    const u32 st = s_base + ld_buf * STAGE_BYTES;
    const int k0 = ld_kt * KC;
    const bool w_ok = k0 + 32 * wu < K, s_ok = k0 + 64 * su < K, a_ok = k0 + 8 * am < lda;
#pragma unroll
    for (int i = 0; i < W_PER; ++i)
      if (w_off[i] >= 0) cp_async16(st + w_dst + 32 * W_ROW * i, w_exp + (w_ok ? w_off[i] + k0 / 8 : 0), w_ok);
#pragma unroll
    for (int i = 0; i < S_PER; ++i)
      if (s_off[i] >= 0) cp_async4(st + s_dst + 64 * S_ROW * i, s_exp + (s_ok ? s_off[i] + k0 / 32 : 0), s_ok);
#pragma unroll
    for (int i = 0; i < A_PER; ++i)
      if (a_off[i] >= 0) cp_async16(st + a_dst + 8 * A_ROW * i, a_src + (a_ok ? a_off[i] + k0 : 0), a_ok);
    ld_buf = ld_buf == STAGES - 1 ? 0 : ld_buf + 1;
    if (++ld_kt == kt_per_tile) {
      ld_kt = 0;
      ++ld_tile;
    }
  };

  float acc[MTILES][2][NT][4];
#pragma unroll
  for (int mt = 0; mt < MTILES; ++mt)
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int t = 0; t < NT; ++t)
#pragma unroll
        for (int v = 0; v < 4; ++v) acc[mt][j][t][v] = 0.f;

#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < n_stages) load_next_stage();
    cp_async_commit();
  }
  int buf = 0, kt = 0, tile = tile0;  // compute-side position of stage s
  for (int s = 0; s < n_stages; ++s) {
    cp_async_wait<STAGES - 2>();
    __syncthreads();  // stage s visible to all; stage s-1's buffer free
    if (s + STAGES - 1 < n_stages) load_next_stage();
    cp_async_commit();

    const unsigned char* st = smem + buf * STAGE_BYTES;
    buf = buf == STAGES - 1 ? 0 : buf + 1;
#pragma unroll
    for (int ch = 0; ch < KC / 128; ++ch) {  // 128-k chunk: thread c's 32 k are the chunk's group c
      const u32 sa = s_base + (st - smem) + W_BYTES + S_BYTES + ch * 256 + a_lane;
      uint4 wq[2][NT];  // the thread's 32 k of weight row r of each n8 tile, and their scale
      __nv_bfloat162 sc[2][NT];
#pragma unroll
      for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int t = 0; t < NT; ++t) {
          const int wr = j * HALF + 8 * (NT * warp + t) + r;
          wq[j][t] = *reinterpret_cast<const uint4*>(st + wr * W_ROW + (((4 * ch + c) ^ ((wr & 1) << 2)) * 16));
          sc[j][t] = __bfloat162bfloat162(
              reinterpret_cast<const __nv_bfloat16*>(st + W_BYTES + wr * S_ROW)[4 * ch + c]);
        }
#pragma unroll
      for (int q = 0; q < 4; ++q) {  // word q of the thread's 32 k: mma k-steps 2q and 2q+1
        u32 b[2][NT][4];
#pragma unroll
        for (int j = 0; j < 2; ++j)
#pragma unroll
          for (int t = 0; t < NT; ++t) {
            const uint4 w = wq[j][t];
            dequant_word(q == 0 ? w.x : q == 1 ? w.y : q == 2 ? w.z : w.w, sc[j][t], b[j][t]);
          }
#pragma unroll
        for (int mt = 0; mt < MTILES; ++mt) {
          if (mt * 16 < rows) {
#pragma unroll
            for (int j2 = 0; j2 < 2; ++j2) {  // k-step 2q + j2: pieces 4q + 2 j2 (+1) of the chunk
              u32 a[4];
              ldmatrix_x4(a, sa + mt * 16 * A_ROW + (((4 * q + 2 * j2) ^ (lane & 6)) * 16));
#pragma unroll
              for (int j = 0; j < 2; ++j)
#pragma unroll
                for (int t = 0; t < NT; ++t)
                  mma_bf16(acc[mt][j][t], a[0], a[1], a[2], a[3], b[j][t][2 * j2], b[j][t][2 * j2 + 1]);
            }
          }
        }
      }
    }

    if (++kt < kt_per_tile) continue;
    // Epilogue of the tile; C fragment: rows r, r+8 of each m16 tile, columns 2c, 2c+1 of each n8 tile.
#pragma unroll
    for (int mt = 0; mt < MTILES; ++mt) {
#pragma unroll
      for (int t = 0; t < NT; ++t) {
        const float* g = acc[mt][0][t];
        if (MODE == 0) {
          // Column n = 8 gi + o sits at 16 s + 8 h + 2 cc + i of chunk n / 128, with cc = (n % 128) / 32,
          // s = 2 (gi % 4) + ((o >> 1) & 1), h = o & 1, i = o >> 2; this thread has o = 2c + h.
          const int gi = tile * (HALF / 8) + NT * warp + t;
          const int d0 = (gi >> 4) * 128 + 16 * (2 * (gi & 3) + (c & 1)) + 2 * ((gi >> 2) & 3) + (c >> 1);
          const int d1 = d0 + 8;
#pragma unroll
          for (int hh = 0; hh < 2; ++hh) {
            const int m = mt * 16 + r + 8 * hh;
            if (m < rows) {
              const float g0 = g[2 * hh], g1 = g[2 * hh + 1];
              const float u0 = acc[mt][1][t][2 * hh], u1 = acc[mt][1][t][2 * hh + 1];
              __nv_bfloat16* dst = h_out + (size_t)(row0 + m) * ((I + 127) / 128 * 128);
              dst[d0] = __float2bfloat16(g0 / (1.f + __expf(-g0)) * u0);
              dst[d1] = __float2bfloat16(g1 / (1.f + __expf(-g1)) * u1);
            }
          }
        } else if (mt * 16 < rows) {
#pragma unroll
          for (int j = 0; j < 2; ++j) {
            // Pair lanes (c, c^1): the even one gathers row r, columns 2c..2c+3; the odd one row r+8.
            const float* v = acc[mt][j][t];
            const bool odd = c & 1;
            const float o0 = __shfl_xor_sync(0xffffffffu, odd ? v[0] : v[2], 1);
            const float o1 = __shfl_xor_sync(0xffffffffu, odd ? v[1] : v[3], 1);
            const int m = mt * 16 + r + (odd ? 8 : 0);
            const int n = tile * BN + j * HALF + 8 * (NT * warp + t) + 2 * (c & ~1);
            if (m < rows && n < N) {
              const int slot = sorted_slot[row0 + m];
              const float wgt = topk_weights[slot];
              const float4 o = odd ? make_float4(o0, o1, v[2], v[3]) : make_float4(v[0], v[1], o0, o1);
              red_add4(acc_out + (size_t)(slot / k) * H + n,
                       make_float4(wgt * o.x, wgt * o.y, wgt * o.z, wgt * o.w));
            }
          }
        }
#pragma unroll
        for (int j = 0; j < 2; ++j)
#pragma unroll
          for (int v = 0; v < 4; ++v) acc[mt][j][t][v] = 0.f;
      }
    }
    kt = 0;
    ++tile;
  }
  cp_async_wait<0>();
}

#define MOE_GEMMS(NAME, MT, NT, STAGES)                                                                         \
  extern "C" __global__ void __launch_bounds__(THREADS, 2) moe_up_##NAME(                                       \
      const __nv_bfloat16* x_perm, const int* w13_packed, const __nv_bfloat16* w13_scale, const int* sorted_slot, \
      const int4* passes, __nv_bfloat16* h, int k, int H, int I, int n_tiles, int tpb) {                        \
    moe_gemm<0, MT, NT, STAGES>(x_perm, w13_packed, w13_scale, sorted_slot, passes, h, nullptr, nullptr, k, H, \
                                I, n_tiles, tpb);                                                              \
  }                                                                                                            \
  extern "C" __global__ void __launch_bounds__(THREADS, 2) moe_down_##NAME(                                     \
      const __nv_bfloat16* h, const int* w2_packed, const __nv_bfloat16* w2_scale, const int* sorted_slot,      \
      const int4* passes, const float* topk_weights, float* acc, int k, int H, int I, int n_tiles, int tpb) {  \
    moe_gemm<1, MT, NT, STAGES>(h, w2_packed, w2_scale, sorted_slot, passes, nullptr, topk_weights, acc, k, H, \
                                I, n_tiles, tpb);                                                              \
  }

// (rows per pass MT, n8 tiles per warp half NT, stages): ~104 KB of shared memory each, 2 blocks per SM.
MOE_GEMMS(m16n1, 16, 1, 4)  // T <= 16
MOE_GEMMS(m32n1, 32, 1, 3)  // a few rows per expert
MOE_GEMMS(m32n2, 32, 2, 2)  // many rows per expert: BN = 256 halves the activation re-reads per weight byte

// out = bf16(acc), 4 values per thread. Launch: any 1-D grid of 256-thread blocks (grid-stride).
extern "C" __global__ void moe_finalize(const float4* __restrict__ acc, uint2* __restrict__ out, int n4) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n4; i += gridDim.x * blockDim.x) {
    const float4 v = acc[i];
    out[i] = make_uint2(bf2_bits(__floats2bfloat162_rn(v.x, v.y)), bf2_bits(__floats2bfloat162_rn(v.z, v.w)));
  }
}
