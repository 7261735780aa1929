"""ringcomm.kernels: every CUDA source compiles to PTX with the expected entry points; the numpy
references compute exactly what the CPU path computes (ringcomm.ops, Strategy.update with
ringcomm.train.optim.Adam); ringcomm.kernels ships the sources and dispatches to the references
on numpy arrays, and passes each kernel the arguments its PTX signature asks for."""
import concurrent.futures
import ctypes
import ctypes.util
import importlib.util
import math
import re
import shutil
import subprocess
import sys
import types
import zipfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from ringcomm import kernels, ops
from ringcomm.ops import ReduceOp
from ringcomm.train import optim
from ringcomm.train.strategy import Replicated

pytestmark = pytest.mark.timeout(120)

ref = kernels.reference
KERNEL_DIR = Path(__file__).resolve().parents[2] / "ringcomm" / "kernels"

# Written out here, not derived from ringcomm.kernels.ENTRY_POINTS, so a typo on either side
# shows up.
EXPECTED_ENTRIES = {
    "reduce": [f"reduce_{op}_{t}" for op in ("sum", "prod", "max", "min")
               for t in ("f16", "f32", "f64", "i32", "i64")]
    + [f"reduce_{op}_{t}" for op in ("band", "bor", "bxor") for t in ("i32", "i64")]
    + ["divide_f16", "divide_f32", "divide_f64", "scale_f32"],
    "adam": ["adam_step_f32"],
    "cast": ["cast_f32_to_f16", "unscale_f16_to_f32", "find_nonfinite_f32"],
    "norm": ["sq_norm_partial_f32_f64"],
}


def bits(a):
    a = np.ascontiguousarray(a)
    return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize])


def assert_same_bits(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    mismatch = np.flatnonzero(bits(a) != bits(b))
    assert mismatch.size == 0, f"{mismatch.size} elements differ, first at {mismatch[0]}: {a.ravel()[mismatch[0]]!r} vs {b.ravel()[mismatch[0]]!r}"


def assert_same_values(a, b):
    """Equal values, NaN where NaN (payload and the sign of zero may differ)."""
    assert a.dtype == b.dtype and a.shape == b.shape
    np.testing.assert_array_equal(a, b)


# -- nvcc: every kernel compiles, with the expected entry points ------------------------------

def find_nvcc():
    found = shutil.which("nvcc")
    if found:
        return found
    fallback = Path("/usr/local/cuda/bin/nvcc")
    return str(fallback) if fallback.is_file() else None


NVCC = find_nvcc()
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc is not on PATH nor at /usr/local/cuda/bin/nvcc: "
                                                     "the CUDA kernels cannot be compiled to PTX here")
NVCC_FLAGS = ["--ptx", "-arch=sm_80", "-std=c++17", "-ftz=true"]  # CuPy adds -ftz=true to every RawModule
VARIANTS = ("file", "no-fp16-header")


def _compile(nvcc, src, out, extra=()):
    proc = subprocess.run([nvcc, *NVCC_FLAGS, *extra, str(src), "-o", str(out)],
                          capture_output=True, text=True, timeout=110, check=False)
    return proc.returncode, proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def ptx(tmp_path_factory):
    """PTX of every source, as it is and with -DRINGCOMM_NO_CUDA_FP16 (no cuda_fp16.h)."""
    if NVCC is None:
        pytest.skip("nvcc is not on PATH nor at /usr/local/cuda/bin/nvcc")
    tmp = tmp_path_factory.mktemp("ptx")
    jobs = {(name, variant): (KERNEL_DIR / f"{name}.cu", () if variant == "file" else (kernels.NO_CUDA_FP16,))
            for name in kernels.SOURCES for variant in VARIANTS}
    with concurrent.futures.ThreadPoolExecutor(max_workers=4) as pool:
        futures = {key: pool.submit(_compile, NVCC, src, tmp / f"{key[0]}.{key[1]}.ptx", extra)
                   for key, (src, extra) in jobs.items()}
        results = {key: f.result() for key, f in futures.items()}
    failed = {key: log for key, (rc, log) in results.items() if rc != 0}
    assert not failed, "nvcc failed:\n" + "\n".join(f"{k}: {log}" for k, log in failed.items())
    for key, (rc, log) in results.items():
        assert "warning" not in log.lower(), f"nvcc warns on {key}: {log}"
    return {key: (tmp / f"{key[0]}.{key[1]}.ptx").read_text() for key in jobs}


