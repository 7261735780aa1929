// Element-wise reduction of a received chunk into the accumulator, in place:
//     acc[i] = acc[i] (op) incoming[i]          (ringcomm.ops.reduce_into; numpy ufuncs)
// or into a third array, which may be either operand (a partial sum passed on in the
// received chunk's buffer, with no copy of the accumulator first):
//     out[i] = a[i] (op) b[i]                   (ringcomm.ops.reduced; ufunc(a, b, out=out))
// and the in-place scalings that finish a result:
//     divide_*:  x[i] = x[i] / divisor          (ringcomm.ops.finalize for avg)
//     scale_f32: x[i] = x[i] * factor           (numpy: x *= factor; Strategy.update's clipping)
//
// Entry points: reduce_{sum,prod,max,min}_{f16,f32,f64,i32,i64}(acc, incoming, n),
//               reduce_{band,bor,bxor}_{i32,i64}(acc, incoming, n),
//               reduce_out_<op>_<type>(out, a, b, n) for each of those (a plays acc),
//               divide_{f16,f32,f64}(x, divisor, n), scale_f32(x, factor, n).
// Arrays are flat and contiguous; n is the element count. fp16 scalars are passed as fp32
// holding an fp16 value (numpy casts a Python scalar to the array's dtype first).
//
// Bit-exact with numpy: fp16 operands are widened to fp32, combined with one correctly
// rounded fp32 operation, and rounded to fp16 once. For +, *, / that equals the correctly
// rounded fp16 result (fp32 has 24 >= 2*11+2 bits, so double rounding is innocuous), which is
// what numpy's float16 loops compute. Integers wrap like numpy (two's complement, computed
// in unsigned arithmetic so there is no signed-overflow UB). max/min propagate NaN like
// np.maximum / np.minimum and store one operand unchanged (see OpMax below).

#include "common.cuh"

namespace rc {

__device__ __forceinline__ int add(int a, int b) {
    return static_cast<int>(static_cast<unsigned>(a) + static_cast<unsigned>(b));
}
__device__ __forceinline__ long long add(long long a, long long b) {
    return static_cast<long long>(static_cast<unsigned long long>(a) +
                                  static_cast<unsigned long long>(b));
}
__device__ __forceinline__ int mul(int a, int b) {
    return static_cast<int>(static_cast<unsigned>(a) * static_cast<unsigned>(b));
}
__device__ __forceinline__ long long mul(long long a, long long b) {
    return static_cast<long long>(static_cast<unsigned long long>(a) *
                                  static_cast<unsigned long long>(b));
}

struct OpSum {
    template <class C> static __device__ __forceinline__ C apply(C a, C b) { return add(a, b); }
};
struct OpProd {
    template <class C> static __device__ __forceinline__ C apply(C a, C b) { return mul(a, b); }
};
struct OpBand {  // the bitwise ops: integers only
    template <class C> static __device__ __forceinline__ C apply(C a, C b) { return a & b; }
};
struct OpBor {
    template <class C> static __device__ __forceinline__ C apply(C a, C b) { return a | b; }
};
struct OpBxor {
    template <class C> static __device__ __forceinline__ C apply(C a, C b) { return a ^ b; }
};
// max/min return one of the two operands unchanged (no fp16 re-rounding, NaN payloads
// kept). NaN wins, and on a tie (-0 vs +0) the pick follows numpy 2.x on x86: the incoming
// operand for fp32/fp64 (SIMD max/min semantics), the accumulator for fp16 (npy_half_ge).
// Values never differ, only the sign of a zero result.
template <class T> struct TieToAcc { static const bool value = false; };
template <> struct TieToAcc<half> { static const bool value = true; };

struct OpMax {
    template <class C> static __device__ __forceinline__ bool keep_acc(C a, C b, bool tie_to_acc) {
        return greater(a, b) || is_nan(a) || (tie_to_acc && equal(a, b));
    }
};
struct OpMin {
    template <class C> static __device__ __forceinline__ bool keep_acc(C a, C b, bool tie_to_acc) {
        return less(a, b) || is_nan(a) || (tie_to_acc && equal(a, b));
    }
};

template <class T, class Op>
__device__ __forceinline__ void reduce_impl(T* acc, const T* incoming, long long n) {
    typedef Compute<T> C;
    RC_GRID_STRIDE(i, n) {
        acc[i] = C::store(Op::apply(C::load(acc[i]), C::load(incoming[i])));
    }
}

template <class T, class Op>
__device__ __forceinline__ void select_impl(T* acc, const T* incoming, long long n) {
    typedef Compute<T> C;
    RC_GRID_STRIDE(i, n) {
        const T a = acc[i], b = incoming[i];
        if (!Op::keep_acc(C::load(a), C::load(b), TieToAcc<T>::value)) acc[i] = b;
    }
}

// out = a (op) b: each thread reads a[i] and b[i] before it writes out[i], so out may be a or b
template <class T, class Op>
__device__ __forceinline__ void reduce_out_impl(T* out, const T* a, const T* b, long long n) {
    typedef Compute<T> C;
    RC_GRID_STRIDE(i, n) { out[i] = C::store(Op::apply(C::load(a[i]), C::load(b[i]))); }
}

template <class T, class Op>
__device__ __forceinline__ void select_out_impl(T* out, const T* a, const T* b, long long n) {
    typedef Compute<T> C;
    RC_GRID_STRIDE(i, n) {
        const T x = a[i], y = b[i];
        out[i] = Op::keep_acc(C::load(x), C::load(y), TieToAcc<T>::value) ? x : y;
    }
}

template <class T>
__device__ __forceinline__ void divide_impl(T* x, typename Compute<T>::type divisor, long long n) {
    typedef Compute<T> C;
    RC_GRID_STRIDE(i, n) { x[i] = C::store(div(C::load(x[i]), divisor)); }
}

}  // namespace rc

