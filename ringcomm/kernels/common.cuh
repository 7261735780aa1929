// common.cuh: what every kernel file of ringcomm shares (fp16 type, finiteness tests,
// grid-stride loop). Included by each *.cu; ringcomm/kernels.py inlines it for NVRTC.
#pragma once
// ---- common prelude: identical in every kernels/*.cu (tests/unit/test_kernels.py checks) ----
// fp16: cuda_fp16.h's __half by default (nvcc has it; CuPy's RawModule finds the copy CuPy
// bundles). -DRINGCOMM_NO_CUDA_FP16 swaps in a two-byte struct with the same layout and the
// same two PTX conversions that __half2float / __float2half_rn emit, for an NVRTC that cannot
// find cuda_fp16.h; ringcomm/kernels.py retries with it. Every floating-point step that must
// match numpy bit for bit uses the round-to-nearest intrinsics (__fadd_rn, __fmul_rn,
// __fdiv_rn, __fsqrt_rn, ...), which are never contracted into an FMA.
#ifndef RINGCOMM_NO_CUDA_FP16
#include <cuda_fp16.h>
namespace rc {
typedef __half half;
__device__ __forceinline__ float to_float(half h) { return __half2float(h); }
__device__ __forceinline__ half to_half(float f) { return __float2half_rn(f); }
__device__ __forceinline__ unsigned short half_bits(half h) { return __half_as_ushort(h); }
}  // namespace rc
#else
namespace rc {
struct __align__(2) half { unsigned short bits; };
__device__ __forceinline__ float to_float(half h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h.bits));
    return f;
}
__device__ __forceinline__ half to_half(float f) {
    half h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h.bits) : "f"(f));
    return h;
}
__device__ __forceinline__ unsigned short half_bits(half h) { return h.bits; }
}  // namespace rc
#endif

namespace rc {

// Finite: the exponent field is not all ones (all ones is inf or nan).
__device__ __forceinline__ bool is_finite(float x) {
    return (__float_as_uint(x) & 0x7f800000u) != 0x7f800000u;
}
__device__ __forceinline__ bool is_finite(double x) {
    return (static_cast<unsigned long long>(__double_as_longlong(x)) & 0x7ff0000000000000ull)
           != 0x7ff0000000000000ull;
}
__device__ __forceinline__ bool is_finite(half x) {
    return (half_bits(x) & 0x7c00u) != 0x7c00u;
}

// The type arithmetic on T happens in: fp16 is widened to fp32 and rounded back once.
template <class T> struct Compute {
    typedef T type;
    static __device__ __forceinline__ T load(T x) { return x; }
    static __device__ __forceinline__ T store(T x) { return x; }
};
template <> struct Compute<half> {
    typedef float type;
    static __device__ __forceinline__ float load(half x) { return to_float(x); }
    static __device__ __forceinline__ half store(float x) { return to_half(x); }
};

// Correctly rounded arithmetic, never contracted.
__device__ __forceinline__ float add(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ double add(double a, double b) { return __dadd_rn(a, b); }
__device__ __forceinline__ float mul(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ double mul(double a, double b) { return __dmul_rn(a, b); }
__device__ __forceinline__ float div(float a, float b) { return __fdiv_rn(a, b); }
__device__ __forceinline__ double div(double a, double b) { return __ddiv_rn(a, b); }

}  // namespace rc

// for (long long i = <this thread's first index>; i < n; i += <threads in the grid>)
#define RC_GRID_STRIDE(i, n)                                                               \
    for (long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;     \
         i < (n); i += static_cast<long long>(blockDim.x) * gridDim.x)
// ---- end of common prelude ----