def ptx_entries(text):
    """{entry name: [param types]} of the ``.entry`` functions in a PTX text."""
    entries = {}
    for match in re.finditer(r"\.entry\s+(\w+)\s*\((.*?)\)", text, re.DOTALL):
        entries[match.group(1)] = re.findall(r"\.param\s+\.(\w+)", match.group(2))
    return entries


def entry_body(text, name):
    start = text.index(f".entry {name}(")
    return text[start:text.index("\n}", start)]


def test_sources_are_the_cu_files():
    assert sorted(p.stem for p in KERNEL_DIR.glob("*.cu")) == sorted(kernels.SOURCES)
    assert {k: sorted(v) for k, v in kernels.ENTRY_POINTS.items()} == {k: sorted(v) for k, v in EXPECTED_ENTRIES.items()}


@needs_nvcc
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("name", kernels.SOURCES)
def test_ptx_has_every_entry_point(ptx, name, variant):
    entries = ptx_entries(ptx[name, variant])
    assert sorted(entries) == sorted(EXPECTED_ENTRIES[name])
    assert ".target sm_80" in ptx[name, variant]


PRELUDE = re.compile(r"^// ---- common prelude:.*?^// ---- end of common prelude ----$", re.MULTILINE | re.DOTALL)


def test_every_source_shares_one_prelude_and_compiles_from_one_string():
    """Each *.cu includes common.cuh; what RawModule gets has it written out, exactly once."""
    common = (KERNEL_DIR / "common.cuh").read_text()
    assert len(PRELUDE.findall(common)) == 1
    for name in kernels.SOURCES:
        text = (KERNEL_DIR / f"{name}.cu").read_text()
        assert text.count('#include "common.cuh"') == 1 and not PRELUDE.findall(text)
        code = kernels.module_source(name)
        assert '#include "' not in code, f"{name}: RawModule gets one string, no local includes"
        assert PRELUDE.findall(code) == PRELUDE.findall(common)


@needs_nvcc
@pytest.mark.parametrize("variant", VARIANTS)
def test_exact_kernels_are_never_contracted_to_fma(ptx, variant):
    """reduce/adam/cast promise numpy's bits: one rounding per operation, no fused multiply-add."""
    for name in ("reduce", "adam", "cast"):
        assert "fma." not in ptx[name, variant], f"{name}.cu ({variant}) has an FMA"
    body = entry_body(ptx["adam", variant], "adam_step_f32")
    for instr in ("div.rn.f32", "sqrt.rn.f32", "mul.rn.f32", "add.rn.f32", "sub.rn.f32"):
        assert instr in body, f"adam_step_f32: no {instr}"
    assert "sqrt.approx" not in body and "div.approx" not in body and "div.full" not in body
    # the fp16 conversions are the two exact PTX ones, with cuda_fp16.h or without it
    assert "cvt.rn.f16.f32" in entry_body(ptx["cast", variant], "cast_f32_to_f16")
    assert "cvt.f32.f16" in entry_body(ptx["cast", variant], "unscale_f16_to_f32")


@needs_nvcc
@pytest.mark.parametrize("variant", VARIANTS)
def test_no_kernel_flushes_subnormals_under_cupys_ftz_flag(ptx, variant):
    """CuPy compiles with -ftz=true; numpy keeps fp32 subnormals, so no instruction of any
    kernel may be the flushing (.ftz) form: sums, products, quotients, square roots, the
    comparisons of max/min and the fp32 -> fp64 widening of the norm."""
    for name in kernels.SOURCES:
        flushing = sorted(set(re.findall(r"\b[a-z]+(?:\.[a-z0-9]+)*\.ftz(?:\.[a-z0-9]+)*", ptx[name, variant])))
        assert not flushing, f"{name}.cu ({variant}) flushes subnormals: {flushing}"
    for entry in ("reduce_max_f32", "reduce_min_f32"):
        assert "setp." in entry_body(ptx["reduce", variant], entry)


