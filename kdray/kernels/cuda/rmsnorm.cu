// RMSNorm of each row; see kernels/rmsnorm.py.
// out = w * to_t(x * rsqrt(mean(x^2) + eps)), and with out_k the same rows in the INT4 experts' k order
// (rmsnorm.cuh). Rounding follows the torch reference: the normalised value is cast to the element type before the
// weight multiplies it.
// Launch: grid (rows), block (threads): threads a multiple of 32, threads * NV * VEC >= dim, dim % VEC == 0,
// every row start VEC-element aligned. VEC elements per access (16 bytes for bf16 rows of 8).
#include "griddep.cuh"
#include "rmsnorm.cuh"

extern "C" __global__ void rmsnorm(const elem_t* __restrict__ x, long long x_stride,  // [rows, dim]
                                   const elem_t* __restrict__ weight,                 // [dim]
                                   elem_t* __restrict__ out,                          // [rows, dim] contiguous
                                   elem_t* __restrict__ out_k,  // [rows, dim] in the experts' k order, or null
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
      s[i] = xr[j];
      add_squares(ss, s[i]);
    }
  }
  rmsnorm_store(s, ss, dim, eps, weight, out + row * dim, out_k == nullptr ? nullptr : out_k + row * dim);
}
