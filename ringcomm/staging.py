"""The segments a collective call has staged but not yet handed to the session: a
:class:`StagingQueue`, one per call on a staged device (see :mod:`ringcomm.device`).

A device segment's copy to the host starts when it is put in the queue; it is handed to the
session once that copy is done — polled as the next segment is staged, so the copy of
segment k+1 runs while segment k goes out — and at the latest before the rank waits for a
message (:meth:`StagingQueue.take`) or the call's body ends (:meth:`StagingQueue.drain`).
No staged segment waits on a receive, so staging cannot deadlock a schedule. The queue
holds at most :attr:`StagedDevice.BUFFERS` segments: their staging buffers are taken in
turn.

>>> queue = StagingQueue(session, device, sig)   # on a rank whose device is staged
>>> queue.put(1, key, segment)      # copy to the host started; handed to rank 1 once done
>>> queue.take(take, 1, other_key, wait=True)      # hands over what is staged, then waits
>>> queue.drain()                   # the call's body ends: every segment handed over
"""
from collections import deque

import numpy as np


class StagingQueue:
    __slots__ = ("session", "device", "sig", "_queue")

    def __init__(self, session, device, sig):
        self.session, self.device, self.sig = session, device, sig
        self._queue = deque()  # (global rank, key, Staged) not yet handed to the session
        device.attach(session)

    def __len__(self):
        return len(self._queue)

    def put(self, dst, key, array):
        """Start staging ``array`` (flat, contiguous, on the device) for global rank ``dst``
        under ``key``; hands over whatever has finished copying meanwhile."""
        queue = self._queue
        if len(queue) == self.device.BUFFERS:  # its staging buffer is the one taken next
            self.hand_over_first()
        # a segment bound for a lane is copied straight into a slot of it, when one is free
        slot = self.session.take_slot(dst, key, array.nbytes)
        try:
            queue.append((dst, key, self.device.stage_out(array, slot)))
        except BaseException:
            if slot is not None:
                self.device.settle()  # a copy queued before the failure lands first
                self.session.give_back_slot(dst, slot[0])
            raise
        while queue and queue[0][2].done():  # poll: the copies that have finished go out
            self.hand_over_first()

    def hand_over_first(self):
        """Hand the oldest staged segment to the session once its copy is done (it leaves
        the queue only then: a failed wait leaves its slot to :meth:`discard`)."""
        dst, key, staged = self._queue[0]
        staged.wait()
        self._queue.popleft()
        self.device.finished(staged)
        host, staged.host = staged.host, None  # no array over a slot outlives its hand-over
        if staged.slot is None:  # the wire copies before send returns: the buffer is free
            self.session.send(dst, key, self.sig, host.view(np.uint8), copy=True)
        else:
            self.session.send_slot(dst, key, self.sig, staged.slot, host.nbytes)

    def take(self, take, src, key, wait):
        """``take(src, key, wait)`` (a receive) while segments are staged: hand over those
        whose copies have finished, take the message if it is here (the other copies go on
        meanwhile), else hand the oldest over, waiting for its copy; once all are out, wait
        as usual. No staged segment waits on the message, and the host never spins on a copy."""
        queue = self._queue
        while queue:
            while queue and queue[0][2].done():
                self.hand_over_first()
            self.session.pump(0)
            payload = take(src, key, wait=False)
            if payload is not None or not wait:
                return payload
            if queue:
                self.hand_over_first()
        return take(src, key, wait)

    @property
    def nbytes(self):
        """Bytes staged but not yet handed over (flow control counts them)."""
        return sum(staged.host.nbytes for _, _, staged in self._queue)

    def drain(self):
        """Hand every staged segment to the session, waiting for its copy."""
        while self._queue:
            self.hand_over_first()

    def discard(self):
        """Drop what is staged (the call failed), giving back the lane slots it holds once
        their copies are done (a copy still landing must not meet the slot's next use)."""
        queue = self._queue
        while queue:
            dst, _, segment = queue.popleft()
            segment.host = None
            if segment.slot is not None:
                try:
                    segment.wait()
                    self.device.finished(segment)
                except BaseException:  # noqa: BLE001 - the device failed: its copy lands nowhere now
                    pass
                self.session.give_back_slot(dst, segment.slot)
