"""The emulated device (``emulated``, for tests): numpy arrays treated as device memory,
with the staging buffers and staging calls of the GPU (:mod:`ringcomm.device.staged`).

>>> dev = EmulatedDevice(slot_bytes=64); dev.activate()
>>> dev.stage_in(np.arange(4.0)).tolist()         # landed in a landing buffer
[0.0, 1.0, 2.0, 3.0]
"""
import threading

import numpy as np

from .staged import StagedDevice


class EmulatedDevice(StagedDevice):
    """numpy memory playing the device, for exercising the staging path without a GPU. As
    strict as CUDA about the current device, which is per thread: a copy on a thread that
    never made this device current raises (on a GPU it would go to device 0)."""

    kind = "emulated"

    def __init__(self, slot_bytes=1 << 20):
        super().__init__(slot_bytes)
        self._threads = set()  # threads that made this device current

    def activate(self):
        self._threads.add(threading.get_ident())

    def _current(self):
        if threading.get_ident() not in self._threads:
            raise RuntimeError(f"a device copy on thread {threading.current_thread().name!r}, which "
                               f"never made the rank's device current (activate)")

    def _pinned(self, nbytes):
        return np.empty(nbytes, np.uint8)

    def _device_bytes(self, nbytes):
        return np.empty(nbytes, np.uint8)

    def _to_host(self, array, host):
        self._current()
        np.copyto(host, array)

    def _to_device(self, host, out, landing=None):
        self._current()
        np.copyto(out, host)
