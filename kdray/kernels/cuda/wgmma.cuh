// Hopper shared-memory, mbarrier / TMA bulk copy and warpgroup-MMA (wgmma) helpers shared by tree_verify_attention.cu,
// prefill_attention.cu (through attention_tile.cuh), w4a16_moe.cu and skinny_linear_wgmma.cu. All but smem_u32, the
// cp.async copies (sm_80 and later) and the operand-list macros exist only when compiling for sm_90a
// (__CUDA_ARCH_FEAT_SM90_ALL).
#pragma once

typedef unsigned int u32;
typedef unsigned long long u64;

__device__ __forceinline__ u32 smem_u32(const void* p) { return (u32)__cvta_generic_to_shared(p); }

// 16 bytes global -> shared address dst through L2 (cp.async.cg), bypassing registers; zero-filled when !valid.
// Copies since the last commit form a group; cp_async_wait<N> waits until at most N of this thread's groups are in
// flight.
__device__ __forceinline__ void cp_async16(u32 dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

// A wgmma's fp32 accumulator operands d[0..N-1], read and written ("+f"), for the asm statements below and in
// the kernels that include this file.
#define WG_ACC_AT8(i)                                                                                           \
  "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), "+f"(d[i + 6]), \
      "+f"(d[i + 7])
#define WG_ACC_AT4(i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3])
#define WG_ACC4 WG_ACC_AT4(0)
#define WG_ACC8 WG_ACC_AT8(0)
#define WG_ACC12 WG_ACC8, WG_ACC_AT4(8)
#define WG_ACC16 WG_ACC8, WG_ACC_AT8(8)
#define WG_ACC20 WG_ACC16, WG_ACC_AT4(16)
#define WG_ACC24 WG_ACC16, WG_ACC_AT8(16)
#define WG_ACC28 WG_ACC24, WG_ACC_AT4(24)
#define WG_ACC32 WG_ACC24, WG_ACC_AT8(24)
#define WG_ACC36 WG_ACC32, WG_ACC_AT4(32)
#define WG_ACC40 WG_ACC32, WG_ACC_AT8(32)
#define WG_ACC44 WG_ACC40, WG_ACC_AT4(40)
#define WG_ACC48 WG_ACC40, WG_ACC_AT8(40)
#define WG_ACC52 WG_ACC48, WG_ACC_AT4(48)
#define WG_ACC56 WG_ACC48, WG_ACC_AT8(48)
#define WG_ACC60 WG_ACC56, WG_ACC_AT4(56)
#define WG_ACC64 WG_ACC56, WG_ACC_AT8(56)
#define WG_ACC128 WG_ACC64, WG_ACC_AT8(64), WG_ACC_AT8(72), WG_ACC_AT8(80), WG_ACC_AT8(88), WG_ACC_AT8(96), \
                  WG_ACC_AT8(104), WG_ACC_AT8(112), WG_ACC_AT8(120)

// The asm operand list of those accumulators, "%0, %1, ..., %(n - 1)".
#define WG_D4 "%0, %1, %2, %3"
#define WG_D8 WG_D4 ", %4, %5, %6, %7"
#define WG_D12 WG_D8 ", %8, %9, %10, %11"
#define WG_D16 WG_D12 ", %12, %13, %14, %15"
#define WG_D20 WG_D16 ", %16, %17, %18, %19"
#define WG_D24 WG_D20 ", %20, %21, %22, %23"
#define WG_D28 WG_D24 ", %24, %25, %26, %27"
#define WG_D32 WG_D28 ", %28, %29, %30, %31"
#define WG_D36 WG_D32 ", %32, %33, %34, %35"
#define WG_D40 WG_D36 ", %36, %37, %38, %39"
#define WG_D44 WG_D40 ", %40, %41, %42, %43"
#define WG_D48 WG_D44 ", %44, %45, %46, %47"
#define WG_D52 WG_D48 ", %48, %49, %50, %51"
#define WG_D56 WG_D52 ", %52, %53, %54, %55"
#define WG_D60 WG_D56 ", %56, %57, %58, %59"
#define WG_D64 WG_D60 ", %60, %61, %62, %63"
#define WG_D80 WG_D64 ", %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79"
#define WG_D96 WG_D80 ", %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95"
#define WG_D112 WG_D96 ", %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111"
#define WG_D120 WG_D112 ", %112, %113, %114, %115, %116, %117, %118, %119"
#define WG_D128 WG_D120 ", %120, %121, %122, %123, %124, %125, %126, %127"

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// wgmma shared-memory descriptor: 128B swizzle, offsets in bytes (encoded >> 4).
__device__ __forceinline__ u64 wg_desc(u32 addr, u32 lbo, u32 sbo) {
  return (u64)((addr & 0x3FFFF) >> 4) | ((u64)(lbo >> 4) << 16) | ((u64)(sbo >> 4) << 32) | (1ull << 62);
}
// The descriptor of the tile `off` bytes past desc's: only the start field changes (it cannot carry below 256 KB).
__device__ __forceinline__ u64 wg_desc_add(u64 desc, u32 off) {
  return (desc & ~0xFFFFFFFFull) | (u32)((u32)desc + (off >> 4));
}
__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_wait_all() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }
// Keeps the compiler from moving accumulator accesses across the asynchronous wgmma window.
template <int N>
__device__ __forceinline__ void wg_pin(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// mbarrier and TMA bulk copy (cp.async.bulk, global -> shared): a stage's copies complete_tx its mbarrier; the
// consumers wait for the barrier's phase (parity), which flips once the expected bytes have all arrived.
__device__ __forceinline__ void mbar_init(u32 bar, u32 count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_init_fence() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
__device__ __forceinline__ void mbar_expect_tx(u32 bar, u32 bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(u32 bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
  asm volatile(
      "{\n.reg .pred p;\nWAIT_%=:\nmbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n@!p bra WAIT_%=;\n}\n"
      ::"r"(bar), "r"(parity)
      : "memory");
}
// bytes (a multiple of 16; src and dst 16-byte aligned) from global src to shared dst, counted on bar.
__device__ __forceinline__ void bulk_copy_g2s(u32 dst, const void* src, u32 bytes, u32 bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(dst),
               "l"(src), "r"(bytes), "r"(bar)
               : "memory");
}

template <int N>
__device__ __forceinline__ void wg_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory"); }

// d[NA] (+)= A[64x16] B[16xN], N = 2 NA = 8 to 128 in steps of 8, or 256, both K-major in 128B-swizzled shared
// memory; accumulate = 0 overwrites d. Operands bf16, or fp16 where the including file defines WGMMA_AB "f16". The
// asm operands: the NA accumulators, the two descriptors (DA, DB), accumulate (P).
#ifndef WGMMA_AB
#define WGMMA_AB "bf16"
#endif
#define WGMMA_SS(NA, N, DA, DB, P)                                                                         \
  __device__ __forceinline__ void wgmma_ss(float(&d)[NA], u64 da, u64 db, int accumulate) {               \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" #P ", 0;\n"                                         \
                 "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." WGMMA_AB "." WGMMA_AB " {" WG_D##NA     \
                 "}, %" #DA ", %" #DB ", p, 1, 1, 0, 0;\n}\n"                                              \
                 : WG_ACC##NA                                                                             \
                 : "l"(da), "l"(db), "r"(accumulate));                                                    \
  }
WGMMA_SS(4, 8, 4, 5, 6)
WGMMA_SS(8, 16, 8, 9, 10)
WGMMA_SS(12, 24, 12, 13, 14)
WGMMA_SS(16, 32, 16, 17, 18)
WGMMA_SS(20, 40, 20, 21, 22)
WGMMA_SS(24, 48, 24, 25, 26)
WGMMA_SS(28, 56, 28, 29, 30)
WGMMA_SS(32, 64, 32, 33, 34)
WGMMA_SS(36, 72, 36, 37, 38)
WGMMA_SS(40, 80, 40, 41, 42)
WGMMA_SS(44, 88, 44, 45, 46)
WGMMA_SS(48, 96, 48, 49, 50)
WGMMA_SS(52, 104, 52, 53, 54)
WGMMA_SS(56, 112, 56, 57, 58)
WGMMA_SS(60, 120, 60, 61, 62)
WGMMA_SS(64, 128, 64, 65, 66)
WGMMA_SS(128, 256, 128, 129, 130)
#undef WGMMA_SS

// d[NA] += A[64x16] B[16xN], N = 2 NA = 16 to 128 in steps of 8, or 256: A from registers (a[4], the m16k16
// fragment of the thread's warp's 16 rows, as mma.sync's), B in 128B-swizzled shared memory, K-major (MN = 0) or
// MN-major (MN = 1). wgmma reads a[] asynchronously: they stay unchanged until a wg_wait retires it (ptxas serializes
// the wgmmas, and says so, where they might not). The asm operands: the NA accumulators, a[0..3] (A0..A0 + 3), the
// descriptor (DB), the scale-d predicate's source (P, always 1) and MN (T).
#define WGMMA_RS(NA, N, A0, A1, A2, A3, DB, P, T)                                                     \
  template <int MN>                                                                                  \
  __device__ __forceinline__ void wgmma_rs(float(&d)[NA], const u32(&a)[4], u64 db) {                \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" #P ", 0;\n"                                    \
                 "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32.bf16.bf16 {" WG_D##NA "}, "         \
                 "{%" #A0 ", %" #A1 ", %" #A2 ", %" #A3 "}, %" #DB ", p, 1, 1, %" #T ";\n}\n"        \
                 : WG_ACC##NA                                                                        \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1), "n"(MN));            \
  }
WGMMA_RS(8, 16, 8, 9, 10, 11, 12, 13, 14)
WGMMA_RS(12, 24, 12, 13, 14, 15, 16, 17, 18)
WGMMA_RS(16, 32, 16, 17, 18, 19, 20, 21, 22)
WGMMA_RS(20, 40, 20, 21, 22, 23, 24, 25, 26)
WGMMA_RS(24, 48, 24, 25, 26, 27, 28, 29, 30)
WGMMA_RS(28, 56, 28, 29, 30, 31, 32, 33, 34)
WGMMA_RS(32, 64, 32, 33, 34, 35, 36, 37, 38)
WGMMA_RS(36, 72, 36, 37, 38, 39, 40, 41, 42)
WGMMA_RS(40, 80, 40, 41, 42, 43, 44, 45, 46)
WGMMA_RS(44, 88, 44, 45, 46, 47, 48, 49, 50)
WGMMA_RS(48, 96, 48, 49, 50, 51, 52, 53, 54)
WGMMA_RS(52, 104, 52, 53, 54, 55, 56, 57, 58)
WGMMA_RS(56, 112, 56, 57, 58, 59, 60, 61, 62)
WGMMA_RS(60, 120, 60, 61, 62, 63, 64, 65, 66)
WGMMA_RS(64, 128, 64, 65, 66, 67, 68, 69, 70)
WGMMA_RS(128, 256, 128, 129, 130, 131, 132, 133, 134)
#undef WGMMA_RS
#endif  // __CUDA_ARCH_FEAT_SM90_ALL
