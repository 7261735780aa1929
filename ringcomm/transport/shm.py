"""Same-host fast path for large segments: they travel through shared memory, only their
notices as messages (through the peer's channel, :mod:`.channel`, or ZeroMQ).

Over ``ipc://`` a ZeroMQ message is copied four times (into ZeroMQ, into the kernel, out of
the kernel, and by the receiver's reduction) and handed between two I/O threads. Between
ranks on one host a *lane* carries the bytes instead, the way NCCL's and Open MPI's shared
memory transports do: the sender copies a segment into a *slot* of the lane once, and the
receiver reduces straight out of it. A device segment (see ringcomm.device) is copied by
the device itself: the sender takes a free slot (:meth:`OutLane.take_slot`), its device
copies into it, and the notice (:meth:`OutLane.notice`) goes out once that copy is done; a
slot taken for a segment that is never sent is given back (:meth:`OutLane.give_back`, the
one ack the sender writes). The receiver's device copies out of the slot, which it keeps
(and so leaves unacknowledged) until that copy is done.

Words used here:

- **lane** — one direction between two ranks that share ``/dev/shm``: a file there named
  ``ringcomm-<token>-<src>-<dst>`` (the sender's random token comes from the signed
  rendezvous table; mode 0600), created by the sender, mapped by both. Page 0 holds the
  *ack table*, one uint64 per slot; then come ``nslots`` slots of ``slot_bytes`` each.
- **slot** — room for one segment. Its *generation* counts how often the sender filled it.
  Its pages are reserved (``posix_fallocate``) when first used, so an idle lane costs one
  page and a full tmpfs fails a reservation (that segment then goes through ZeroMQ) instead
  of killing the process with SIGBUS on a write.
- **notice** — the message (kind ``SHM``) that replaces a DATA message: the usual
  header, then a :data:`NOTICE` of slot and generation.

Lanes are opened at start-up (:meth:`~.zmq_transport.ZmqTransport.open_lanes`): every
sender creates its lanes and says so with a LANE message, and every receiver maps and at
once unlinks the lanes into it, so no name from the network is ever opened and nothing
stays in ``/dev/shm`` once a job has started; a sender unlinks what was never opened when
it closes.

A slot is free when the ack table holds its current generation. The receiver writes it when
the last array over the slot is garbage (``weakref.finalize`` on a ctypes window, which every
numpy view keeps alive), so an algorithm that reduces and forgets a segment frees its slot
at once, and one that keeps it holds the slot. A sender that finds no free slot sends the
segment through ZeroMQ as usual: it never waits for a receiver, so ranks that wait on each
other's slots cannot deadlock.

Ordering: the sender's copy into a slot happens before its notice is published (a later
store into the channel, or a system call; for a device's copy, a wait for its event);
the receiver's reads of a slot happen before its ack store, and the sender reads the ack
before refilling the slot. x86-64 keeps stores behind earlier loads; weaker memory models
(ARM) would want a fence before the ack store, which Python does not offer.

>>> # rank 0 → rank 1 on one host, a 1 MiB segment:
>>> notice = out_lane.put(segment)        # rank 0: None if every slot is still in use
>>> array = in_lanes.take(0, notice, n)   # rank 1: read-only uint8 array over the slot
"""
import contextlib
import ctypes
import mmap
import os
import re
import secrets
import stat
import struct
import time
import weakref

import numpy as np

from ..errors import FrameError
from .frame import SHM_NOTICE_BYTES

SHM_DIR = "/dev/shm"
NOTICE = struct.Struct("<IIQ")  # slot, pad, generation
assert NOTICE.size == SHM_NOTICE_BYTES
_TOKEN = re.compile(r"[0-9a-f]{32}")
_PAGE = mmap.PAGESIZE


def new_token():
    return secrets.token_hex(16)


def identity(directory=SHM_DIR):
    """Says which ``/dev/shm`` this process sees, and as whom: ranks with equal identities can
    share lanes (a container may share ``/tmp`` with the host but not ``/dev/shm``)."""
    st = os.stat(directory)
    return f"{st.st_dev}:{st.st_ino}:{os.geteuid()}"


def lane_path(directory, token, src, dst):
    if not _TOKEN.fullmatch(token):
        raise ValueError(f"not a lane token: {token!r}")
    return os.path.join(directory, f"ringcomm-{token}-{src}-{dst}")


