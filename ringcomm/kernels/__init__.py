"""The CUDA kernels of this package and their numpy references, behind one set of functions.

Every function takes numpy or CuPy arrays (all of one kind) and works in place where the
kernel does:

- ``reduce(op, acc, incoming)``, ``finalize(op, acc, n)``, ``divide(x, divisor)``,
  ``scale(x, factor)`` -- ``reduce.cu``;
- ``adam_step(master, grad, m, v, lr, beta1, beta2, eps, weight_decay, step)`` --
  ``adam.cu``;
- ``cast_to_half(src, dst)``, ``unscale(src, dst, loss_scale, found=None) -> found_inf``,
  ``found_nonfinite(x, found=None)`` -- ``cast.cu`` (``found``: a device flag the kernel ORs
  into, so the answer stays on the GPU);
- ``sq_norm_partial(x, loss_scale=1.0, num_blocks=None, acc_dtype=float64)``,
  ``sq_norm(x, loss_scale=1.0, on_device=False) -> float`` -- ``norm.cu``.

numpy arrays go to the references (:mod:`.reference`, what the CPU path computes);
CuPy arrays go to the kernels, compiled once per process and device with
``cupy.RawModule(code=module_source(name), options=("-std=c++17",))`` and launched on the
current stream. The kernels cover the dtypes ringcomm's collectives and trainer use, no
more: on CuPy arrays ``scale``, ``found_nonfinite`` and ``sq_norm`` take fp32 only
(``sq_norm_partial``: fp32 with fp64 accumulation), ``unscale`` an fp16 source and an fp32
destination, and each raises TypeError for anything else; ``reduce`` takes every dtype the
collectives accept, ``divide`` fp16, fp32 and fp64. The references are not narrowed: on
numpy arrays each function takes the dtypes numpy does.
:func:`backend` says which of the two this process can use: ``"cupy"`` when CuPy imports and
sees a device, else ``"numpy"``.

The ``.cu`` sources and ``common.cuh`` live in the project's top-level ``kernels/`` folder,
whose README says what each kernel computes and how exactness is kept; a wheel carries them
as ``ringcomm/kernels/cuda/`` (:data:`KERNEL_DIR` is whichever of the two holds them).
"""
import functools
from pathlib import Path

import numpy as np

from . import reference

SOURCES = ("reduce", "adam", "cast", "norm")
THREADS = 256  # threads per block of every launch (norm.cu needs a multiple of 32)

_SUFFIX = {"float16": "f16", "float32": "f32", "float64": "f64", "int32": "i32", "int64": "i64"}
_REDUCE_OPS = ("sum", "prod", "max", "min")


def _entry_points():
    """Every ``extern "C" __global__`` name each source defines (checked against the PTX)."""
    reduce_entries = [f"reduce{form}_{op}_{sfx}" for form in ("", "_out") for sfx in _SUFFIX.values()
                      for op in _REDUCE_OPS]
    reduce_entries += [f"reduce{form}_{op}_{sfx}" for form in ("", "_out") for sfx in ("i32", "i64")
                       for op in reference.BITWISE]
    reduce_entries += [f"divide_{sfx}" for sfx in ("f16", "f32", "f64")] + ["scale_f32"]
    return {
        "reduce": tuple(reduce_entries),
        "adam": ("adam_step_f32",),
        "cast": ("cast_f32_to_f16", "unscale_f16_to_f32", "find_nonfinite_f32"),
        "norm": ("sq_norm_partial_f32_f64",),
    }


ENTRY_POINTS = _entry_points()

# -- the sources -------------------------------------------------------------------------------

def _kernel_dir():
    """Where the ``.cu`` sources are: ``cuda/`` beside this file in an installed wheel, else
    the checkout's top-level ``kernels/`` (a source tree or an editable install)."""
    here = Path(__file__).resolve().parent
    for place in (here / "cuda", here.parents[1] / "kernels"):
        if (place / "common.cuh").is_file():
            return place
    return here / "cuda"  # a broken install: numpy work goes on, a CUDA compile names the path


KERNEL_DIR = _kernel_dir()


def source_path(name):
    """Path of ``<name>.cu`` (in :data:`KERNEL_DIR`)."""
    if name not in SOURCES:
        raise ValueError(f"unknown kernel source {name!r}; expected one of {SOURCES}")
    return KERNEL_DIR / f"{name}.cu"


# -- CuPy ---------------------------------------------------------------------------------------

@functools.cache
def _cupy():
    """The ``cupy`` module, or None when it is not importable."""
    try:
        import cupy
    except Exception:  # ImportError, or a broken CUDA install raising at import
        return None
    return cupy