@needs_nvcc
def test_flags_are_one_atomic_per_block(ptx):
    for name, entry in (("cast", "unscale_f16_to_f32"), ("cast", "find_nonfinite_f32")):
        body = entry_body(ptx[name, "file"], entry)
        assert "bar.red.or.pred" in body and "atom.global.or.b32" in body, entry


@needs_nvcc
def test_ptx_assembles_for_sm80(ptx, tmp_path):
    ptxas = shutil.which("ptxas") or str(Path(NVCC).resolve().parent / "ptxas")
    if not Path(ptxas).is_file():
        pytest.skip("ptxas not found beside nvcc")
    for name in kernels.SOURCES:
        src = tmp_path / f"{name}.ptx"
        src.write_text(ptx[name, "file"])
        proc = subprocess.run([ptxas, "-arch=sm_80", str(src), "-o", str(tmp_path / f"{name}.cubin")],
                              capture_output=True, text=True, timeout=60, check=False)
        assert proc.returncode == 0, proc.stderr


def test_compile_falls_back_to_own_fp16_only_for_cuda_fp16_errors():
    calls = []

    def fails_on_header(code, options):
        calls.append(options)
        if kernels.NO_CUDA_FP16 not in options:
            raise RuntimeError('k.cu(32): catastrophic error: could not open source file "cuda_fp16.h"')
        return "module"

    assert kernels.compile_with_fallback(fails_on_header, "code") == "module"
    assert calls == [kernels.COMPILE_OPTIONS, kernels.COMPILE_OPTIONS + (kernels.NO_CUDA_FP16,)]

    def syntax_error(code, options):
        raise RuntimeError("k.cu(3): error: expected a ;")

    with pytest.raises(RuntimeError, match="expected a ;"):
        kernels.compile_with_fallback(syntax_error, "code")


def find_nvrtc():
    """libnvrtc.so from the nvidia-cuda-nvrtc-cu12 wheel, the CUDA toolkit, or the loader path."""
    candidates = []
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec else []:
        candidates += sorted(Path(root).glob("cuda_nvrtc/lib/libnvrtc.so*"))
    candidates += sorted(Path("/usr/local/cuda/lib64").glob("libnvrtc.so*"))
    candidates = [c for c in candidates if "builtins" not in c.name and ".alt." not in c.name]
    if candidates:
        return str(candidates[0])
    return ctypes.util.find_library("nvrtc")


def nvrtc_compiler(path):
    """compile(code, options) -> PTX with NVRTC through ctypes, raising with NVRTC's log."""
    for builtins in sorted(Path(path).parent.glob("libnvrtc-builtins.so*")):
        if ".alt." not in builtins.name:
            ctypes.CDLL(str(builtins), mode=ctypes.RTLD_GLOBAL)
    lib = ctypes.CDLL(path)

    def compile(code, options):
        options = [*options, "-arch=compute_80"]
        prog = ctypes.c_void_p()
        assert lib.nvrtcCreateProgram(ctypes.byref(prog), code.encode(), b"kernels.cu", 0, None, None) == 0
        try:
            argv = (ctypes.c_char_p * len(options))(*(o.encode() for o in options))
            rc = lib.nvrtcCompileProgram(prog, len(options), argv)
            size = ctypes.c_size_t()
            lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
            log = ctypes.create_string_buffer(size.value)
            lib.nvrtcGetProgramLog(prog, log)
            if rc != 0:
                raise RuntimeError(log.value.decode(errors="replace"))
            lib.nvrtcGetPTXSize(prog, ctypes.byref(size))
            ptx_text = ctypes.create_string_buffer(size.value)
            lib.nvrtcGetPTX(prog, ptx_text)
            return ptx_text.value.decode()
        finally:
            lib.nvrtcDestroyProgram(ctypes.byref(prog))

    return compile


