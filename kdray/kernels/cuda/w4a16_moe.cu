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

#include "griddep.cuh"
#include "moe_prep.cuh"
#include "wgmma.cuh"

typedef unsigned int u32;

#define THREADS 256  // GEMM block: 8 warps
#define KC 256       // k per pipeline stage: 128 contiguous bytes of every packed weight row

__device__ __forceinline__ u32 smem_addr(const void* p) {
  u32 a;
  asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
  return a;
}

// 4 bytes global -> shared address dst, bypassing registers; zero-filled when !valid (cp_async16: wgmma.cuh).
__device__ __forceinline__ void cp_async4(u32 dst, const void* src, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 4 : 0));
}

// The four 8x8 b16 matrices whose rows lanes 8i..8i+7 address -> a[i] (an m16k16 A fragment).
__device__ __forceinline__ void ldmatrix_x4(u32* a, u32 addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(a[0]), "=r"(a[1]), "=r"(a[2]), "=r"(a[3])
               : "r"(addr)
               : "memory");
}

// Four 8x8 b16 matrices, fragment a[i] each (lane 4 g + c: row g, columns 2 c, 2 c + 1), stored transposed: row k
// of matrix i (the fragment's column k) at the address lane 8 i + k gives.
__device__ __forceinline__ void stmatrix_x4_trans(u32 addr, const u32* a) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1,%2,%3,%4};\n" ::"r"(addr), "r"(a[0]),
               "r"(a[1]), "r"(a[2]), "r"(a[3])
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

// Launch: grid (1 + P), block 1024, dynamic shared memory 8 * E bytes. Block 0 sorts topk_ids [T, k] by expert
// (moe_sort_slots), blocks 1..P permute x (moe_permute_x); see moe_prep.cuh.
extern "C" __global__ void __launch_bounds__(1024) moe_prep(
    const long long* __restrict__ topk_ids, const uint4* __restrict__ x, uint4* __restrict__ x_perm,
    int* __restrict__ sorted_slot, int4* __restrict__ passes, int T, int k, int E, int H, int mt) {
  griddep_wait();  // no early launch of the expert GEMMs (see moe_route_prep)
  extern __shared__ int sm[];
  if (blockIdx.x > 0)
    moe_permute_x(x, x_perm, T, H, 1);
  else
    moe_sort_slots(topk_ids, sm, sorted_slot, passes, T, k, E, mt);
}

// The split sort for many slots (moe_prep.cuh): moe_prep_count, grid (S + P), block 1024, dynamic shared memory
// 4 * E bytes: blocks 0..S-1 count the slots of chunk each into hist [S][E], the others permute x; then
// moe_prep_place, grid (S), the same block and shared memory: sorted_slot and passes as moe_prep's.
extern "C" __global__ void __launch_bounds__(1024) moe_prep_count(
    const long long* __restrict__ topk_ids, const uint4* __restrict__ x, uint4* __restrict__ x_perm,
    int* __restrict__ hist, int T, int k, int E, int H, int S, int chunk) {
  griddep_wait();  // (no early launch of the next kernel: its blocks would take the SMs the permutation runs on)
  extern __shared__ int sm[];
  if (blockIdx.x >= S)
    moe_permute_x(x, x_perm, T, H, S);
  else
    moe_count_slots(topk_ids, sm, hist, T * k, chunk, E);
}

extern "C" __global__ void __launch_bounds__(1024) moe_prep_place(
    const long long* __restrict__ topk_ids, const int* __restrict__ hist, int* __restrict__ sorted_slot,
    int4* __restrict__ passes, int T, int k, int E, int mt, int S, int chunk) {
  griddep_wait();
  extern __shared__ int sm[];
  moe_place_slots(topk_ids, hist, sm, sorted_slot, passes, T * k, chunk, S, E, mt);
}

// One GEMM of a pass: out[m, n] = sum_k A[m, k] * W[e][n, k] for the pass's rows m and the block's N tiles.
// A tile is BN = 128 * NT weight rows, two halves of HALF = 64 * NT rows; warp w owns the n8 tiles at rows
// j * HALF + 8 * (NT * w + t), j < 2, t < NT. A stage holds KC = 256 k (two 128-k mma chunks) of the tile:
// packed weights [BN][128 B], scales [BN][8 groups], activations [MT][512 B] (rows of lda = K rounded up to 128).
// MODE 0 (gate/up): A = x_perm rows of the pass's tokens, K = H, W = w13 (N = 2I); half 0 holds HALF gate rows
//   and half 1 the matching up rows, so h[row, n] = silu(gate) * up is formed in registers and stored bf16 in
//   the logical k order.
// MODE 1 (down): A = h rows, K = I, W = w2 (N = H); y[slot, n] = bf16(topk_weight * out), one row per (token, slot)
//   (moe_finalize_slots sums a token's rows in slot order).
// Launch: grid (max_passes, ceil(n_tiles / tpb)), block 256,
// shared STAGES * (BN * KC / 2 + BN * KC / 16 + MT * KC * 2) bytes.
template <int MODE, int MT, int NT, int STAGES>
__device__ __forceinline__ void moe_gemm(const __nv_bfloat16* __restrict__ a_src, const int* __restrict__ w_packed,
                                         const __nv_bfloat16* __restrict__ w_scale,
                                         const int* __restrict__ sorted_slot, const int4* __restrict__ passes,
                                         __nv_bfloat16* __restrict__ h_out, const float* __restrict__ topk_weights,
                                         __nv_bfloat16* __restrict__ y_out, int k, int H, int I, int n_tiles, int tpb,
                                         int tiled) {
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
  // Offsets in the expert's weights / scales for the tile being loaded (-1 past N), and their step per stage:
  // compressed-tensors rows [N][K/8 words] / [N][K/32], or the tiled layout [K/64][N][8] / [K/64][N][2].
  int w_off[W_PER], s_off[S_PER];
  const int w_step = tiled ? 32 * N : KC / 8, s_step = tiled ? 8 * N : KC / 32;
  auto global_row = [&](int tile, int row) { return tile * TILE_N + (row >= HALF ? half_off : 0) + row % HALF; };
  int ld_kt = 0, ld_tile = tile0, ld_buf = 0;
  auto load_next_stage = [&]() {
    if (ld_kt == 0) {
#pragma unroll
      for (int i = 0; i < W_PER; ++i) {
        const int grow = global_row(ld_tile, (tid >> 3) + 32 * i);
        w_off[i] = grow >= N ? -1 : tiled ? (wu >> 1) * 8 * N + grow * 8 + 4 * (wu & 1) : grow * (K / 8) + 4 * wu;
      }
#pragma unroll
      for (int i = 0; i < S_PER; ++i) {
        const int grow = global_row(ld_tile, (tid >> 2) + 64 * i);
        s_off[i] = grow >= N ? -1 : tiled ? su * 2 * N + grow * 2 : grow * (K / 32) + 2 * su;
      }
    }
    const u32 st = s_base + ld_buf * STAGE_BYTES;
    const int k0 = ld_kt * KC;
    const bool w_ok = k0 + 32 * wu < K, s_ok = k0 + 64 * su < K, a_ok = k0 + 8 * am < lda;
#pragma unroll
    for (int i = 0; i < W_PER; ++i)
      if (w_off[i] >= 0) cp_async16(st + w_dst + 32 * W_ROW * i, w_exp + (w_ok ? w_off[i] + ld_kt * w_step : 0), w_ok);
#pragma unroll
    for (int i = 0; i < S_PER; ++i)
      if (s_off[i] >= 0) cp_async4(st + s_dst + 64 * S_ROW * i, s_exp + (s_ok ? s_off[i] + ld_kt * s_step : 0), s_ok);
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
              *reinterpret_cast<uint2*>(y_out + (size_t)slot * H + n) =
                  make_uint2(bf2_bits(__floats2bfloat162_rn(wgt * o.x, wgt * o.y)),
                             bf2_bits(__floats2bfloat162_rn(wgt * o.z, wgt * o.w)));
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

#define MOE_GEMMS(NAME, MT, NT, STAGES, MIN_BLOCKS)                                                             \
  extern "C" __global__ void __launch_bounds__(THREADS, MIN_BLOCKS) moe_up_##NAME(                                       \
      const __nv_bfloat16* x_perm, const int* w13_packed, const __nv_bfloat16* w13_scale, const int* sorted_slot, \
      const int4* passes, __nv_bfloat16* h, int k, int H, int I, int n_tiles, int tpb, int tiled) {             \
    griddep_begin();                                                                                            \
    moe_gemm<0, MT, NT, STAGES>(x_perm, w13_packed, w13_scale, sorted_slot, passes, h, nullptr, nullptr, k, H, \
                                I, n_tiles, tpb, tiled);                                                       \
  }                                                                                                            \
  extern "C" __global__ void __launch_bounds__(THREADS, MIN_BLOCKS) moe_down_##NAME(                                     \
      const __nv_bfloat16* h, const int* w2_packed, const __nv_bfloat16* w2_scale, const int* sorted_slot,      \
      const int4* passes, const float* topk_weights, __nv_bfloat16* y, int k, int H, int I, int n_tiles,       \
      int tpb, int tiled) {                                                                                    \
    griddep_begin();                                                                                           \
    moe_gemm<1, MT, NT, STAGES>(h, w2_packed, w2_scale, sorted_slot, passes, nullptr, topk_weights, y, k, H,   \
                                I, n_tiles, tpb, tiled);                                                       \
  }

// (rows per pass MT, n8 tiles per warp half NT, stages, blocks per SM): ~104 KB of shared memory each for the
// first three (2 blocks per SM), 136 KB for the prefill size (one block per SM).
MOE_GEMMS(m16n1, 16, 1, 4, 2)  // T <= 16
MOE_GEMMS(m32n1, 32, 1, 3, 2)  // a few rows per expert
MOE_GEMMS(m32n2, 32, 2, 2, 2)  // many rows per expert: BN = 256 halves the activation re-reads per weight byte
MOE_GEMMS(m64n2, 64, 2, 2, 1)  // prefill: each dequantized weight feeds twice the MMAs

// ---------------------------------------------------------------------------------------------------------------
// Skinny path (few rows per expert): a pass is one expert's <= 8 rows, and the mma is swapped: 16 weight rows are
// the A operand (each lane's 16-byte weight pieces, loaded from global memory into registers and dequantized there)
// and the pass's rows the 8 columns of B (read from x or h as they are and permuted in registers), so each weight byte
// crosses HBM once and feeds one mma. Lane (r, c) of a warp loads the 32 k [32 (4 ch + c), +32) of chunk ch of
// weight rows r and r + 8 (one group: one scale) and the same 32 k of row r of B; pair p of word q of its weight
// piece (nibbles p, p + 4) meets the B pair (8q + p, 8q + p + 4), the k-slot mapping of the tensor-core path above.

