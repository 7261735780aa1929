"""Same-host fast path: segments travel through shared memory, only their notices through ZeroMQ.

Over ``ipc://`` a ZeroMQ message is copied four times (into ZeroMQ, into the kernel, out of
the kernel, and by the receiver's reduction) and handed between two I/O threads. Between
ranks on one host a *lane* carries the bytes instead, the way NCCL's and Open MPI's shared
memory transports do: the sender copies a segment into a *slot* of the lane once, and the
receiver reduces straight out of it.

Words used here:

- **lane** — one direction between two ranks on a host: a file in ``/dev/shm`` created by
  the sender (mode 0600, random name), mapped by both. Page 0 holds the *ack table*, one
  uint64 per slot; then come ``nslots`` slots of ``slot_bytes`` each.
- **slot** — room for one segment. Its *generation* counts how often the sender filled it.
- **notice** — the ZeroMQ message (kind ``SHM``) that replaces a DATA message: the usual
  header, then a :data:`NOTICE` naming the lane file, slot and generation.

A slot is free when the ack table holds its current generation. The receiver writes it when
the last array over the slot is garbage (``weakref.finalize``), so an algorithm that reduces
and forgets a segment frees its slot at once, and one that keeps it holds the slot. A sender
that finds no free slot sends the segment through ZeroMQ as usual: it never waits for a
receiver, so two ranks that each wait on the other's slots cannot deadlock.

Ordering: the sender's copy into a slot happens before its notice is sent (a system call),
and the receiver's last read of a slot before its ack store; the ack is read by the sender
before it refills the slot. The receiver unlinks the file as soon as it has mapped it, so a
killed job leaves nothing in ``/dev/shm``; the sender unlinks the ones never opened at close.

>>> # rank 0 → rank 1 on one host, a 1 MiB segment:
>>> notice = out_lane.put(segment)        # rank 0: None if every slot is still in use
>>> array = in_lanes.take(0, notice, n)   # rank 1: read-only uint8 array over the slot
"""
import ctypes
import mmap
import os
import re
import secrets
import struct
import weakref

import numpy as np

from ..errors import FrameError
from .frame import SHM_NOTICE_BYTES

SHM_DIR = "/dev/shm"
NOTICE = struct.Struct("<IIQ48s")  # slot, pad, generation, lane file name
assert NOTICE.size == SHM_NOTICE_BYTES
_NAME = re.compile(r"ringcomm-[0-9a-f]{32}")
_PAGE = mmap.PAGESIZE


def _layout(nslots, slot_bytes):
    slot_bytes = -(-slot_bytes // _PAGE) * _PAGE
    ack_bytes = -(-nslots * 8 // _PAGE) * _PAGE
    return slot_bytes, ack_bytes, ack_bytes + nslots * slot_bytes


class OutLane:
    """The sending end of a lane to one peer (created on the first segment sent there)."""

    def __init__(self, nslots, slot_bytes, directory=SHM_DIR):
        self.name = f"ringcomm-{secrets.token_hex(16)}"
        self.path = os.path.join(directory, self.name)
        self.slot_bytes, ack_bytes, total = _layout(nslots, slot_bytes)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            # reserve the pages now: a full tmpfs must fail here, not SIGBUS on first write
            os.posix_fallocate(fd, 0, total)
            self._map = mmap.mmap(fd, total)
        except BaseException:
            os.unlink(self.path)
            raise
        finally:
            os.close(fd)
        self._ack = np.frombuffer(self._map, np.uint64, nslots)
        self._slots = np.frombuffer(self._map, np.uint8, nslots * self.slot_bytes, ack_bytes)
        self._generation = [0] * nslots
        self._next = 0
        self.fallbacks = 0  # segments that found no free slot

    def put(self, payload):
        """Copy ``payload`` into a free slot; the notice to send, or ``None`` if none is free."""
        data = np.frombuffer(payload, np.uint8)
        nslots = len(self._generation)
        for i in range(nslots):
            slot = (self._next + i) % nslots
            if self._ack[slot] == self._generation[slot]:
                break
        else:
            self.fallbacks += 1
            return None
        self._next = (slot + 1) % nslots
        self._generation[slot] += 1
        start = slot * self.slot_bytes
        self._slots[start:start + data.size] = data
        return NOTICE.pack(slot, 0, self._generation[slot], self.name.encode())

    def close(self):
        try:
            os.unlink(self.path)  # only still there if the peer never opened it
        except FileNotFoundError:
            pass


class InLanes:
    """The receiving ends of every lane into this rank, opened on their first notice."""

    def __init__(self, nslots, slot_bytes, directory=SHM_DIR):
        self.nslots, self.directory = nslots, directory
        self.slot_bytes, self._ack_bytes, self._total = _layout(nslots, slot_bytes)
        self._lanes = {}  # (src, name) -> (ack table, mapping)

    def take(self, src, notice, nbytes):
        """A read-only uint8 array over the segment that ``notice`` from ``src`` names.

        The slot is acknowledged when that array (and every view of it) is garbage.
        Raises :class:`FrameError` for a notice that names no valid lane or slot.
        """
        if len(notice) != NOTICE.size:
            raise FrameError(f"shared-memory notice of {len(notice)} bytes, expected {NOTICE.size}")
        slot, _, generation, raw = NOTICE.unpack(notice)
        name = raw.rstrip(b"\0").decode("ascii", "replace")
        if not _NAME.fullmatch(name) or slot >= self.nslots or nbytes > self.slot_bytes:
            raise FrameError(f"bad shared-memory notice from rank {src} (lane {name!r}, slot {slot}, "
                             f"{nbytes} bytes)")
        ack, mapped = self._lanes.get((src, name)) or self._open(src, name)
        # numpy collapses views to the array that owns the memory, so a finalizer on a
        # numpy view would fire early; a ctypes window stays the base of every array over it
        window = (ctypes.c_char * nbytes).from_buffer(mapped, self._ack_bytes + slot * self.slot_bytes)
        weakref.finalize(window, ack.__setitem__, slot, generation)
        view = np.frombuffer(window, np.uint8)
        view.flags.writeable = False
        return view

    def _open(self, src, name):
        path = os.path.join(self.directory, name)
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError as exc:
            raise FrameError(f"rank {src} named shared memory {path} that cannot be opened: {exc}") from None
        try:
            if os.fstat(fd).st_size != self._total:
                raise FrameError(f"shared memory {path} from rank {src} has the wrong size")
            mapped = mmap.mmap(fd, self._total)
        finally:
            os.close(fd)
            os.unlink(path)  # both ends hold the mapping; the name is no longer needed
        lane = (np.frombuffer(mapped, np.uint64, self.nslots), mapped)
        self._lanes[(src, name)] = lane
        return lane