def _layout(nslots, slot_bytes):
    slot_bytes = -(-slot_bytes // _PAGE) * _PAGE
    ack_bytes = -(-nslots * 8 // _PAGE) * _PAGE
    return slot_bytes, ack_bytes, ack_bytes + nslots * slot_bytes


class OutLane:
    """The sending end of a lane to one peer."""

    def __init__(self, path, nslots, slot_bytes):
        self.path = path
        self.slot_bytes, self._ack_bytes, total = _layout(nslots, slot_bytes)
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            os.ftruncate(self._fd, total)  # sparse: slots take memory when first reserved
            os.posix_fallocate(self._fd, 0, self._ack_bytes)  # even a read of a hole allocates
            self._map = mmap.mmap(self._fd, total)
        except BaseException:
            os.close(self._fd)
            os.unlink(path)
            raise
        self._ack = np.frombuffer(self._map, np.uint64, nslots)
        self._slots = np.frombuffer(self._map, np.uint8, nslots * self.slot_bytes, self._ack_bytes)
        self._generation = [0] * nslots
        self._reserved = [False] * nslots
        self._no_space_until = 0.0  # after a failed reservation, do not retry at once
        self.fallbacks = 0  # segments that found no free slot
        self.puts = 0       # segments that went through the lane

    def put(self, payload):
        """Copy ``payload`` into a free slot; the notice to send, or ``None`` if none is free."""
        data = np.frombuffer(payload, np.uint8)
        taken = self.take_slot()
        if taken is None:
            return None
        slot, window = taken
        window[:data.size] = data
        return self.notice(slot)

    def take_slot(self):
        """A free slot, now in use: ``(slot, writable uint8 array over all of it)``, or
        ``None`` when none is free. The segment written there goes with :meth:`notice`, or
        the slot is given back with :meth:`give_back`."""
        # the lowest free slot, not the next in turn: a slot used a moment ago is still in
        # the shared cache for both ends (4 MiB all-reduce at N=2: put 2x faster)
        for slot in range(len(self._generation)):
            if self._ack[slot] == self._generation[slot]:
                break
        else:
            self.fallbacks += 1
            return None
        if not self._reserved[slot]:
            # a failing reservation on a full tmpfs first fills what is left, then gives it
            # back: costly, so after one, segments go through ZeroMQ for a second
            if time.monotonic() < self._no_space_until:
                self.fallbacks += 1
                return None
            try:
                os.posix_fallocate(self._fd, self._ack_bytes + slot * self.slot_bytes, self.slot_bytes)
            except OSError:  # /dev/shm is full: this segment goes through ZeroMQ
                self._no_space_until = time.monotonic() + 1.0
                self.fallbacks += 1
                return None
            self._reserved[slot] = True
        self._generation[slot] += 1  # in use until the receiver acknowledges this generation
        start = slot * self.slot_bytes
        return slot, self._slots[start:start + self.slot_bytes]

    def notice(self, slot):
        """The notice for the segment just written into ``slot`` (taken with :meth:`take_slot`)."""
        self.puts += 1
        return NOTICE.pack(slot, 0, self._generation[slot])

    def give_back(self, slot):
        """Free ``slot``, taken but never announced (the receiver will not acknowledge it)."""
        self._ack[slot] = self._generation[slot]

    def close(self):
        """Unlink the file if the peer never opened it, and give the memory back."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        del self._ack, self._slots
        try:
            self._map.close()
        except BufferError:  # an array over a slot is still alive; the GC unmaps it
            pass
        finally:
            os.close(self._fd)


class InLanes:
    """The receiving ends of every lane into this rank."""

    def __init__(self, nslots, slot_bytes):
        self.nslots = nslots
        self.slot_bytes, self._ack_bytes, self._total = _layout(nslots, slot_bytes)
        self._lanes = {}  # src -> (ack table, mapping)
        self._slots_at = {}  # src -> address of its lane's first slot (see slot_of)

    def open(self, src, path):
        """Map the lane from rank ``src`` at ``path`` and unlink its name. Raises ``OSError``
        or ``ValueError`` when it cannot be used."""
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
                raise ValueError(f"{path} is not a private regular file of this user")
            if st.st_size != self._total:
                raise ValueError(f"{path} has {st.st_size} bytes, expected {self._total} "
                                 f"(do the ranks agree on the segment size?)")
            mapped = mmap.mmap(fd, self._total)
        finally:
            os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # both ends hold the mapping; the name is no longer needed
        ack = np.frombuffer(mapped, np.uint64, self.nslots)  # at the start of the mapping
        self._lanes[src] = (ack, mapped)
        self._slots_at[src] = ack.__array_interface__["data"][0] + self._ack_bytes

    def take(self, src, notice, nbytes):
        """A read-only uint8 array over the segment that ``notice`` from ``src`` names.

        The slot is acknowledged when that array (and every view of it) is garbage.
        Raises :class:`FrameError` for a notice that names no open lane or no valid slot.
        """
        if len(notice) != NOTICE.size:
            raise FrameError(f"shared-memory notice of {len(notice)} bytes, expected {NOTICE.size}")
        slot, _, generation = NOTICE.unpack(notice)
        lane = self._lanes.get(src)
        if lane is None or slot >= self.nslots or nbytes > self.slot_bytes:
            raise FrameError(f"bad shared-memory notice from rank {src} (slot {slot}, {nbytes} bytes"
                             f"{'' if lane else ', no lane from that rank'})")
        ack, mapped = lane
        # numpy collapses views to the array that owns the memory, so a finalizer on a
        # numpy view would fire early; a ctypes window stays the base of every array over it
        window = (ctypes.c_char * nbytes).from_buffer(mapped, self._ack_bytes + slot * self.slot_bytes)
        # not at interpreter exit, and never in a forked child: only the process that took
        # the slot may say it is done with it
        weakref.finalize(window, _acknowledge, ack, slot, generation, os.getpid()).atexit = False
        view = np.frombuffer(window, np.uint8)
        view.flags.writeable = False
        return view

    def slot_of(self, array):
        """The whole slot (a read-only uint8 array) that ``array``, taken from a lane, lies
        in; ``None`` for memory outside the lanes."""
        address = array.__array_interface__["data"][0]
        for src, first in self._slots_at.items():
            offset = address - first
            if 0 <= offset < self.nslots * self.slot_bytes:
                start = self._ack_bytes + offset // self.slot_bytes * self.slot_bytes
                slot = np.frombuffer(self._lanes[src][1], np.uint8, self.slot_bytes, start)
                slot.flags.writeable = False
                return slot
        return None

    def close(self):
        mappings = [mapped for _, mapped in self._lanes.values()]
        self._lanes.clear()
        self._slots_at.clear()  # drops the ack tables over the mappings
        for mapped in mappings:
            # an array over a slot is still alive; the GC unmaps it
            with contextlib.suppress(BufferError):
                mapped.close()


def _acknowledge(ack, slot, generation, pid):
    if os.getpid() == pid:
        ack[slot] = generation