@functools.cache
def backend():
    """``"cupy"`` if CuPy imports and a CUDA device is visible, else ``"numpy"``."""
    cp = _cupy()
    if cp is None:
        return "numpy"
    try:
        return "cupy" if cp.cuda.runtime.getDeviceCount() > 0 else "numpy"
    except Exception:  # no driver, no device
        return "numpy"


def _is_cupy(x):
    cp = _cupy()
    return cp is not None and isinstance(x, cp.ndarray)


def _on_gpu(*arrays):
    """True if the arrays are CuPy arrays, False if numpy; TypeError for a mix or anything else."""
    present = [a for a in arrays if a is not None]
    kinds = {"cupy" if _is_cupy(a) else "numpy" if isinstance(a, np.ndarray) else type(a).__name__
             for a in present}
    if kinds == {"numpy"}:
        return False
    if kinds == {"cupy"}:
        return True
    raise TypeError(f"expected numpy arrays or CuPy arrays, not a mix: got {sorted(kinds)}")


COMPILE_OPTIONS = ("-std=c++17",)  # the sources include no header: nothing else is needed


def module_source(name):
    """The code ``cupy.RawModule`` compiles: ``<name>.cu`` with its
    ``#include "common.cuh"`` (fp16 type, finiteness test, grid-stride loop) written out in
    place, so NVRTC needs no include path."""
    code = source_path(name).read_text()
    common = (source_path(name).parent / "common.cuh").read_text().replace("#pragma once\n", "")
    return code.replace('#include "common.cuh"', common)


@functools.cache
def _module(name, device_id):
    mod = _cupy().RawModule(code=module_source(name), options=COMPILE_OPTIONS)
    mod.compile()  # now, so that a compile error names the module at its first use
    return mod


@functools.cache
def _function(source, entry, device_id):
    return _module(source, device_id).get_function(entry)


def _kernel(source, entry):
    """The ``cupy.RawKernel`` for ``entry`` of ``<source>.cu`` on the current device."""
    return _function(source, entry, _cupy().cuda.Device().id)


@functools.cache
def _max_blocks(device_id):
    cp = _cupy()
    return 32 * int(cp.cuda.Device(device_id).attributes["MultiProcessorCount"])


