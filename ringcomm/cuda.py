"""The GPU a worker owns, through CuPy: :class:`CudaDevice`, the staged device of
:mod:`ringcomm.device` whose copies and kernels run on a CUDA stream of its own (the stream
contract and the staging are described there).

>>> dev = CudaDevice(local_rank=1)      # GPU 1 % device_count, its communication stream made
"""
import collections
import contextlib

import numpy as np

from .device import StagedDevice, log

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
        self._registered = {}  # lane slot address -> registered with CUDA (False: refused)
        self._held = collections.deque()  # (event, received host array) copies in flight
        self._spare = []  # events of finished segment copies, recorded again for the next ones
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
        self._held.append((self.stream.record(self._event()), host))

    def release(self):
        held = self._held
        while held and held[0][0].done:
            self._spare.append(held.popleft()[0])

    def finished(self, staged):
        if staged.event is not None:
            self._spare.append(staged.event)
            staged.event = None

    def settle(self):
        with contextlib.suppress(Exception):  # best effort: the original failure is what matters
            self.stream.synchronize()

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
        array.get(stream=self.stream, out=host, blocking=False)
        return self.stream.record(self._event())

    def _to_device(self, host, out):
        out.set(host, stream=self.stream)

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
            if ready is not None:
                self.stream.wait_event(ready)
            yield

    def done(self):
        self.release()
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
