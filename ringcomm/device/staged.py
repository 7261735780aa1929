"""The staging path that the GPU and the emulated device share: :class:`StagedDevice`.

Staging is double-buffered: :meth:`StagedDevice.stage_out` queues a segment's copy to the
host (on a GPU on a copy stream of its own, ordered after the communication stream's work:
see :mod:`ringcomm.device.cuda`) and returns at once with an event; the link hands a
staged segment to the session once its event has passed, polling it as it stages the next
one, so the copy of segment k+1 runs while segment k is handed over. Before the rank waits
for a message, and when a call's body ends, every staged segment is handed over (waiting
for its copy): a segment never waits on a receive, so staging cannot deadlock a schedule.
The wire copies a segment (into ZeroMQ's buffer, a channel or a lane slot) before
``send`` returns, so a staging buffer is free again as soon as its segment is handed over. A
received segment is copied in (on a GPU on the other copy stream) before the kernel that
reduces it runs, and a copy into a landing buffer follows the kernel that read the buffer's
previous segment, while the other buffer's segment may still be being reduced.

**Lane slots** (between ranks of one host, segments large enough for the shared-memory
lanes of :mod:`ringcomm.transport.shm`): the device copies straight into a free slot of
the lane to the peer and the wire announces the slot once the copy is done, and a
received segment is copied to the device straight out of its slot: one copy each way
instead of two. On a GPU each slot is registered with CUDA (``cudaHostRegister``) the
first time it is used, so those copies are asynchronous; a received segment's host array
is then kept until its copy's event has passed, and only then can the slot be
acknowledged and refilled by the sender. A slot taken for a segment that is never sent (the
call failed) is given back. Registrations are undone before the wire unmaps the lanes.

>>> from ringcomm.device import EmulatedDevice
>>> dev = EmulatedDevice(); dev.activate()
>>> staged = dev.stage_out(np.arange(4.0))  # a copy into a pinned buffer, started
>>> staged.wait(); wire = staged.host        # ... finished: the bytes for the wire
"""

from .host import HostDevice


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
    BUFFERS = 2  # copy k+1 to the host while segment k is handed to the session
    LANDINGS = 2  # copy segment k+1 in while segment k is reduced

    def __init__(self, slot_bytes=1 << 20):
        self.slot_bytes = slot_bytes
        self._buffers = [self._pinned(slot_bytes) for _ in range(self.BUFFERS)]
        self._next = 0
        # the device buffers a segment without a destination lands in, taken in turn (a
        # copy into one may run while the kernel that reads the other's segment does)
        self._landings = [None] * self.LANDINGS
        self._landed = 0  # how many segments have landed in them
        self._session = None  # whose lane slots this device copies through (see attach)
        self.copies_out = self.copies_in = 0
        self.slot_copies = 0  # copies straight between the device and a lane slot

    def attach(self, session):
        """Copy through ``session``'s lane slots from now on; what the device did to their
        memory (registering it) is undone before the wire unmaps it."""
        if self._session is not session:
            self._session = session
            session.before_unmap.append(self._forget_lanes)

    def stage_out(self, array, slot=None):
        """Start copying ``array`` (flat, contiguous, on the device) into the lane slot
        ``slot`` (``(slot, uint8 array over it)``, from the session's ``take_slot``) or
        else the next staging buffer; returns its :class:`Staged`. Buffers are taken in
        turn, so the caller must have handed the segment staged :attr:`BUFFERS` calls ago to
        the session (which copies it) before staging another."""
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
        ``host`` lies in (the session's ``slot_of``); a copy from a registered slot runs
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
        """Undo :meth:`_pin` for every lane slot (before the wire unmaps them)."""

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
