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
- :class:`~ringcomm.cuda.CudaDevice` (``gpu``, in :mod:`ringcomm.cuda`): CuPy arrays on GPU
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
   queued there, and its copies on two copy streams ordered after it (:mod:`ringcomm.cuda`);
3. when the collective's last device work is queued, :meth:`done` records the **completion
   event** on the communication stream, which has waited for every copy that lands on the
   device;
4. :meth:`join` — on return of a synchronous call, or in ``Work.wait()`` — makes the
   *waiting* thread's current stream wait for the completion event, so kernels it queues
   next see the result without the host blocking; ``Work.synchronize()`` blocks the host
   until the event has passed.

Staging is double-buffered: :meth:`StagedDevice.stage_out` queues a segment's copy to the
host (on a GPU on a copy stream of its own, ordered after the communication stream's work:
see :mod:`ringcomm.cuda`) and returns at once with an event; the link hands a
staged segment to the transport once its event has passed, polling it as it stages the next
one, so the copy of segment k+1 runs while segment k is handed over. Before the rank waits
for a message, and when a call's body ends, every staged segment is handed over (waiting
for its copy): a segment never waits on a receive, so staging cannot deadlock a schedule.
The transport copies a segment (into ZeroMQ's buffer, a channel or a lane slot) before
``send`` returns, so a staging buffer is free again as soon as its segment is handed over. A
received segment is copied in (on a GPU on the other copy stream) before the kernel that
reduces it runs, and a copy into a landing buffer follows the kernel that read the buffer's
previous segment, while the other buffer's segment may still be being reduced.

**Lane slots** (between ranks of one host, segments large enough for the shared-memory
lanes of :mod:`ringcomm.transport.shm`): the device copies straight into a free slot of
the lane to the peer and the transport announces the slot once the copy is done, and a
received segment is copied to the device straight out of its slot: one copy each way
instead of two. On a GPU each slot is registered with CUDA (``cudaHostRegister``) the
first time it is used, so those copies are asynchronous; a received segment's host array
is then kept until its copy's event has passed, and only then can the slot be
acknowledged and refilled by the sender. A slot taken for a segment that is never sent (the
call failed) is given back. Registrations are undone before the transport unmaps the lanes.

>>> dev = select("emulated", local_rank=0)
>>> dev.activate()
>>> staged = dev.stage_out(np.arange(4.0))  # a copy into a pinned buffer, started
>>> staged.wait(); wire = staged.host        # ... finished: the bytes for the transport
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


class Staged:
    """A segment on its way to the wire: ``host`` (its bytes in a staging buffer, or in the
    lane slot ``slot`` when one was given) is valid once the copy has finished (``done()``
    polls, ``wait()`` blocks)."""

    __slots__ = ("host", "event", "slot")

    def __init__(self, host, event=None, slot=None):
        self.host, self.event, self.slot = host, event, slot

    def done(self):
        return self.event is None or self.event.done

    def wait(self):
        if self.event is not None:
            self.event.synchronize()


class StagedDevice(HostDevice):
    """Staging through :attr:`BUFFERS` reused pinned buffers, and received segments landing
    in their destination or one of two reused device buffers; subclasses move the bytes."""

    staged = True
    BUFFERS = 2  # copy k+1 to the host while segment k is handed to the transport
    LANDINGS = 2  # copy segment k+1 in while segment k is reduced

    def __init__(self, slot_bytes=1 << 20):
        self.slot_bytes = slot_bytes
        self._buffers = [self._pinned(slot_bytes) for _ in range(self.BUFFERS)]
        self._next = 0
        # the device buffers a segment without a destination lands in, taken in turn (a
        # copy into one may run while the kernel that reads the other's segment does)
        self._landings = [None] * self.LANDINGS
        self._landed = 0  # how many segments have landed in them
        self._transport = None  # whose lane slots this device copies through (see attach)
        self.copies_out = self.copies_in = 0
        self.slot_copies = 0  # copies straight between the device and a lane slot

    def attach(self, transport):
        """Copy through ``transport``'s lane slots from now on; what the device did to their
        memory (registering it) is undone before the transport unmaps it."""
        if self._transport is not transport:
            self._transport = transport
            transport.before_unmap.append(self._forget_lanes)

    def stage_out(self, array, slot=None):
        """Start copying ``array`` (flat, contiguous, on the device) into the lane slot
        ``slot`` (``(slot, uint8 array over it)``, from the transport's ``take_slot``) or
        else the next staging buffer; returns its :class:`Staged`. Buffers are taken in
        turn, so the caller must have handed the segment staged :attr:`BUFFERS` calls ago to
        the transport (which copies it) before staging another."""
        self.release()
        nbytes = array.nbytes
        number, window = slot or (None, self._buffers[self._next])
        if slot is not None:
            self._pin(window)
        elif nbytes > self.slot_bytes:
            raise ValueError(f"segment of {nbytes} bytes exceeds the {self.slot_bytes}-byte staging buffer")
        host = window[:nbytes].view(array.dtype)
        staged = Staged(host, self._to_host(array, host), number)
        if slot is None:
            self._next = (self._next + 1) % self.BUFFERS
        self.slot_copies += slot is not None
        self.copies_out += 1
        return staged

    def stage_in(self, host, into=None, slot=None):
        """The received host array ``host`` on the device: copied into ``into`` (a device
        array of its shape and dtype), or else into a landing buffer, which a later
        ``stage_in`` overwrites: queue what uses what it returns before receiving again (the
        device reads it in stream order, before a copy lands there again). ``slot``: the lane slot
        ``host`` lies in (the transport's ``slot_of``); a copy from a registered slot runs
        asynchronously, so ``host`` is kept (and the slot unacknowledged) until it is done."""
        self.copies_in += 1
        self.release()
        pinned = slot is not None and self._pin(slot)
        self.slot_copies += slot is not None
        try:
            return self._copy_in(host, into)
        finally:
            if pinned:  # whatever happened after the copy was queued, it reads ``host``
                try:
                    self._hold(host)
                except BaseException:
                    self.settle()
                    raise

    def _copy_in(self, host, into):
        if into is None or not into.flags.c_contiguous:
            turn = self._landed % self.LANDINGS
            self._landed += 1
            landing = self._landings[turn]
            if landing is None or landing.nbytes < host.nbytes:
                landing = self._landings[turn] = self._device_bytes(max(host.nbytes, self.slot_bytes))
            target = landing[:host.nbytes].view(host.dtype)
            self._to_device(host, target, turn)
            if into is None:
                return target
            into[...] = target  # a strided destination: one copy on the device
            return into
        self._to_device(host, into)
        return into

    # -- what a concrete device provides ----------------------------------------------------
    def _pin(self, window):
        """Make host memory the device copies through directly (a lane slot) page-locked;
        True when copies from it run asynchronously."""
        return False

    def _hold(self, host):
        """Keep ``host`` alive until the copy just queued from it is done."""

    def finished(self, staged):
        """``staged`` (from :meth:`stage_out`) is done and will not be looked at again: a
        device may reuse what it holds (its event)."""

    def settle(self):
        """Best effort, after a failure: wait until the device's queued copies are done."""

    def release(self):
        """Let go of the received host arrays whose copies are done (their lane slots are
        acknowledged when nothing else refers to them); called as calls end and segments
        cross, so a slot is held no longer than its copy and the next call."""

    def _forget_lanes(self):
        """Undo :meth:`_pin` for every lane slot (before the transport unmaps them)."""

    def _pinned(self, nbytes):
        raise NotImplementedError

    def _device_bytes(self, nbytes):
        raise NotImplementedError

    def _to_host(self, array, host):
        """Start the copy; returns an event to poll, or None when the bytes are there."""
        raise NotImplementedError

    def _to_device(self, host, out, landing=None):
        """Copy ``host`` into ``out``: a caller's destination, or a view of landing buffer
        number ``landing``. The kernels queued next read what it copied."""
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

    def _device_bytes(self, nbytes):
        return np.empty(nbytes, np.uint8)

    def _to_host(self, array, host):
        self._current()
        np.copyto(host, array)

    def _to_device(self, host, out, landing=None):
        self._current()
        np.copyto(out, host)


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
        from .cuda import CudaDevice
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
    kernels.cast_to_half(src, dst)