// 16-byte load of streamed weights: not kept in L1.
__device__ __forceinline__ uint4 ld_stream(const uint4* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

__device__ __forceinline__ uint4 ld_nc(const uint4* p) {  // 16 bytes through L1, issued where written
  uint4 v;
  asm volatile("ld.global.nc.v4.u32 {%0,%1,%2,%3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}
__device__ __forceinline__ int ld_s32(const int* p) {  // issued where written
  int v;
  asm volatile("ld.global.nc.s32 %0, [%1];\n" : "=r"(v) : "l"(p));
  return v;
}
__device__ __forceinline__ __nv_bfloat16 ld_bf16(const __nv_bfloat16* p) {  // issued where written
  unsigned short v;
  asm volatile("ld.global.nc.u16 %0, [%1];\n" : "=h"(v) : "l"(p));
  return __ushort_as_bfloat16(v);
}

// B fragment of k-step 2q + j of a chunk from the lane's 16-byte piece q of its B row:
// (k 2j, 2j + 4) and (2j + 1, 2j + 5) of the piece.
__device__ __forceinline__ void b_frag(uint4 v, int j, u32& b0, u32& b1) {
  const u32 lo = j ? v.y : v.x, hi = j ? v.w : v.z;
  b0 = __byte_perm(lo, hi, 0x5410);
  b1 = __byte_perm(lo, hi, 0x7632);
}

// acc[m] += W_m (16 rows: pieces w[m][0] for row r, w[m][1] for row r + 8, scales sc[m][*]) x B over one 128-k chunk.
template <int M>
__device__ __forceinline__ void skinny_chunk(float (*acc)[4], const uint4 (*w)[2], const __nv_bfloat16 (*sc)[2],
                                             const uint4* xv) {
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    u32 a[M][2][4];
#pragma unroll
    for (int m = 0; m < M; ++m)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const uint4 v = w[m][h];
        dequant_word(q == 0 ? v.x : q == 1 ? v.y : q == 2 ? v.z : v.w, __bfloat162bfloat162(sc[m][h]), a[m][h]);
      }
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      u32 b0, b1;
      b_frag(xv[q], j, b0, b1);
#pragma unroll
      for (int m = 0; m < M; ++m)
        mma_bf16(acc[m], a[m][0][2 * j], a[m][1][2 * j], a[m][0][2 * j + 1], a[m][1][2 * j + 1], b0, b1);
    }
  }
}

// Index of 16-byte piece (= scale) g of weight row n of expert e over N rows of `groups` pieces: row-major for
// compressed-tensors, [K/64][N][2 pieces] for the tiled layout (repack_int4_experts). Split as row part + group part.
// 32-bit: an expert tensor holds fewer than 2^32 pieces (64 GiB).
__device__ __forceinline__ u32 skinny_row(int e, int n, int N, int groups, int tiled) {
  return (u32)e * N * groups + (u32)n * (tiled ? 2 : groups);
}
__device__ __forceinline__ u32 skinny_group(int g, int N, int tiled) {
  return tiled ? (u32)(g >> 1) * 2 * N + (g & 1) : (u32)g;
}

#define SK_DOWN_WARPS 8  // warps of a down block, 32 output rows each

// The skinny kernels are persistent: the grid is at most a wave of blocks, and a block takes the items (pass,
// column tile) blockIdx.x, + gridDim.x, ... of the passes[0].x passes that moe_prep wrote. The launch cannot know
// that count (no host sync: it is captured in graphs), so a grid of max_passes blocks per column tile would be mostly
// blocks that read the count and exit, each holding an SM's slot for a global load (at 65 tokens, ~6,000 of the up
// kernel's ~7,200 blocks).

// Gate/up: h[row0 + n, c0 + i] = silu(gate) * up for the pass's rows n < rows and the item's 16 columns
// [c0, c0 + 16) of h (gate rows c0 + i and up rows I + c0 + i of w13). The WARPS warps split K = H into 128-k
// chunks (warp w: chunks w, w + WARPS, ...) and sum their partial tiles in shared memory at the item's end. A warp's
// chunks, over the block's items one after another, are one stream: each lane loads its 16-byte weight pieces, their
// scales and its x pieces straight into registers AHEAD chunks ahead of their math (volatile loads: ptxas keeps them
// ahead of the mma's), so the stream runs on into the next item across the epilogue's barriers. Every warp takes
// ceil(chunks / WARPS) positions an item (past its last chunk it loads that chunk again and adds nothing), so the
// barriers are uniform. Lanes past the pass's rows load its last row's x (that row's lane's addresses: no more
// traffic); their columns are not stored. (A cp.async ring in shared memory took 13-17% more time alone at 4-65
// tokens: its 4-byte scale copies alone cost ~15% of a plain read of the bytes.)
// Forms (WARPS, BLOCKS resident per SM, AHEAD), chosen by items per SM in w4a16_moe.py: (16, 1, 1) for a token's
// ~one item an SM, (4, 4, 1) from a few, (4, 3, 2) from many (fewer warps, twice the loads in flight each).
// Launch: grid min(max_passes * I / 16, BLOCKS * SMs), block 32 * WARPS; H % 128 == 0, group 32. h rows are natural
// k order.
template <int WARPS, int AHEAD>
__device__ __forceinline__ void moe_up_skinny(
    const __nv_bfloat16* __restrict__ x, const int* __restrict__ w13_packed,
    const __nv_bfloat16* __restrict__ w13_scale, const int* __restrict__ sorted_slot, const int4* __restrict__ passes,
    __nv_bfloat16* __restrict__ h, int k, int H, int I, int tiled) {
  static_assert(WARPS >= 4, "the epilogue's 128 threads sum the partial tiles");
  __shared__ float part[WARPS][2][4][32];  // the warps' partial tiles
  const int tiles = I / 16, items = passes[0].x * tiles, G = gridDim.x;
  if ((int)blockIdx.x >= items) return;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, r = lane >> 2, c = lane & 3;
  const int groups = H / 32, chunks = H / 128, N = 2 * I, per_item = (chunks + WARPS - 1) / WARPS;
  const u32 row_stride = tiled ? 2 : groups;  // pieces between consecutive weight rows (skinny_row)
  const uint4* wq = reinterpret_cast<const uint4*>(w13_packed);
  // An item's pass (expert 0, no rows past the items) and the slot of its row r (of its last row past its rows, slot
  // 0 past the items: every lane loads from real rows, and the columns past the rows are not stored). Both are read
  // an item or two before they are used, so that no warp waits on them at an item's start.
  auto pass_at = [&](int it) { return it < items ? passes[1 + it / tiles] : make_int4(0, 0, 0, 0); };
  auto slot_of = [&](int4 p) { return p.z > 0 ? sorted_slot[p.y + min(r, p.z - 1)] : 0; };

  // Issue side: the item and position of the next chunk to load, the piece index of its gate row c0 + r and the x
  // row of lane row r (slot_of); the next item's pass and slot, the one after's pass.
  int i_item = blockIdx.x, i_pos = 0;
  u32 i_w0;
  const uint4* i_xr;
  auto start_item = [&](int4 p, int slot) {
    i_w0 = skinny_row(p.x, i_item % tiles * 16 + r, N, groups, tiled);
    i_xr = reinterpret_cast<const uint4*>(x) + (size_t)(slot / k) * (H / 8);
  };
  const int4 pass0 = pass_at(i_item);
  start_item(pass0, slot_of(pass0));
  int4 i_pass1 = pass_at(i_item + G), i_pass2 = pass_at(i_item + 2 * G);
  int i_slot1 = slot_of(i_pass1);
  struct Chunk {
    uint4 w[2][2], x[4];  // weight pieces of rows (gate, up) x (r, r + 8); x pieces of row r
    __nv_bfloat16 s[2][2];
  };
  auto issue = [&](Chunk& b) {  // load the issue side's chunk (past the warp's chunks, its last again) and step
    const int g = 4 * min(warp + i_pos * WARPS, chunks - 1) + c;
#pragma unroll
    for (int m = 0; m < 2; ++m)
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const u32 piece = i_w0 + (u32)(m * I + 8 * hh) * row_stride + skinny_group(g, N, tiled);
        b.w[m][hh] = ld_stream(wq + piece);
        b.s[m][hh] = ld_bf16(w13_scale + piece);
      }
#pragma unroll
    for (int q = 0; q < 4; ++q) b.x[q] = ld_nc(i_xr + 4 * g + q);
    if (++i_pos == per_item) {
      i_pos = 0;
      i_item += G;
      start_item(i_pass1, i_slot1);
      i_pass1 = i_pass2;
      i_slot1 = slot_of(i_pass2);
      i_pass2 = pass_at(i_item + 2 * G);
    }
  };

  Chunk buf[AHEAD + 1];
#pragma unroll
  for (int a = 0; a < AHEAD; ++a) issue(buf[a]);
  int item = blockIdx.x, pos = 0;  // compute side: its item, position and pass; the next item's pass
  int4 pass = pass0, next_pass = pass_at(item + G);
  float acc[2][4] = {};
  while (item < items) {
#pragma unroll
    for (int u = 0; u <= AHEAD; ++u) {  // position u of AHEAD + 1 sits in buf[u]
      issue(buf[(u + AHEAD) % (AHEAD + 1)]);
      if (warp + pos * WARPS < chunks) skinny_chunk<2>(acc, buf[u].w, buf[u].s, buf[u].x);
      if (++pos == per_item) {  // the item's last position: sum the warps' tiles, write h
#pragma unroll
        for (int m = 0; m < 2; ++m)
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            part[warp][m][i][lane] = acc[m][i];
            acc[m][i] = 0.f;
          }
        __syncthreads();
        if (threadIdx.x < 128) {  // C element i of lane l: tile row (l >> 2) + 8 (i >> 1), column 2 (l & 3) + (i & 1)
          const int l = threadIdx.x & 31, i = threadIdx.x >> 5, n = 2 * (l & 3) + (i & 1);
          float g = 0.f, up = 0.f;
#pragma unroll
          for (int v = 0; v < WARPS; ++v) {
            g += part[v][0][i][l];
            up += part[v][1][i][l];
          }
          if (n < pass.z)
            h[(size_t)(pass.y + n) * I + item % tiles * 16 + (l >> 2) + 8 * (i >> 1)] =
                __float2bfloat16(g / (1.f + __expf(-g)) * up);
        }
        item += G;
        if (item >= items) break;
        __syncthreads();  // part is rewritten by the next item
        pos = 0;
        pass = next_pass;
        next_pass = pass_at(item + G);
      }
    }
  }
}
#define MOE_UP_SKINNY(WARPS, BLOCKS, AHEAD)                                                                        \
  extern "C" __global__ void __launch_bounds__(32 * WARPS, BLOCKS) moe_up_skinny_w##WARPS##_b##BLOCKS##_a##AHEAD(      \
      const __nv_bfloat16* __restrict__ x, const int* __restrict__ w13_packed,                                     \
      const __nv_bfloat16* __restrict__ w13_scale, const int* __restrict__ sorted_slot,                           \
      const int4* __restrict__ passes, __nv_bfloat16* __restrict__ h, int k, int H, int I, int tiled) {            \
    griddep_begin();                                                                                               \
    moe_up_skinny<WARPS, AHEAD>(x, w13_packed, w13_scale, sorted_slot, passes, h, k, H, I, tiled);               \
  }
