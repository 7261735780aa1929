"""ringcomm.kernels on this machine and on a stand-in CuPy: the sources are read from the
top-level kernels/ in a checkout and from ringcomm/kernels/cuda/ in a wheel; on numpy arrays the
dispatch functions are the references; on stand-in device arrays each launch passes the
arguments its kernel's PTX signature asks for, the dtypes no kernel takes are refused before
anything is launched, and numpy models of the kernels compute what the references compute, bit
for bit. (test_kernels_compile.py compiles the sources, test_kernels_reference.py and
test_kernels_adam.py check the references.)"""
import importlib.util
import math
import shutil
import subprocess
import sys
import types
import zipfile
from pathlib import Path

import numpy as np
import pytest

from ringcomm import kernels

from kernel_helpers import EXPECTED_ENTRIES, KERNEL_DIR, OPS, assert_same_bits, assert_same_values, needs_nvcc, \
    ptx_entries, ref, special_fp32

pytestmark = pytest.mark.timeout(120)


# -- ringcomm.kernels on this machine: sources, backend, dispatch to the references --------------

def test_backend_is_numpy_without_cupy():
    if importlib.util.find_spec("cupy") is None:
        assert kernels.backend() == "numpy"
    else:
        assert kernels.backend() in ("numpy", "cupy")


def test_a_checkout_reads_the_top_level_sources():
    assert kernels.KERNEL_DIR == KERNEL_DIR
    assert kernels.source_path("adam") == KERNEL_DIR / "adam.cu"
    assert Path(ref.__file__).resolve().parent == Path(kernels.__file__).resolve().parent
    with pytest.raises(ValueError):
        kernels.source_path("softmax")


