// kv_compact: move each accepted node's KV row into the sequence's next slot, in every layer.
// Launch: grid (B, num_layers), block (BLOCK,), dynamic shared memory = 2*A*8 + (A-1)*row bytes.
// Each block stages all moved rows of its (sequence, layer) in shared memory before writing any,
// so a destination may be another entry's source. VEC (bytes) is the copy unit: 16, 8, 4, 2 or 1.

#include "griddep.cuh"

#ifndef VEC
#define VEC 16
#endif

#if VEC == 16
typedef uint4 vec_t;
#elif VEC == 8
typedef uint2 vec_t;
#elif VEC == 4
typedef unsigned int vec_t;
#elif VEC == 2
typedef unsigned short vec_t;
#else
typedef unsigned char vec_t;
#endif

extern "C" __global__ void kv_compact(vec_t* __restrict__ cache,              // [layers, P, S, row_vecs]
                                      const int* __restrict__ block_table,    // [B, max_pages]
                                      const int* __restrict__ prefix_lens,    // [B]
                                      const int* __restrict__ accepted,       // [B, A]
                                      const int* __restrict__ accept_len,     // [B]
                                      long long layer_vecs, int S, int row_vecs, int max_pages, int A) {
  griddep_begin();
  extern __shared__ uint4 smem[];
  long long* src_off = reinterpret_cast<long long*>(smem);  // [A] row offsets (vecs) in the layer
  long long* dst_off = src_off + A;                          // [A]
  vec_t* stage = reinterpret_cast<vec_t*>(dst_off + A);       // [(A-1) * row_vecs]
  const int b = blockIdx.x;
  const int n = min(accept_len[b], A) - 1;  // rows j = 1 .. n
  if (n <= 0) return;
  const int prefix = prefix_lens[b];
  const int* table = block_table + (long long)b * max_pages;
  for (int j = 1 + threadIdx.x; j <= n; j += blockDim.x) {
    const int src = accepted[(long long)b * A + j];
    const int ps = prefix + src, pd = prefix + j;
    src_off[j] = src == j ? -1 : ((long long)table[ps / S] * S + ps % S) * row_vecs;
    dst_off[j] = ((long long)table[pd / S] * S + pd % S) * row_vecs;
  }
  __syncthreads();
  vec_t* layer = cache + (long long)blockIdx.y * layer_vecs;
  const int total = n * row_vecs;
  for (int k = threadIdx.x; k < total; k += blockDim.x) {
    const int j = 1 + k / row_vecs;
    if (src_off[j] >= 0) stage[k] = layer[src_off[j] + k % row_vecs];
  }
  __syncthreads();
  for (int k = threadIdx.x; k < total; k += blockDim.x) {
    const int j = 1 + k / row_vecs;
    if (src_off[j] >= 0) layer[dst_off[j] + k % row_vecs] = stage[k];
  }
}