@pytest.mark.parametrize("name", kernels.SOURCES)
def test_nvrtc_compiles_the_module_strings(name):
    """What cupy.RawModule does, without a GPU: NVRTC on module_source(name), through the
    loader's fallback (NVRTC alone has no cuda_fp16.h; CuPy adds its own copy)."""
    path = find_nvrtc()
    if path is None:
        pytest.skip("libnvrtc not found (pip install nvidia-cuda-nvrtc-cu12 to run this check)")
    text = kernels.compile_with_fallback(nvrtc_compiler(path), kernels.module_source(name))
    assert sorted(ptx_entries(text)) == sorted(EXPECTED_ENTRIES[name])
    if name != "norm":
        assert "fma." not in text


# -- reduce.cu references ---------------------------------------------------------------------

FLOAT_WIDTH = {"float16": 16, "float32": 32, "float64": 64}
OPS = ("sum", "avg", "max", "min", "prod")


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


# -- adam.cu reference vs the CPU path --------------------------------------------------------

LR, BETAS, EPS = 1e-3, (0.9, 0.999), 1e-8


class TorchOrderAdam(optim.Adam):
    """Adam written out with numpy in torch.optim.Adam's order of operations: an oracle
    independent of ringcomm.kernels (which optim.Adam calls)."""

    def update(self, param, grad, offset=0):
        b1, b2 = self.betas
        m, v = self.m[offset:offset + param.size], self.v[offset:offset + param.size]
        grad = grad.copy()
        if self.weight_decay:
            grad += self.weight_decay * param
        m *= b1
        m += (1 - b1) * grad
        v *= b2
        v += (1 - b2) * grad * grad
        denom = np.sqrt(v)
        denom /= math.sqrt(1 - b2 ** self.t)
        denom += self.eps
        param -= self.lr / (1 - b1 ** self.t) * (m / denom)


def cpu_strategy(size, mixed, weight_decay, clip, master0):
    """A one-rank Replicated strategy with just what Strategy.update touches: the real
    update, owned_grad, master_pieces, write_back and LossScaler, and Adam in torch's order
    written out independently of the kernels."""
    s = object.__new__(Replicated)
    s.mixed, s.rank = mixed, 0
    s.meta = types.SimpleNamespace(all_reduce=lambda x: x)  # one rank: the sum is itself
    s._weight = np.ones(size)  # every element counts in the norm
    s.cfg = types.SimpleNamespace(clip_grad_norm=clip, offload=False)
    s.scaler = optim.LossScaler(enabled=mixed)
    s.layout = types.SimpleNamespace(total=size)
    s.flat_grads = np.zeros(size, np.float16 if mixed else np.float32)
    s.optimizer = TorchOrderAdam(size, lr=LR, betas=BETAS, eps=EPS, weight_decay=weight_decay)
    if mixed:
        s.master = master0.copy()
        s.flat_params = master0.astype(np.float16)
    else:
        s.master = s.flat_params = master0.copy()
    return s


def gradients(rng, size, steps, scale, mixed, bad_steps):
    for step in range(steps):
        g = rng.standard_normal(size).astype(np.float32) * np.float32(rng.uniform(1e-4, 1e-2))
        g[rng.random(size) < 0.02] = 0.0
        if mixed:
            g = (g * np.float32(scale)).astype(np.float16)  # may overflow to inf by itself
        if step in bad_steps:
            g[rng.integers(size)] = np.inf if step % 2 else np.nan
        yield g


