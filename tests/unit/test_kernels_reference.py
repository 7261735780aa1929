"""The numpy references of reduce.cu, cast.cu and norm.cu (ringcomm.kernels.reference) compute
exactly what the CPU path computes: ringcomm.ops' reduce and finalize, fp16 as one fp32
operation rounded once, max/min and integer wraparound as the kernels do them, the scale factor
rounded to fp32; Strategy.update's fp16 write-back, unscale and check, and squared norm, with the
norm's partials laid out as the grid-stride loop visits them."""
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from ringcomm import kernels, ops
from ringcomm.ops import ReduceOp

from kernel_helpers import OPS, assert_same_bits, assert_same_values, ref, special_fp32

pytestmark = pytest.mark.timeout(120)


# -- reduce.cu references ---------------------------------------------------------------------

FLOAT_WIDTH = {"float16": 16, "float32": 32, "float64": 64}


@st.composite
def operand_pairs(draw, dtypes=ref.REDUCE_DTYPES):
    dtype = draw(st.sampled_from(dtypes))
    n = draw(st.integers(0, 48))
    if dtype.kind == "f":
        elements = st.floats(width=FLOAT_WIDTH[dtype.name], allow_nan=True, allow_infinity=True)
    else:
        info = np.iinfo(dtype)
        elements = st.integers(int(info.min), int(info.max))
    a = draw(hnp.arrays(dtype, n, elements=elements))
    b = draw(hnp.arrays(dtype, n, elements=elements))
    return a, b


@settings(max_examples=300, deadline=None)
@given(operand_pairs(), st.sampled_from(OPS), st.booleans())
def test_reduce_reference_is_ops_reduce_into(pair, op, as_member):
    """Both share one op table: each is checked against numpy's ufunc written out here."""
    a, b = pair
    ufunc = {"sum": np.add, "avg": np.add, "max": np.maximum, "min": np.minimum, "prod": np.multiply}[op]
    with np.errstate(all="ignore"):
        expected = ufunc(a, b)
        assert_same_bits(ops.reduce_into(ReduceOp(op), a.copy(), b), expected)
        got = a.copy()
        assert ref.reduce(ReduceOp(op) if as_member else op.upper(), got, b) is got
    assert_same_bits(got, expected)


@settings(max_examples=150, deadline=None)
@given(operand_pairs(dtypes=(np.dtype(np.float16),)), st.sampled_from(("sum", "prod")))
def test_fp16_reduce_is_one_fp32_operation_rounded_once(pair, op):
    """What reduce_<op>_f16 does (widen, one fp32 operation, round to fp16 once) is numpy's
    float16 result: fp32 has more than 2*11+2 bits, so the double rounding is innocuous."""
    a, b = pair
    f = {"sum": np.add, "prod": np.multiply}[op]
    with np.errstate(all="ignore"):
        model = f(a.astype(np.float32), b.astype(np.float32)).astype(np.float16)
        got = ref.reduce(op, a.copy(), b)
    assert_same_values(got, model)
    finite = np.isfinite(model)
    assert_same_bits(got[finite], model[finite])


def test_fp16_one_rounding_over_every_fp16_value():
    """The same claim, deterministically: every fp16 bit pattern against shuffled partners,
    for +, *, and / by a world size."""
    every = np.arange(2 ** 16, dtype=np.uint16).view(np.float16)
    rng = np.random.default_rng(11)
    with np.errstate(all="ignore"):
        for _ in range(4):
            partner = rng.permutation(every)
            for op in ("sum", "prod"):
                f = {"sum": np.add, "prod": np.multiply}[op]
                model = f(every.astype(np.float32), partner.astype(np.float32)).astype(np.float16)
                assert_same_values(ref.reduce(op, every.copy(), partner), model)
        for n in (2, 3, 5, 7, 24, 1000):
            model = (every.astype(np.float32) / np.float32(n)).astype(np.float16)
            assert_same_values(ref.divide(every.copy(), n), model)


@settings(max_examples=300, deadline=None)
@given(operand_pairs(), st.sampled_from(("max", "min")))
def test_max_min_model_of_the_kernel(pair, op):
    """reduce_max/min keep acc when a > b (a < b), when a is NaN, and (fp16) on a tie."""
    a, b = pair
    with np.errstate(invalid="ignore"):
        keep = (a > b) if op == "max" else (a < b)
        if a.dtype.kind == "f":
            keep |= np.isnan(a)
        if a.dtype == np.float16:
            keep |= a == b
    model = np.where(keep, a, b)
    with np.errstate(invalid="ignore"):
        assert_same_values(ref.reduce(op, a.copy(), b), model)