def test_an_installed_wheel_carries_and_finds_the_sources(tmp_path):
    """The wheel holds the top-level kernels/ folder as ringcomm/kernels/cuda/, and ringcomm
    imported from the unpacked wheel (away from any checkout) reads its sources there."""
    root, src = KERNEL_DIR.parent, tmp_path / "src"  # a copy: the build leaves files behind
    src.mkdir()
    for name in ("setup.cfg", "setup.py", "pyproject.toml", "README.md"):
        shutil.copy(root / name, src / name)
    for folder in ("ringcomm", "kernels"):
        shutil.copytree(root / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path), str(src)], check=True, capture_output=True, timeout=120)
    wheel, = tmp_path.glob("ringcomm-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for source in kernels.SOURCES:
        assert f"ringcomm/kernels/cuda/{source}.cu" in names
    assert {"ringcomm/kernels/cuda/common.cuh", "ringcomm/kernels/cuda/README.md",
            "ringcomm/kernels/reference.py", "ringcomm/kernels/__init__.py"} <= names
    assert not any(name.startswith("kernels/") for name in names)
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    probe = ("from ringcomm import kernels; print(kernels.KERNEL_DIR); "
             "print(len(kernels.module_source('reduce')))")
    found = subprocess.run([sys.executable, "-I", "-c", f"import sys; sys.path.insert(0, {str(site)!r}); {probe}"],
                           cwd=tmp_path, check=True, capture_output=True, text=True, timeout=60).stdout.split()
    assert Path(found[0]) == site / "ringcomm" / "kernels" / "cuda"
    assert int(found[1]) > len((KERNEL_DIR / "reduce.cu").read_text())  # common.cuh written in


def test_dispatch_on_numpy_arrays_is_the_reference():
    rng = np.random.default_rng(5)
    for dtype in ref.REDUCE_DTYPES:
        a = (rng.standard_normal(33) * 50).astype(dtype)
        b = (rng.standard_normal(33) * 50).astype(dtype)
        for op in OPS:
            if op == "avg" and dtype.kind != "f":
                continue
            expected = ref.reduce(op, a.copy(), b)
            assert_same_bits(kernels.reduce(op, a.copy(), b), expected)
            out = b.copy()
            assert_same_bits(kernels.reduce(op, a, out, out=out), expected)
        if dtype.kind == "f":
            assert_same_bits(kernels.finalize("avg", a.copy(), 3), ref.finalize("avg", a.copy(), 3))
            assert_same_bits(kernels.scale(a.copy(), 0.3), ref.scale(a.copy(), 0.3))
            assert_same_bits(kernels.divide(a.copy(), 7), ref.divide(a.copy(), 7))

    grad = (rng.standard_normal(100) * 100).astype(np.float16)
    grad32 = grad.astype(np.float32)
    state = [rng.standard_normal(100).astype(np.float32), np.zeros(100, np.float32), np.zeros(100, np.float32)]
    twin = [x.copy() for x in state]
    args = (1e-3, 0.9, 0.999, 1e-8, 0.01, 1)
    assert kernels.adam_step(state[0], grad32, state[1], state[2], *args) is None
    ref.adam_step(twin[0], grad32, twin[1], twin[2], *args)
    for x, y in zip(state, twin, strict=True):
        assert_same_bits(x, y)

    dst, twin_dst = np.empty(100, np.float32), np.empty(100, np.float32)
    assert kernels.unscale(grad, dst, 64.0) == ref.unscale(grad, twin_dst, 64.0)
    assert_same_bits(dst, twin_dst)
    assert_same_bits(kernels.cast_to_half(dst, np.empty(100, np.float16)),
                     ref.cast_to_half(dst, np.empty(100, np.float16)))
    assert kernels.found_nonfinite(np.array([1.0, np.nan])) is True
    assert kernels.sq_norm(grad, 64.0) == ref.sq_norm(grad, 64.0)
    assert_same_bits(kernels.sq_norm_partial(grad, 64.0), ref.sq_norm_partial(grad, 64.0))


def test_dispatch_rejects_a_mix_of_array_kinds():
    with pytest.raises(TypeError, match="not a mix"):
        kernels.reduce("sum", np.zeros(3), [0.0, 0.0, 0.0])


# -- the CuPy path against a stand-in CuPy ------------------------------------------------------
# Each launch is checked against the kernel's PTX signature (argument count and types), then
# carried out by a numpy model of what the .cu source computes, written from the kernel's side:
# the scalars exactly as the wrapper passes them. The dispatch functions on these stand-in
# arrays must then equal the references bit for bit -- which catches a swapped, missing or
# wrongly rounded argument that a type check would not. (tests/gpu checks the real kernels.)

def _standin_kernels():
    """The numpy models of the kernels, from the CuPy stand-in (loaded by path: importing the
    stand-in's package would put a ``cupy`` module in this process)."""
    path = Path(__file__).resolve().parents[1] / "standin" / "cupy" / "_kernels.py"
    spec = importlib.util.spec_from_file_location("standin_kernels", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


STANDIN_KERNELS = _standin_kernels()


def model_launch(name, grid, block, args):
    """What kernel ``name`` computes, per its source, in numpy."""
    STANDIN_KERNELS.model(name, grid, block, [x.data if isinstance(x, FakeArray) else x for x in args])


class FakeArray:
    """Just enough of cupy.ndarray for ringcomm.kernels: numpy storage, .get()."""

    def __init__(self, data):
        self.data = data

    dtype = property(lambda self: self.data.dtype)
    size = property(lambda self: self.data.size)
    shape = property(lambda self: self.data.shape)
    flags = property(lambda self: self.data.flags)

    def reshape(self, *shape):
        return FakeArray(self.data.reshape(*shape))

    def get(self):
        return self.data.copy()

    def sum(self, dtype=None):
        return FakeArray(np.asarray(self.data.sum(dtype=dtype)))

    def __setitem__(self, key, value):
        self.data[key] = value.data if isinstance(value, FakeArray) else value


def fake_cupy(ptx_by_source, launches):
    signatures = {}
    for source, text in ptx_by_source.items():
        signatures.update({name: (source, params) for name, params in ptx_entries(text).items()})

    class Kernel:
        def __init__(self, source, name):
            assert name in signatures and signatures[name][0] == source, f"{name} is not in {source}.cu"
            self.source, self.name = source, name

        def __call__(self, grid, block, args):
            params = signatures[self.name][1]
            assert isinstance(grid, tuple) and isinstance(block, tuple)
            assert block == (kernels.THREADS,) and grid[0] >= 1
            assert len(args) == len(params), f"{self.name}: {len(args)} arguments for {len(params)} parameters"
            for i, (arg, ptype) in enumerate(zip(args, params, strict=True)):
                expected = {"f32": (np.float32,), "f64": (np.float64,), "u32": (np.int32,),
                            "u64": (FakeArray, np.int64)}[ptype]
                assert type(arg) in expected, f"{self.name} parameter {i} ({ptype}): got {type(arg).__name__}"
            launches.append((self.name, grid, args))
            model_launch(self.name, grid, block, args)

    class RawModule:
        def __init__(self, code, options):
            assert options[0] == "-std=c++17"
            self.source = next(s for s in kernels.SOURCES if kernels.module_source(s) == code)

        def compile(self):
            pass

        def get_function(self, name):
            return Kernel(self.source, name)

    device = types.SimpleNamespace(id=0, attributes={"MultiProcessorCount": 132})
    cuda = types.SimpleNamespace(Device=lambda *a: device,
                                 runtime=types.SimpleNamespace(getDeviceCount=lambda: 1))
    return types.SimpleNamespace(
        ndarray=FakeArray, RawModule=RawModule, cuda=cuda,
        zeros=lambda n, dtype: FakeArray(np.zeros(n, dtype)),
        empty=lambda n, dtype: FakeArray(np.zeros(n, dtype)))


def _faked_gpu(monkeypatch, ptx_by_source):
    """ringcomm.kernels on fake_cupy(ptx_by_source); yields the list of launches."""
    launches = []
    cp = fake_cupy(ptx_by_source, launches)
    caches = (kernels._module, kernels._function, kernels._max_blocks, kernels.backend)
    for cache in caches:
        cache.cache_clear()
    monkeypatch.setattr(kernels, "_cupy", lambda: cp)
    yield launches
    for cache in caches:
        cache.cache_clear()


@pytest.fixture
def fake_gpu(ptx, monkeypatch):
    yield from _faked_gpu(monkeypatch, ptx)


@pytest.fixture
def fake_gpu_without_kernels(monkeypatch):
    """A fake GPU whose modules have no entry points (no PTX needed): any launch fails."""
    yield from _faked_gpu(monkeypatch, {})


@needs_nvcc
def test_cupy_path_launches_match_the_ptx_signatures(fake_gpu):
    launches = fake_gpu
    assert kernels.backend() == "cupy"

    def dev(dtype, n=1000):
        return FakeArray(np.ones(n, dtype))

    for dtype in ref.REDUCE_DTYPES:
        for op in ("sum", "prod", "max", "min", "avg"):
            kernels.reduce(op, dev(dtype), dev(dtype))
            kernels.reduce(op, dev(dtype), dev(dtype), out=dev(dtype))
        if dtype.kind == "i":
            for op in ref.BITWISE:
                kernels.reduce(op, dev(dtype), dev(dtype))
                kernels.reduce(op, dev(dtype), dev(dtype), out=dev(dtype))
        if dtype.kind == "f":
            kernels.finalize("avg", dev(dtype), 4)
    kernels.scale(dev(np.float32), 0.5)
    assert kernels.found_nonfinite(dev(np.float32)) is False
    for weight_decay in (0.01, 0.0):
        assert kernels.adam_step(*(dev(np.float32) for _ in range(4)),
                                 1e-3, 0.9, 0.999, 1e-8, weight_decay, 3) is None
    half = dev(np.float16)
    assert kernels.cast_to_half(dev(np.float32), half) is half
    dst = dev(np.float32)
    assert kernels.unscale(dev(np.float16), dst, 128.0) is False
    found = FakeArray(np.zeros(1, np.int32))
    assert kernels.unscale(dev(np.float16), dst, 0.0, found=found) is None and found.data[0] == 1
    partial = kernels.sq_norm_partial(dev(np.float32, 5000), 4.0)
    assert partial.dtype == np.float64 and partial.size == ref.default_blocks(5000)
    assert kernels.sq_norm(dev(np.float32), 4.0) == 1000 / 16

    launched = {name for name, _, _ in launches}
    every_entry = {e for entries in EXPECTED_ENTRIES.values() for e in entries}
    assert launched == every_entry
    assert all(grid[0] <= 32 * 132 for _, grid, _ in launches)  # at most 32 blocks per SM
    big = FakeArray(np.ones(10_000_000, np.float32))
    kernels.scale(big, 2.0)
    assert launches[-1][1] == (32 * 132,)  # the grid-stride loop covers the rest
    before = len(launches)
    kernels.reduce("sum", dev(np.float32, 0), dev(np.float32, 0))  # nothing to launch
    assert len(launches) == before


@needs_nvcc
def test_cupy_path_rejects_what_no_kernel_takes(fake_gpu):
    with pytest.raises(TypeError, match="dtypes differ"):
        kernels.reduce("sum", FakeArray(np.ones(4, np.float32)), FakeArray(np.ones(4, np.float64)))
    with pytest.raises(ValueError, match="sizes differ"):
        kernels.reduce("sum", FakeArray(np.ones(4, np.float32)), FakeArray(np.ones(5, np.float32)))
    with pytest.raises(TypeError, match="src has dtype float64"):
        kernels.cast_to_half(FakeArray(np.ones(4, np.float64)), FakeArray(np.ones(4, np.float16)))
    with pytest.raises(TypeError, match="dst has dtype float32"):  # fp32 -> fp16 only
        kernels.cast_to_half(FakeArray(np.ones(4, np.float32)), FakeArray(np.ones(4, np.float32)))
    with pytest.raises(ValueError, match="contiguous"):
        kernels.scale(FakeArray(np.ones((4, 4), np.float32)[:, 1]), 2.0)
    fp32 = [FakeArray(np.ones(4, np.float32)) for _ in range(4)]
    with pytest.raises(TypeError, match="grad has dtype float16"):  # an fp32 gradient only
        kernels.adam_step(fp32[0], FakeArray(np.ones(4, np.float16)), fp32[2], fp32[3],
                          1e-3, 0.9, 0.999, 1e-8, 0.0, 1)
    with pytest.raises(ValueError, match="sizes differ"):
        kernels.adam_step(*fp32[:3], FakeArray(np.ones(5, np.float32)), 1e-3, 0.9, 0.999, 1e-8, 0.0, 1)
    with pytest.raises(TypeError, match="not a mix"):
        kernels.reduce("sum", FakeArray(np.ones(4, np.float32)), np.ones(4, np.float32))


def test_cupy_path_refuses_dtypes_it_has_no_kernel_for(fake_gpu_without_kernels):
    """scale, found_nonfinite and the norm have an fp32 kernel only (fp64 sums), unscale an
    fp16 -> fp32 one only: on device arrays of another dtype each says what it takes, before
    anything is launched or written. On numpy arrays the references still take them."""
    launches = fake_gpu_without_kernels

    def dev(dtype, n=8):
        return FakeArray(np.ones(n, dtype))

    found = FakeArray(np.zeros(1, np.int32))
    for dtype in ("float16", "float64"):
        x = dev(dtype)
        with pytest.raises(TypeError, match=f"^scale takes float32 on a GPU, not {dtype}"):
            kernels.scale(x, 0.5)
        assert_same_bits(x.data, np.ones(8, dtype))
        with pytest.raises(TypeError, match=f"^found_nonfinite takes float32 on a GPU, not {dtype}"):
            kernels.found_nonfinite(dev(dtype), found=found)
        with pytest.raises(TypeError, match=f"^sq_norm takes float32 on a GPU, not {dtype}"):
            kernels.sq_norm(dev(dtype), on_device=True)
        for acc in ("float32", "float64"):
            with pytest.raises(TypeError, match=f"^sq_norm_partial takes float32 input with float64 "
                                                f"accumulation on a GPU, not {dtype} input with {acc}"):
                kernels.sq_norm_partial(dev(dtype), acc_dtype=acc)
    with pytest.raises(TypeError, match="^sq_norm_partial takes float32 input with float64 accumulation "
                                        "on a GPU, not float32 input with float32 accumulation"):
        kernels.sq_norm_partial(dev(np.float32), acc_dtype=np.float32)
    for dtype in ("float32", "float64"):
        dst = dev(np.float32)
        with pytest.raises(TypeError, match=f"^unscale takes a float16 source on a GPU, not a {dtype} source"):
            kernels.unscale(dev(dtype), dst, 128.0, found=found)
        assert_same_bits(dst.data, np.ones(8, np.float32))
    inplace = dev(np.float32)  # the numpy path's in-place fp32 unscale has no kernel
    with pytest.raises(TypeError, match="^unscale takes a float16 source on a GPU, not a float32 source"):
        kernels.unscale(inplace, inplace, 128.0)
    assert found.data[0] == 0 and launches == []

    for dtype in ("float16", "float64"):
        x = np.full(8, 3.0, dtype)
        assert_same_bits(kernels.scale(x.copy(), 0.5), ref.scale(x.copy(), 0.5))
        assert kernels.found_nonfinite(x) is False
        assert kernels.sq_norm(x, 2.0) == ref.sq_norm(x, 2.0) == 8 * 1.5 ** 2
    x = np.full(8, 2.0, np.float32)
    assert kernels.unscale(x, x, 4.0) is False and (x == 0.5).all()


def _pair(x):
    """(stand-in device copy, host copy) of x."""
    return FakeArray(x.copy()), x.copy()


@needs_nvcc
def test_cupy_path_computes_what_the_references_compute(fake_gpu):
    rng = np.random.default_rng(9)
    for dtype in ref.REDUCE_DTYPES:
        for op in ("sum", "prod", "max", "min", "avg"):
            if dtype.kind == "f":
                a = (rng.standard_normal(777) * 300).astype(dtype)
                b = (rng.standard_normal(777) * 300).astype(dtype)
                a[:4], b[:4] = np.array([np.nan, 0.0, -0.0, 1], dtype), np.array([1, -0.0, 0.0, np.nan], dtype)
            else:
                info = np.iinfo(dtype)
                a = rng.integers(info.min, info.max, 777, dtype=dtype)
                b = rng.integers(info.min, info.max, 777, dtype=dtype)
            dev, host = _pair(a)
            with np.errstate(all="ignore"):
                kernels.reduce(op, dev, FakeArray(b.copy()))
                ref.reduce(op, host, b)
            assert_same_bits(dev.data, host) if op in ("max", "min") else assert_same_values(dev.data, host)
            # out = a (op) b into b's own buffer (a received segment passed on): the same bits,
            # a unchanged
            first, second = FakeArray(a.copy()), FakeArray(b.copy())
            with np.errstate(all="ignore"):
                assert kernels.reduce(op, first, second, out=second) is second
            assert_same_bits(second.data, dev.data) if op in ("max", "min") else assert_same_values(second.data, dev.data)
            assert_same_bits(first.data, a)
        if dtype.kind == "f":
            scaling = ((kernels.scale, 0.1),) if dtype == np.float32 else ()  # scale_f32 only
            for fn, arg in (*scaling, (kernels.divide, 3), (kernels.finalize, 5)):
                dev, host = _pair(a)
                with np.errstate(all="ignore"):
                    if fn is kernels.finalize:
                        fn("avg", dev, arg)
                        ref.finalize("avg", host, arg)
                    else:
                        fn(dev, arg)
                        getattr(ref, fn.__name__)(host, arg)
                assert_same_values(dev.data, host)

    n = 3001
    master0 = rng.standard_normal(n).astype(np.float32)
    devs = [FakeArray(master0.copy()), FakeArray(np.zeros(n, np.float32)), FakeArray(np.zeros(n, np.float32))]
    hosts = [master0.copy(), np.zeros(n, np.float32), np.zeros(n, np.float32)]
    for step in range(1, 6):
        g = (rng.standard_normal(n) * 1e-2).astype(np.float32)
        if step == 4:
            g[17] = np.nan  # no check: the step is taken, as the caller decided
        args = (2e-3, 0.9, 0.999, 1e-8, 0.01 if step % 2 else 0.0, step)
        with np.errstate(invalid="ignore"):
            kernels.adam_step(devs[0], FakeArray(g), devs[1], devs[2], *args)
            ref.adam_step(hosts[0], g, hosts[1], hosts[2], *args)
        for d, h in zip(devs, hosts, strict=True):
            assert_same_bits(d.data, h)
    assert np.isnan(hosts[0][17])

    x = special_fp32(rng, 5000)
    with np.errstate(over="ignore"):
        x16 = x.astype(np.float16)
    dev, host = FakeArray(np.empty(x.size, np.float16)), np.empty(x.size, np.float16)
    with np.errstate(all="ignore"):
        kernels.cast_to_half(FakeArray(x), dev)
        ref.cast_to_half(x, host)
    assert_same_bits(dev.data, host)
    for loss_scale in (256.0, 3.0):
        dev, host = FakeArray(np.empty(x16.size, np.float32)), np.empty(x16.size, np.float32)
        assert kernels.unscale(FakeArray(x16), dev, loss_scale) == ref.unscale(x16, host, loss_scale) is True
        assert_same_bits(dev.data, host)
    finite16 = x16[np.isfinite(x16)]
    dev, host = FakeArray(np.empty(finite16.size, np.float32)), np.empty(finite16.size, np.float32)
    assert kernels.unscale(FakeArray(finite16), dev, 256.0) == ref.unscale(finite16, host, 256.0) is False
    assert_same_bits(dev.data, host)
    x32 = x16.astype(np.float32)  # inf where fp16 overflowed
    assert kernels.found_nonfinite(FakeArray(x32)) == ref.found_nonfinite(x32) is True
    assert kernels.found_nonfinite(FakeArray(np.ones(9, np.float32))) is False

    y = (rng.standard_normal(70_001) * 30).astype(np.float32)
    y[:3] = np.float32(2.0 ** -149), np.float32(3e-39), -0.0  # subnormals and a signed zero
    got = kernels.sq_norm_partial(FakeArray(y), 4.0)
    assert_same_bits(got.data, ref.sq_norm_partial(y, 4.0))
    assert math.isclose(kernels.sq_norm(FakeArray(y), 4.0), ref.sq_norm(y, 4.0), rel_tol=1e-12)
