// y = x W^T for a few tokens (decode and small verify steps); see kernels/skinny_linear.py.
// A block owns 16 output rows: one m16 tile of W, the mma's A operand, loaded from HBM straight into registers
// (16-byte loads, no shared-memory staging), over all of K, which its SL_WARPS warps split in 32-k blocks (warp w:
// blocks w, w + SL_WARPS, ..., two in flight per iteration); the T <= 8 NT tokens are NT n8 tiles of the B operand.
// Lane (r, c) loads k [32 b + 8 c, + 8) of weight rows r and r + 8 and of token rows r + 8 j: words 2 s and 2 s + 1
// of the piece are k-step s's low and high k slots, in A and in B alike. The block sums its warps' tiles in
// shared memory and writes y [T, N] (fp32 when OUT_F32, else bf16).
// Launch: grid (N / 16), block 32 * SL_WARPS; K % 32 == 0; W and x rows 16-byte aligned.
#include "mma.cuh"

#ifndef NT
#define NT 1
#endif
#ifndef OUT_F32
#define OUT_F32 0
#endif
#define SL_WARPS 16

// acc[j] += W rows (r: wa, r + 8: wb) x token tile j, over one 32-k block.
__device__ __forceinline__ void block_mma(float (*acc)[4], uint4 wa, uint4 wb, const uint4* xv) {
#pragma unroll
  for (int j = 0; j < NT; ++j) {
    mma_bf16(acc[j], wa.x, wb.x, wa.y, wb.y, xv[j].x, xv[j].y);
    mma_bf16(acc[j], wa.z, wb.z, wa.w, wb.w, xv[j].z, xv[j].w);
  }
}

extern "C" __global__ void __launch_bounds__(32 * SL_WARPS) skinny_linear(
    const __nv_bfloat16* __restrict__ x, long long x_stride, int T,  // [T, K]
    const __nv_bfloat16* __restrict__ w,                             // [N, K]
    void* __restrict__ y,                                            // [T, N]
    int N, int K) {
  __shared__ float part[SL_WARPS][NT][4][32];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, r = lane >> 2, c = lane & 3;
  const int o0 = blockIdx.x * 16, blocks = K / 32;
  const uint4* wa = reinterpret_cast<const uint4*>(w + (size_t)(o0 + r) * K) + c;
  const uint4* wb = reinterpret_cast<const uint4*>(w + (size_t)(o0 + r + 8) * K) + c;
  const uint4* xr[NT];
#pragma unroll
  for (int j = 0; j < NT; ++j)
    xr[j] = r + 8 * j < T ? reinterpret_cast<const uint4*>(x + (r + 8 * j) * x_stride) + c : nullptr;
  const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
  float acc[NT][4] = {};
  for (int b = warp; b < blocks; b += 2 * SL_WARPS) {
    const int b2 = b + SL_WARPS;
    const bool two = b2 < blocks;
    const uint4 a0 = ld_stream(wa + 4 * b), a1 = ld_stream(wb + 4 * b);
    const uint4 a2 = two ? ld_stream(wa + 4 * b2) : zero, a3 = two ? ld_stream(wb + 4 * b2) : zero;
    uint4 x0[NT], x1[NT];
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      x0[j] = xr[j] != nullptr ? __ldg(xr[j] + 4 * b) : zero;
      x1[j] = xr[j] != nullptr && two ? __ldg(xr[j] + 4 * b2) : zero;
    }
    block_mma(acc, a0, a1, x0);
    if (two) block_mma(acc, a2, a3, x1);
  }
#pragma unroll
  for (int j = 0; j < NT; ++j)
#pragma unroll
    for (int i = 0; i < 4; ++i) part[warp][j][i][lane] = acc[j][i];
  __syncthreads();
  // C element i of lane l in tile j: output row (l >> 2) + 8 (i >> 1), token 8 j + 2 (l & 3) + (i & 1).
  for (int idx = threadIdx.x; idx < NT * 128; idx += blockDim.x) {
    const int j = idx >> 7, i = (idx >> 5) & 3, l = idx & 31;
    const int t = 8 * j + 2 * (l & 3) + (i & 1), o = o0 + (l >> 2) + 8 * (i >> 1);
    if (t < T) {
      float v = 0.f;
#pragma unroll
      for (int v_w = 0; v_w < SL_WARPS; ++v_w) v += part[v_w][j][i][l];
#if OUT_F32
      reinterpret_cast<float*>(y)[(size_t)t * N + o] = v;
#else
      reinterpret_cast<__nv_bfloat16*>(y)[(size_t)t * N + o] = __float2bfloat16(v);
#endif
    }
  }
}
