// tree_accept: walk each sequence's verified draft tree with the target's per-node choices.
// Launch: grid (B,), block (BLOCK,). One block per sequence; each step the block scans the
// sequence's nodes for the child of `cur` that carries the chosen token (at most one matches). A chosen token equal
// to the sequence's stop token (stop may be null; -1: none) ends the walk as the bonus.

#include "griddep.cuh"

extern "C" __global__ void tree_accept(const long long* __restrict__ tokens,  // [B, n1]
                                       const int* __restrict__ parents,       // [B, n1]
                                       const int* __restrict__ num_nodes,     // [B]
                                       const long long* __restrict__ choices, // [B, n1]
                                       const long long* __restrict__ stop,    // [B] or null
                                       int* __restrict__ accepted,            // [B, max_depth + 1]
                                       int* __restrict__ accept_len,          // [B]
                                       long long* __restrict__ next_token,    // [B]
                                       int n1, int max_depth) {
  griddep_begin();
  __shared__ int found[2];  // double-buffered: step s writes found[s & 1]
  const int b = blockIdx.x;
  const long long* tok = tokens + (long long)b * n1;
  const int* par = parents + (long long)b * n1;
  const long long* cho = choices + (long long)b * n1;
  int* acc = accepted + (long long)b * (max_depth + 1);
  const int n = min(max(num_nodes[b], 1), n1);

  const long long s = stop != nullptr ? stop[b] : -1;
  int cur = 0, len = 1;
  long long t = cho[0];
  if (threadIdx.x == 0) {
    found[0] = -1;
    acc[0] = 0;
  }
  __syncthreads();
  for (int step = 0; len <= max_depth && (s < 0 || t != s); ++step) {
    int* slot = &found[step & 1];
    for (int c = 1 + threadIdx.x; c < n; c += blockDim.x)
      if (par[c] == cur && tok[c] == t) *slot = c;
    if (threadIdx.x == 0) found[(step + 1) & 1] = -1;  // the next step's slot, not read this step
    __syncthreads();
    const int hit = *slot;
    if (hit < 0) break;
    if (threadIdx.x == 0) acc[len] = hit;
    cur = hit;
    ++len;
    t = cho[cur];
    __syncthreads();  // every thread has read `slot` before step + 2 resets it
  }
  for (int i = len + threadIdx.x; i <= max_depth; i += blockDim.x) acc[i] = -1;
  if (threadIdx.x == 0) {
    accept_len[b] = len;
    next_token[b] = t;
  }
}
