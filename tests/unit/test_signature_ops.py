"""Collective signatures (ringcomm.signature) and reduction operators (ringcomm.ops)."""
import itertools

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from ringcomm import ops, signature
from ringcomm.ops import ReduceOp

pytestmark = pytest.mark.timeout(30)

ALL_DTYPES = [None] + list(signature.DTYPES)


def expected_description(collective, dtype, op, algorithm, root, count):
    parts = [f"count={count}"]
    if dtype is not None:
        parts.append(f"dtype={np.dtype(dtype).name}")
    if op not in (None, "none"):
        parts.append(f"op={getattr(op, 'value', op)}")
    if algorithm not in (None, "none"):
        parts.append(f"algorithm={algorithm}")
    if collective in ("broadcast", "reduce", "gather", "scatter"):
        parts.append(f"root={root}")
    return f"{collective}({', '.join(parts)})"


# -- signature ------------------------------------------------------------------------------------

def test_documented_example():
    assert (signature.describe(signature.pack("all_reduce", np.float32, "sum", "ring", 0, 10))
            == "all_reduce(count=10, dtype=float32, op=sum, algorithm=ring)")


@pytest.mark.parametrize("collective", signature.COLLECTIVES)
def test_pack_describe_every_combination(collective):
    seen = {}
    for dtype, op, algorithm in itertools.product(ALL_DTYPES, signature.OPS, signature.ALGORITHMS):
        sig = signature.pack(collective, dtype, op, algorithm, 3, 12345)
        assert isinstance(sig, bytes) and len(sig) == signature.SIZE == 16
        assert signature.describe(sig) == expected_description(
            collective, dtype, op, algorithm, 3, 12345)
        assert sig not in seen, f"{(dtype, op, algorithm)} and {seen.get(sig)} pack alike"
        seen[sig] = (dtype, op, algorithm)


@given(collective=st.sampled_from(signature.COLLECTIVES),
       root=st.integers(-2 ** 31, 2 ** 31 - 1), count=st.integers(0, 2 ** 64 - 1))
def test_root_and_count_round_trip(collective, root, count):
    sig = signature.pack(collective, np.int64, "max", "ps", root, count)
    assert signature.describe(sig) == expected_description(
        collective, np.int64, "max", "ps", root, count)


@pytest.mark.parametrize("member", list(ReduceOp))
def test_pack_accepts_reduce_op_members(member):
    assert (signature.pack("reduce", np.float64, member, "ring", 1, 5)
            == signature.pack("reduce", np.float64, member.value, "ring", 1, 5))


def test_none_means_absent():
    assert (signature.pack("barrier", None, None, None, 0, 0)
            == signature.pack("barrier", None, "none", "none", 0, 0))
    assert signature.describe(signature.pack("barrier", None, None, "rd", 0, 0)) \
        == "barrier(count=0, algorithm=rd)"


def test_signatures_differ_in_every_field():
    base = ("all_reduce", np.float32, "sum", "ring", 0, 10)
    variants = [("reduce_scatter",) + base[1:], base[:1] + (np.float64,) + base[2:],
                base[:2] + ("max",) + base[3:], base[:3] + ("ps",) + base[4:],
                base[:4] + (1,) + base[5:], base[:5] + (11,)]
    sigs = {signature.pack(*base)} | {signature.pack(*v) for v in variants}
    assert len(sigs) == 1 + len(variants)


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64", "int8", "int16", "int32",
                                   "int64", "uint8", "uint16", "uint32", "uint64", "bool"])
def test_dtype_supported(dtype):
    assert signature.dtype_supported(dtype)
    assert signature.dtype_supported(np.dtype(dtype).type)


@pytest.mark.parametrize("dtype", [np.complex64, np.complex128, "U3", object, "V4"])
def test_dtype_not_supported(dtype):
    assert not signature.dtype_supported(dtype)


@given(st.binary(max_size=40))
def test_describe_malformed_bytes_does_not_raise(raw):
    text = signature.describe(raw)
    assert isinstance(text, str)
    if len(raw) != 16:
        assert text == f"<malformed signature {raw.hex()}>"


def test_describe_unknown_codes_as_numbers():
    raw = bytes([200, 99, 77, 66]) + (5).to_bytes(4, "little", signed=True) + (7).to_bytes(8, "little")
    # dtype byte 99 = view 6 (unknown) over wire code 3 (float64)
    assert signature.describe(raw) == "?200(count=7, dtype=?6 as float64, op=?77, algorithm=?66)"
    assert signature.describe(bytearray(raw)) == signature.describe(raw)


