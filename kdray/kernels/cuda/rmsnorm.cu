// RMSNorm of each row, optionally after a residual add; see kernels/rmsnorm.py.
// out = w * to_t(s * rsqrt(mean(s^2) + eps)), s = x (rmsnorm) or s = to_t(x + residual), written to
// residual_out (add_rmsnorm). Rounding follows the torch reference: the sum and the normalised value are
// cast to the element type before the next step.
// Launch: grid (rows), block (threads): threads a multiple of 32, threads * NV * VEC >= dim, dim % VEC == 0,
// every row start VEC-element aligned. VEC elements per access (16 bytes for bf16 rows of 8).
#include "griddep.cuh"
#include "rmsnorm.cuh"

extern "C" __global__ void rmsnorm(const elem_t* __restrict__ x, long long x_stride,       // [rows, dim]
                                   const elem_t* __restrict__ residual, long long r_stride,  // [rows, dim] or null
                                   elem_t* __restrict__ residual_out,                        // [rows, dim] contiguous
                                   const elem_t* __restrict__ weight,                        // [dim]
                                   elem_t* __restrict__ out,                                 // [rows, dim] contiguous
                                   int dim, float eps) {
  griddep_begin();
  const long long row = blockIdx.x;
  const int nvec = dim / VEC;
  const vec_t* xr = reinterpret_cast<const vec_t*>(x + row * x_stride);
  vec_t s[NV];
  float ss = 0.f;
#pragma unroll
  for (int i = 0; i < NV; ++i) {
    const int j = threadIdx.x + i * blockDim.x;
    if (j < nvec) {
      vec_t a = xr[j];
      if (residual != nullptr) {
        const vec_t b = reinterpret_cast<const vec_t*>(residual + row * r_stride)[j];
#pragma unroll
        for (int e = 0; e < VEC; ++e) a.v[e] = to_t(to_f(a.v[e]) + to_f(b.v[e]));
        reinterpret_cast<vec_t*>(residual_out + row * dim)[j] = a;
      }
      s[i] = a;
      add_squares(ss, a);
    }
  }
  rmsnorm_store(s, ss, dim, eps, weight, out + row * dim);
}
