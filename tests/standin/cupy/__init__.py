"""A strict stand-in for the part of CuPy that ringcomm uses, running on numpy.

It exists so that the GPU path runs in ``make test`` on a machine without a GPU and fails
there the way it would fail on a GPU: device arrays are their own type and refuse numpy
arrays (``_array``); work on a stream is deferred until something waits for it, so a
missing wait reads stale memory (``_runtime``); the current device and stream are per
thread; pinned and device memory are counted. ringcomm's kernels run as numpy models of
their sources (``_kernels``). Put ``tests/standin`` first on ``PYTHONPATH`` to use it; it
says what it is in ``cupy.STANDIN``.
"""
import numpy as np

from . import _kernels, _runtime, cuda
from ._array import apply, ndarray

STANDIN = True
__version__ = "14.2.0+standin"


def _device_array(host, dtype=None):
    """A device array holding numpy/Python data ``host``: the copy runs on the current stream."""
    host = np.array(host, dtype=dtype, copy=True)
    out = ndarray(host.shape, host.dtype)
    out.set(host)
    return out


def asarray(a, dtype=None, order=None):
    if isinstance(a, ndarray):
        return a if dtype is None or np.dtype(dtype) == a.dtype else a.astype(dtype)
    return _device_array(a, dtype)


ascontiguousarray = asarray


def asnumpy(a, stream=None, order="C", out=None, blocking=True):
    if isinstance(a, ndarray):
        return a.get(stream=stream, out=out, blocking=blocking)
    return np.asarray(a)


def empty(shape, dtype=float, order="C"):
    return ndarray(shape, dtype)


def _filled(maker):
    def create(*args, **kwargs):
        return _device_array(maker(*args, **kwargs))
    return create


zeros, ones, full, arange = (_filled(f) for f in (np.zeros, np.ones, np.full, np.arange))


class RawModule:
    """Compiles nothing: the entry points are the numpy models of ringcomm's kernels."""

    def __init__(self, code=None, options=(), backend="nvrtc", name_expressions=None, jitify=False):
        self.code, self.options = code, tuple(options)

    def compile(self, log_stream=None):
        return self

    def get_function(self, name):
        return RawKernel(self.code, name, self.options)


class RawKernel:
    def __init__(self, code, name, options=(), backend="nvrtc", translate_cucomplex=False,
                 enable_cooperative_groups=False, jitify=False):
        if not name.startswith(_kernels.PREFIXES):
            raise cuda.driver.CUDADriverError(f"CUDA_ERROR_NOT_FOUND: named symbol not found: {name}")
        self.name = name

    def __call__(self, grid, block, args, *, shared_mem=0, stream=None):
        arrays = [a for a in args if isinstance(a, ndarray)]
        for a in arrays:
            if a._buffer.device != _runtime.current_device():
                raise cuda.driver.CUDADriverError(
                    f"CUDA_ERROR_ILLEGAL_ADDRESS: {self.name} reads device {a._buffer.device}'s memory "
                    f"on device {_runtime.current_device()}")
        real = [a._a if isinstance(a, ndarray) else a for a in args]
        if any(isinstance(a, np.ndarray) for a in args):
            raise TypeError(f"{self.name}: a numpy array is not a kernel argument")
        model, name = _kernels.model, self.name
        _runtime.counts["kernels"] += 1
        _runtime.counts[f"kernel {name}"] += 1
        (stream or _runtime.current_stream()).launch(
            lambda: model(name, tuple(grid), tuple(block), real), f"kernel {name}")


def pinned_bytes():
    """Host memory the stand-in's CUDA knows as page-locked, by kind."""
    return dict(_runtime.pinned_bytes)


_DIRECT = {"dtype", "finfo", "iinfo", "result_type", "can_cast", "promote_types", "isscalar",
           "newaxis", "inf", "nan", "pi", "e", "ndim", "shape", "errstate"}


def __getattr__(name):
    """numpy's types and constants as they are; numpy's functions as device operations."""
    value = getattr(np, name)
    if name in _DIRECT or isinstance(value, type) or not callable(value):
        return value
    if name.startswith("_") or name in ("from_dlpack", "frombuffer", "fromfile", "load", "save"):
        raise AttributeError(f"the CuPy stand-in has no {name}")
    return lambda *args, **kwargs: apply(value, args, kwargs, name)