#define RC_REDUCE_ENTRY(opname, impl, Op, suffix, T)                                       \
    extern "C" __global__ void reduce_##opname##_##suffix(T* acc, const T* incoming,     \
                                                          long long n) {                  \
        rc::impl<T, rc::Op>(acc, incoming, n);                                            \
    }

#define RC_REDUCE_OUT_ENTRY(opname, impl, Op, suffix, T)                                   \
    extern "C" __global__ void reduce_out_##opname##_##suffix(T* out, const T* a,         \
                                                              const T* b, long long n) {  \
        rc::impl<T, rc::Op>(out, a, b, n);                                                \
    }

// both forms of one op: in place (acc op= incoming) and out of place (out = a op b)
#define RC_REDUCE_BOTH(opname, form, Op, suffix, T)                                       \
    RC_REDUCE_ENTRY(opname, form##_impl, Op, suffix, T)                                    \
    RC_REDUCE_OUT_ENTRY(opname, form##_out_impl, Op, suffix, T)

#define RC_REDUCE_ALL_OPS(suffix, T)                                                       \
    RC_REDUCE_BOTH(sum, reduce, OpSum, suffix, T)                                          \
    RC_REDUCE_BOTH(prod, reduce, OpProd, suffix, T)                                        \
    RC_REDUCE_BOTH(max, select, OpMax, suffix, T)                                          \
    RC_REDUCE_BOTH(min, select, OpMin, suffix, T)

RC_REDUCE_ALL_OPS(f16, rc::half)
RC_REDUCE_ALL_OPS(f32, float)
RC_REDUCE_ALL_OPS(f64, double)
RC_REDUCE_ALL_OPS(i32, int)
RC_REDUCE_ALL_OPS(i64, long long)

#define RC_REDUCE_BITWISE(suffix, T)                                                       \
    RC_REDUCE_BOTH(band, reduce, OpBand, suffix, T)                                        \
    RC_REDUCE_BOTH(bor, reduce, OpBor, suffix, T)                                          \
    RC_REDUCE_BOTH(bxor, reduce, OpBxor, suffix, T)

RC_REDUCE_BITWISE(i32, int)
RC_REDUCE_BITWISE(i64, long long)

#define RC_DIVIDE_ENTRY(suffix, T, S)                                                      \
    extern "C" __global__ void divide_##suffix(T* x, S divisor, long long n) {            \
        rc::divide_impl<T>(x, divisor, n);                                                 \
    }

RC_DIVIDE_ENTRY(f16, rc::half, float)
RC_DIVIDE_ENTRY(f32, float, float)
RC_DIVIDE_ENTRY(f64, double, double)

extern "C" __global__ void scale_f32(float* x, float factor, long long n) {
    RC_GRID_STRIDE(i, n) { x[i] = rc::mul(x[i], factor); }
}
