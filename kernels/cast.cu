// The fp16 copy of fp32 values, unscaling with an overflow flag, and the finiteness check.
//
//   cast_f32_to_f16(src, dst, n)          dst[i] = fp16(src[i])
//       the fp16 parameters from the fp32 master (device.cast_into)
//   unscale_f16_to_f32(src, dst, loss_scale, found_inf, n)
//                                         dst[i] = fp32(src[i]) / loss_scale
//       ORs "some result is inf/nan" into *found_inf, as the CPU path's
//       `grad /= scale; not np.isfinite(grad).all()` (mixed precision's fp16 gradient)
//   find_nonfinite_f32(x, found, n)       *found |= any(!isfinite(x[i]))
//       the fp32 gradient's check (fp32 training)
//
// Flags are int32, zeroed by the caller; each block writes at most once (__syncthreads_or,
// then atomicOr). Every quotient is one correctly rounded fp32 operation and every fp16
// rounding is round-to-nearest-even, as numpy's astype.

#include "common.cuh"

namespace rc {

// One atomic per block with a non-finite value; call once from every thread of the block.
__device__ __forceinline__ void block_flag(int bad, int* flag) {
    if (__syncthreads_or(bad) && threadIdx.x == 0) atomicOr(flag, 1);
}

}  // namespace rc

extern "C" __global__ void cast_f32_to_f16(const float* src, rc::half* dst, long long n) {
    RC_GRID_STRIDE(i, n) { dst[i] = rc::to_half(src[i]); }
}

extern "C" __global__ void unscale_f16_to_f32(const rc::half* src, float* dst, float loss_scale,
                                              int* found_inf, long long n) {
    int bad = 0;
    RC_GRID_STRIDE(i, n) {
        const float g = rc::div(rc::to_float(src[i]), loss_scale);
        dst[i] = g;
        bad |= !rc::is_finite(g);
    }
    rc::block_flag(bad, found_inf);
}

extern "C" __global__ void find_nonfinite_f32(const float* x, int* found, long long n) {
    int bad = 0;
    RC_GRID_STRIDE(i, n) { bad |= !rc::is_finite(x[i]); }
    rc::block_flag(bad, found);
}