MOE_UP_SKINNY(16, 1, 1)  // 122 registers each
MOE_UP_SKINNY(4, 4, 1)
MOE_UP_SKINNY(4, 3, 2)  // 158 registers

// Down: y[slot, n] = bf16(topk_weight * (W2[e] h)[n]) for the pass's rows (one row per (token, slot), as the wgmma
// family's down GEMMs write it; moe_finalize_slots sums a token's rows in slot order, so the result is the same bits
// on every call); per item (pass, tile of 256 outputs) warp w owns output rows n0 = 256 tile + 32 w + [0, 32) (two
// m16 tiles) over all of K = I; each tile goes through shared memory so a lane stores 4 consecutive outputs of one
// row (8 bytes). The blocks resident on an SM hide each other's latencies.
// Launch: grid min(max_passes * ceil(H / 256), 3 SMs) (79 registers: three blocks of 8 warps fit an SM), block
// 32 * SK_DOWN_WARPS; H % 16 == 0, I % 128 == 0, group 32.
extern "C" __global__ void __launch_bounds__(32 * SK_DOWN_WARPS) moe_down_skinny(
    const __nv_bfloat16* __restrict__ h, const int* __restrict__ w2_packed, const __nv_bfloat16* __restrict__ w2_scale,
    const int* __restrict__ sorted_slot, const int4* __restrict__ passes, const float* __restrict__ topk_weights,
    __nv_bfloat16* __restrict__ y, int H, int I, int tiled) {
  griddep_begin();
  __shared__ float tile[SK_DOWN_WARPS][16 * 8];
  const int tiles = (H + 32 * SK_DOWN_WARPS - 1) / (32 * SK_DOWN_WARPS), n_pass = passes[0].x, items = n_pass * tiles;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, r = lane >> 2, c = lane & 3;
  const int groups = I / 32, chunks = I / 128;
  const uint4* wq = reinterpret_cast<const uint4*>(w2_packed);
  // Items pass-fastest (the blocks at work share a tile of outputs). A block reads its next item's pass while it works
  // on this one, and a lane its row's slot before the weights (volatile, so it is issued there): neither an item's
  // weight loads nor its reduction wait on a read that could have been made earlier.
  const int n = lane & 7, quad = lane >> 3;  // epilogue: lane l stores outputs 4 quad .. + 3 of the tile, pass row n
  int4 pass_next = blockIdx.x < items ? passes[1 + blockIdx.x % n_pass] : make_int4(0, 0, 0, 0);
  for (int item = blockIdx.x; item < items; item += gridDim.x) {
    const int4 pass = pass_next;
    if (item + gridDim.x < items) pass_next = passes[1 + (item + gridDim.x) % n_pass];
    const int e = pass.x, row0 = pass.y, rows = pass.z;
    const int n0 = item / n_pass * 32 * SK_DOWN_WARPS + 32 * warp;
    if (n0 < H) {
      const int slot = n < rows ? ld_s32(sorted_slot + row0 + n) : -1;
      const bool tile1 = n0 + 16 < H;
      u32 wrow[2][2];  // as in moe_up_skinny; rows past H (a half block) are never loaded
#pragma unroll
      for (int m = 0; m < 2; ++m)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) wrow[m][hh] = skinny_row(e, n0 + r + 16 * m + 8 * hh, H, groups, tiled);
      // h row of lane row r (of the pass's last row past its rows: its columns are not added)
      const uint4* hr = reinterpret_cast<const uint4*>(h) + (size_t)(row0 + min(r, rows - 1)) * (I / 8);
      float acc[2][4] = {};
#pragma unroll 2
      for (int ch = 0; ch < chunks; ++ch) {
        const int g = 4 * ch + c;
        uint4 w[2][2], xv[4];
        __nv_bfloat16 sc[2][2];
#pragma unroll
        for (int m = 0; m < 2; ++m)
#pragma unroll
          for (int hh = 0; hh < 2; ++hh) {
            const u32 piece = wrow[m][hh] + skinny_group(g, H, tiled);
            const bool ok = m == 0 || tile1;
            w[m][hh] = ok ? ld_stream(wq + piece) : make_uint4(0u, 0u, 0u, 0u);
            sc[m][hh] = ok ? ld_bf16(w2_scale + piece) : __float2bfloat16(0.f);
          }
#pragma unroll
        for (int q = 0; q < 4; ++q) xv[q] = ld_nc(hr + 4 * g + q);
        skinny_chunk<2>(acc, w, sc, xv);
      }
      const float wgt = slot >= 0 ? topk_weights[slot] : 0.f;
      float* t = tile[warp];
#pragma unroll
      for (int m = 0; m < 2; ++m) {
        if (m == 1 && !tile1) break;
        t[r * 8 + 2 * c] = acc[m][0];
        t[r * 8 + 2 * c + 1] = acc[m][1];
        t[(r + 8) * 8 + 2 * c] = acc[m][2];
        t[(r + 8) * 8 + 2 * c + 1] = acc[m][3];
        __syncwarp();
        if (slot >= 0) {
          const __nv_bfloat162 lo = __floats2bfloat162_rn(wgt * t[(4 * quad) * 8 + n], wgt * t[(4 * quad + 1) * 8 + n]);
          const __nv_bfloat162 hi =
              __floats2bfloat162_rn(wgt * t[(4 * quad + 2) * 8 + n], wgt * t[(4 * quad + 3) * 8 + n]);
          *reinterpret_cast<uint2*>(y + (size_t)slot * H + n0 + 16 * m + 4 * quad) =
              make_uint2(bf2_bits(lo), bf2_bits(hi));
        }
        __syncwarp();
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Hopper path (sm_90a; many rows per expert): wgmma grouped GEMM over the tiled expert layout of
// repack_int4_experts (packed [E][K/64][N][8 words], scales [E][K/64][N][2]: the 64 k of one K tile of an N tile's
// rows are one contiguous run). A block owns one pass (<= M = 64 WGM rows of one expert) and streams its N tiles
// of BN = 256 weight rows over K in stages of 64 k, flat over (tile, K tile) like moe_gemm above:
//   * cp.async ring of WG_STAGES raw stages: the pass's activation rows [M][64 k] (natural k order, 128B swizzle:
//     16-byte chunk c of row r at c ^ (r & 7), the canonical K-major wgmma layout), packed weights [BN][32 B] and
//     scales [BN][2];
//   * all 256 threads dequantize a raw stage into bf16 [BN][64 k] (same swizzle) in one of two B buffers while the
//     tensor cores run the previous stage (wgmma is asynchronous; two stages' wgmma groups are in flight at the
//     top of a step, so the tensor cores never wait for the barriers);
//   * wgmma m64nNk16, both operands from shared memory: WGM = 2 warpgroups each take 64 rows x all 256 columns
//     (N = 256), or WGM = 1: both warpgroups take the 64 rows, 128 columns each.
// Up (MODE 0): tile t holds 128 outputs; its B rows are [gate 64][up 64][gate 64][up 64] (outputs 128 t + [0, 64),
// then + [64, 128)), so every 128-column slice has a gate column and its up column 64 apart in one thread's
// accumulators; h[row, o] = silu(gate) * up (bf16, natural order). Down (MODE 1): y[slot, n] = topk_weight *
// (W2 h)[n] in bf16, one row per (token, slot); moe_finalize_slots sums each token's k rows in slot order, so the
// result is the same bits on every call (no atomics).
#define WG_BN 256     // weight rows per N tile
#define WG_THREADS 256

#define WG_RES_K 256  // the down GEMM keeps its pass's h rows in shared memory when I <= WG_RES_K

// RES: the pass's activation rows [M][K <= WG_RES_K] are loaded once into shared memory (64-k chunks of [M][128 B],
// swizzled) instead of with every stage; the down GEMM's K = I is that small for K2 TP8 (256), and its N tiles
// would otherwise read the same rows 28 times.
template <int WGM, bool RES>
struct WgCfg {
  static constexpr int M = 64 * WGM, WGN = 2 / WGM, NW = WG_BN / WGN;  // rows per pass; columns per warpgroup
  static constexpr int A_BYTES = RES ? 0 : M * 128, W_BYTES = WG_BN * 32, S_BYTES = WG_BN * 4;
  static constexpr int STAGE = A_BYTES + W_BYTES + S_BYTES;  // a multiple of 1024 (swizzle atom alignment)
  static constexpr int STAGES = RES ? 8 : WGM == 2 ? 5 : 6;
  static constexpr int RES_BYTES = RES ? M * WG_RES_K * 2 : 0;
  static constexpr int B_BYTES = WG_BN * 128;
  // [resident A][raw stages][2 B buffers]; + 1024: the base is rounded up to 1024
  static constexpr int SMEM = 1024 + RES_BYTES + STAGES * STAGE + 2 * B_BYTES;
};
static_assert(WgCfg<1, false>::STAGE % 1024 == 0 && WgCfg<2, false>::STAGE % 1024 == 0 &&
              WgCfg<1, true>::STAGE % 1024 == 0, "stages must keep 1024-byte alignment");
static_assert(WgCfg<2, true>::SMEM <= 227 * 1024 && WgCfg<2, false>::SMEM <= 227 * 1024, "shared memory per block");

// Word of 8 nibbles (8 consecutive k) -> 4 bf16x2 (k 2j, 2j + 1) * scale, q = u - 8: natural k order.
__device__ __forceinline__ void dequant_word_natural(u32 w, __nv_bfloat162 scale, u32* out) {
  const __nv_bfloat162 bias = bits_bf2(0x43084308u);  // 136 = 128 + 8
  const u32 hi = w >> 4;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    u32 t = __byte_perm(w, hi, j | ((4 + j) << 8));  // low nibbles: byte 0 = nibble 2j, byte 2 = nibble 2j + 1
    asm("lop3.b32 %0, %0, %1, %2, 0xEA;\n" : "+r"(t) : "r"(0x000F000Fu), "r"(0x43004300u));
    out[j] = bf2_bits(__hmul2(__hsub2(bits_bf2(t), bias), scale));
  }
}

// The 4 lanes of a quad each hold one row's bf16x2 words w[i] = columns 8 i + 2 (lane & 3) .. + 1 of 4 consecutive
// 8-column groups i; returns this lane's 16 bytes, columns 8 (lane & 3) .. + 7 (the quad's 4 x 4 transpose in two
// rounds of shuffles), so the epilogue stores 16 bytes per lane instead of 4 (four times fewer store instructions:
// the down GEMM's epilogue was throttled on the store queue). All 32 lanes must call it.
__device__ __forceinline__ uint4 quad_transpose(const u32 (&w)[4], int lane) {
  const bool b = lane & 1, h = lane & 2;
  const u32 s0 = __shfl_xor_sync(0xffffffffu, b ? w[0] : w[1], 1);
  const u32 s1 = __shfl_xor_sync(0xffffffffu, b ? w[2] : w[3], 1);
  // Columns 4 h .. + 3 of groups b (c0) and 2 + b (c1).
  const u32 c0lo = b ? s0 : w[0], c0hi = b ? w[1] : s0, c1lo = b ? s1 : w[2], c1hi = b ? w[3] : s1;
  const u32 r_lo = __shfl_xor_sync(0xffffffffu, h ? c0lo : c1lo, 2);
  const u32 r_hi = __shfl_xor_sync(0xffffffffu, h ? c0hi : c1hi, 2);
  return h ? make_uint4(r_lo, r_hi, c1lo, c1hi) : make_uint4(c0lo, c0hi, r_lo, r_hi);
}

// MODE 0: a_src = x [T, H], w = w13 tiled, writes h [slots, I]. MODE 1: a_src = h, w = w2 tiled, writes y
// [T * k, H]. Launch: grid (ceil(n_tiles / tpb), max_passes), block 256, shared WgCfg<WGM, RES>::SMEM bytes: the
// blocks of one pass run side by side (its activation rows are read from L2 once), then those of the expert's next
// pass (its weights again).
// Needs H % 256 == 0, I % 128 == 0, and with RES K <= WG_RES_K (checked by the caller).
template <int MODE, int WGM, bool RES>
__device__ __forceinline__ void moe_wgmma_gemm(const __nv_bfloat16* __restrict__ a_src,
                                               const int* __restrict__ w_packed,
                                               const __nv_bfloat16* __restrict__ w_scale,
                                               const int* __restrict__ sorted_slot, const int4* __restrict__ passes,
                                               __nv_bfloat16* __restrict__ out, const float* __restrict__ topk_weights,
                                               int k, int H, int I, int n_tiles, int tpb) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using C = WgCfg<WGM, RES>;
  constexpr int A_PER = RES ? 1 : C::M / 32;  // 16-byte activation chunks per thread and stage
  extern __shared__ unsigned char wg_smem[];
  if (blockIdx.y >= passes[0].x) return;
  const int4 pass = passes[1 + blockIdx.y];
  const int e = pass.x, row0 = pass.y, rows = pass.z;
  const int K = MODE == 0 ? H : I, N = MODE == 0 ? 2 * I : H, KT = K / 64;
  const int tile0 = blockIdx.x * tpb;
  const int n_stages = (min(tile0 + tpb, n_tiles) - tile0) * KT;
  const int tid = threadIdx.x, wg = tid >> 7, warp = (tid >> 5) & 3, lane = tid & 31;
  const int wg_m = WGM == 2 ? wg : 0, wg_n = WGM == 2 ? 0 : wg;
  const u32 base = (smem_u32(wg_smem) + 1023) & ~1023u;
  unsigned char* const sbase = wg_smem + (base - smem_u32(wg_smem));
  const u32 raw_base = base + C::RES_BYTES, b_base = raw_base + C::STAGES * C::STAGE;
  const int* w_exp = w_packed + (size_t)e * KT * N * 8;
  const __nv_bfloat16* s_exp = w_scale + (size_t)e * KT * N * 2;

  // Loader: activation chunk (row (tid >> 3) + 32 i, chunk tid & 7); weight pieces (row (tid >> 1) + 128 i, half
  // tid & 1: words 4 half .. + 3); scales (threads < 64: rows 4 tid .. + 3, 16 bytes).
  int a_off[A_PER];
#pragma unroll
  for (int i = 0; i < A_PER; ++i) {
    const int ar = (tid >> 3) + 32 * i;
    a_off[i] = RES || ar >= rows ? -1
                                 : (MODE == 0 ? (sorted_slot[row0 + ar] / k) * H : (row0 + ar) * I) + 8 * (tid & 7);
  }
  const u32 a_dst = (tid >> 3) * 128 + (((tid & 7) ^ ((tid >> 3) & 7)) << 4);
  // Weight row of B row r of tile t (MODE 0: [gate 64][up 64][gate 64][up 64] of outputs 128 t + [0, 128)).
  auto grow = [&](int t, int r) {
    return MODE == 0 ? ((r >> 6) & 1) * I + t * 128 + (r >> 7) * 64 + (r & 63) : t * WG_BN + r;
  };
  if (RES) {  // the pass's rows, all of K, once (they join stage 0's copy group): chunk q -> row q / (K / 8)
    const int per_row = K / 8;
    for (int q = tid; q < C::M * per_row; q += WG_THREADS) {
      const int ar = q / per_row, ch = q - ar * per_row, c = ch & 7;
      if (ar < rows)
        cp_async16(base + (ch >> 3) * C::M * 128 + ar * 128 + ((c ^ (ar & 7)) << 4),
                   a_src + (MODE == 0 ? (sorted_slot[row0 + ar] / k) * H : (row0 + ar) * I) + 8 * ch, true);
    }
  }
  int ld_kt = 0, ld_tile = tile0, ld_slot = 0;
  int w_row[2], s_row = 0;
  auto load_next = [&]() {
    if (ld_kt == 0) {
#pragma unroll
      for (int i = 0; i < 2; ++i) w_row[i] = grow(ld_tile, (tid >> 1) + 128 * i);
      s_row = grow(ld_tile, 4 * (tid & 63));
    }
    const u32 st = raw_base + ld_slot * C::STAGE;
    const int k0 = ld_kt * 64;
#pragma unroll
    for (int i = 0; i < A_PER; ++i)
      if (!RES && a_off[i] >= 0) cp_async16(st + a_dst + 32 * 128 * i, a_src + a_off[i] + k0, true);
    const int* wk = w_exp + (size_t)ld_kt * N * 8 + 4 * (tid & 1);
#pragma unroll
    for (int i = 0; i < 2; ++i) cp_async16(st + C::A_BYTES + (tid + 256 * i) * 16, wk + w_row[i] * 8, true);
    if (tid < 64)
      cp_async16(st + C::A_BYTES + C::W_BYTES + tid * 16, s_exp + (size_t)ld_kt * N * 2 + s_row * 2, true);
    ld_slot = ld_slot == C::STAGES - 1 ? 0 : ld_slot + 1;
    if (++ld_kt == KT) {
      ld_kt = 0;
      ++ld_tile;
    }
  };
  // Raw stage `slot` -> bf16 B buffer `buf`: unit (row r, half) per thread and i: r = (tid >> 1) + 128 i.
  auto dequant = [&](int slot, int buf) {
    const unsigned char* st = sbase + C::RES_BYTES + slot * C::STAGE;
    unsigned char* b = sbase + C::RES_BYTES + C::STAGES * C::STAGE + buf * C::B_BYTES;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int r = (tid >> 1) + 128 * i, half = tid & 1;
      const uint4 w = *reinterpret_cast<const uint4*>(st + C::A_BYTES + (tid + 256 * i) * 16);
      const __nv_bfloat162 sc = __bfloat162bfloat162(
          reinterpret_cast<const __nv_bfloat16*>(st + C::A_BYTES + C::W_BYTES)[2 * r + half]);
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        u32 v[4];
        dequant_word_natural(q == 0 ? w.x : q == 1 ? w.y : q == 2 ? w.z : w.w, sc, v);
        *reinterpret_cast<uint4*>(b + r * 128 + (((4 * half + q) ^ (r & 7)) << 4)) = make_uint4(v[0], v[1], v[2], v[3]);
      }
    }
  };

  // This thread's accumulator rows (16 warp + g, + 8) of the pass, and for the down GEMM their slots and weights.
  const int m_lo = wg_m * 64 + 16 * warp + (lane >> 2);
  int slot_of[2] = {0, 0};
  float wgt[2] = {0.f, 0.f};
  if (MODE == 1) {
#pragma unroll
    for (int hh = 0; hh < 2; ++hh)
      if (m_lo + 8 * hh < rows) {
        slot_of[hh] = sorted_slot[row0 + m_lo + 8 * hh];
        wgt[hh] = topk_weights[slot_of[hh]];
      }
  }
  float acc[C::NW / 2];
