"""Array helpers for code that holds host (numpy) or device (CuPy) arrays alike — the
trainer and the reduce operators — apart from the communication device of
:mod:`ringcomm.device`.

>>> array_module(np.zeros(2)) is np
True
>>> to_host(np.arange(3)).tolist()                # a CuPy array would be copied to the host
[0, 1, 2]
"""
from typing import Any, TypeAlias

import numpy as np

# a numpy.ndarray or a cupy.ndarray; CuPy is optional, so checkers see it as any array
Array: TypeAlias = Any


def to_host(a):
    """``a`` as a numpy array (a CuPy array is copied to the host)."""
    return a if isinstance(a, np.ndarray) else a.get()


def array_module(a):
    """numpy, or cupy for a CuPy array."""
    if isinstance(a, np.ndarray):
        return np
    import cupy
    return cupy


def copy_into(dst, src):
    """``dst[...] = src`` whichever of them lives on the host or the device."""
    if isinstance(dst, np.ndarray):
        dst[...] = to_host(src)
    else:
        dst[...] = array_module(dst).asarray(src, dtype=dst.dtype)


def cast_into(dst, src):
    """``dst[...] = src`` for a float32 ``src`` and float16 ``dst`` (the fp16 copy of fp32
    master weights): the cast kernel when both are on the GPU, else :func:`copy_into`. Both
    round each value to nearest even, so the bits are the same either way."""
    if isinstance(dst, np.ndarray) or isinstance(src, np.ndarray):
        copy_into(dst, src)
        return
    from . import kernels
    kernels.cast_to_half(src, dst)
