"""The GPU a worker owns, through CuPy: :class:`CudaDevice`, the staged device of
:mod:`ringcomm.device.staged` (the stream contract is in :mod:`ringcomm.device`).

**Three streams**, all non-blocking and the device's own, so that a ring step's copy out,
copy in and reduction can run at once on the GPU's two copy engines and its cores:

- the **communication stream** (:attr:`CudaDevice.stream`): the collective's kernels
  (reductions, a strided destination's copy); it is current while a collective runs, and
  its events are the ones callers see (``ready``, ``done``);
- the **out stream**: device -> host copies (segments staged for the wire);
- the **in stream**: host -> device copies (received segments).

They are ordered by events, per buffer where the device can tell which bytes a copy
touches: a copy out waits for the kernels and copies in queued before it (what it reads may
have just been reduced there, or just landed); a copy into landing buffer k waits only for
the kernels that read k's previous segment, so it runs while the other landing buffer's
segment is reduced; a copy into a caller's destination waits for everything queued on the
communication stream (it may have read or written those bytes) and for the copies out in
flight that read them; the communication stream waits for each copy in before its next
kernel, and for the copies out in flight (a kernel after a receive may write what is being
sent: recursive doubling reduces into the buffer it just sent). The events that only order
streams are few and re-recorded (a wait takes the event's state when it is queued); those
the host polls come from a pool.

>>> dev = CudaDevice(local_rank=1)      # GPU 1 % device_count, its three streams made
"""
import collections
import contextlib
import logging

import numpy as np

from .staged import StagedDevice

log = logging.getLogger(__name__)

HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable


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
        self.out_stream = cupy.cuda.Stream(non_blocking=True)  # device -> host copies
        self.in_stream = cupy.cuda.Stream(non_blocking=True)  # host -> device copies
        self._registered = {}  # lane slot address -> registered with CUDA (False: refused)
        self._held = collections.deque()  # (event, received host array) copies in flight
        self._spare = []  # events of finished segment copies, recorded again for the next ones
        self._reading = []  # (first, last byte address, event) of each copy out in flight
        # events that only order streams, re-recorded at each use: the communication
        # stream's progress, a copy in just queued, and per landing buffer the point after
        # the kernels that read its last segment
        self._queued, self._copied_in = self._fresh_event(), self._fresh_event()
        self._free = [self._fresh_event() for _ in range(self.LANDINGS)]
        super().__init__(slot_bytes)

    def _pin(self, window):
        address = window.__array_interface__["data"][0]
        registered = self._registered.get(address)
        if registered is None:
            try:  # portable: page-locked for every context, so any thread may unregister it
                self.cupy.cuda.runtime.hostRegister(address, window.nbytes, HOST_REGISTER_PORTABLE)
                registered = True
            except Exception as exc:  # noqa: BLE001 - a limit on locked memory: copy as before
                log.warning("cannot register a shared-memory slot with CUDA (%s); copies through "
                            "it are not asynchronous", exc)
                registered = False
            self._registered[address] = registered
        return registered

    def _hold(self, host):
        self._held.append((self.in_stream.record(self._event()), host))

    def release(self):
        held = self._held
        while held and held[0][0].done:
            self._spare.append(held.popleft()[0])

    def finished(self, staged):
        if staged.event is not None:
            self._reading = [r for r in self._reading if r[2] is not staged.event]
            self._spare.append(staged.event)
            staged.event = None

    def settle(self):
        with contextlib.suppress(Exception):  # best effort: the original failure is what matters
            for stream in (self.out_stream, self.in_stream, self.stream):
                stream.synchronize()

    def _forget_lanes(self):
        # on the rank's device: every copy into or out of a slot is done before it goes
        with self.cupy.cuda.Device(self.index):
            self.settle()
            self._spare.extend(event for event, _ in self._held)
            self._held.clear()
            for address, registered in self._registered.items():
                if registered:
                    try:
                        self.cupy.cuda.runtime.hostUnregister(address)
                    except Exception as exc:  # noqa: BLE001 - the others must still go
                        log.warning("cannot unregister a shared-memory slot: %s", exc)
        self._registered.clear()

    def is_array(self, x):
        return isinstance(x, self.cupy.ndarray)

    def _pinned(self, nbytes):
        import cupyx
        return cupyx.empty_pinned(nbytes, np.uint8)

    def _device_bytes(self, nbytes):
        return self.cupy.empty(nbytes, np.uint8)

    def _to_host(self, array, host):
        out = self.out_stream
        out.wait_event(self.stream.record(self._queued))  # after what wrote it (module docstring)
        array.get(stream=out, out=host, blocking=False)
        event = out.record(self._event())
        first = array.data.ptr
        self._reading.append((first, first + array.nbytes, event))
        return event

    def _to_device(self, host, out, landing=None):
        copies = self.in_stream
        if landing is None:  # a caller's destination: after every kernel that may touch it
            copies.wait_event(self.stream.record(self._queued))
        else:  # after the kernels that read this buffer's last segment, which are queued by now
            copies.wait_event(self._free[landing])
            self.stream.record(self._free[(landing - 1) % self.LANDINGS])
        first = out.data.ptr
        last = first + out.nbytes
        for start, end, event in self._reading:
            if start < last and first < end:  # a copy out still reads these bytes
                copies.wait_event(event)
        out.set(host, stream=copies)
        self.stream.wait_event(copies.record(self._copied_in))
        for *_, event in self._reading:  # the next kernel may write what is being sent
            self.stream.wait_event(event)

    def ready(self):
        # the submitting thread's stream *of this device*, used with the device current: a
        # default stream's handle means the current device's stream, and an event can only
        # be recorded on its own device's, so a thread that never made the device current
        # (a torch completer, a user's thread) would order another device's work, or fail
        with self.cupy.cuda.Device(self.index):
            return self.cupy.cuda.get_current_stream(self.index).record(self._fresh_event())

    @contextlib.contextmanager
    def running(self, ready):
        # the previous current device comes back on exit: the caller's thread is not left
        # switched by a collective it ran inline
        with self.cupy.cuda.Device(self.index), self.stream:
            self.release()  # the slots of the last call's final copies, done by now
            # copies out of a failed call's segments that were never handed over
            self._reading = [r for r in self._reading if not r[2].done]
            if ready is not None:
                self.stream.wait_event(ready)
            for free in self._free:  # every landing buffer is free after what is queued so far
                self.stream.record(free)
            yield

    def done(self):
        self.release()
        for *_, event in self._reading:  # none once every segment was handed over
            self.stream.wait_event(event)
        return self.stream.record(self._fresh_event())

    def _event(self):
        # a segment copy's event: one that finished before (a stream that waited on it has
        # its wait already; nothing else looks at it again), else a new one
        return self._spare.pop() if self._spare else self._fresh_event()

    def _fresh_event(self):
        # a call's events (ready, done) are the caller's to keep: never reused. Made on the
        # rank's device (an event belongs to the device current when it is made); ordering
        # only: no timestamps
        with self.cupy.cuda.Device(self.index):
            return self.cupy.cuda.Event(disable_timing=True)

    def join(self, done, synchronize=False):
        if done is None:
            return
        if synchronize:
            done.synchronize()
        else:  # with the device current: see ready()
            with self.cupy.cuda.Device(self.index):
                self.cupy.cuda.get_current_stream(self.index).wait_event(done)
