// Sigmoid routing of a token to its top-k experts, all in one warp; see kernels/moe_route.py.
// s = sigmoid(logit), choice = s + bias; with n_group > 1 only the topk_group groups of highest top-2 choice
// sum stay eligible (the others' choice becomes 0, as HF masks them); ids = the k highest choices (ties: lower
// id), weights = s[ids] (/ their sum + 1e-20 when renormalize) * scale. Ids outside [e0, e0 + n_local) are
// written as -1, the others as id - e0 (expert parallelism).
// Launch: grid (ceil(T / 4)), block (128): a warp per token, expert e = 32 i + lane held in registers
// (EPL = ceil(E / 32) per lane, a compile-time define); k <= 32, n_group <= 32.

#ifndef EPL
#define EPL 12
#endif
#define WARPS 4
#define FULL 0xffffffffu
#define NEG_INF __int_as_float(0xff800000)

// Warp-wide argmax of (v, i): the highest v, ties to the lowest i; every lane gets the result.
__device__ __forceinline__ void warp_argmax(float& v, int& i) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(FULL, v, o);
    const int oi = __shfl_xor_sync(FULL, i, o);
    if (ov > v || (ov == v && oi < i)) {
      v = ov;
      i = oi;
    }
  }
}

extern "C" __global__ void __launch_bounds__(128) moe_route(const float* __restrict__ logits,  // [T, E]
                                                            const float* __restrict__ bias,    // [E]
                                                            long long* __restrict__ ids,       // [T, k]
                                                            float* __restrict__ weights,       // [T, k]
                                                            int T, int E, int k, int n_group, int topk_group,
                                                            int renormalize, float scale, int e0, int n_local) {
  __shared__ float grouped[WARPS][EPL * 32];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const long long t = (long long)blockIdx.x * WARPS + warp;
  if (t >= T) return;  // whole warps only: nothing below synchronises the block
  float s[EPL], ch[EPL];
#pragma unroll
  for (int i = 0; i < EPL; ++i) {
    const int e = 32 * i + lane;
    s[i] = 0.f;
    ch[i] = NEG_INF;  // -inf: not a candidate (past E, or already chosen)
    if (e < E) {
      s[i] = 1.f / (1.f + __expf(-logits[t * E + e]));
      ch[i] = s[i] + bias[e];
    }
  }
  if (n_group > 1) {
    const int G = E / n_group;
    float* sh = grouped[warp];
#pragma unroll
    for (int i = 0; i < EPL; ++i)
      if (32 * i + lane < E) sh[32 * i + lane] = ch[i];
    __syncwarp();
    float gs = NEG_INF;  // lane g < n_group: group g's top-2 sum
    if (lane < n_group) {
      float m1 = NEG_INF, m2 = NEG_INF;
      for (int j = 0; j < G; ++j) {
        const float v = sh[lane * G + j];
        if (v > m1) {
          m2 = m1;
          m1 = v;
        } else if (v > m2) {
          m2 = v;
        }
      }
      gs = m1 + m2;
    }
    __syncwarp();
    unsigned keep = 0u;
    for (int r = 0; r < topk_group; ++r) {
      float v = gs;
      int g = lane;
      warp_argmax(v, g);
      keep |= 1u << g;
      if (lane == g) gs = NEG_INF;
    }
#pragma unroll
    for (int i = 0; i < EPL; ++i) {
      const int e = 32 * i + lane;
      if (e < E && !((keep >> (e / G)) & 1u)) ch[i] = 0.f;
    }
  }
  int my_e = -1;
  float my_w = 0.f, wsum = 0.f;
  for (int j = 0; j < k; ++j) {
    float v = NEG_INF;
    int e = 0x7fffffff;
#pragma unroll
    for (int i = 0; i < EPL; ++i)
      if (ch[i] != NEG_INF && (ch[i] > v || (ch[i] == v && 32 * i + lane < e))) {
        v = ch[i];
        e = 32 * i + lane;
      }
    warp_argmax(v, e);
    const int owner = e & 31, slot = e >> 5;
    float w = 0.f;
    if (lane == owner) {
#pragma unroll
      for (int i = 0; i < EPL; ++i)
        if (i == slot) {
          w = s[i];
          ch[i] = NEG_INF;
        }
    }
    w = __shfl_sync(FULL, w, owner);
    if (lane == j) {
      my_e = e;
      my_w = w;
    }
    wsum += w;
  }
  if (lane < k) {
    const float w = (renormalize ? my_w / (wsum + 1e-20f) : my_w) * scale;
    ids[t * k + lane] = my_e >= e0 && my_e < e0 + n_local ? my_e - e0 : -1;
    weights[t * k + lane] = w;
  }
}
