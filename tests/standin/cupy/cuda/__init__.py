"""``cupy.cuda`` of the stand-in: devices, streams, events, runtime calls."""
from .. import _runtime as rt
from . import compiler, driver, runtime
from .._runtime import Event


class Device:
    def __init__(self, device=None):
        self.id = rt.current_device() if device is None else int(device)
        if not 0 <= self.id < rt.DEVICE_COUNT:
            raise runtime.CUDARuntimeError(f"cudaErrorInvalidDevice: {self.id}")
        self.attributes = {"MultiProcessorCount": 4}

    def use(self):
        rt.set_device(self.id)

    def __enter__(self):
        self._previous = rt.current_device()
        rt.set_device(self.id)
        return self

    def __exit__(self, *exc):
        rt.set_device(self._previous)

    def synchronize(self):
        rt.synchronize_device(self.id)


class Stream(rt.Stream):
    def __init__(self, null=False, non_blocking=False, ptds=False):
        super().__init__(null=null, non_blocking=non_blocking, ptds=ptds)


def get_current_stream(device_id=None):
    return rt.current_stream(device_id)


__all__ = ["Device", "Event", "Stream", "compiler", "driver", "get_current_stream", "runtime"]