def test_a_view_signs_apart_from_its_wire_dtype():
    """bfloat16 travelling as int16 (or complex as float32) is not int16 (float32)."""
    plain = signature.pack("broadcast", np.int16, None, "ring", 0, 8)
    with signature.viewed_as("bfloat16"):
        viewed = signature.pack("broadcast", np.int16, None, "ring", 0, 8, signature.current_view())
        with signature.viewed_as(""):
            assert signature.current_view() == 0
        assert signature.current_view() == 1
    assert signature.current_view() == 0
    assert viewed != plain and viewed[2:] == plain[2:]
    assert signature.describe(viewed) == "broadcast(count=8, dtype=bfloat16 as int16, algorithm=ring, root=0)"
    with signature.viewed_as("complex"):
        assert "dtype=complex as float32" in signature.describe(
            signature.pack("all_reduce", np.float32, "sum", "ring", 0, 4, signature.current_view()))


# -- ops.parse_op ---------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["sum", "SUM", "Sum", "avg", "AVG", "max", "Max", "min", "MIN",
                                  "prod", "PROD"])
def test_parse_op_names_case_insensitive(name):
    op = ops.parse_op(name, np.float32)
    assert op is ReduceOp(name.lower())


@pytest.mark.parametrize("member", list(ReduceOp))
def test_parse_op_members(member):
    assert ops.parse_op(member, np.int64 if member in BITWISE else np.float64) is member


@pytest.mark.parametrize("bad", ["mean", "", "sum ", "add", "and", "xor", None, 0, 1.5])
def test_parse_op_rejects_unknown(bad):
    with pytest.raises(ValueError, match="unknown reduce op"):
        ops.parse_op(bad, np.float32)


@pytest.mark.parametrize("dtype", [np.int8, np.int32, np.int64, np.uint8, np.uint64, np.bool_])
@pytest.mark.parametrize("op", ["avg", "AVG", ReduceOp.AVG])
def test_parse_op_avg_on_integers_is_type_error(op, dtype):
    with pytest.raises(TypeError, match="avg"):
        ops.parse_op(op, dtype)


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_parse_op_avg_on_floats(dtype):
    assert ops.parse_op("avg", dtype) is ReduceOp.AVG


@pytest.mark.parametrize("op", ["sum", "max", "min", "prod"])
def test_parse_op_other_ops_on_integers(op):
    assert ops.parse_op(op, np.int32) is ReduceOp(op)


@pytest.mark.parametrize("op", ["band", "BOR", ReduceOp.BXOR])
@pytest.mark.parametrize("dtype", [np.int8, np.uint16, np.int64, np.bool_])
def test_parse_op_bitwise_on_integers_and_bools(op, dtype):
    assert ops.parse_op(op, dtype) is ReduceOp(str(getattr(op, "value", op)).lower())


@pytest.mark.parametrize("op", ["band", "bor", "bxor"])
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_parse_op_bitwise_on_floats_is_type_error(op, dtype):
    with pytest.raises(TypeError, match="integer or bool"):
        ops.parse_op(op, dtype)


@pytest.mark.parametrize("op", list(ReduceOp))
def test_bool_arrays_reduce_as_numpy_does(op):
    """sum and max are a logical or on bools, prod and min an and; avg is refused."""
    a = np.array([False, False, True, True])
    b = np.array([False, True, False, True])
    if op is ReduceOp.AVG:
        with pytest.raises(TypeError):
            ops.parse_op(op, a.dtype)
        return
    got = ops.reduce_into(ops.parse_op(op, a.dtype), a.copy(), b)
    assert got.dtype == np.bool_
    np.testing.assert_array_equal(got, NUMPY[op](a, b), strict=True)


def test_reduce_op_is_str():
    assert ReduceOp.SUM == "sum"


# -- reduce_into / reduced / finalize ------------------------------------------------------------

NUMPY = {ReduceOp.SUM: np.add, ReduceOp.AVG: np.add, ReduceOp.MAX: np.maximum,
         ReduceOp.MIN: np.minimum, ReduceOp.PROD: np.multiply, ReduceOp.BAND: np.bitwise_and,
         ReduceOp.BOR: np.bitwise_or, ReduceOp.BXOR: np.bitwise_xor}
BITWISE = (ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR)


def operands(dtype, seed=0):
    rng = np.random.default_rng(seed)
    if np.issubdtype(dtype, np.floating):
        a, b = rng.uniform(-4, 4, 33), rng.uniform(-4, 4, 33)
        a[:3], b[:3] = [0.0, -0.0, 1.0], [-0.0, 0.0, -1.0]
    else:
        info = np.iinfo(dtype)
        a = rng.integers(info.min, info.max, 33, dtype=dtype, endpoint=True)
        b = rng.integers(info.min, info.max, 33, dtype=dtype, endpoint=True)
    return a.astype(dtype), b.astype(dtype)


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64, np.int8, np.int32,
                                   np.uint16, np.int64, np.uint64])
@pytest.mark.parametrize("op", list(ReduceOp))
def test_reduce_into_matches_numpy(op, dtype):
    if op in BITWISE and np.issubdtype(dtype, np.floating):
        pytest.skip("bitwise ops take integers and bools (parse_op refuses floats)")
    a, b = operands(dtype)
    expected = NUMPY[op](a, b)
    acc, b_before = a.copy(), b.copy()
    with np.errstate(over="ignore"):
        result = ops.reduce_into(op, acc, b)
    assert result is acc
    assert acc.dtype == dtype
    np.testing.assert_array_equal(acc, expected, strict=True)
    np.testing.assert_array_equal(b, b_before)


