"""What the kernel tests (tests/unit/test_kernels*.py) share: where the sources are and which
entry points each must have, bit-for-bit comparison, inputs with fp16's special values, and
how nvcc is found and run (the ``ptx`` fixture in conftest.py compiles with it)."""
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from ringcomm import kernels

ref = kernels.reference
KERNEL_DIR = Path(__file__).resolve().parents[2] / "kernels"

# Written out here, not derived from ringcomm.kernels.ENTRY_POINTS, so a typo on either side
# shows up.
EXPECTED_ENTRIES = {
    "reduce": [f"reduce{form}_{op}_{t}" for form in ("", "_out") for op in ("sum", "prod", "max", "min")
               for t in ("f16", "f32", "f64", "i32", "i64")]
    + [f"reduce{form}_{op}_{t}" for form in ("", "_out") for op in ("band", "bor", "bxor") for t in ("i32", "i64")]
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


OPS = ("sum", "avg", "max", "min", "prod")


def special_fp32(rng, n):
    """fp32 values with what fp16 makes of them: inf, subnormals, -0.0, its largest value."""
    x = rng.standard_normal(n).astype(np.float32) * np.float32(1e3)
    x[::7] = np.float32(7e4)  # beyond fp16: inf
    x[1::11] = np.float32(3e-8)  # fp16 subnormal
    x[2::13] = -0.0
    x[3::17] = np.float32(65519.0)  # rounds to fp16 max, 65520 would round to inf
    return x


# -- nvcc: the PTX of every source -------------------------------------------------------------

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


def _compile(nvcc, src, out, extra=()):
    proc = subprocess.run([nvcc, *NVCC_FLAGS, *extra, str(src), "-o", str(out)],
                          capture_output=True, text=True, timeout=110, check=False)
    return proc.returncode, proc.stdout + proc.stderr


def ptx_entries(text):
    """{entry name: [param types]} of the ``.entry`` functions in a PTX text."""
    entries = {}
    for match in re.finditer(r"\.entry\s+(\w+)\s*\((.*?)\)", text, re.DOTALL):
        entries[match.group(1)] = re.findall(r"\.param\s+\.(\w+)", match.group(2))
    return entries
