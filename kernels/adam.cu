// Fused Adam step on a flat fp32 master slice from its fp32 gradient (already unscaled and
// clipped: Strategy.update does both, and decides across ranks whether the step is taken,
// before any Adam step runs).
//
//   adam_step_f32(master, grad, m, v, weight_decay, use_weight_decay,
//                 beta1, one_minus_beta1, beta2, one_minus_beta2,
//                 step_size, bias_correction2_sqrt, eps, n)
//       per element, in exactly the order of ringcomm.train.optim.Adam.update
//       (torch.optim.Adam, L2 weight decay):
//           g  = grad + weight_decay * p                only if use_weight_decay
//           m  = m * beta1 + one_minus_beta1 * g
//           v  = v * beta2 + (one_minus_beta2 * g) * g
//           d  = sqrt(v) / bias_correction2_sqrt + eps
//           p  = p - step_size * (m / d)
//       grad is read only.
//
// Every scalar is the fp32 rounding of the double the CPU path computes in Python:
// one_minus_beta1 = fp32(1 - beta1), step_size = fp32(lr / (1 - beta1**t)),
// bias_correction2_sqrt = fp32(sqrt(1 - beta2**t)). Each operation is a single correctly
// rounded fp32 operation (the _rn intrinsics: no FMA contraction), which is what numpy does
// one array operation at a time, so the result equals the numpy reference bit for bit.

#include "common.cuh"

extern "C" __global__ void adam_step_f32(
    float* __restrict__ master, const float* __restrict__ grad, float* __restrict__ m,
    float* __restrict__ v, float weight_decay, int use_weight_decay, float beta1,
    float one_minus_beta1, float beta2, float one_minus_beta2, float step_size,
    float bias_correction2_sqrt, float eps, long long n) {
    RC_GRID_STRIDE(i, n) {
        float g = grad[i];
        float p = master[i];
        if (use_weight_decay) g = rc::add(g, rc::mul(weight_decay, p));
        const float mi = rc::add(rc::mul(m[i], beta1), rc::mul(one_minus_beta1, g));
        const float vi = rc::add(rc::mul(v[i], beta2), rc::mul(rc::mul(one_minus_beta2, g), g));
        const float denom = rc::add(rc::div(rc::sqrt_rn(vi), bias_correction2_sqrt), eps);
        p = rc::sub(p, rc::mul(step_size, rc::div(mi, denom)));
        m[i] = mi;
        v[i] = vi;
        master[i] = p;
    }
}
