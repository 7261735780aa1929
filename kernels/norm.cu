// Partial squared L2 norm of the fp32 gradient for global-norm gradient clipping:
//
//   sq_norm_partial_f32_f64(x, divisor, partial, n)
//       partial[b] = sum of u*u over the elements block b visits, u = fp64(x[i] / divisor)
//
// The quotient is taken in fp32 exactly as the CPU path unscales (`grad /= scale`), then
// widened to fp64 and squared there; each square is exact (24-bit significands, 48-bit
// product), as in the reference's (the CPU path's) np.dot(u.astype(float64), u). divisor = 1
// for an already unscaled gradient.
//
// Block b visits i = (b + k * gridDim.x) * blockDim.x + t (the grid-stride loop), so block b
// covers every element whose (i / blockDim.x) % gridDim.x == b. partial has gridDim.x
// entries; the caller sums them (in fp64) and all-reduces the sum across ranks. blockDim.x
// must be a multiple of 32, at most 1024. The summation order differs from numpy's, so the
// result agrees with it to rounding, not bit for bit.

#include "common.cuh"

namespace rc {

__device__ __forceinline__ double warp_sum(double s) {
    for (int offset = 16; offset > 0; offset >>= 1) s = add(s, __shfl_down_sync(0xffffffffu, s, offset));
    return s;
}

// Sum of s over the block; the total is valid in thread 0.
__device__ __forceinline__ double block_sum(double s) {
    __shared__ double warp_totals[32];
    const unsigned lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
    s = warp_sum(s);
    if (lane == 0) warp_totals[warp] = s;
    __syncthreads();
    if (warp == 0) {
        s = threadIdx.x < (blockDim.x >> 5) ? warp_totals[lane] : 0.0;
        s = warp_sum(s);
    }
    return s;
}

}  // namespace rc

extern "C" __global__ void sq_norm_partial_f32_f64(const float* x, float divisor, double* partial,
                                                   long long n) {
    double s = 0.0;
    RC_GRID_STRIDE(i, n) {
        const double u = rc::widen(rc::div(x[i], divisor));
        s = rc::add(s, rc::mul(u, u));
    }
    s = rc::block_sum(s);
    if (threadIdx.x == 0) partial[blockIdx.x] = s;
}
