"""``cupy.cuda.runtime`` of the stand-in."""
from .. import _runtime as rt

CUDARuntimeError = rt.CUDARuntimeError
is_hip = False
hostRegisterDefault, hostRegisterPortable, hostRegisterMapped = 0, 1, 2


def getDeviceCount():
    return rt.DEVICE_COUNT


def getDevice():
    return rt.current_device()


def setDevice(index):
    rt.set_device(index)


def deviceSynchronize():
    rt.synchronize_device()


def runtimeGetVersion():
    return 13000


def driverGetVersion():
    return 13000


def hostRegister(ptr, size, flags=0):
    rt.register(ptr, size)


def hostUnregister(ptr):
    rt.unpin(ptr)