#pragma unroll
  for (int i = 0; i < C::NW / 2; ++i) acc[i] = 0.f;

#pragma unroll
  for (int s = 0; s < C::STAGES - 1; ++s) {
    if (s < n_stages) load_next();
    cp_async_commit();
  }
  cp_async_wait<C::STAGES - 2>();
  fence_proxy_async();
  __syncthreads();
  if (n_stages > 0) dequant(0, 0);
  fence_proxy_async();  // the generic-proxy stores of B, read next by wgmma (async proxy)
  __syncthreads();

  const bool active = wg_m * 64 < rows;  // warpgroup-uniform: a second warpgroup past the pass's rows stores nothing
  int kt = 0, tile = tile0, slot = 0;
  for (int s = 0; s < n_stages; ++s) {
    // Step s: wgmma(s) joins wgmma(s - 1) in flight; once (s - 1) is done everywhere, its raw slot takes the copies of
    // stage s + STAGES - 1 and its B buffer the dequantized stage s + 1.
    const u32 a_st = (RES ? base + kt * C::M * 128 : raw_base + slot * C::STAGE) + wg_m * 64 * 128;
    const u32 b_st = b_base + (s & 1) * C::B_BYTES + wg_n * C::NW * 128;
    const u64 da = wg_desc(a_st, 16, 1024), db = wg_desc(b_st, 16, 1024);
    wg_fence();
#pragma unroll
    for (int ks = 0; ks < 4; ++ks)  // k16 steps: +32 bytes inside the 128-byte swizzled rows
      wgmma_ss(acc, wg_desc_add(da, 32 * ks), wg_desc_add(db, 32 * ks), kt > 0 || ks > 0);
    wg_commit();
    wg_wait<1>();                    // this warpgroup's wgmma(s - 1) is done
    cp_async_wait<C::STAGES - 3>();  // stage s + 1 has landed (this thread's copies)
    fence_proxy_async();
    __syncthreads();  // ... everyone's; every wgmma(s - 1) done: its raw slot and B buffer are free
    if (s + C::STAGES - 1 < n_stages) load_next();  // into the slot of stage s - 1
    cp_async_commit();
    slot = slot == C::STAGES - 1 ? 0 : slot + 1;
    if (s + 1 < n_stages) dequant(slot, (s + 1) & 1);  // overlaps the tensor cores' work on stage s
    fence_proxy_async();
    __syncthreads();  // B of stage s + 1 complete
    if (++kt < KT) continue;
    // Epilogue of tile `tile`: acc[4 j + v] is row m_lo + 8 (v >> 1), column 8 j + 2 (lane & 3) + (v & 1) of the
    // slice.
    wg_wait<0>();
    wg_pin(acc);
    // Each quad's row: groups of 4 x 8 columns, transposed across the quad into one 16-byte store per lane (lane q
    // stores group 4 g + q).
    if (active) {
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int m = m_lo + 8 * hh;  // quad-uniform; every lane shuffles, only rows < rows store
        if (MODE == 0) {
          __nv_bfloat16* dst = out + (size_t)(row0 + m) * I + tile * 128 + wg_n * (C::NW / 2) + 8 * (lane & 3);
#pragma unroll
          for (int g = 0; g < C::NW / 64; ++g) {  // 8-column groups 4 g .. + 3 of the h slice (gate at jg, up at + 8)
            u32 w[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) {
              const int jo = 4 * g + i, jg = 16 * (jo >> 3) + (jo & 7), ju = jg + 8;
              const float g0 = acc[4 * jg + 2 * hh], g1 = acc[4 * jg + 2 * hh + 1];
              const float u0 = acc[4 * ju + 2 * hh], u1 = acc[4 * ju + 2 * hh + 1];
              w[i] = bf2_bits(__floats2bfloat162_rn(g0 / (1.f + __expf(-g0)) * u0, g1 / (1.f + __expf(-g1)) * u1));
            }
            const uint4 v = quad_transpose(w, lane);
            if (m < rows) *reinterpret_cast<uint4*>(dst + 32 * g) = v;
          }
        } else {
          __nv_bfloat16* dst = out + (size_t)slot_of[hh] * H + tile * WG_BN + wg_n * C::NW + 8 * (lane & 3);
#pragma unroll
          for (int g = 0; g < C::NW / 32; ++g) {
            u32 w[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) {
              const int j = 4 * g + i;
              w[i] = bf2_bits(__floats2bfloat162_rn(wgt[hh] * acc[4 * j + 2 * hh], wgt[hh] * acc[4 * j + 2 * hh + 1]));
            }
            const uint4 v = quad_transpose(w, lane);
            if (m < rows) *reinterpret_cast<uint4*>(dst + 32 * g) = v;
          }
        }
      }
    }
    kt = 0;
    ++tile;
  }
  wg_wait<0>();
  cp_async_wait<0>();
