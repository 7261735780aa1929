"""``device="auto"`` takes the GPU only when CuPy can compile and run a kernel there, and
says which it took; ``device="gpu"`` refuses a GPU that cannot run kernels. CuPy is stood
in for by a module that has a device count and a kernel that compiles or not."""
import numpy as np
import pytest
class _Cupy:
    """Just enough of CuPy for device.select: a device count and a kernel that may fail."""

    def __init__(self, devices, compiles):
        import contextlib
        import types
        self.float32 = np.float32
        self.used = []  # the devices the probe ran on

        @contextlib.contextmanager
        def device(index):
            self.used.append(index)
            yield
        self.cuda = types.SimpleNamespace(runtime=types.SimpleNamespace(getDeviceCount=lambda: devices),
                                          Device=device)
        self._compiles = compiles

    def zeros(self, n, dtype):
        return np.zeros(n, dtype)

    def RawKernel(self, source, name):  # noqa: N802 - CuPy's name
        if not self._compiles:
            raise RuntimeError("nvrtc: error: invalid value for --gpu-architecture (-arch)")

        def launch(grid, block, args):
            np.add(args[0], 1, out=args[0])
        return launch


@pytest.mark.parametrize("devices, compiles, chosen, said", [
    (0, True, "cpu", "CuPy sees no CUDA device"),
    (1, False, "cpu", "cannot compile and run a kernel on it (nvrtc: error"),
])
def test_auto_takes_the_gpu_only_if_a_kernel_runs_there(monkeypatch, caplog, devices, compiles, chosen, said):
    import logging
    import sys
    from ringcomm import device
    monkeypatch.setitem(sys.modules, "cupy", _Cupy(devices, compiles))
    with caplog.at_level(logging.INFO, logger="ringcomm.device"):
        assert device.select("auto").kind == chosen
    assert said in caplog.text, caplog.text
    if devices:  # a GPU that is there but cannot run kernels is a warning, and "gpu" refuses it
        assert any(r.levelno == logging.WARNING for r in caplog.records)
        with pytest.raises(ValueError, match="cannot compile and run a kernel"):
            device.select("gpu")


def test_auto_takes_a_gpu_that_runs_the_probe(monkeypatch):
    import sys
    from ringcomm import device
    cupy = _Cupy(3, True)
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    assert device.gpu_usable() == (True, "")
    assert device.gpu_usable(local_rank=4) == (True, "")
    assert cupy.used == [0, 1]  # the probe runs on the rank's own device (4 % 3), not device 0
