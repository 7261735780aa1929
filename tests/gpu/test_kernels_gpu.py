"""Every CUDA kernel of kernels/ against its numpy reference, on random data, on a GPU.

Bit for bit wherever the reference is (reduce, scale/divide, Adam, casts, flags); the squared
norm to rounding (a different summation order). NaN payloads are the one thing allowed to
differ in arithmetic results: the GPU returns the canonical NaN."""
import zlib

import numpy as np
import pytest

cp = pytest.importorskip("cupy", reason="GPU kernel tests need CuPy")
try:
    _DEVICES = cp.cuda.runtime.getDeviceCount()
except Exception as exc:  # CuPy without a driver
    pytest.skip(f"GPU kernel tests need a CUDA device; CuPy cannot query one ({exc})",
                allow_module_level=True)
if _DEVICES < 1:
    pytest.skip("GPU kernel tests need a CUDA device; CuPy sees none", allow_module_level=True)

from ringcomm import kernels  # noqa: E402

ref = kernels.reference
pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]

SIZES = (1, 1000, 3 * 2 ** 20 + 7)  # the last one strides: more elements than threads
FLOATS = ("float16", "float32", "float64")


def bits(a):
    a = np.ascontiguousarray(a)
    return a.view({2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize])


def assert_same(got, want, nan_payload=True):
    """Identical bits; with nan_payload=False any NaN matches any NaN."""
    got = cp.asnumpy(got) if isinstance(got, cp.ndarray) else got
    assert got.dtype == want.dtype and got.shape == want.shape
    if not nan_payload and got.dtype.kind == "f":
        nan = np.isnan(want)
        assert (np.isnan(got) == nan).all(), "NaN in different places"
        got, want = got[~nan], want[~nan]
    diff = np.flatnonzero(bits(got) != bits(want))
    assert diff.size == 0, (f"{diff.size} of {got.size} differ; first at {diff[0]}: "
                            f"{got[diff[0]]!r} vs {want[diff[0]]!r}")


def data(dtype, n, rng, specials=True, spread=100.0):
    dtype = np.dtype(dtype)
    if dtype.kind == "i":
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, n, dtype=dtype, endpoint=True)
    x = (rng.standard_normal(n) * spread).astype(dtype)
    if specials and n >= 8:
        idx = rng.choice(n, size=max(8, n // 50), replace=False)
        x[idx] = rng.choice(np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 1.0], dtype), idx.size)
    return x


@pytest.fixture
def rng(request):
    return np.random.default_rng(zlib.crc32(request.node.name.encode()))


def test_backend_and_every_entry_point():
    assert kernels.backend() == "cupy"
    for source, entries in kernels.ENTRY_POINTS.items():
        for entry in entries:
            kernels._kernel(source, entry)


def test_modules_compile_without_any_cuda_header(rng):
    """The sources include no header, so CuPy's NVRTC compiles them with or without the CUDA
    headers; their own fp16 converts as cuda_fp16.h's does."""
    mods = {name: cp.RawModule(code=kernels.module_source(name), options=kernels.COMPILE_OPTIONS)
            for name in kernels.SOURCES}
    for mod in mods.values():
        mod.compile()
    a, b = data(np.float16, 4096, rng), data(np.float16, 4096, rng)
    acc = cp.asarray(a)
    mods["reduce"].get_function("reduce_sum_f16")((16,), (256,), (acc, cp.asarray(b), np.int64(a.size)))
    assert_same(acc, ref.reduce("sum", a.copy(), b), nan_payload=False)
    x = data(np.float32, 4096, rng, spread=3e4)
    out = cp.empty(x.size, np.float16)
    mods["cast"].get_function("cast_f32_to_f16")((16,), (256,), (cp.asarray(x), out, np.int64(x.size)))
    with np.errstate(over="ignore"):
        assert_same(out, ref.cast_to_half(x, np.empty(x.size, np.float16)), nan_payload=False)


# -- reduce.cu -------------------------------------------------------------------------------

