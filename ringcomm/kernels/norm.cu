// Partial squared L2 norm for global-norm gradient clipping:
//
//   sq_norm_partial_<in>_<acc>(x, divisor, partial, n)
//       partial[b] = sum of u*u over the elements block b visits, u = x[i] / divisor
//
// <in>_<acc> in {f16_f32, f16_f64, f32_f32, f32_f64, f64_f64}. The quotient is taken in the
// input's arithmetic type (fp32 for fp16/fp32, fp64 for fp64) exactly as the CPU path unscales
// (`grad /= scale`), then widened to the accumulator type and squared there; for fp32 input
// and fp64 accumulation each square is exact, as in the reference's (the CPU path's)
// np.dot(u.astype(float64), u). divisor = 1 for an already unscaled gradient.
//
// Block b visits i = (b + k * gridDim.x) * blockDim.x + t (the grid-stride loop), so block b
// covers every element whose (i / blockDim.x) % gridDim.x == b. partial has gridDim.x
// entries; the caller sums them (in fp64) and all-reduces the sum across ranks. blockDim.x
// must be a multiple of 32, at most 1024. The summation order differs from numpy's, so the
// result agrees with it to rounding, not bit for bit.

#include "common.cuh"

namespace rc {

template <class A> __device__ __forceinline__ A warp_sum(A s) {
    for (int offset = 16; offset > 0; offset >>= 1) s = add(s, __shfl_down_sync(0xffffffffu, s, offset));
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
        const A u = convert(div(Compute<T>::load(x[i]), divisor), A());
        s = add(s, mul(u, u));
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
