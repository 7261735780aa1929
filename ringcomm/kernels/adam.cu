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
//       otherwise, per element, in exactly the order of ringcomm.train.strategy.Strategy.update and
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

#include "common.cuh"

namespace rc {

template <class G>
__device__ __forceinline__ void adam_unscale_check_impl(const G* grad, float loss_scale,
                                                        int* found_inf, long long n) {
    int bad = 0;
    RC_GRID_STRIDE(i, n) {
        const float g = div(Compute<G>::load(grad[i]), loss_scale);
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
        float g = div(Compute<G>::load(grad[i]), loss_scale);
        g = mul(g, clip_coef);
        float p = master[i];
        if (use_weight_decay) g = add(g, mul(weight_decay, p));
        const float mi = add(mul(m[i], beta1), mul(one_minus_beta1, g));
        const float vi = add(mul(v[i], beta2),
                                   mul(mul(one_minus_beta2, g), g));
        const float denom = add(div(sqrt_rn(vi), bias_correction2_sqrt), eps);
        p = sub(p, mul(step_size, div(mi, denom)));
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