@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("op", ["sum", "prod", "max", "min", "avg"])
@pytest.mark.parametrize("dtype", FLOATS + ("int32", "int64"))
def test_reduce(dtype, op, n, rng):
    a, b = data(dtype, n, rng), data(dtype, n, rng)
    if np.dtype(dtype).kind == "f" and n >= 4:  # signed-zero ties, both ways
        a[:2], b[:2] = np.array([-0.0, 0.0], dtype), np.array([0.0, -0.0], dtype)
    acc = cp.asarray(a)
    assert kernels.reduce(op, acc, cp.asarray(b)) is acc
    with np.errstate(all="ignore"):
        want = ref.reduce(op, a.copy(), b)
    assert_same(acc, want, nan_payload=op in ("max", "min"))


@pytest.mark.parametrize("op", ["band", "bor", "bxor"])
@pytest.mark.parametrize("dtype", ["int32", "int64"])
def test_reduce_bitwise(dtype, op, rng):
    a, b = data(dtype, 100_003, rng), data(dtype, 100_003, rng)
    acc = cp.asarray(a)
    assert kernels.reduce(op, acc, cp.asarray(b)) is acc
    assert_same(acc, ref.reduce(op, a.copy(), b), nan_payload=False)


@pytest.mark.parametrize("dtype", FLOATS)
def test_divide_finalize(dtype, rng):
    x = data(dtype, 100_003, rng)
    with np.errstate(all="ignore"):
        for arg in (3, 2049):
            d = cp.asarray(x)
            assert kernels.divide(d, arg) is d
            assert_same(d, ref.divide(x.copy(), arg), nan_payload=False)
        d = cp.asarray(x)
        kernels.finalize("avg", d, 7)
        assert_same(d, ref.finalize("avg", x.copy(), 7), nan_payload=False)


def test_scale(rng):
    """scale_f32: clipping's grad *= coefficient."""
    x = data(np.float32, 100_003, rng)
    with np.errstate(all="ignore"):
        for factor in (0.1, 3.0, 0.3183098861837907):
            d = cp.asarray(x)
            assert kernels.scale(d, factor) is d
            assert_same(d, ref.scale(x.copy(), factor), nan_payload=False)


def test_reduce_on_a_side_stream(rng):
    a, b = data(np.float32, 10_000, rng), data(np.float32, 10_000, rng)
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        acc, inc = cp.asarray(a), cp.asarray(b)
        kernels.reduce("sum", acc, inc)
    stream.synchronize()
    assert_same(acc, ref.reduce("sum", a.copy(), b), nan_payload=False)


# -- adam.cu ---------------------------------------------------------------------------------

@pytest.mark.parametrize("n", [1, 1000, 3 * 2 ** 20 + 7])
@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
def test_adam_steps(weight_decay, n, rng):
    master0 = (rng.standard_normal(n) * 0.1).astype(np.float32)
    host = [master0.copy(), np.zeros(n, np.float32), np.zeros(n, np.float32)]
    dev = [cp.asarray(x) for x in host]
    for step in range(1, 7):
        g = (rng.standard_normal(n) * 1e-2).astype(np.float32)
        args = (1e-3, 0.9, 0.999, 1e-8, weight_decay, step)
        assert kernels.adam_step(dev[0], cp.asarray(g), dev[1], dev[2], *args) is None
        ref.adam_step(host[0], g, host[1], host[2], *args)
        for d, h in zip(dev, host, strict=True):
            assert_same(d, h)


def test_adam_step_has_no_check(rng):
    """A NaN or inf in the gradient is stepped on, as the reference does: the decision to
    skip was taken before the call."""
    n = 50_000
    master = (rng.standard_normal(n)).astype(np.float32)
    host = [master.copy(), np.zeros(n, np.float32), np.zeros(n, np.float32)]
    dev = [cp.asarray(x) for x in host]
    g = (rng.standard_normal(n) * 3).astype(np.float32)
    g[7], g[9] = np.nan, np.inf
    with np.errstate(invalid="ignore"):
        for step in range(1, 4):
            kernels.adam_step(dev[0], cp.asarray(g), dev[1], dev[2], 1e-2, 0.9, 0.999, 1e-8, 0.0, step)
            ref.adam_step(host[0], g, host[1], host[2], 1e-2, 0.9, 0.999, 1e-8, 0.0, step)
    assert np.isnan(host[0][7]) and np.isnan(host[0][9])
    for d, h in zip(dev, host, strict=True):
        assert_same(d, h, nan_payload=False)