@pytest.mark.parametrize("clip", [None, 0.1])  # gradient norms run from 3e-3 to 0.3
@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
@pytest.mark.parametrize("mixed", [True, False])
def test_adam_step_is_strategy_update(mixed, weight_decay, clip):
    """Several steps of what Strategy.update runs -- unscale and check, clip, reference.adam_step,
    the fp16 copy -- against Strategy.update with Adam in torch's order and write_back, bit for
    bit, including overflowed steps (skipped, nothing changes, t stays). Unscaling and the
    clipping product are the CPU path's numpy written out here; Strategy.update clips with
    kernels.scale."""
    rng = np.random.default_rng([mixed, int(weight_decay * 100), clip is not None])
    size = 1031
    master0 = rng.standard_normal(size).astype(np.float32) * np.float32(0.1)
    cpu = cpu_strategy(size, mixed, weight_decay, clip, master0)
    master, m, v = master0.copy(), np.zeros(size, np.float32), np.zeros(size, np.float32)
    params = master0.astype(np.float16) if mixed else None
    scaler, t, clipped = optim.LossScaler(enabled=mixed), 0, 0
    bad = {2, 5} if mixed else set()
    for step, grad in enumerate(gradients(rng, size, 8, scaler.scale, mixed, bad)):
        cpu.flat_grads[...] = grad
        g = grad.astype(np.float32)
        g /= scaler.scale
        overflow = not np.isfinite(g).all()
        snapshot = (master.copy(), m.copy(), v.copy())
        assert scaler.update(overflow) == cpu.update(0.0)[1] == overflow
        if overflow:
            assert step in bad or not np.isfinite(grad).all()
            for now, before in zip((master, m, v), snapshot):
                assert_same_bits(now, before)
        else:
            if clip:
                coef = optim.clip_coefficient(ref.sq_norm(g), clip)
                clipped += coef < 1
                g *= coef
            t += 1
            assert ref.adam_step(master, g, m, v, LR, *BETAS, EPS, weight_decay, t) is None
            if mixed:
                ref.cast_to_half(master, params)
        assert cpu.optimizer.t == t and scaler.scale == cpu.scaler.scale
        assert_same_bits(master, cpu.master)
        assert_same_bits(m, cpu.optimizer.m)
        assert_same_bits(v, cpu.optimizer.v)
        if mixed:
            assert_same_bits(params, cpu.flat_params)
    assert t >= 5
    assert not clip or 0 < clipped < t  # steps with and without clipping


def test_adam_step_has_no_check_and_takes_the_step_like_the_unscaled_cpu_path():
    """fp32 training has no loss scaler: the CPU path updates even with a NaN gradient."""
    rng = np.random.default_rng(7)
    size = 257
    master0 = rng.standard_normal(size).astype(np.float32)
    cpu = cpu_strategy(size, False, 0.01, None, master0)
    master, m, v = master0.copy(), np.zeros(size, np.float32), np.zeros(size, np.float32)
    for step, grad in enumerate(gradients(rng, size, 4, 1.0, False, bad_steps={1})):
        cpu.flat_grads[...] = grad
        with np.errstate(invalid="ignore"):
            assert cpu.update(0.0)[1] is False
            ref.adam_step(master, grad, m, v, LR, *BETAS, EPS, 0.01, step + 1)
        for ours, theirs in ((master, cpu.master), (m, cpu.optimizer.m), (v, cpu.optimizer.v)):
            assert_same_bits(ours, theirs)
    assert np.isnan(master).any()


def test_adam_step_does_not_modify_grad_and_accepts_numpy_scalars():
    rng = np.random.default_rng(3)
    grad = rng.standard_normal(64).astype(np.float32)
    keep = grad.copy()
    a = [np.ones(64, np.float32), np.zeros(64, np.float32), np.zeros(64, np.float32)]
    b = [x.copy() for x in a]
    ref.adam_step(*a[:1], grad, *a[1:], 1e-3, 0.9, 0.999, 1e-8, 0.1, 1)
    ref.adam_step(*b[:1], grad, *b[1:], np.float64(1e-3), np.float64(0.9), np.float64(0.999),
                  np.float64(1e-8), np.float64(0.1), np.int64(1))
    assert_same_bits(grad, keep)
    for x, y in zip(a, b):
        assert_same_bits(x, y)
    assert not np.array_equal(a[0], np.ones(64, np.float32))  # a step was taken


