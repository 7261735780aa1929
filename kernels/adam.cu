// Fused Adam step on a flat fp32 master shard, from an fp16 (or fp32) gradient shard that
// still carries the loss scale. Two launches on one stream, no host round trip between them:
//
//   adam_unscale_check_{f16,f32}(grad, loss_scale, found_inf, n)
//       g = grad / loss_scale; each block ORs "some g is inf/nan" into *found_inf
//       (__syncthreads_or, then one atomicOr per block). *found_inf starts at 0.
//
//   adam_step_{f16,f32}(master, grad, m, v, param_out, write_param_out, skip,
//                       loss_scale, clip_coef, weight_decay, use_weight_decay,
//                       beta1, one_minus_beta1, beta2, one_minus_beta2,
//                       step_size, bias_correction2_sqrt, eps, n)
//       does nothing when *skip != 0 (an overflow: the step is skipped, nothing changes);
//       otherwise, per element, in exactly the order of ringcomm.train.strategy._update and
//       ringcomm.train.optim.Adam.update (torch.optim.Adam, L2 weight decay):
//           g  = grad / loss_scale                      unscale
//           g  = g * clip_coef                          global-norm clipping (1 = none)
//           g  = g + weight_decay * p                   only if use_weight_decay
//           m  = m * beta1 + one_minus_beta1 * g
//           v  = v * beta2 + (one_minus_beta2 * g) * g
//           d  = sqrt(v) / bias_correction2_sqrt + eps
//           p  = p - step_size * (m / d)
//           param_out = fp16(p)                         only if write_param_out
//
// Every scalar is the fp32 rounding of the double the CPU path computes in Python:
// one_minus_beta1 = fp32(1 - beta1), step_size = fp32(lr / (1 - beta1**t)),
// bias_correction2_sqrt = fp32(sqrt(1 - beta2**t)). Each operation is a single correctly
// rounded fp32 operation (the _rn intrinsics: no FMA contraction), which is what numpy does
// one array operation at a time, so the result equals the numpy reference bit for bit.
// param_out is neither read nor written when write_param_out is 0 (any pointer will do).

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

template <class G>
__device__ __forceinline__ void adam_unscale_check_impl(const G* grad, float loss_scale,
                                                        int* found_inf, long long n) {
    int bad = 0;
    RC_GRID_STRIDE(i, n) {
        const float g = __fdiv_rn(Compute<G>::load(grad[i]), loss_scale);
        bad |= !is_finite(g);
    }
    // every thread of the block reaches this once, whatever its trip count
    if (__syncthreads_or(bad) && threadIdx.x == 0) atomicOr(found_inf, 1);
}

template <class G>
__device__ __forceinline__ void adam_step_impl(
    float* __restrict__ master, const G* __restrict__ grad, float* __restrict__ m,
    float* __restrict__ v, half* __restrict__ param_out, int write_param_out,
    const int* skip, float loss_scale, float clip_coef, float weight_decay,
    int use_weight_decay, float beta1, float one_minus_beta1, float beta2,
    float one_minus_beta2, float step_size, float bias_correction2_sqrt, float eps,
    long long n) {
    if (*skip) return;
    RC_GRID_STRIDE(i, n) {
        float g = __fdiv_rn(Compute<G>::load(grad[i]), loss_scale);
        g = __fmul_rn(g, clip_coef);
        float p = master[i];
        if (use_weight_decay) g = __fadd_rn(g, __fmul_rn(weight_decay, p));
        const float mi = __fadd_rn(__fmul_rn(m[i], beta1), __fmul_rn(one_minus_beta1, g));
        const float vi = __fadd_rn(__fmul_rn(v[i], beta2),
                                   __fmul_rn(__fmul_rn(one_minus_beta2, g), g));
        const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(vi), bias_correction2_sqrt), eps);
        p = __fsub_rn(p, __fmul_rn(step_size, __fdiv_rn(mi, denom)));
        m[i] = mi;
        v[i] = vi;
        master[i] = p;
        if (write_param_out) param_out[i] = to_half(p);
    }
}

}  // namespace rc

#define RC_ADAM_ENTRIES(suffix, G)                                                         \
    extern "C" __global__ void adam_unscale_check_##suffix(const G* grad, float loss_scale, \
                                                           int* found_inf, long long n) {  \
        rc::adam_unscale_check_impl<G>(grad, loss_scale, found_inf, n);                   \
    }                                                                                      \
    extern "C" __global__ void adam_step_##suffix(                                         \
        float* master, const G* grad, float* m, float* v, rc::half* param_out,             \
        int write_param_out, const int* skip, float loss_scale, float clip_coef,           \
        float weight_decay, int use_weight_decay, float beta1, float one_minus_beta1,      \
        float beta2, float one_minus_beta2, float step_size, float bias_correction2_sqrt,  \
        float eps, long long n) {                                                          \
        rc::adam_step_impl<G>(master, grad, m, v, param_out, write_param_out, skip,        \
                              loss_scale, clip_coef, weight_decay, use_weight_decay,       \
                              beta1, one_minus_beta1, beta2, one_minus_beta2, step_size,   \
                              bias_correction2_sqrt, eps, n);                              \
    }

RC_ADAM_ENTRIES(f16, rc::half)
RC_ADAM_ENTRIES(f32, float)
