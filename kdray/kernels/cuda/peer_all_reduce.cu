// One-shot all-reduce of a few rows over peer buffers (CUDA IPC), optionally fused with the RMSNorm after it; see
// kernels/peer_all_reduce.py.
//
// Every rank owns one buffer that all ranks have mapped (bases[r]: rank r's buffer in this process's address space):
//   flags  u32 [BLOCKS][MAX_WORLD]  flags[b][r]: the last call of block b at which rank r had written its rows
//   counts u32 [BLOCKS]             this rank's calls so far, per block (only its own rank touches them)
//   rows   elem_t [2][half_elems]   the rows of the calls with odd and even counts, [rows][dim] each
// A call: block b copies its rows (b, b + BLOCKS, ...) of x into its own buffer's half (call & 1), then for each
// rank r stores the call's count into rank r's flags[b][me] (system-scope release) and waits until its own
// flags[b][r] has reached it (acquire): rank r's block b has written the same rows. It then sums each row over the
// ranks in rank order in fp32, rounds once to the element type, and writes it (with a weight, also normalises it as
// rmsnorm.cu does, in the same rounding and the same block reduction, so the norm equals rmsnorm of the reduced rows
// bit for bit). No barrier at the end: a rank's next call writes the other half, and
// the one after it waits for every rank's flag of the call between, which each rank sets only after its own stream
// has finished this call's reads.
// Launch: grid (BLOCKS) always (every block counts every call), block (threads): a multiple of 32 with
// threads * NV * VEC >= dim (the rmsnorm launch's threads for fewer rows than SMs), dim % VEC == 0, rows 16-byte
// aligned; world <= MAX_WORLD; rows * dim <= half_elems.
#include "griddep.cuh"
#include "rmsnorm.cuh"

#define BLOCKS 32     // blocks of every launch
#define MAX_WORLD 8   // ranks at most
#define HEADER 4096   // bytes before the rows: flags, then counts

typedef unsigned int u32;

__device__ __forceinline__ void store_release_sys(u32* p, u32 v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;\n" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ u32 load_acquire_sys(const u32* p) {
  u32 v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// 16 bytes of a peer's rows, fetched again (ld.global.cv: never a stale line of an earlier call).
__device__ __forceinline__ vec_t load_peer(const vec_t* p) {
  const uint4 u = __ldcv(reinterpret_cast<const uint4*>(p));
  return *reinterpret_cast<const vec_t*>(&u);
}

extern "C" __global__ void __launch_bounds__(1024) peer_all_reduce(const long long* __restrict__ bases,  // [world] buffer addresses
                                           int rank, int world, long long half_elems,
                                           const elem_t* __restrict__ x, long long x_stride,  // [rows, dim]: my part
                                           int rows, int dim,
                                           elem_t* __restrict__ sum,           // [rows, dim] contiguous
                                           const elem_t* __restrict__ weight,  // [dim], or null: no norm
                                           elem_t* __restrict__ normed,        // [rows, dim] (with a weight)
                                           float eps) {
  griddep_wait();  // the kernel after this one is launched once this block has met the other ranks (below)
  char* self = reinterpret_cast<char*>(bases[rank]);
  u32* counts = reinterpret_cast<u32*>(self) + BLOCKS * MAX_WORLD;
  const u32 call = counts[blockIdx.x] + 1;
  const long long half = (call & 1) * half_elems;
  const int nvec = dim / VEC;

  vec_t* mine = reinterpret_cast<vec_t*>(reinterpret_cast<elem_t*>(self + HEADER) + half);
  for (int row = blockIdx.x; row < rows; row += BLOCKS) {
    const vec_t* xr = reinterpret_cast<const vec_t*>(x + row * x_stride);
    for (int j = threadIdx.x; j < nvec; j += blockDim.x) mine[(long long)row * nvec + j] = xr[j];
  }
  __syncthreads();
  if (threadIdx.x < world) {  // thread r meets rank r
    u32* theirs = reinterpret_cast<u32*>(bases[threadIdx.x]) + blockIdx.x * MAX_WORLD + rank;
    store_release_sys(theirs, call);  // releases the block's rows too (ordered before it by the barrier)
    const u32* seen = reinterpret_cast<const u32*>(self) + blockIdx.x * MAX_WORLD + threadIdx.x;
    while ((int)(load_acquire_sys(seen) - call) < 0) {  // a rank may already be one call ahead
    }
  }
  __syncthreads();
  // Not at the start: a launched dependent's blocks wait on the SMs, and a chain of this kernel's calls launched
  // that way would fill them before the other ranks' blocks (ranks sharing a GPU) had come.
  griddep_launch_dependents();

  for (int row = blockIdx.x; row < rows; row += BLOCKS) {  // uniform over the block: block_sum inside
    vec_t s[NV];  // the rows' sums, kept rounded: 16 bytes a vector
    float ss = 0.f;
#pragma unroll
    for (int i = 0; i < NV; ++i) {
      const int j = threadIdx.x + i * blockDim.x;
      if (j < nvec) {
        float acc[VEC];
#pragma unroll
        for (int e = 0; e < VEC; ++e) acc[e] = 0.f;
        for (int r = 0; r < world; ++r) {  // rank order: every rank rounds the same sum
          const long long at = (long long)row * nvec + j;
          const vec_t v = r == rank ? reinterpret_cast<const vec_t*>(x + row * x_stride)[j]
                                    : load_peer(reinterpret_cast<const vec_t*>(
                                          reinterpret_cast<const elem_t*>(
                                              reinterpret_cast<const char*>(bases[r]) + HEADER) + half) + at);
#pragma unroll
          for (int e = 0; e < VEC; ++e) acc[e] += to_f(v.v[e]);
        }
        vec_t a;
#pragma unroll
        for (int e = 0; e < VEC; ++e) a.v[e] = to_t(acc[e]);
        s[i] = a;
        add_squares(ss, a);
      }
    }
#pragma unroll
    for (int i = 0; i < NV; ++i) {
      const int j = threadIdx.x + i * blockDim.x;
      if (j < nvec) reinterpret_cast<vec_t*>(sum + (long long)row * dim)[j] = s[i];
    }
    if (weight != nullptr) rmsnorm_store(s, ss, dim, eps, weight, normed + (long long)row * dim);  // uniform
  }
  if (threadIdx.x == 0) counts[blockIdx.x] = call;  // every thread read it before the barrier above
}