@pytest.mark.parametrize("dtype", [np.float32, np.int32, np.uint8])
@pytest.mark.parametrize("op", list(ReduceOp))
def test_reduced_matches_numpy_without_touching_inputs(op, dtype):
    if op in BITWISE and np.issubdtype(dtype, np.floating):
        pytest.skip("bitwise ops take integers and bools (parse_op refuses floats)")
    a, b = operands(dtype, seed=1)
    a0, b0 = a.copy(), b.copy()
    with np.errstate(over="ignore"):
        fresh = ops.reduced(op, a, b)
        out = np.empty_like(a)
        into = ops.reduced(op, a, b, out=out)
    expected = NUMPY[op](a0, b0)
    np.testing.assert_array_equal(fresh, expected, strict=True)
    assert into is out
    np.testing.assert_array_equal(out, expected, strict=True)
    assert fresh is not a and fresh is not b
    np.testing.assert_array_equal(a, a0)
    np.testing.assert_array_equal(b, b0)


def test_documented_reduce_into_example():
    acc = np.array([1.0, 5.0])
    ops.reduce_into(ReduceOp.MAX, acc, np.array([3.0, 2.0]))
    np.testing.assert_array_equal(acc, [3.0, 5.0])


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("n", [1, 2, 3, 7])
def test_finalize_avg_divides_once(n, dtype):
    acc = (np.arange(10) * n).astype(dtype)
    result = ops.finalize(ReduceOp.AVG, acc, n)
    assert result is acc and acc.dtype == dtype
    np.testing.assert_array_equal(acc, np.arange(10).astype(dtype))


@pytest.mark.parametrize("op", [ReduceOp.SUM, ReduceOp.MAX, ReduceOp.MIN, ReduceOp.PROD])
def test_finalize_other_ops_leave_result(op):
    acc = np.array([1.5, -2.0, 9.0])
    assert ops.finalize(op, acc, 4) is acc
    np.testing.assert_array_equal(acc, [1.5, -2.0, 9.0])


@pytest.mark.parametrize("op", list(ReduceOp))
def test_finalize_empty(op):
    acc = np.empty(0, np.float32)
    assert ops.finalize(op, acc, 3) is acc
    assert acc.size == 0


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_reduce_then_finalize_matches_numpy_mean(dtype):
    rng = np.random.default_rng(5)
    stacked = rng.standard_normal((5, 40)).astype(dtype)
    acc = stacked[0].copy()
    for row in stacked[1:]:
        ops.reduce_into(ReduceOp.AVG, acc, row)
    ops.finalize(ReduceOp.AVG, acc, 5)
    np.testing.assert_allclose(acc, stacked.mean(axis=0, dtype=np.float64),
                               rtol=1e-5 if dtype == np.float32 else 1e-12, atol=1e-6)


# -- checks.check_device_reduce --------------------------------------------------------------------

class _Device:
    """A device of ``kind`` that takes numpy arrays for its own (what the check asks)."""

    def __init__(self, kind):
        self.kind = kind

    def is_array(self, x):
        return isinstance(x, np.ndarray)


@pytest.mark.parametrize("dtype, op", [("int8", "sum"), ("uint64", "max"), ("bool", "bor"),
                                       ("int16", "band"), ("float32", "sum")])
def test_a_gpu_reduction_without_a_kernel_is_refused_up_front(dtype, op):
    """reduce.cu has sum/avg/max/min/prod on f16, f32, f64, i32, i64 and the bitwise ops on
    i32, i64: anything else on a GPU array raises here, before a collective sends a byte."""
    from ringcomm.checks import check_device_reduce
    x = np.zeros(3, dtype)
    op = ops.parse_op(op, x.dtype)
    if dtype == "float32":  # has a kernel: no error
        check_device_reduce(x, op, _Device("gpu"))
        return
    with pytest.raises(TypeError, match="no reduce kernel"):
        check_device_reduce(x, op, _Device("gpu"))
    check_device_reduce(x, op, _Device("cpu"))  # numpy reduces anything
    check_device_reduce(x, op, _Device("emulated"))


def test_wire_codes_only_grow_at_the_end():
    """A code's meaning never changes: what older ranks sent still decodes the same."""
    assert signature.OPS[:6] == ("none", "sum", "avg", "max", "min", "prod")
    assert [d.name for d in signature.DTYPES[:11]] == [
        "float16", "float32", "float64", "int8", "int16", "int32", "int64",
        "uint8", "uint16", "uint32", "uint64"]
    assert signature.COLLECTIVES[:7] == ("all_reduce", "reduce_scatter", "all_gather", "broadcast",
                                         "reduce", "barrier", "point_to_point")
