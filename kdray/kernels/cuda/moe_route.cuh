// Sigmoid routing of one token by one warp; see kernels/moe_route.py. Shared by the kernels of moe_route.cu.
// s = sigmoid(logit), choice = s + bias; with n_group > 1 only the topk_group groups of highest top-2 choice
// sum stay eligible (the others' choice becomes 0, as HF masks them); ids = the k highest choices (ties: lower
// id; a NaN choice is never taken), weights = s[ids] (/ their sum + 1e-20 when renormalize) * scale. Ids outside
// [e0, e0 + n_local) are given as -1, the others as id - e0 (expert parallelism). Expert e = 32 i + lane is held in
// registers (PER_LANE >= ceil(E / 32) per lane); k <= 32, n_group <= 32.
#pragma once

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

// A choice as an unsigned key in the same order (0: no candidate, below every choice's key; NaN: none either).
__device__ __forceinline__ unsigned choice_key(float v) {
  const unsigned u = __float_as_uint(v);
  return v != v ? 0u : (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// The warp's highest (MAX) or lowest unsigned value, in every lane.
template <bool MAX>
__device__ __forceinline__ unsigned warp_extreme(unsigned v) {
#if __CUDA_ARCH__ >= 800
  return MAX ? __reduce_max_sync(FULL, v) : __reduce_min_sync(FULL, v);
#else
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const unsigned u = __shfl_xor_sync(FULL, v, o);
    v = MAX ? max(v, u) : min(v, u);
  }
  return v;
#endif
}

// The highest of keys [LO, LO + N) as a tree of depth log2(N) (indices known at compile time: registers).
template <int LO, int N>
struct KeyMax {
  static __device__ __forceinline__ unsigned of(const unsigned* key) {
    return max(KeyMax<LO, N / 2>::of(key), KeyMax<LO + N / 2, N - N / 2>::of(key));
  }
};
template <int LO>
struct KeyMax<LO, 1> {
  static __device__ __forceinline__ unsigned of(const unsigned* key) { return key[LO]; }
};

// The highest of a lane's N keys and its slot (ties: the lower slot).
template <int N>
__device__ __forceinline__ void lane_best(const unsigned (&key)[N], unsigned& best, int& slot) {
  best = KeyMax<0, N>::of(key);
  unsigned hit = 0u;
#pragma unroll
  for (int i = 0; i < N; ++i) hit |= (key[i] == best ? 1u : 0u) << i;
  slot = __ffs(hit) - 1;
}

// Routes the token of logits [E] (all 32 lanes call it); lane j < k gets its j-th choice as (id, weight).
// grouped: E floats of scratch for this warp alone, used when n_group > 1.
template <int PER_LANE>
__device__ __forceinline__ void route_token(const float* __restrict__ logits, const float* __restrict__ bias, int E,
                                            int k, int n_group, int topk_group, int renormalize, float scale, int e0,
                                            int n_local, float* grouped, int& id, float& weight) {
  const int lane = threadIdx.x & 31;
  float s[PER_LANE], ch[PER_LANE];
#pragma unroll
  for (int i = 0; i < PER_LANE; ++i) {
    const int e = 32 * i + lane;
    s[i] = 0.f;
    ch[i] = NEG_INF;  // past E: never a candidate (its key below is 0)
    if (e < E) {
      s[i] = 1.f / (1.f + __expf(-logits[e]));
      ch[i] = s[i] + bias[e];
    }
  }
  if (n_group > 1) {
    const int G = E / n_group;
#pragma unroll
    for (int i = 0; i < PER_LANE; ++i)
      if (32 * i + lane < E) grouped[32 * i + lane] = ch[i];
    __syncwarp();
    float gs = NEG_INF;  // lane g < n_group: group g's top-2 sum
    if (lane < n_group) {
      float m1 = NEG_INF, m2 = NEG_INF;
      for (int j = 0; j < G; ++j) {
        const float v = grouped[lane * G + j];
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
    for (int i = 0; i < PER_LANE; ++i) {
      const int e = 32 * i + lane;
      if (e < E && !((keep >> (e / G)) & 1u)) ch[i] = 0.f;
    }
  }
  // The k rounds: each lane keeps the best of its own experts (key, slot); a round takes the warp's best with two
  // reductions and the winning lane alone looks again at its own. (H200, K2: one scan of every lane's experts and a
  // 10-shuffle argmax a round took ~4 us of moe_route_prep's ~9 at one token.)
  unsigned key[PER_LANE];
#pragma unroll
  for (int i = 0; i < PER_LANE; ++i) key[i] = 32 * i + lane < E ? choice_key(ch[i]) : 0u;
  unsigned best;
  int best_i;
  lane_best(key, best, best_i);
  int my_e = -1;
  float my_w = 0.f, wsum = 0.f;
  for (int j = 0; j < k; ++j) {
    const unsigned top = warp_extreme<true>(best);
    const int e = (int)warp_extreme<false>(best == top ? 32u * best_i + lane : 0xffffffffu);  // ties: the lower id
    const int owner = e & 31;
    float w = 0.f;
    if (lane == owner) {
#pragma unroll
      for (int i = 0; i < PER_LANE; ++i)
        if (i == best_i) {
          w = s[i];
          key[i] = 0u;
        }
      lane_best(key, best, best_i);
    }
    w = __shfl_sync(FULL, w, owner);
    if (lane == j) {
      my_e = e;
      my_w = w;
    }
    wsum += w;
  }
  id = my_e >= e0 && my_e < e0 + n_local ? my_e - e0 : -1;
  weight = (renormalize ? my_w / (wsum + 1e-20f) : my_w) * scale;
}
