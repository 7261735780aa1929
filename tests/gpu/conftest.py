"""tests/gpu/: tests of the GPU path. Those with the ``backend`` fixture run twice: on the
CuPy stand-in (``tests/standin``, everywhere) and on real CuPy with a CUDA device; every
other test here, and the real-CuPy runs, need CuPy and a device and are skipped elsewhere.

A module that imports ``cupy`` itself (``test_kernels_gpu.py``) guards that import: a
module-level ``pytest.importorskip("cupy")`` and a device check that ends in
``pytest.skip(..., allow_module_level=True)``. That cannot live in this file: a skip raised
while pytest imports a conftest of a directory named on the command line aborts the whole run
(``pytest tests/gpu`` would crash instead of reporting skips). What this file does, without
raising: it marks the stand-in runs ``standin`` and every other test below this directory
``gpu`` (both declared in setup.cfg) and gives the ``gpu`` ones, where there is no device, a
skip that says why.
"""
from pathlib import Path

import pytest

_HERE = Path(__file__).resolve().parent


def gpu_unavailable_reason():
    """None where CuPy imports and sees a CUDA device, else why not (never raises)."""
    try:
        import cupy
    except Exception as exc:  # ImportError, or a CuPy that cannot load its CUDA libraries
        return f"GPU tests need CuPy, which is not importable here ({type(exc).__name__}: {exc})"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # no driver
        return f"GPU tests need a CUDA device; CuPy cannot query one ({type(exc).__name__}: {exc})"
    if count < 1:
        return "GPU tests need a CUDA device; CuPy sees none"
    return None


REASON = gpu_unavailable_reason()


def pytest_collection_modifyitems(config, items):
    for item in items:
        if _HERE in Path(str(item.path)).resolve().parents:
            callspec = getattr(item, "callspec", None)
            if callspec is not None and callspec.params.get("backend") == "standin":
                item.add_marker(pytest.mark.standin)  # the CuPy stand-in: runs everywhere
                continue
            item.add_marker(pytest.mark.gpu)
            if REASON is not None:
                item.add_marker(pytest.mark.skip(reason=REASON))
