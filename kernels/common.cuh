// common.cuh: what every kernel file of ringcomm shares (fp16 type, finiteness test, exact
// never-flushed arithmetic and comparisons, widening, grid-stride loop). Included by each
// *.cu; ringcomm/kernels/__init__.py inlines it for NVRTC.
#pragma once
// ---- common prelude: identical in every kernels/*.cu (tests/unit/test_kernels_compile.py checks) ----
// fp16: a two-byte struct with __half's layout and the two PTX conversions __half2float and
// __float2half_rn emit, so that no source includes a CUDA header: NVRTC compiles the kernels
// whether or not CuPy or a toolkit supplies cuda_fp16.h. Every floating-point step that must
// match numpy bit for bit goes through rc::add/sub/mul/div/sqrt_rn and the comparisons
// below: correctly rounded, never contracted into an FMA, and never flushed to zero.
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
}  // namespace rc

namespace rc {

// Finite: the exponent field is not all ones (all ones is inf or nan).
__device__ __forceinline__ bool is_finite(float x) {
    return (__float_as_uint(x) & 0x7f800000u) != 0x7f800000u;
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

// Correctly rounded arithmetic, never contracted, and for fp32 never flushed: CuPy compiles
// every RawModule with -ftz=true, which turns each fp32 add/mul/div/sqrt/compare/widen the
// compiler emits into its .ftz form (a subnormal operand or result becomes zero). numpy keeps
// subnormals, so the fp32 steps are written as the PTX instructions without .ftz; the
// -ftz flag only changes instructions the compiler chooses. fp64 has no flush mode.
#define RC_PTX_F32(name, instruction)                                                      \
    __device__ __forceinline__ float name(float a, float b) {                              \
        float r;                                                                           \
        asm(instruction " %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));                        \
        return r;                                                                          \
    }
RC_PTX_F32(add, "add.rn.f32")
RC_PTX_F32(sub, "sub.rn.f32")
RC_PTX_F32(mul, "mul.rn.f32")
RC_PTX_F32(div, "div.rn.f32")
#undef RC_PTX_F32
__device__ __forceinline__ float sqrt_rn(float a) {
    float r;
    asm("sqrt.rn.f32 %0, %1;" : "=f"(r) : "f"(a));
    return r;
}
__device__ __forceinline__ double add(double a, double b) { return __dadd_rn(a, b); }
__device__ __forceinline__ double sub(double a, double b) { return __dsub_rn(a, b); }
__device__ __forceinline__ double mul(double a, double b) { return __dmul_rn(a, b); }
__device__ __forceinline__ double div(double a, double b) { return __ddiv_rn(a, b); }

// fp32 -> fp64 without flushing a subnormal (a plain cast compiles to cvt.ftz.f64.f32).
__device__ __forceinline__ double widen(float a) {
    double r;
    asm("cvt.f64.f32 %0, %1;" : "=d"(r) : "f"(a));
    return r;
}

// Ordered comparisons that see a subnormal as non-zero (a > b compiles to setp.gt.ftz.f32).
__device__ __forceinline__ bool greater(float a, float b) {
    unsigned r;
    asm("{ .reg .pred p; setp.gt.f32 p, %1, %2; selp.u32 %0, 1, 0, p; }" : "=r"(r) : "f"(a), "f"(b));
    return r != 0;
}
__device__ __forceinline__ bool less(float a, float b) { return greater(b, a); }
__device__ __forceinline__ bool equal(float a, float b) {
    unsigned r;
    asm("{ .reg .pred p; setp.eq.f32 p, %1, %2; selp.u32 %0, 1, 0, p; }" : "=r"(r) : "f"(a), "f"(b));
    return r != 0;
}
template <class C> __device__ __forceinline__ bool greater(C a, C b) { return a > b; }  // fp64, ints
template <class C> __device__ __forceinline__ bool less(C a, C b) { return a < b; }
template <class C> __device__ __forceinline__ bool equal(C a, C b) { return a == b; }
template <class C> __device__ __forceinline__ bool is_nan(C x) { return x != x; }
__device__ __forceinline__ bool is_nan(float x) { return (__float_as_uint(x) & 0x7fffffffu) > 0x7f800000u; }

}  // namespace rc

// for (long long i = <this thread's first index>; i < n; i += <threads in the grid>)
#define RC_GRID_STRIDE(i, n)                                                               \
    for (long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;     \
         i < (n); i += static_cast<long long>(blockDim.x) * gridDim.x)
// ---- end of common prelude ----
