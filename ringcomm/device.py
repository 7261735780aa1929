"""The device a worker owns, how its arrays reach the wire, and how a collective's device
work is ordered with the caller's.

Words: a **host** array lives in CPU memory (numpy); a **device** array lives on the
worker's accelerator (CuPy). ZeroMQ and the shared-memory lanes move host bytes only, so a
device segment is *staged*: copied into the **staging buffer** — one page-locked ("pinned")
host buffer, allocated once — before it is sent, and a received segment is copied from the
host into device memory before it is reduced there.

Three devices share one staging path (:class:`StagedDevice`), so the code that runs on a GPU
is the code the CPU tests exercise:

- :class:`HostDevice` (``cpu``): numpy; nothing to stage, segments go out zero-copy.
- :class:`CudaDevice` (``gpu``): CuPy arrays on GPU ``LOCAL_RANK % device_count``.
- :class:`EmulatedDevice` (``emulated``, for tests): numpy arrays treated as device memory,
  with the same staging buffer and staging calls as the GPU.

**Stream order on the GPU** (NCCL's contract). Each rank's collectives run on the
**communication stream**, a non-blocking CUDA stream of the device's own:

1. at submission, on the calling thread, :meth:`ready` records an event on that thread's
   current stream (the kernels that produced the input);
2. the thread that runs the collective (the caller's, or the communication thread) enters
   :meth:`running`: the device is made current, the communication stream becomes the
   current stream, and it waits for that event; every copy and reduce kernel of the
   collective is queued there;
3. when the collective's last device work is queued, :meth:`done` records the **completion
   event** on the communication stream;
4. :meth:`join` — on return of a synchronous call, or in ``Work.wait()`` — makes the
   *waiting* thread's current stream wait for the completion event, so kernels it queues
   next see the result without the host blocking; ``Work.synchronize()`` blocks the host
   until the event has passed.

Staging a segment out copies it on the communication stream and waits for that copy before
the bytes go to the transport; a received segment is copied in on the same stream, so the
kernel that reduces it follows it.

The transport copies a staged segment (into ZeroMQ's buffer or a lane's slot) before
``send`` returns, so one staging buffer is enough and is free again at once: nothing ever
waits on a send that a dead peer will never complete.

>>> dev = select("emulated", local_rank=0)
>>> host = dev.stage_out(np.arange(4.0))    # a copy in the pinned buffer, ready for the wire
"""
import contextlib
import logging
import os
import threading

import numpy as np

DEVICES = ("auto", "cpu", "gpu", "emulated")
log = logging.getLogger(__name__)


class HostDevice:
    kind = "cpu"
    xp = np
    staged = False

    def is_array(self, x):
        return isinstance(x, np.ndarray)

    def stage_out(self, array):
        """Host bytes to send for ``array`` (flat, contiguous); for a staged device they are
        valid until the next call, so the caller must have them copied before that."""
        return array

    def stage_in(self, host):
        """A device array holding the received host array ``host``."""
        return host

    def activate(self):
        """Make this the current device of the calling thread (before each collective)."""

    # -- stream order (a GPU's; nothing to order on the host) ---------------------------------
    def ready(self):
        """On the submitting thread: what the collective's device work must follow (None)."""
        return None

    def running(self, ready):
        """Context in which the thread that runs a collective queues its device work."""
        self.activate()
        return contextlib.nullcontext()

    def done(self):
        """After the collective's last device work: its completion event (None)."""
        return None

    def join(self, done, synchronize=False):
        """On the waiting thread: order what it does next after ``done`` (see the module)."""


class StagedDevice(HostDevice):
    """Staging through one reused pinned buffer; subclasses move bytes between device and host."""

    staged = True

    def __init__(self, slot_bytes=1 << 20):
        self.slot_bytes = slot_bytes
        self._buffer = self._pinned(slot_bytes)
        self.copies_out = self.copies_in = 0

    def stage_out(self, array):
        nbytes = array.nbytes
        if nbytes > self.slot_bytes:
            raise ValueError(f"segment of {nbytes} bytes exceeds the {self.slot_bytes}-byte staging buffer")
        host = self._buffer[:nbytes].view(array.dtype)
        self._to_host(array, host)
        self.copies_out += 1
        return host

    def stage_in(self, host):
        self.copies_in += 1
        return self._to_device(host)

    # -- what a concrete device provides ----------------------------------------------------
    def _pinned(self, nbytes):
        raise NotImplementedError

    def _to_host(self, array, host):
        raise NotImplementedError

    def _to_device(self, host):
        raise NotImplementedError


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

    def _to_host(self, array, host):
        self._current()
        np.copyto(host, array)

    def _to_device(self, host):
        self._current()
        return np.array(host, copy=True)


class CudaDevice(StagedDevice):
    """CuPy arrays on one GPU; every collective's device work on :attr:`stream` (module
    docstring)."""

    kind = "gpu"

    def __init__(self, local_rank, slot_bytes=1 << 20):
        import cupy
        self.cupy = self.xp = cupy
        self.index = local_rank % cupy.cuda.runtime.getDeviceCount()
        cupy.cuda.Device(self.index).use()
        self.stream = cupy.cuda.Stream(non_blocking=True)  # the communication stream
        super().__init__(slot_bytes)

    def is_array(self, x):
        return isinstance(x, self.cupy.ndarray)

    def _pinned(self, nbytes):
        import cupyx
        return cupyx.empty_pinned(nbytes, np.uint8)

    def _to_host(self, array, host):
        array.get(stream=self.stream, out=host)  # blocking: the bytes are there on return

    def _to_device(self, host):
        out = self.cupy.empty(host.shape, host.dtype)
        out.set(host, stream=self.stream)
        return out

    def ready(self):
        # the submitting thread's stream *of this device*: a thread that never made the
        # device current (a torch completer, a user's thread) still orders the right stream
        return self.cupy.cuda.get_current_stream(self.index).record(self._event())

    @contextlib.contextmanager
    def running(self, ready):
        # the previous current device comes back on exit: the caller's thread is not left
        # switched by a collective it ran inline
        with self.cupy.cuda.Device(self.index), self.stream:
            if ready is not None:
                self.stream.wait_event(ready)
            yield

    def done(self):
        return self.stream.record(self._event())

    def _event(self):
        return self.cupy.cuda.Event(disable_timing=True)  # ordering only: no timestamps

    def join(self, done, synchronize=False):
        if done is None:
            return
        if synchronize:
            done.synchronize()
        else:
            self.cupy.cuda.get_current_stream(self.index).wait_event(done)


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
        return CudaDevice(local_rank, slot_bytes)
    if device == "emulated":
        return EmulatedDevice(slot_bytes)
    return HostDevice()


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
    kernels.scale_cast(src, dst)