#else
  __trap();  // the Python side launches these on sm_90 only
#endif
}

#define MOE_WGMMA(NAME, WGM)                                                                                   \
  extern "C" __global__ void __launch_bounds__(WG_THREADS, 1) moe_up_##NAME(                                  \
      const __nv_bfloat16* x, const int* w13_packed, const __nv_bfloat16* w13_scale, const int* sorted_slot,   \
      const int4* passes, __nv_bfloat16* h, int k, int H, int I, int n_tiles, int tpb) {                      \
    griddep_begin();                                                                                          \
    moe_wgmma_gemm<0, WGM, false>(x, w13_packed, w13_scale, sorted_slot, passes, h, nullptr, k, H, I, n_tiles, \
                                  tpb);                                                                        \
  }                                                                                                            \
  extern "C" __global__ void __launch_bounds__(WG_THREADS, 1) moe_down_##NAME(                                \
      const __nv_bfloat16* h, const int* w2_packed, const __nv_bfloat16* w2_scale, const int* sorted_slot,     \
      const int4* passes, const float* topk_weights, __nv_bfloat16* y, int k, int H, int I, int n_tiles,      \
      int tpb) {                                                                                               \
    griddep_begin();                                                                                           \
    moe_wgmma_gemm<1, WGM, false>(h, w2_packed, w2_scale, sorted_slot, passes, y, topk_weights, k, H, I,      \
                                  n_tiles, tpb);                                                               \
  }                                                                                                            \
  /* I <= WG_RES_K: the pass's h rows stay in shared memory across the N tiles */                              \
  extern "C" __global__ void __launch_bounds__(WG_THREADS, 1) moe_down_##NAME##_res(                          \
      const __nv_bfloat16* h, const int* w2_packed, const __nv_bfloat16* w2_scale, const int* sorted_slot,     \
      const int4* passes, const float* topk_weights, __nv_bfloat16* y, int k, int H, int I, int n_tiles,      \
      int tpb) {                                                                                               \
    griddep_begin();                                                                                           \
    moe_wgmma_gemm<1, WGM, true>(h, w2_packed, w2_scale, sorted_slot, passes, y, topk_weights, k, H, I,       \
                                 n_tiles, tpb);                                                                \
  }

MOE_WGMMA(wg64, 1)   // 64-row passes: both warpgroups on the same rows, 128 columns each
MOE_WGMMA(wg128, 2)  // 128-row passes: a warpgroup per 64 rows, all 256 columns each

// Swapped gate/up GEMM (moe_up_rs; sm_90a): the wgmma family's up GEMM transposed, for passes of up to RS_MT rows. The
// weights are wgmma's A operand, dequantized from each thread's 16-byte pieces straight into registers in the tile
// path's k order (dequant_word: no bf16 copy of the weights in shared memory, no barrier per dequantized stage); the
// pass's rows of x_perm (that logical k order; moe_prep writes it) are its N columns (with_pass_n), staged by cp.async
// in 128B-swizzled shared memory that the block's four warpgroups share. A block owns HV halves of 128 outputs of h:
// warp w the outputs o = 128 (blockIdx.x + hf) + 8 w + g, as A rows g (gate) and g + 8 (up), so each thread holds gate
// and up of its outputs for the same tokens. A pass of up to RS_PAIR_ROWS rows takes HV = 2: the even block of each
// pair of halves does both (its odd partner exits), so the pass's x rows are read once for both, and the block streams
// twice the weights a chunk (more bytes in flight); larger passes, whose accumulators would not fit twice, take HV = 1.
// Per 128-k chunk, lane (g, c) takes k [32 c, 32 c + 32) of its weight rows (one scale each) from the chunk's weight
// stage, which eight producer lanes (producer_copy) fill by TMA bulk copies 3 chunks ahead (the block's 128 HV gate or
// up rows of a K tile are 4 HV KB contiguous in the tiled layout; H200: 3-8% faster than every thread copying its own
// 16-byte pieces); word q of that piece feeds k16 steps 2q and 2q + 1. h (natural k order for the wgmma down GEMM, the
// logical one for moe_down_rs: h_logical) goes out through shared memory, 16 bytes per store.
// Launch: grid (I / 128, max_passes), block RS_THREADS, shared RS_SMEM bytes; H % 256 == 0, I % 128 == 0.
#define RS_MT 128                      // rows per pass
#define RS_THREADS 512                 // four warpgroups, 64 weight rows each
#define RS_PAIR_ROWS 64                // passes of up to this many rows: both halves of a pair in one block (HV = 2)
#define RS_STAGES 4                    // chunks of x: the one in use, the one its last wgmmas may read, 2 ahead
#define RS_HALF (RS_MT * 128)          // one 64-k half of a chunk: [RS_MT rows][128 B]
#define RS_WSTAGES 4                   // chunks of weights in flight: the one in use and 3 ahead
// Passes of up to RS_UP_BURST_ROWS rows issue each half's chunk as one burst of 8 wgmmas (rs_chunk_burst), the other
// half's burst still running: one fence and one wait a burst instead of one a wgmma (H200, K2 TP8, uniform routing:
// moe_up_rs 260 -> 252 us at 1024 tokens, 1-3% from 512 to 1536; with 40 rows or more the fragments of two bursts
// beside both halves' accumulators do not fit in 128 registers)
#define RS_UP_BURST_ROWS 32
// A stage's K tile: 128 HV gate rows x 32 B, 128 HV up rows (+ 64 B: fewer conflicts); its scale pairs: 4 B a row
// (+ 64 B); a chunk's two K tiles, then their scales. Shared memory: the x stages of `rows` rows, the weight stages,
// their mbarriers.
__host__ __device__ constexpr int rs_wtile(int hv) { return 8192 * hv + 64; }
__host__ __device__ constexpr int rs_wscales(int hv) { return 1024 * hv + 64; }
__host__ __device__ constexpr int rs_wstage(int hv) { return 2 * rs_wtile(hv) + 2 * rs_wscales(hv); }
__host__ __device__ constexpr int rs_smem(int hv, int rows) {
  return 1024 + RS_STAGES * 2 * rows * 128 + RS_WSTAGES * rs_wstage(hv) + 8 * RS_WSTAGES;
}
__host__ __device__ constexpr int rs_h_pitch(int hv) { return 128 * hv + 8; }  // bf16 per row of the h tile (+ 8)
// the larger of the two layouts (HV 1: 206880 bytes)
#define RS_SMEM (1024 + RS_STAGES * 2 * RS_PAIR_ROWS * 128 + RS_WSTAGES * (2 * 16448 + 2 * 2112) + 8 * RS_WSTAGES)
static_assert(RS_SMEM == rs_smem(2, RS_PAIR_ROWS) && RS_SMEM >= rs_smem(1, RS_MT), "RS_SMEM holds either layout");
static_assert(RS_PAIR_ROWS * rs_h_pitch(2) <= RS_STAGES * RS_PAIR_ROWS * 128 &&
                  RS_MT * rs_h_pitch(1) <= RS_STAGES * RS_MT * 128,
              "the epilogue's h tile reuses the stages");

