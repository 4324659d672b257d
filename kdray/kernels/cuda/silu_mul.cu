// SwiGLU gate: out[t, i] = to_t(to_t(silu(gate)) * up), gate = x[t, i], up = x[t, I + i]; see kernels/silu_mul.py.
// Launch: any 1-D grid of 256-thread blocks (grid-stride over rows * I / VEC vectors); I % VEC == 0, rows VEC-aligned.
#include "dtype.cuh"
#include "griddep.cuh"

#ifndef VEC
#define VEC 8
#endif

struct __align__(VEC * sizeof(elem_t)) vec_t {
  elem_t v[VEC];
};

extern "C" __global__ void silu_mul(const elem_t* __restrict__ x, long long x_stride,  // [rows, 2I]
                                    elem_t* __restrict__ out,                         // [rows, I] contiguous
                                    long long rows, int I) {
  griddep_begin();
  const int per_row = I / VEC;
  const long long n = rows * per_row;
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
    const long long t = i / per_row;
    const int j = (int)(i - t * per_row);
    const vec_t* row = reinterpret_cast<const vec_t*>(x + t * x_stride);
    const vec_t g = row[j], u = row[per_row + j];
    vec_t y;
#pragma unroll
    for (int e = 0; e < VEC; ++e) {
      const float a = to_f(g.v[e]);
      y.v[e] = to_t(to_f(to_t(a / (1.f + __expf(-a)))) * to_f(u.v[e]));
    }
    reinterpret_cast<vec_t*>(out)[i] = y;
  }
}