# -- cast.cu ---------------------------------------------------------------------------------

def test_cast_to_half(rng):
    x = data(np.float32, 300_001, rng, spread=3e4)  # beyond fp16's range too: inf
    tiny = np.float32(2.0 ** -149)
    x[:4] = np.array([3 * tiny, -5 * tiny, 2.0 ** -24, 65519.0], np.float32)  # fp16 zeros, subnormal, max
    x[4:1004] = rng.integers(-2 ** 20, 2 ** 20, 1000) * np.float32(2.0 ** -34)  # fp16 subnormals, rounded
    out = cp.empty(x.size, np.float16)
    assert kernels.cast_to_half(cp.asarray(x), out) is out
    with np.errstate(over="ignore"):
        assert_same(out, ref.cast_to_half(x, np.empty(x.size, np.float16)), nan_payload=False)


@pytest.mark.parametrize("poison", [None, np.inf, np.nan])
def test_unscale_and_found_nonfinite(poison, rng):
    g = data(np.float16, 300_001, rng, specials=False)
    if poison is not None:
        g[rng.integers(g.size)] = poison
    want = np.empty(g.size, np.float32)
    want_flag = ref.unscale(g, want, 1024.0)
    out = cp.empty(g.size, np.float32)
    assert kernels.unscale(cp.asarray(g), out, 1024.0) is want_flag is (poison is not None)
    assert_same(out, want, nan_payload=False)
    found = cp.zeros(1, np.int32)
    assert kernels.unscale(cp.asarray(g), cp.empty(g.size, np.float32), 1024.0, found=found) is None
    assert int(found.get()[0]) == want_flag
    g32 = g.astype(np.float32)
    assert kernels.found_nonfinite(cp.asarray(g32)) is ref.found_nonfinite(g32) is (poison is not None)


def test_dtypes_without_a_kernel_are_refused():
    for dtype in ("float16", "float64"):
        with pytest.raises(TypeError, match="scale takes float32"):
            kernels.scale(cp.ones(8, dtype), 0.5)
        with pytest.raises(TypeError, match="found_nonfinite takes float32"):
            kernels.found_nonfinite(cp.ones(8, dtype))
        with pytest.raises(TypeError, match="sq_norm takes float32"):
            kernels.sq_norm(cp.ones(8, dtype))
    with pytest.raises(TypeError, match="sq_norm_partial takes float32 input with float64 accumulation"):
        kernels.sq_norm_partial(cp.ones(8, np.float32), acc_dtype=np.float32)
    x = cp.ones(8, np.float32)
    with pytest.raises(TypeError, match="unscale takes a float16 source"):
        kernels.unscale(x, x, 2.0)


# -- norm.cu ---------------------------------------------------------------------------------

@pytest.mark.parametrize("n", [1, 1000, 3 * 2 ** 20 + 7])
def test_sq_norm_partial(n, rng):
    """sq_norm_partial_f32_f64: the fp32 gradient's squared norm in fp64 sums."""
    x = data(np.float32, n, rng, specials=False, spread=30.0)
    got = cp.asnumpy(kernels.sq_norm_partial(cp.asarray(x), 4.0))
    want = ref.sq_norm_partial(x, 4.0)
    assert got.dtype == want.dtype == np.float64 and got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-12)
    assert kernels.sq_norm(cp.asarray(x), 4.0) == pytest.approx(ref.sq_norm(x, 4.0), rel=1e-12)
    on_device = kernels.sq_norm(cp.asarray(x), 4.0, on_device=True)
    assert isinstance(on_device, cp.ndarray) and on_device.dtype == np.float64
