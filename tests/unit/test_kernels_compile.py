"""ringcomm.kernels' CUDA sources: nvcc compiles each to PTX with the expected entry points,
from one common prelude that includes no header; the kernels that promise numpy's bits have
no fused multiply-add, no kernel flushes subnormals under CuPy's -ftz=true, the flags take one
atomic per block, the PTX assembles for sm_80; NVRTC alone (no CUDA headers) compiles the
strings cupy.RawModule gets."""
import ctypes
import ctypes.util
import importlib.util
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from ringcomm import kernels

from kernel_helpers import EXPECTED_ENTRIES, KERNEL_DIR, NVCC, needs_nvcc, ptx_entries

pytestmark = pytest.mark.timeout(120)


def entry_body(text, name):
    start = text.index(f".entry {name}(")
    return text[start:text.index("\n}", start)]


def test_sources_are_the_cu_files():
    assert sorted(p.stem for p in KERNEL_DIR.glob("*.cu")) == sorted(kernels.SOURCES)
    assert {k: sorted(v) for k, v in kernels.ENTRY_POINTS.items()} == {k: sorted(v) for k, v in EXPECTED_ENTRIES.items()}


@needs_nvcc
@pytest.mark.parametrize("name", kernels.SOURCES)
def test_ptx_has_every_entry_point(ptx, name):
    entries = ptx_entries(ptx[name])
    assert sorted(entries) == sorted(EXPECTED_ENTRIES[name])
    assert ".target sm_80" in ptx[name]


PRELUDE = re.compile(r"^// ---- common prelude:.*?^// ---- end of common prelude ----$", re.MULTILINE | re.DOTALL)


def test_every_source_shares_one_prelude_and_compiles_from_one_string():
    """Each *.cu includes common.cuh; what RawModule gets has it written out, exactly once."""
    common = (KERNEL_DIR / "common.cuh").read_text()
    assert len(PRELUDE.findall(common)) == 1
    for name in kernels.SOURCES:
        text = (KERNEL_DIR / f"{name}.cu").read_text()
        assert text.count('#include "common.cuh"') == 1 and not PRELUDE.findall(text)
        code = kernels.module_source(name)
        assert "#include" not in code, f"{name}: RawModule gets one string that includes no header"
        assert PRELUDE.findall(code) == PRELUDE.findall(common)


@needs_nvcc
def test_exact_kernels_are_never_contracted_to_fma(ptx):
    """reduce/adam/cast promise numpy's bits: one rounding per operation, no fused multiply-add."""
    for name in ("reduce", "adam", "cast"):
        assert "fma." not in ptx[name], f"{name}.cu has an FMA"
    body = entry_body(ptx["adam"], "adam_step_f32")
    for instr in ("div.rn.f32", "sqrt.rn.f32", "mul.rn.f32", "add.rn.f32", "sub.rn.f32"):
        assert instr in body, f"adam_step_f32: no {instr}"
    assert "sqrt.approx" not in body and "div.approx" not in body and "div.full" not in body
    # the fp16 conversions are the two exact PTX ones cuda_fp16.h's would emit
    assert "cvt.rn.f16.f32" in entry_body(ptx["cast"], "cast_f32_to_f16")
    assert "cvt.f32.f16" in entry_body(ptx["cast"], "unscale_f16_to_f32")


@needs_nvcc
def test_no_kernel_flushes_subnormals_under_cupys_ftz_flag(ptx):
    """CuPy compiles with -ftz=true; numpy keeps fp32 subnormals, so no instruction of any
    kernel may be the flushing (.ftz) form: sums, products, quotients, square roots, the
    comparisons of max/min and the fp32 -> fp64 widening of the norm."""
    for name in kernels.SOURCES:
        flushing = sorted(set(re.findall(r"\b[a-z]+(?:\.[a-z0-9]+)*\.ftz(?:\.[a-z0-9]+)*", ptx[name])))
        assert not flushing, f"{name}.cu flushes subnormals: {flushing}"
    for entry in ("reduce_max_f32", "reduce_min_f32"):
        assert "setp." in entry_body(ptx["reduce"], entry)


@needs_nvcc
def test_flags_are_one_atomic_per_block(ptx):
    for name, entry in (("cast", "unscale_f16_to_f32"), ("cast", "find_nonfinite_f32")):
        body = entry_body(ptx[name], entry)
        assert "bar.red.or.pred" in body and "atom.global.or.b32" in body, entry


@needs_nvcc
def test_ptx_assembles_for_sm80(ptx, tmp_path):
    ptxas = shutil.which("ptxas") or str(Path(NVCC).resolve().parent / "ptxas")
    if not Path(ptxas).is_file():
        pytest.skip("ptxas not found beside nvcc")
    for name in kernels.SOURCES:
        src = tmp_path / f"{name}.ptx"
        src.write_text(ptx[name])
        proc = subprocess.run([ptxas, "-arch=sm_80", str(src), "-o", str(tmp_path / f"{name}.cubin")],
                              capture_output=True, text=True, timeout=60, check=False)
        assert proc.returncode == 0, proc.stderr


def find_nvrtc():
    """libnvrtc.so from an nvidia-cuda-nvrtc wheel (-cu12, or 13.x), the CUDA toolkit, or the
    loader path."""
    candidates = []
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec else []:
        for layout in ("cuda_nvrtc/lib", "cu13/lib"):  # the -cu12 wheels' layout, CUDA 13's
            candidates += sorted(Path(root).glob(f"{layout}/libnvrtc.so*"))
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
    """What cupy.RawModule does, without a GPU: NVRTC alone (no CUDA header anywhere) on
    module_source(name) with ringcomm's options and CuPy's ``-ftz=true``; nothing is
    contracted to an FMA and no instruction flushes subnormals."""
    path = find_nvrtc()
    if path is None:
        pytest.skip("libnvrtc not found (pip install nvidia-cuda-nvrtc-cu12 to run this check)")
    compile_ = nvrtc_compiler(path)
    text = compile_(kernels.module_source(name), [*kernels.COMPILE_OPTIONS, "-ftz=true"])
    assert sorted(ptx_entries(text)) == sorted(EXPECTED_ENTRIES[name])
    assert "fma." not in text and ".ftz" not in text