def _launch(source, entry, n, args, blocks=None):
    """Launch ``entry`` with THREADS threads per block, over at most a few waves of blocks
    (the grid-stride loops take the rest); nothing for n == 0 unless ``blocks`` is given."""
    cp = _cupy()
    if blocks is None:
        if n == 0:
            return
        blocks = min(-(-n // THREADS), _max_blocks(cp.cuda.Device().id))
    _kernel(source, entry)((blocks,), (THREADS,), args)


def _flat(x, name):
    if not x.flags.c_contiguous:
        raise ValueError(f"{name} must be contiguous for the CUDA kernels")
    return x.reshape(-1)


def _same_size(**arrays):
    sizes = {name: a.size for name, a in arrays.items() if a is not None}
    if len(set(sizes.values())) > 1:
        raise ValueError(f"sizes differ: {sizes}")


def _need_dtype(x, name, *dtypes):
    if x.dtype.name not in dtypes:
        raise TypeError(f"{name} has dtype {x.dtype.name}; the kernel takes {', '.join(dtypes)}")


def _scalar_for(dtype, value):
    """A scalar of the kernel's parameter type holding ``value`` rounded to ``dtype`` (fp16
    scalars travel as fp32 holding an fp16 value)."""
    dtype = np.dtype(dtype)
    if dtype == np.float16:
        return np.float32(np.float16(value))
    return dtype.type(value)


def _flag(cp):
    return cp.zeros(1, dtype=np.int32)


# -- reduce.cu ----------------------------------------------------------------------------------

def reduce(op, acc, incoming, out=None):
    """In place: ``acc = acc (op) incoming``; returns ``acc`` (``ringcomm.ops.reduce_into``).
    With ``out`` (which may be ``incoming``): ``out = acc (op) incoming``, ``acc`` unchanged,
    one pass (``reduce_out_*``); returns ``out``."""
    ref = reference
    if not _on_gpu(acc, incoming, out):
        return ref.reduce(op, acc, incoming, out)
    name = ref.op_name(op)
    if incoming.dtype != acc.dtype:
        raise TypeError(f"dtypes differ: acc {acc.dtype.name}, incoming {incoming.dtype.name}")
    _need_dtype(acc, "acc", *(("int32", "int64") if name in ref.BITWISE else _SUFFIX))
    _same_size(acc=acc, incoming=incoming)
    kernel_op = "sum" if name == "avg" else name
    a, b = _flat(acc, "acc"), _flat(incoming, "incoming")
    if out is None:
        _launch("reduce", f"reduce_{kernel_op}_{_SUFFIX[acc.dtype.name]}", a.size,
                (a, b, np.int64(a.size)))
        return acc
    if out.dtype != acc.dtype:
        raise TypeError(f"dtypes differ: acc {acc.dtype.name}, out {out.dtype.name}")
    _same_size(acc=acc, out=out)
    _launch("reduce", f"reduce_out_{kernel_op}_{_SUFFIX[acc.dtype.name]}", a.size,
            (_flat(out, "out"), a, b, np.int64(a.size)))
    return out


def _unsupported(fn, got, supported):
    """The TypeError for CuPy arrays of a dtype no kernel behind ``fn`` takes."""
    return TypeError(f"{fn} takes {supported} on a GPU, not {got} (no CUDA kernel for it)")


def scale(x, factor):
    """In place: ``x *= factor`` (``factor`` rounded to ``x.dtype``); returns ``x``. On CuPy
    arrays float32 only (``scale_f32``: clipping's ``grad *= coefficient``)."""
    if not _on_gpu(x):
        return reference.scale(x, factor)
    if x.dtype != np.float32:
        raise _unsupported("scale", x.dtype.name, "float32")
    flat = _flat(x, "x")
    _launch("reduce", "scale_f32", flat.size, (flat, np.float32(float(factor)), np.int64(flat.size)))
    return x


def divide(x, divisor):
    """In place: ``x /= divisor`` (``divisor`` rounded to ``x.dtype``); returns ``x``. On CuPy
    arrays float16, float32 or float64 (``divide_<dtype>``: avg's division)."""
    if not _on_gpu(x):
        return reference.divide(x, divisor)
    _need_dtype(x, "x", "float16", "float32", "float64")
    flat = _flat(x, "x")
    _launch("reduce", f"divide_{_SUFFIX[x.dtype.name]}", flat.size,
            (flat, _scalar_for(x.dtype, float(divisor)), np.int64(flat.size)))
    return x


def finalize(op, acc, n):
    """In place: a finished sum over ``n`` ranks becomes the result of ``op`` (avg divides);
    ``ringcomm.ops.finalize``."""
    if not _on_gpu(acc):
        return reference.finalize(op, acc, n)
    if reference.op_name(op) == "avg" and acc.size:
        divide(acc, n)
    return acc


# -- adam.cu ------------------------------------------------------------------------------------

def adam_step(master, grad, m, v, lr, beta1, beta2, eps, weight_decay, step):
    """One fused Adam step, in place on the fp32 ``master``, ``m`` and ``v``, from the fp32
    ``grad`` (already unscaled and clipped; not modified); see :func:`.reference.adam_step`.
    On CuPy arrays: one launch on the current stream, nothing waits for the GPU."""
    ref = reference
    if not _on_gpu(master, grad, m, v):
        return ref.adam_step(master, grad, m, v, lr, beta1, beta2, eps, weight_decay, step)
    named = (("master", master), ("grad", grad), ("m", m), ("v", v))
    for name, x in named:
        _need_dtype(x, name, "float32")
    _same_size(**dict(named))
    s = ref.adam_scalars(lr, beta1, beta2, eps, weight_decay, step)
    n = master.size
    f32 = np.float32
    _launch("adam", "adam_step_f32", n, (
        *(_flat(x, name) for name, x in named),
        f32(s["weight_decay"]), np.int32(s["use_weight_decay"]), f32(s["beta1"]),
        f32(s["one_minus_beta1"]), f32(s["beta2"]), f32(s["one_minus_beta2"]),
        f32(s["step_size"]), f32(s["bias_correction2_sqrt"]), f32(s["eps"]), np.int64(n)))


# -- cast.cu ------------------------------------------------------------------------------------

def cast_to_half(src, dst):
    """``dst[...] = src`` from fp32 to fp16 (round to nearest even, as numpy); returns ``dst``."""
    if not _on_gpu(src, dst):
        return reference.cast_to_half(src, dst)
    _need_dtype(src, "src", "float32")
    _need_dtype(dst, "dst", "float16")
    _same_size(src=src, dst=dst)
    a, b = _flat(src, "src"), _flat(dst, "dst")
    _launch("cast", "cast_f32_to_f16", a.size, (a, b, np.int64(a.size)))
    return dst


def _flag_result(flag, given=None):
    """What a checking kernel returns: None when the caller ``given`` its own flag (an int32
    device array of one element, left on the device: no synchronisation), else ``flag`` as
    a bool (one synchronisation)."""
    return None if given is not None else bool(int(flag.get()[0]))


def unscale(src, dst, loss_scale, found=None):
    """``dst[...] = fp32(src) / loss_scale`` into the fp32 ``dst``; returns True if some
    result is inf or NaN. On CuPy arrays ``src`` is fp16 (``unscale_f16_to_f32``: mixed
    precision's gradient), and with ``found`` (an int32 device array of one element) the flag
    is ORed into it instead and None returned: nothing waits for the GPU. On numpy arrays
    ``src`` may also be fp32, and may be ``dst``."""
    if not _on_gpu(src, dst):
        flag = reference.unscale(src, dst, loss_scale)
        if found is None:
            return flag
        found[0] |= int(flag)
        return None
    if src.dtype != np.float16:
        raise _unsupported("unscale", f"a {src.dtype.name} source", "a float16 source")
    _need_dtype(dst, "dst", "float32")
    _same_size(src=src, dst=dst)
    flag = _flag(_cupy()) if found is None else found
    d = _flat(dst, "dst")
    _launch("cast", "unscale_f16_to_f32", d.size,
            (_flat(src, "src"), d, np.float32(float(loss_scale)), flag, np.int64(d.size)))
    return _flag_result(flag, found)


def found_nonfinite(x, found=None):
    """True if ``x`` holds an inf or NaN (``found``: as for :func:`unscale`). On CuPy arrays
    float32 only (``find_nonfinite_f32``: fp32 training's gradient)."""
    if not _on_gpu(x):
        flag = reference.found_nonfinite(x)
        if found is None:
            return flag
        found[0] |= int(flag)
        return None
    if x.dtype != np.float32:
        raise _unsupported("found_nonfinite", x.dtype.name, "float32")
    flag = _flag(_cupy()) if found is None else found
    flat = _flat(x, "x")
    _launch("cast", "find_nonfinite_f32", flat.size, (flat, flag, np.int64(flat.size)))
    return _flag_result(flag, found)


# -- norm.cu ------------------------------------------------------------------------------------

def sq_norm_partial(x, loss_scale=1.0, num_blocks=None, acc_dtype=np.float64):
    """Per-block partial sums of ``(x / loss_scale) ** 2`` (``num_blocks`` of them, dtype
    ``acc_dtype``); their sum is the squared norm. Same array kind as ``x``. On CuPy arrays
    float32 ``x`` with float64 accumulation only (``sq_norm_partial_f32_f64``)."""
    ref = reference
    if not _on_gpu(x):
        return ref.sq_norm_partial(x, loss_scale, num_blocks, THREADS, acc_dtype)
    acc_dtype = np.dtype(acc_dtype)
    if x.dtype != np.float32 or acc_dtype != np.float64:
        raise _unsupported("sq_norm_partial", f"{x.dtype.name} input with {acc_dtype.name} accumulation",
                           "float32 input with float64 accumulation")
    flat = _flat(x, "x")
    if num_blocks is None:
        num_blocks = ref.default_blocks(flat.size, THREADS)
    partial = _cupy().empty(num_blocks, dtype=acc_dtype)
    _launch("norm", "sq_norm_partial_f32_f64", flat.size,
            (flat, np.float32(loss_scale), partial, np.int64(flat.size)), blocks=num_blocks)
    return partial


def sq_norm(x, loss_scale=1.0, on_device=False):
    """Squared L2 norm of ``x / loss_scale`` as a Python float (fp64 accumulation); with
    ``on_device`` on CuPy arrays a 0-d fp64 device array instead (nothing waits). On CuPy
    arrays float32 only (:func:`sq_norm_partial`)."""
    if not _on_gpu(x):
        return reference.sq_norm(x, loss_scale)
    if x.dtype != np.float32:
        raise _unsupported("sq_norm", x.dtype.name, "float32")
    total = sq_norm_partial(x, loss_scale).sum(dtype=np.float64)
    return total if on_device else float(total.get())


__all__ = ["COMPILE_OPTIONS", "ENTRY_POINTS", "SOURCES", "THREADS", "adam_step",
           "backend", "cast_to_half", "divide", "finalize",
           "found_nonfinite", "module_source", "reduce", "reference", "scale", "source_path",
           "sq_norm", "sq_norm_partial", "unscale"]
