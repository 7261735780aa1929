// Partial squared L2 norm for global-norm gradient clipping:
//
//   sq_norm_partial_<in>_<acc>(x, divisor, partial, n)
//       partial[b] = sum of u*u over the elements block b visits, u = x[i] / divisor
//
// <in>_<acc> in {f16_f32, f16_f64, f32_f32, f32_f64, f64_f64}. The quotient is taken in the
// input's arithmetic type (fp32 for fp16/fp32, fp64 for fp64) exactly as the CPU path unscales
// (`grad /= scale`), then widened to the accumulator type and squared there; for fp32 input
// and fp64 accumulation each square is exact, as in the CPU path's
// np.dot(grad.astype(float64), grad). divisor = 1 for an already unscaled gradient.
//
// Block b visits i = (b + k * gridDim.x) * blockDim.x + t (the grid-stride loop), so block b
// covers every element whose (i / blockDim.x) % gridDim.x == b. partial has gridDim.x
// entries; the caller sums them (in fp64) and all-reduces the sum across ranks. blockDim.x
// must be a multiple of 32, at most 1024. The summation order differs from numpy's, so the
// result agrees with it to rounding, not bit for bit.

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

namespace rc {

template <class A> __device__ __forceinline__ A warp_sum(A s) {
    for (int offset = 16; offset > 0; offset >>= 1) s += __shfl_down_sync(0xffffffffu, s, offset);
    return s;
}

// Sum of s over the block; the total is valid in thread 0.
template <class A> __device__ __forceinline__ A block_sum(A s) {
    __shared__ A warp_totals[32];
    const unsigned lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
    s = warp_sum(s);
    if (lane == 0) warp_totals[warp] = s;
    __syncthreads();
    if (warp == 0) {
        s = threadIdx.x < (blockDim.x >> 5) ? warp_totals[lane] : A(0);
        s = warp_sum(s);
    }
    return s;
}

template <class T, class A>
__device__ __forceinline__ void sq_norm_partial_impl(const T* x, typename Compute<T>::type divisor,
                                                     A* partial, long long n) {
    A s = A(0);
    RC_GRID_STRIDE(i, n) {
        const A u = static_cast<A>(div(Compute<T>::load(x[i]), divisor));
        s += u * u;
    }
    s = block_sum(s);
    if (threadIdx.x == 0) partial[blockIdx.x] = s;
}

}  // namespace rc

#define RC_SQ_NORM_ENTRY(suffix, T, S, A)                                                  \
    extern "C" __global__ void sq_norm_partial_##suffix(const T* x, S divisor, A* partial, \
                                                        long long n) {                    \
        rc::sq_norm_partial_impl<T, A>(x, divisor, partial, n);                            \
    }

RC_SQ_NORM_ENTRY(f16_f32, rc::half, float, float)
RC_SQ_NORM_ENTRY(f16_f64, rc::half, float, double)
RC_SQ_NORM_ENTRY(f32_f32, float, float, float)
RC_SQ_NORM_ENTRY(f32_f64, float, float, double)
RC_SQ_NORM_ENTRY(f64_f64, double, double, double)