def test_adam_scalars_are_the_cpu_path_doubles():
    s = ref.adam_scalars(2e-3, 0.9, 0.999, 1e-8, 0.1, 7)
    assert s["step_size"] == 2e-3 / (1 - 0.9 ** 7)
    assert s["bias_correction2_sqrt"] == math.sqrt(1 - 0.999 ** 7)
    assert s["one_minus_beta1"] == 1 - 0.9 and s["one_minus_beta2"] == 1 - 0.999
    assert s["use_weight_decay"] and not ref.adam_scalars(1, .9, .9, 1, 0.0, 1)["use_weight_decay"]


@settings(max_examples=300, deadline=None)
@given(hnp.arrays(np.float32, st.integers(0, 64), elements=st.floats(width=32)),
       st.floats(0.0, 1.0), st.floats(0.0, 1e6))
def test_clipping_with_scale_is_the_python_float_product(x, max_norm, sq_norm):
    """Strategy.update clips with kernels.scale(grad, clip_coefficient(...)): the same bits as
    the CPU path's ``grad *= coefficient`` with the Python float (NEP 50: rounded to fp32,
    one fp32 product), subnormals and specials included."""
    coef = optim.clip_coefficient(sq_norm, max_norm)
    assert type(coef) is float
    with np.errstate(all="ignore"):
        expected = x.copy()
        expected *= coef
        assert_same_bits(ref.scale(x.copy(), coef), expected)
        assert_same_bits(kernels.scale(x.copy(), coef), expected)


# -- cast.cu / norm.cu references --------------------------------------------------------------

def special_fp32(rng, n):
    x = rng.standard_normal(n).astype(np.float32) * np.float32(1e3)
    x[::7] = np.float32(7e4)  # beyond fp16: inf
    x[1::11] = np.float32(3e-8)  # fp16 subnormal
    x[2::13] = -0.0
    x[3::17] = np.float32(65519.0)  # rounds to fp16 max, 65520 would round to inf
    return x


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


# -- ringcomm.kernels on this machine: sources, backend, dispatch to the references --------------

def test_backend_is_numpy_without_cupy():
    if importlib.util.find_spec("cupy") is None:
        assert kernels.backend() == "numpy"
    else:
        assert kernels.backend() in ("numpy", "cupy")


def test_sources_ship_beside_the_dispatcher():
    assert kernels.KERNEL_DIR == KERNEL_DIR
    assert kernels.source_path("adam") == KERNEL_DIR / "adam.cu"
    assert Path(ref.__file__).resolve() == KERNEL_DIR / "reference.py"
    with pytest.raises(ValueError):
        kernels.source_path("softmax")


def test_an_installed_wheel_carries_the_sources(tmp_path):
    """The wheel setup.cfg builds holds every .cu source, the header and the README as package
    data of ringcomm.kernels: no file-path search is needed to find them."""
    root, src = KERNEL_DIR.parents[1], tmp_path / "src"  # a copy: the build leaves files behind
    src.mkdir()
    for name in ("setup.cfg", "pyproject.toml", "README.md"):
        shutil.copy(root / name, src / name)
    shutil.copytree(root / "ringcomm", src / "ringcomm", ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path), str(src)], check=True, capture_output=True, timeout=120)
    wheel, = tmp_path.glob("ringcomm-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for source in kernels.SOURCES:
        assert f"ringcomm/kernels/{source}.cu" in names
    assert {"ringcomm/kernels/common.cuh", "ringcomm/kernels/README.md", "ringcomm/kernels/reference.py",
            "ringcomm/kernels/__init__.py"} <= names


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
    for x, y in zip(state, twin):
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
    for (source, variant), text in ptx_by_source.items():
        if variant == "file":
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
            for i, (arg, ptype) in enumerate(zip(args, params)):
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
        if dtype.kind == "i":
            for op in ref.BITWISE:
                kernels.reduce(op, dev(dtype), dev(dtype))
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
        for d, h in zip(devs, hosts):
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
