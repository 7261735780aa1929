"""The device a worker owns, how its arrays reach the wire, and how a collective's device
work is ordered with the caller's.

Words: a **host** array lives in CPU memory (numpy); a **device** array lives on the
worker's accelerator (CuPy). ZeroMQ and the shared-memory lanes move host bytes only, so a
device segment is *staged*: copied into a **staging buffer** — one of two page-locked
("pinned") host buffers, allocated once — before it is sent, and a received segment is
copied from the host into device memory before it is used there: straight into its
destination when it has one (a broadcast, an all-gather), else into a **landing buffer**,
one of two device buffers taken in turn by the segments that are reduced on arrival.

Three devices share one staging path (:class:`StagedDevice`), so the code that runs on a GPU
is the code the CPU tests exercise:

- :class:`HostDevice` (``cpu``): numpy; nothing to stage, segments go out zero-copy.
- :class:`~ringcomm.device.cuda.CudaDevice` (``gpu``): CuPy arrays on GPU
  ``LOCAL_RANK % device_count``.
- :class:`EmulatedDevice` (``emulated``, for tests): numpy arrays treated as device memory,
  with the same staging buffer and staging calls as the GPU.

**Stream order on the GPU** (NCCL's contract). Each rank's collectives run on the
**communication stream**, a non-blocking CUDA stream of the device's own:

1. at submission, on the calling thread, :meth:`ready` records an event on that thread's
   current stream (the kernels that produced the input);
2. the thread that runs the collective (the caller's, or the communication thread) enters
   :meth:`running`: the device is made current, the communication stream becomes the
   current stream, and it waits for that event; every reduce kernel of the collective is
   queued there, and its copies on two copy streams ordered after it
   (:mod:`ringcomm.device.cuda`);
3. when the collective's last device work is queued, :meth:`done` records the **completion
   event** on the communication stream, which has waited for every copy that lands on the
   device;
4. :meth:`join` — on return of a synchronous call, or in ``Work.wait()`` — makes the
   *waiting* thread's current stream wait for the completion event, so kernels it queues
   next see the result without the host blocking; ``Work.synchronize()`` blocks the host
   until the event has passed.

The staging path itself is :mod:`ringcomm.device.staged`; the GPU's streams are
:mod:`ringcomm.device.cuda`.

>>> dev = select("emulated", local_rank=0)
>>> dev.activate()
>>> staged = dev.stage_out(np.arange(4.0))  # a copy into a pinned buffer, started
>>> staged.wait(); wire = staged.host        # ... finished: the bytes for the transport
"""
import logging
import os

from .emulated import EmulatedDevice
from .host import HostDevice
from .staged import Staged, StagedDevice

__all__ = ["DEVICES", "EmulatedDevice", "HostDevice", "Staged", "StagedDevice", "gpu_available",
           "gpu_usable", "select"]

DEVICES = ("auto", "cpu", "gpu", "emulated")
log = logging.getLogger(__name__)


UNUSABLE = "CuPy sees a CUDA device but cannot compile and run a kernel on it"
PROBE = r"""extern "C" __global__ void ringcomm_probe(float* x) { x[threadIdx.x] += 1.0f; }"""


def gpu_usable(local_rank=0):
    """``(True, "")`` when CuPy sees a CUDA device and can compile and run a kernel on it
    (NVRTC and the driver agree), else ``(False, why)``; ``why`` names a device that is
    there but cannot run kernels with :data:`UNUSABLE`. The probe runs on the device the
    rank will use (``local_rank % device_count``), so no rank touches another's GPU."""
    try:
        import cupy
    except Exception as exc:  # noqa: BLE001 - not installed, or a broken install: all mean "no"
        return False, f"CuPy cannot be imported ({exc})"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
        if count < 1:
            return False, "CuPy sees no CUDA device"
    except Exception as exc:  # noqa: BLE001 - no driver
        return False, f"CuPy sees no CUDA device ({exc})"
    try:
        with cupy.cuda.Device(local_rank % count):
            x = cupy.zeros(4, dtype=cupy.float32)
            cupy.RawKernel(PROBE, "ringcomm_probe")((1,), (4,), (x,))
            ok = bool((x == 1).all())
    except Exception as exc:  # noqa: BLE001 - NVRTC missing, a driver older than the toolkit...
        return False, f"{UNUSABLE} ({exc})"
    return ok, "" if ok else f"{UNUSABLE}: a probe kernel computed a wrong result"


def gpu_available():
    return gpu_usable()[0]


def select(device=None, local_rank=0, slot_bytes=1 << 20):
    """The device for this worker: ``auto`` (a GPU if CuPy sees one and can run a probe kernel
    on it, else the CPU; the choice is logged, a GPU that cannot run kernels as a warning),
    ``cpu``, ``gpu`` (an error without a usable one), or ``emulated``. Default:
    ``RINGCOMM_DEVICE`` or auto."""
    device = device or os.environ.get("RINGCOMM_DEVICE", "auto")
    if device not in DEVICES:
        raise ValueError(f"unknown device {device!r}; expected one of {DEVICES}")
    if device in ("auto", "gpu"):
        usable, why = gpu_usable(local_rank)  # the probe runs once
    if device == "auto":
        device = "gpu" if usable else "cpu"
        log.log(logging.WARNING if why.startswith(UNUSABLE) else logging.INFO,
                "device auto: %s", "the GPU" if usable else f"the CPU: {why}")
    if device == "gpu":
        if not usable:
            raise ValueError(f"device='gpu' needs CuPy and a CUDA device it can run kernels on: "
                             f"{why} (install ringcomm[gpu], or use device='cpu')")
        from .cuda import CudaDevice  # CuPy is imported only here
        return CudaDevice(local_rank, slot_bytes)
    if device == "emulated":
        return EmulatedDevice(slot_bytes)
    return HostDevice()