@settings(max_examples=200, deadline=None)
@given(operand_pairs(dtypes=(np.dtype(np.int32), np.dtype(np.int64))), st.sampled_from(("sum", "prod")))
def test_integer_reduce_wraps_like_unsigned_arithmetic(pair, op):
    a, b = pair
    u = np.dtype(a.dtype.str.replace("i", "u"))
    f = {"sum": np.add, "prod": np.multiply}[op]
    model = f(a.view(u), b.view(u)).view(a.dtype)
    with np.errstate(over="ignore"):
        assert_same_bits(ref.reduce(op, a.copy(), b), model)


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(ref.DIVIDE_DTYPES), st.integers(1, 4096), st.data())
def test_finalize_avg_is_ops_finalize(dtype, n, data):
    x = data.draw(hnp.arrays(dtype, data.draw(st.integers(0, 40)),
                             elements=st.floats(width=FLOAT_WIDTH[dtype.name])))
    expected = ops.finalize(ReduceOp.AVG, x.copy(), n)
    assert_same_bits(ref.finalize("avg", x.copy(), n), expected)
    assert_same_bits(ref.finalize("sum", x.copy(), n), x)
    if dtype == np.float16:  # divide_f16: fp32 quotient by the fp16-rounded divisor, rounded once
        model = (x.astype(np.float32) / np.float32(np.float16(n))).astype(np.float16)
        assert_same_values(ref.divide(x.copy(), n), model)


@settings(max_examples=200, deadline=None)
@given(hnp.arrays(np.float32, st.integers(0, 40), elements=st.floats(width=32)), st.floats(-1e3, 1e3))
def test_scale_rounds_the_factor_to_fp32(x, factor):
    """scale_f32's reference: the factor rounded to fp32 once, then one fp32 product."""
    with np.errstate(all="ignore"):
        expected = x.copy()
        expected *= np.float32(factor)
        assert_same_bits(ref.scale(x.copy(), factor), expected)


def test_unknown_op():
    with pytest.raises(ValueError, match="unknown reduce op"):
        ref.reduce("mean", np.zeros(2), np.zeros(2))


# -- cast.cu / norm.cu references --------------------------------------------------------------

def test_cast_to_half_is_write_back():
    x = special_fp32(np.random.default_rng(0), 4096)
    tiny = np.float32(2.0 ** -149)  # the smallest fp32 subnormal
    x[4::19], x[5::23] = 3 * tiny, -5 * tiny  # fp16 zeros, the sign kept
    flat_params = np.empty(x.size, np.float16)
    with np.errstate(over="ignore"):
        flat_params[...] = x  # Replicated.write_back
        dst = np.empty(x.size, np.float16)
        got = ref.cast_to_half(x, dst)
        assert got is dst
        assert_same_bits(got, flat_params)
        assert_same_bits(kernels.cast_to_half(x, np.empty(x.size, np.float16)), flat_params)


@pytest.mark.parametrize("poison", [None, np.inf, -np.inf, np.nan])
def test_unscale_and_found_nonfinite_are_the_strategy_check(poison):
    """Mixed precision: the fp16 gradient cast to fp32, divided by the loss scale and checked
    (unscale_f16_to_f32); fp32 training: the fp32 gradient checked (find_nonfinite_f32)."""
    rng = np.random.default_rng(2)
    grad = (rng.standard_normal(999) * 1000).astype(np.float16)
    grad32 = (rng.standard_normal(999) * 1000).astype(np.float32)
    if poison is not None:
        grad[500] = grad32[500] = poison
    scale = 2.0 ** 10
    expected = grad.astype(np.float32)  # Strategy.update
    expected /= scale
    overflow = not np.isfinite(expected).all()
    dst = np.empty(grad.size, np.float32)
    assert ref.unscale(grad, dst, scale) == overflow == (poison is not None)
    assert_same_bits(dst, expected)
    assert ref.found_nonfinite(grad32) == (poison is not None)


def test_sq_norm_is_the_strategy_norm_and_the_partials_sum_to_it():
    rng = np.random.default_rng(4)
    x = (rng.standard_normal(100_003) * 300).astype(np.float32)
    scale = 512.0
    grad = x.copy()  # Strategy.update: the fp32 gradient, unscaled
    grad /= scale
    total = ref.sq_norm(x, scale)
    assert total == float(np.dot(grad.astype(np.float64), grad)) == ref.sq_norm(grad)
    partial = ref.sq_norm_partial(x, scale)  # sq_norm_partial_f32_f64
    assert partial.dtype == np.float64
    assert partial.size == ref.default_blocks(x.size) == min(1024, -(-x.size // 256))
    assert math.isclose(float(partial.sum(dtype=np.float64)), total, rel_tol=1e-12)


def test_sq_norm_partial_layout_is_the_grid_stride_loop():
    x = np.arange(1, 40, dtype=np.float32)
    threads, blocks = 4, 3
    expected = np.zeros(blocks)
    for i in range(x.size):  # block b, thread t visits (b + k*blocks)*threads + t
        expected[(i // threads) % blocks] += float(x[i]) ** 2
    got = ref.sq_norm_partial(x, 1.0, num_blocks=blocks, threads=threads)
    np.testing.assert_array_equal(got, expected)
    assert ref.sq_norm_partial(np.zeros(0, np.float32)).tolist() == [0.0]