// Position in a 128-k chunk's logical order (see the top of this file) of its k: the inverse of
// k = 32 c + 8 (s >> 1) + 2 (s & 1) + h + 4 i at position 16 s + 8 h + 2 c + i.
__device__ __forceinline__ int logical_pos(int k) {
  const int c = k >> 5, q = (k >> 3) & 3, i = (k >> 2) & 1, s1 = (k >> 1) & 1, h = k & 1;
  return 16 * (2 * q + s1) + 8 * h + 2 * c + i;
}

// The swapped GEMMs' weight copies (TMA) are issued by lane 0 of eight warps, one copy each: copy q by warp 5 q mod
// 16, two warps of each warpgroup on each SM sub-partition. This returns a warp's copy q (q >= 8: none). (H200,
// K2 TP8, in the MoE: thread 0 issuing all eight, ~20 instructions each, took moe_down_rs 4-9% longer, the whole MoE
// 504 -> 481 us at 1024 tokens, 987 -> 969 at 4096.)
__device__ __forceinline__ int producer_copy(int warp) { return (13 * warp) & 15; }  // 13 = 5^-1 mod 16

// The A fragments of k16 steps 2q and 2q + 1 (rs_chunk's operands): row g from word q of w0 (scale s0), row g + 8
// from word q of w1 (s1).
__device__ __forceinline__ void rs_frags(uint4 w0, uint4 w1, __nv_bfloat162 s0, __nv_bfloat162 s1, int q,
                                         u32 (&a)[2][4]) {
  u32 d0[4], d1[4];
  dequant_word(q == 0 ? w0.x : q == 1 ? w0.y : q == 2 ? w0.z : w0.w, s0, d0);
  dequant_word(q == 0 ? w1.x : q == 1 ? w1.y : q == 2 ? w1.z : w1.w, s1, d1);
#pragma unroll
  for (int j = 0; j < 2; ++j) {  // k slots 2c.. and 2c + 8..
    a[j][0] = d0[2 * j];
    a[j][1] = d1[2 * j];
    a[j][2] = d0[2 * j + 1];
    a[j][3] = d1[2 * j + 1];
  }
}

// acc += A x B over one 128-k chunk, for moe_up_rs and moe_down_rs: A is this warp's 16 rows, row g from piece w0
// (scale s0) and row g + 8 from w1 (s1), lane c holding k [32 c, 32 c + 32) of the chunk; B is the chunk's N rows in
// the logical k order at b (k16 steps 0-3, 128B-swizzled [rows][128 B]) and b + XH (steps 4-7). Each step
// retires the one two before, whose A registers the next word's dequantization may take (H200: waiting for the one
// before cost moe_up_rs 4-6% at 2k-16k tokens; three in flight, at 128 registers, was slower). B's descriptor is built
// once a chunk and each step adds its offset (H200: both GEMMs 2-3% faster than a descriptor built per step).
template <int NA, int XH = RS_HALF>
__device__ __forceinline__ void rs_chunk(float (&acc)[NA], uint4 w0, uint4 w1, __nv_bfloat162 s0,
                                         __nv_bfloat162 s1, u32 b) {
  const u64 desc = wg_desc(b, 16, 1024);
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    u32 a[2][4];
    rs_frags(w0, w1, s0, s1, q, a);
#pragma unroll
    for (int j = 0; j < 2; ++j) {  // k16 step 2q + j
      const int s = 2 * q + j;
      wg_fence();
      wgmma_rs<0>(acc, a[j], wg_desc_add(desc, (s >> 2) * XH + 32 * (s & 3)));
      wg_commit();
      wg_wait<2>();
    }
  }
}

// rs_chunk as one burst, for passes whose accumulators leave registers for two chunks' A fragments: all eight k16
// steps' A dequantized first (32 registers), then (with WAIT >= 0, once at most WAIT earlier groups still run) their
// eight wgmmas in one group: the caller retires them (wg_wait) before it touches acc, and keeps each burst's
// fragments apart.
template <int NA, int XH = RS_HALF, int WAIT = -1>
__device__ __forceinline__ void rs_chunk_burst(float (&acc)[NA], uint4 w0, uint4 w1, __nv_bfloat162 s0,
                                               __nv_bfloat162 s1, u32 b) {
  const u64 desc = wg_desc(b, 16, 1024);
  u32 a[4][2][4];
#pragma unroll
  for (int q = 0; q < 4; ++q) rs_frags(w0, w1, s0, s1, q, a[q]);
  if constexpr (WAIT >= 0) wg_wait<WAIT>();
  wg_fence();
#pragma unroll
  for (int s = 0; s < 8; ++s) wgmma_rs<0>(acc, a[s >> 1][s & 1], wg_desc_add(desc, (s >> 2) * XH + 32 * (s & 3)));
  wg_commit();
}

template <int N>
struct PassN {
  static constexpr int value = N;
};
// f(PassN<N>()) for the wgmma N of a pass of `rows` rows: rows rounded up to a multiple of 8, at least 16 (H200, K2
// TP8: steps of 16 instead of 32 spared the tensor cores ~7% of the padding columns at 4096 tokens, ~19% at 2080;
// steps of 8 up to 32 ~22% at 1024, where passes have ~21 rows; steps of 8 past 32 took the MoE at 2080 tokens, ~43
// rows a pass, from 634 to 613 us, and left 1024-8192 tokens within 1%).
template <class F>
__device__ __forceinline__ void with_pass_n(int rows, F&& f) {
#define PASS_N(i) case i: return f(PassN<8 * i>());  // rows 8 i - 7 .. 8 i
  switch ((rows + 7) >> 3) {
    case 0: case 1: case 2: return f(PassN<16>());
    PASS_N(3) PASS_N(4) PASS_N(5) PASS_N(6) PASS_N(7) PASS_N(8) PASS_N(9) PASS_N(10) PASS_N(11) PASS_N(12)
    PASS_N(13) PASS_N(14) PASS_N(15)
    default: return f(PassN<128>());
  }
#undef PASS_N
}

template <int NP, int HV>
__device__ __forceinline__ void moe_up_rs_pass(const __nv_bfloat16* __restrict__ x_perm,
                                               const int* __restrict__ w13_packed,
                                               const __nv_bfloat16* __restrict__ w13_scale,
                                               const int* __restrict__ sorted_slot, int e, int row0, int rows,
                                               __nv_bfloat16* __restrict__ h, int k, int H, int I, int h_logical) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr int B_PER = (NP * 16 + RS_THREADS - 1) / RS_THREADS;  // 16-byte pieces of x per thread and chunk
  constexpr int XH = (HV == 2 ? RS_PAIR_ROWS : RS_MT) * 128;  // one 64-k half of an x stage: [rows][128 B]
  constexpr int WT = rs_wtile(HV), WS = rs_wscales(HV), PITCH = rs_h_pitch(HV);
  static_assert(HV == 1 || NP <= RS_PAIR_ROWS, "a pair's accumulators fit for passes of up to RS_PAIR_ROWS rows");
  extern __shared__ unsigned char wg_smem[];
  const u32 base = (smem_u32(wg_smem) + 1023) & ~1023u;
  unsigned char* const sbase = wg_smem + (base - smem_u32(wg_smem));
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, c = lane & 3;
  const int n_chunks = H / 128, N2 = 2 * I;

  // x: piece tid & 15 of the 256-byte chunk of rows (tid >> 4) + 32 i.
  int b_off[B_PER];
#pragma unroll
  for (int i = 0; i < B_PER; ++i) {
    const int r = (tid >> 4) + 32 * i;
    b_off[i] = r < rows ? (sorted_slot[row0 + r] / k) * H + 8 * (tid & 15) : -1;
  }
  const int piece = tid & 15;
  const u32 b_dst = (piece >> 3) * XH + (tid >> 4) * 128 + (((piece & 7) ^ ((tid >> 4) & 7)) << 4);
  auto load_x = [&](int ch) {
    if (ch >= n_chunks) return;
    const u32 st = base + (ch % RS_STAGES) * 2 * XH + b_dst;
#pragma unroll
    for (int i = 0; i < B_PER; ++i)
      if (b_off[i] >= 0) cp_async16(st + 32 * 128 * i, x_perm + b_off[i] + 128 * ch, true);
  };

  // Weights: gate rows 128 blockIdx.x .. + 128 HV - 1 and the up rows I above them of the tiled w13 ([E][H/64][2I][8
  // words] and scale pairs [E][H/64][2I][2]); chunk ch is K tiles 2 ch and 2 ch + 1. A producer's copy (K tile
  // j = copy >> 2, gate / up u = (copy >> 1) & 1) takes the block of 128 HV rows to j * WT + u * 4096 HV of the stage
  // (copy even) or its scales to 2 WT + j * WS + u * 512 HV (copy odd), arriving on the stage's mbarrier with its
  // bytes first. Stage ch % RS_WSTAGES is refilled after the barrier of chunk
  // ch - 1, whose threads have read it by then.
  const u32 w_base = base + RS_STAGES * 2 * XH, bars = w_base + RS_WSTAGES * rs_wstage(HV);
  const size_t row_b = (size_t)e * (H / 64) * N2 + 128 * blockIdx.x;  // K tile 0, gate, the block's first row
  const int copy = producer_copy(warp);
  auto load_w = [&](int ch) {
    if (lane != 0 || copy >= 8 || ch >= n_chunks) return;
    const int j = copy >> 2, u = (copy >> 1) & 1;
    const u32 st = w_base + (ch % RS_WSTAGES) * rs_wstage(HV), bar = bars + 8 * (ch % RS_WSTAGES);
    const size_t r = row_b + (size_t)(2 * ch + j) * N2 + u * I;
    const u32 bytes = copy & 1 ? 512 * HV : 4096 * HV;
    mbar_expect_tx(bar, bytes);
    if (copy & 1)
      bulk_copy_g2s(st + 2 * WT + j * WS + u * 512 * HV, w13_scale + 2 * r, bytes, bar);
    else
      bulk_copy_g2s(st + j * WT + u * 4096 * HV, reinterpret_cast<const uint4*>(w13_packed) + 2 * r, bytes, bar);
  };
  if (tid == 0) {
    for (int i = 0; i < RS_WSTAGES; ++i) mbar_init(bars + 8 * i, 8);
    mbar_init_fence();
  }
  __syncthreads();
  const int ol = 8 * warp + g;  // the lane's row among each half's 128 gate (and up) rows

  float acc[HV][NP / 2];
