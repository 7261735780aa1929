"""``cupy.cuda.runtime`` of the stand-in."""
from .. import _runtime as rt

CUDARuntimeError = rt.CUDARuntimeError


def getDeviceCount():
    return rt.DEVICE_COUNT


def hostRegister(ptr, size, flags):
    rt.register(ptr, size)


def hostUnregister(ptr):
    rt.unregister(ptr)