#pragma unroll
  for (int hf = 0; hf < HV; ++hf)
#pragma unroll
    for (int i = 0; i < NP / 2; ++i) acc[hf][i] = 0.f;
  // x copy groups, oldest first: X0 X1, then X(ch + 2) per chunk ch. Chunk ch waits for X(ch) (X(ch + 1) may stay in
  // flight), and the barrier also frees the x stage of chunk ch - 2 (only chunk ch - 1's wgmmas may still run: its
  // last two, or its two bursts) and the weight stage of chunk ch - 1.
  load_w(0);
  load_w(1);
  load_w(2);
  load_x(0);
  cp_async_commit();
  load_x(1);
  cp_async_commit();
  for (int ch = 0; ch < n_chunks; ++ch) {
    cp_async_wait<1>();
    fence_proxy_async();
    __syncthreads();
    load_x(ch + 2);
    cp_async_commit();
    load_w(ch + 3);
    mbar_wait(bars + 8 * (ch % RS_WSTAGES), (ch / RS_WSTAGES) & 1);
    const u32 st = base + (ch % RS_STAGES) * 2 * XH;
    const unsigned char* wst = sbase + RS_STAGES * 2 * XH + (ch % RS_WSTAGES) * rs_wstage(HV);
    uint4 wv[HV][2];
    __nv_bfloat162 sv[HV][2];
#pragma unroll
    for (int hf = 0; hf < HV; ++hf)
#pragma unroll
      for (int u = 0; u < 2; ++u) {
        const int row = (u * HV + hf) * 128 + ol;  // among the K tile's 256 HV rows in the stage
        wv[hf][u] = *reinterpret_cast<const uint4*>(wst + (c >> 1) * WT + row * 32 + (c & 1) * 16);
        sv[hf][u] = __bfloat162bfloat162(
            reinterpret_cast<const __nv_bfloat16*>(wst + 2 * WT + (c >> 1) * WS + row * 4)[c & 1]);
      }
#pragma unroll
    for (int hf = 0; hf < HV; ++hf)  // rows g: gate, g + 8: up
      if constexpr (NP <= RS_UP_BURST_ROWS)  // the other half's burst (or the last chunk's) may still run
        rs_chunk_burst<NP / 2, XH, 1>(acc[hf], wv[hf][0], wv[hf][1], sv[hf][0], sv[hf][1], st);
      else
        rs_chunk<NP / 2, XH>(acc[hf], wv[hf][0], wv[hf][1], sv[hf][0], sv[hf][1], st);
  }
  wg_wait<0>();
  cp_async_wait<0>();
  __syncthreads();  // every warpgroup's wgmmas are done with the stages: the h tile takes their place

  // acc[hf][4 j + v]: row g + 8 (v >> 1) of the warp's 16 (gate, then up) of half hf, token 8 j + 2 c + (v & 1). Each
  // half's 128 outputs are one 128-k chunk of the down GEMM: h_logical puts output o at its position there
  // (logical_pos).
  __nv_bfloat16* tile = reinterpret_cast<__nv_bfloat16*>(sbase);  // [NP tokens][PITCH]
  const int col = h_logical ? logical_pos(8 * warp + g) : 8 * warp + g;
#pragma unroll
  for (int hf = 0; hf < HV; ++hf)
#pragma unroll
    for (int j = 0; j < NP / 8; ++j)
#pragma unroll
      for (int v = 0; v < 2; ++v) {
        const float gt = acc[hf][4 * j + v], u = acc[hf][4 * j + 2 + v];
        tile[(8 * j + 2 * c + v) * PITCH + 128 * hf + col] = __float2bfloat16_rn(gt / (1.f + __expf(-gt)) * u);
      }
  __syncthreads();
  for (int i = tid; i < rows * 16 * HV; i += RS_THREADS) {
    const int r = i / (16 * HV), p = i - r * 16 * HV;
    *reinterpret_cast<uint4*>(h + (size_t)(row0 + r) * I + 128 * blockIdx.x + 8 * p) =
        *reinterpret_cast<const uint4*>(tile + r * PITCH + 8 * p);
  }
#else
  __trap();
#endif
}

extern "C" __global__ void __launch_bounds__(RS_THREADS, 1) moe_up_rs(
    const __nv_bfloat16* x_perm, const int* w13_packed, const __nv_bfloat16* w13_scale, const int* sorted_slot,
    const int4* passes, __nv_bfloat16* h, int k, int H, int I, int h_logical) {
  griddep_begin();
  if (blockIdx.y >= passes[0].x) return;
  const int4 p = passes[1 + blockIdx.y];
  const bool pair = p.z <= RS_PAIR_ROWS;
  if (pair && (blockIdx.x & 1)) return;  // its half is the even block's second
  with_pass_n(p.z, [&](auto n) {
    constexpr int NP = decltype(n)::value;
    if constexpr (NP <= RS_PAIR_ROWS) {
      if (blockIdx.x + 1 < gridDim.x) {
        moe_up_rs_pass<NP, 2>(x_perm, w13_packed, w13_scale, sorted_slot, p.x, p.y, p.z, h, k, H, I, h_logical);
        return;
      }
    }
    moe_up_rs_pass<NP, 1>(x_perm, w13_packed, w13_scale, sorted_slot, p.x, p.y, p.z, h, k, H, I, h_logical);
  });
}

// Swapped down GEMM (moe_down_rs; sm_90a), moe_up_rs's partner when I <= RSD_MAX_I: y[slot, n] = topk_weight * (W2
// h)[n] for the pass's rows, as the wgmma family's down GEMM writes it. The pass's h rows (the logical k order, from
// moe_up_rs) stay in shared memory as the N columns; the block streams tiles of 256 outputs, warp w owning outputs n =
// 256 t + 16 w + g (A row g) and + 8 (row g + 8), their weights dequantized into registers from each thread's pieces of
// a ring that producer lanes (producer_copy) fill by TMA RSD_WSTAGES - 1 tiles ahead (mbarriers; no block barrier
// inside the loop). The accumulators, weighted, go to y through a staging tile per warpgroup (stmatrix.trans), 32
// tokens at a time: each token's 64 outputs of the warpgroup leave as one 128-byte line (H200, 4096 tokens: y's stores
// from the registers, 16 bytes of a line per warp instruction, took 167 of moe_down_rs's 422 us; the ring by TMA and
// the stmatrix stores took it from 391-396 to 349-351 us).
// Launch: grid (ceil(n_tiles / tpb), max_passes), n_tiles = H / 256, block RS_THREADS, shared RSD_SMEM bytes;
// H % 256 == 0, I % 128 == 0, I <= RSD_MAX_I.
#define RSD_MAX_I 256
#define RSD_WSTAGES 3
// Passes of up to RSD_BURST_ROWS rows issue a tile's chunks as rs_chunk_burst's bursts, all 16 wgmmas in flight (H200,
// K2 TP8, uniform routing: the MoE 0.8-1.5% faster at 512-2080 tokens; half-bursts past 64 rows gained nothing).
#define RSD_BURST_ROWS 64
#define RSD_KT_W 8256  // a stage's K tile of weights: the tile's 256 rows x 32 B (+ 64 B: no bank conflicts)
#define RSD_KT_S 1088  // its scale pairs: 256 rows x 4 B (+ 64 B)
#define RSD_WSTAGE ((RSD_MAX_I / 64) * (RSD_KT_W + RSD_KT_S))  // a tile's K tiles of weights, then their scales
#define RSD_YPITCH 144  // bytes per token row of a y staging tile: 64 outputs + 16 B (conflict-free writes)
#define RSD_YSTAGE (32 * RSD_YPITCH)  // a warpgroup's y staging tile: 32 tokens
#define RSD_SMEM (1024 + RS_MT * RSD_MAX_I * 2 + RSD_WSTAGES * (RSD_WSTAGE + 16) + RS_MT * 8 + 4 * RSD_YSTAGE)

// Barrier of warpgroup wg's 128 threads alone (named barrier 1 + wg).
__device__ __forceinline__ void bar_sync_wg(int wg) { asm volatile("bar.sync %0, 128;\n" ::"r"(1 + wg) : "memory"); }

template <int NP>
__device__ __forceinline__ void moe_down_rs_pass(const __nv_bfloat16* __restrict__ h,
                                                 const int* __restrict__ w2_packed,
                                                 const __nv_bfloat16* __restrict__ w2_scale,
                                                 const int* __restrict__ sorted_slot,
                                                 const float* __restrict__ topk_weights, int e, int row0, int rows,
                                                 __nv_bfloat16* __restrict__ y, int H, int I, int n_tiles, int tpb) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ unsigned char wg_smem[];
  const u32 base = (smem_u32(wg_smem) + 1023) & ~1023u;
  unsigned char* const sbase = wg_smem + (base - smem_u32(wg_smem));
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, c = lane & 3;
  const int tile0 = blockIdx.x * tpb, tiles = min(tile0 + tpb, n_tiles) - tile0, n_chunks = I / 128;
  // h rows [NP][I] in 64-k blocks of [RS_MT rows][128 B], swizzled; then the weight ring and its mbarriers (full,
  // then empty, per stage); then slots and weights; then the warpgroups' y staging tiles.
  const u32 w_base = base + RS_MT * RSD_MAX_I * 2, full = w_base + RSD_WSTAGES * RSD_WSTAGE,
            empty = full + 8 * RSD_WSTAGES;
  int* slot_of = reinterpret_cast<int*>(sbase + RS_MT * RSD_MAX_I * 2 + RSD_WSTAGES * RSD_WSTAGE + 16 * RSD_WSTAGES);
  float* weight_of = reinterpret_cast<float*>(slot_of + RS_MT);
  unsigned char* y_stage = reinterpret_cast<unsigned char*>(weight_of + RS_MT) + (warp >> 2) * RSD_YSTAGE;
  // Weights of tile t: rows 256 t .. 256 t + 255 of each K tile of the tiled w2 ([E][I/64][H][8 words], scale pairs
  // [E][I/64][H][2]): 8 KB and 1 KB contiguous. A producer's copy of tile i (K tile copy >> 1: its weights, copy even,
  // or scales) goes into stage i % RSD_WSTAGES by TMA, arriving on the stage's full barrier with its bytes first; every
  // thread arrives on the empty barrier once it has read its pieces, and the producers wait for that before they refill
  // the stage.
  const int copy = producer_copy(warp);
  const bool producer = lane == 0 && copy < 2 * (I / 64);
  auto load_w = [&](int i) {  // the block's i-th tile
    if (i >= tiles) return;
    const int s = i % RSD_WSTAGES, kt = copy >> 1;
    const size_t r = ((size_t)e * (I / 64) + kt) * H + 256 * (tile0 + i);
    const u32 st = w_base + s * RSD_WSTAGE, bytes = copy & 1 ? 1024 : 8192;
    mbar_expect_tx(full + 8 * s, bytes);
    if (copy & 1)
      bulk_copy_g2s(st + (I / 64) * RSD_KT_W + kt * RSD_KT_S, w2_scale + 2 * r, bytes, full + 8 * s);
    else
      bulk_copy_g2s(st + kt * RSD_KT_W, reinterpret_cast<const uint4*>(w2_packed) + 2 * r, bytes, full + 8 * s);
  };
  if (tid == 0) {
    for (int s = 0; s < RSD_WSTAGES; ++s) {
      mbar_init(full + 8 * s, 2 * (I / 64));
      mbar_init(empty + 8 * s, RS_THREADS);
    }
    mbar_init_fence();
  }
  __syncthreads();  // the barriers are set up
  if (producer)
    for (int i = 0; i < RSD_WSTAGES - 1; ++i) load_w(i);
  for (int q = tid; q < rows * (I / 8); q += RS_THREADS) {
    const int r = q / (I / 8), u = q - r * (I / 8);
    cp_async16(base + (u >> 3) * RS_HALF + r * 128 + (((u & 7) ^ (r & 7)) << 4), h + (size_t)(row0 + r) * I + 8 * u,
               true);
  }
  cp_async_commit();
  if (tid < rows) {
    slot_of[tid] = sorted_slot[row0 + tid];
    weight_of[tid] = topk_weights[slot_of[tid]];
  }
  cp_async_wait<0>();
  fence_proxy_async();
  __syncthreads();  // h rows and slots in place
  // This thread's pieces in a stage: chunk ch, row half rh is half c & 1 of row 16 w + g + 8 rh of K tile
  // 2 ch + (c >> 1); its scale pair's entry c & 1.
  const int w_lane = (c >> 1) * RSD_KT_W + (16 * warp + g) * 32 + (c & 1) * 16;
  const int s_lane = (I / 64) * RSD_KT_W + (c >> 1) * RSD_KT_S + (16 * warp + g) * 4 + (c & 1) * 2;

  float acc[NP / 2];
  for (int i = 0; i < tiles; ++i) {
    if (producer && i + RSD_WSTAGES - 1 < tiles) {  // into the stage of tile i - 1, once every thread has read it
      if (i > 0) mbar_wait(empty + 8 * ((i - 1) % RSD_WSTAGES), ((i - 1) / RSD_WSTAGES) & 1);
      load_w(i + RSD_WSTAGES - 1);
    }
    mbar_wait(full + 8 * (i % RSD_WSTAGES), (i / RSD_WSTAGES) & 1);
    const unsigned char* wst = sbase + RS_MT * RSD_MAX_I * 2 + (i % RSD_WSTAGES) * RSD_WSTAGE;
#pragma unroll
    for (int v = 0; v < NP / 2; ++v) acc[v] = 0.f;
#pragma unroll
    for (int ch = 0; ch < RSD_MAX_I / 128; ++ch) {  // unrolled: constant offsets (H200: 2% less at 1024 tokens)
      if (ch >= n_chunks) break;
      uint4 wv[2];
      __nv_bfloat162 sv[2];
#pragma unroll
      for (int rh = 0; rh < 2; ++rh) {
        wv[rh] = *reinterpret_cast<const uint4*>(wst + w_lane + 2 * ch * RSD_KT_W + rh * 256);
        sv[rh] = __bfloat162bfloat162(
            *reinterpret_cast<const __nv_bfloat16*>(wst + s_lane + 2 * ch * RSD_KT_S + rh * 32));
      }
      if constexpr (NP <= RSD_BURST_ROWS)
        rs_chunk_burst(acc, wv[0], wv[1], sv[0], sv[1], base + 2 * ch * RS_HALF);
      else
        rs_chunk(acc, wv[0], wv[1], sv[0], sv[1], base + 2 * ch * RS_HALF);
    }
    mbar_arrive(empty + 8 * (i % RSD_WSTAGES));  // this thread's pieces of the stage are read
    wg_wait<0>();
    wg_pin(acc);
    // acc[4 j + v]: output row g + 8 (v >> 1) of the warp's 16, token 8 j + 2 c + (v & 1): per j and row half, an
    // 8 x 8 matrix [outputs][tokens] in the mma fragment layout once weighted and rounded to bf16 pairs, which
    // stmatrix.trans stores as [tokens][8 outputs], 16 bytes a token, into the warpgroup's staging tile; its rows then
    // go to y, 16 bytes per lane. Lane 8 m + k addresses row k (token) of matrix m: (j + (m >> 1), half m & 1).
    const int wgt = tid & 127;
    __nv_bfloat16* const y_tile = y + 256 * (tile0 + i) + 64 * (warp >> 2);
    const u32 stsm_lane = smem_u32(y_stage) + (8 * (lane >> 4) + (lane & 7)) * RSD_YPITCH +
                          (16 * (warp & 3) + 8 * ((lane >> 3) & 1)) * 2;
#pragma unroll
    for (int r = 0; r < (NP + 31) / 32; ++r) {  // tokens 32 r .. 32 r + 31
      if (32 * r >= rows) break;
#pragma unroll
      for (int j = 4 * r; j < min(4 * r + 4, NP / 8); j += 2) {
        u32 m[4];
#pragma unroll
        for (int jj = 0; jj < 2; ++jj) {
          if (j + jj >= NP / 8) {  // NP = 24: the last matrices hold no tokens of the pass (rows never copied)
            m[2 * jj] = m[2 * jj + 1] = 0u;
            continue;
          }
          const float2 wt = *reinterpret_cast<const float2*>(weight_of + 8 * (j + jj) + 2 * c);
#pragma unroll
          for (int hf = 0; hf < 2; ++hf)
            m[2 * jj + hf] = bf2_bits(__floats2bfloat162_rn(wt.x * acc[4 * (j + jj) + 2 * hf],
                                                           wt.y * acc[4 * (j + jj) + 2 * hf + 1]));
        }
        stmatrix_x4_trans(stsm_lane + (8 * j - 32 * r) * RSD_YPITCH, m);
      }
      bar_sync_wg(warp >> 2);
#pragma unroll
      for (int q = wgt; q < 32 * 8; q += 128) {  // token 32 r + (q >> 3), 16-byte piece q & 7 of its 64 outputs
        const int t = 32 * r + (q >> 3);
        if (t < rows)
          *reinterpret_cast<uint4*>(y_tile + (size_t)slot_of[t] * H + 8 * (q & 7)) =
              *reinterpret_cast<const uint4*>(y_stage + (q >> 3) * RSD_YPITCH + 16 * (q & 7));
      }
      bar_sync_wg(warp >> 2);  // the tile is read before the next round writes it
    }
  }
#else
  __trap();
#endif
}

extern "C" __global__ void __launch_bounds__(RS_THREADS, 1) moe_down_rs(
    const __nv_bfloat16* h, const int* w2_packed, const __nv_bfloat16* w2_scale, const int* sorted_slot,
    const int4* passes, const float* topk_weights, __nv_bfloat16* y, int k, int H, int I, int n_tiles, int tpb) {
  griddep_begin();
  if (blockIdx.y >= passes[0].x) return;
  const int4 p = passes[1 + blockIdx.y];
  with_pass_n(p.z, [&](auto n) {
    moe_down_rs_pass<decltype(n)::value>(h, w2_packed, w2_scale, sorted_slot, topk_weights, p.x, p.y, p.z, y, H, I,
                                         n_tiles, tpb);
  });
}

// out[t] = bf16(sum over valid slots j in order of y[t k + j]) (+ add: bf16(float(bf16(sum)) + float(add)), torch's
// rounding of `routed + add`); ids < 0 or >= E are skipped (their rows, never written, are read and dropped, so that
// no load waits for an id). 8 outputs per thread. Launch: any 1-D grid of 256-thread blocks (grid-stride); add may be
// null.
extern "C" __global__ void moe_finalize_slots(const uint4* __restrict__ y, const long long* __restrict__ ids,
                                              const uint4* __restrict__ add, uint4* __restrict__ out, int T, int H,
                                              int k, int E) {
  griddep_begin();
  const int h8 = H / 8;
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < T * h8; i += gridDim.x * blockDim.x) {
    const int t = i / h8, c = i - t * h8;
    const uint4 a = add != nullptr ? add[i] : make_uint4(0u, 0u, 0u, 0u);
    float s[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    for (int j0 = 0; j0 < k; j0 += 8) {  // 8 slots' loads in flight at once, then their sum in slot order
      uint4 v[8];
      bool ok[8];
#pragma unroll
      for (int jj = 0; jj < 8; ++jj) {  // each row is loaded with its id; a skipped slot's row is dropped below
        const int j = j0 + jj;
        const long long id = j < k ? ids[(size_t)t * k + j] : -1;
        ok[jj] = id >= 0 && id < E;
        v[jj] = j < k ? y[((size_t)t * k + j) * h8 + c] : make_uint4(0u, 0u, 0u, 0u);
      }
#pragma unroll
      for (int jj = 0; jj < 8; ++jj) {
        if (!ok[jj]) continue;
        const u32 w[4] = {v[jj].x, v[jj].y, v[jj].z, v[jj].w};
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          const float2 f = __bfloat1622float2(bits_bf2(w[q]));
          s[2 * q] += f.x;
          s[2 * q + 1] += f.y;
        }
      }
    }
    u32 o[4];
    const u32 aw[4] = {a.x, a.y, a.z, a.w};
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      __nv_bfloat162 r = __floats2bfloat162_rn(s[2 * q], s[2 * q + 1]);
      if (add != nullptr) {
        const float2 rf = __bfloat1622float2(r), af = __bfloat1622float2(bits_bf2(aw[q]));
        r = __floats2bfloat162_rn(rf.x + af.x, rf.y + af.y);
      }
      o[q] = bf2_bits(r);
    }
    out[i] = make_uint4(o[0], o[1], o[2], o[3]);
  }
}
