"""A one-way shared-memory channel between two processes of one host: small messages travel
inline, and a side that must wait spins briefly, then sleeps on a futex the other side wakes.

This is the piece the same-host fast path is built from (one channel per ordered pair of
ranks); ZeroMQ stays for start-up, control and other hosts.

Words used here:

- **channel** — a shared mapping of a header and a *ring* of ``capacity`` bytes (a power of
  two), written by one *sender* and read by one *receiver*.
- **record** — one message in the ring: an 8-byte length, then the payload, padded to 8
  bytes. A record never wraps: when it would pass the end of the ring the sender writes a
  *skip* length and starts at 0.
- **head / tail** — bytes ever written / consumed (uint64, never wrap in practice), on their
  own cache lines. The ring holds ``head - tail`` bytes; the sender never lets it exceed
  ``capacity``.
- **bell** — a uint32 futex word per direction of waiting (``data`` rung by the sender after
  publishing, ``room`` rung by the receiver after consuming). A waiter reads the bell, checks
  its condition, and sleeps only while the bell still holds what it read; the ringer bumps it
  and calls ``FUTEX_WAKE`` when the waiter says it may be asleep.

Waiting: spin up to ``spin`` seconds (long when every rank has a core, about zero when ranks
outnumber cores, so that two ranks on one core do not burn each other's time slices), then
sleep in slices of at most ``SLEEP_SLICE`` seconds, calling ``check()`` between slices, so a
peer that died (``check`` raises) or a passed deadline ends the wait within one slice.

Memory ordering: the sender writes the payload, then stores ``head``; the receiver loads
``head``, then reads the payload, then stores ``tail``. x86-64 keeps stores in order and loads
in order, which is all this needs. Weaker models (ARM) would need a release fence before the
``head``/``tail`` stores and an acquire fence after their loads, which Python cannot issue:
on such machines this channel is not used. The "may be asleep" flag is a store followed by a
load on each side (a Dekker pattern), which x86-64 may reorder; a wake-up lost that way costs
one sleep slice, never a hang.

>>> a, b = Channel.pair(1 << 16)          # or Channel.create(path) / Channel.open(path)
>>> a.send(b"hello"); bytes(b.recv(check=lambda: None))
b'hello'
"""
import ctypes
import mmap
import os
import platform
import struct
import time

import numpy as np

from ..errors import CommTimeout

HEADER = 256            # bytes before the ring: four 64-byte lines
SKIP = (1 << 64) - 1    # a record length that says "the rest of the ring is empty, go to 0"
SLEEP_SLICE = 0.002     # the longest one futex sleep lasts before check() runs again
_U64, _U32 = struct.Struct("<Q"), struct.Struct("<I")
# byte offsets in the header: head and tail on lines of their own, then the bells and the
# "may be asleep" flags
_HEAD, _TAIL = 0, 64
_DATA_BELL, _ROOM_BELL = 128, 136
_DATA_SLEEPER, _ROOM_SLEEPER = 192, 200

_FUTEX_WAIT, _FUTEX_WAKE = 0, 1
_SYS_FUTEX = {"x86_64": 202, "aarch64": 98}.get(platform.machine())
_libc = ctypes.CDLL(None, use_errno=True)


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def supported():
    """Whether this machine runs the channel: Linux futexes and x86-64's memory order."""
    return _SYS_FUTEX is not None and platform.machine() == "x86_64"


def default_spin(ranks_on_host):
    """How long a waiter spins before sleeping: 50 µs while every rank has a core of its
    own, none when ranks outnumber the cores this process may run on."""
    cores = len(os.sched_getaffinity(0))
    return 50e-6 if ranks_on_host <= cores else 0.0


class Channel:
    """One end of a channel over ``mapping`` (an ``mmap`` of ``HEADER + capacity`` bytes)."""

    def __init__(self, mapping, capacity, spin=50e-6):
        if capacity & (capacity - 1) or capacity < 64:
            raise ValueError(f"capacity must be a power of two of at least 64 bytes, got {capacity}")
        self._map, self.capacity, self.spin = mapping, capacity, spin
        self._ring = np.frombuffer(mapping, np.uint8, capacity, HEADER)
        self._taken = 0
        base = ctypes.addressof(ctypes.c_char.from_buffer(mapping))
        self._data_bell = ctypes.c_void_p(base + _DATA_BELL)
        self._room_bell = ctypes.c_void_p(base + _ROOM_BELL)

    # -- making one ------------------------------------------------------------------------
    @classmethod
    def create(cls, path, capacity, spin=50e-6):
        """The sender's end: a new file at ``path`` (mode 0600), zeroed."""
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, HEADER + capacity)
            mapping = mmap.mmap(fd, HEADER + capacity)
        finally:
            os.close(fd)
        return cls(mapping, capacity, spin)

    @classmethod
    def open(cls, path, capacity, spin=50e-6):
        """The receiver's end of the channel at ``path``."""
        fd = os.open(path, os.O_RDWR)
        try:
            if os.fstat(fd).st_size != HEADER + capacity:
                raise ValueError(f"{path} is not a channel of {capacity} bytes")
            mapping = mmap.mmap(fd, HEADER + capacity)
        finally:
            os.close(fd)
        return cls(mapping, capacity, spin)

    @classmethod
    def pair(cls, capacity, spin=50e-6):
        """Two ends over one anonymous shared mapping (inherited by a forked child)."""
        mapping = mmap.mmap(-1, HEADER + capacity)
        return cls(mapping, capacity, spin), cls(mapping, capacity, spin)

    # -- sending ---------------------------------------------------------------------------
    def send(self, payload, check=None, deadline=None):
        """Append one message (bytes-like, at most ``capacity // 2`` bytes); waits for room
        while the receiver is behind (see the module docstring)."""
        data = memoryview(payload).cast("B")
        n = data.nbytes
        if n > self.capacity // 2:
            raise ValueError(f"a message of {n} bytes does not fit a channel of {self.capacity}")
        need = 8 + (n + 7) // 8 * 8
        mapping, capacity = self._map, self.capacity
        head = _U64.unpack_from(mapping, _HEAD)[0]
        pos = head % capacity
        skip = capacity - pos if pos + need > capacity else 0
        if head + skip + need - _U64.unpack_from(mapping, _TAIL)[0] > capacity:
            self._wait(lambda: head + skip + need - _U64.unpack_from(mapping, _TAIL)[0] <= capacity,
                       self._room_bell, _ROOM_BELL, _ROOM_SLEEPER, check, deadline, "room in the channel")
        if skip:
            _U64.pack_into(mapping, HEADER + pos, SKIP)
            head, pos = head + skip, 0
        start = HEADER + pos + 8
        mapping[start:start + n] = data
        _U64.pack_into(mapping, HEADER + pos, n)
        _U64.pack_into(mapping, _HEAD, head + need)  # publishes it (stores stay in order on x86-64)
        self._ring_bell(self._data_bell, _DATA_BELL, _DATA_SLEEPER)

    # -- receiving -------------------------------------------------------------------------
    def poll(self):
        """The next message as a read-only uint8 array over the ring (valid until
        :meth:`release`), or None if none has arrived."""
        mapping = self._map
        tail = _U64.unpack_from(mapping, _TAIL)[0]
        if _U64.unpack_from(mapping, _HEAD)[0] == tail:
            return None
        pos = tail % self.capacity
        n = _U64.unpack_from(mapping, HEADER + pos)[0]
        if n == SKIP:
            _U64.pack_into(mapping, _TAIL, tail + self.capacity - pos)
            pos = 0
            n = _U64.unpack_from(mapping, HEADER)[0]
        self._taken = 8 + (n + 7) // 8 * 8
        view = self._ring[pos + 8:pos + 8 + n]
        view.flags.writeable = False
        return view

    def release(self):
        """Free the message :meth:`poll` or :meth:`recv` returned last."""
        mapping = self._map
        _U64.pack_into(mapping, _TAIL, _U64.unpack_from(mapping, _TAIL)[0] + self._taken)
        self._ring_bell(self._room_bell, _ROOM_BELL, _ROOM_SLEEPER)

    def recv(self, check=None, deadline=None):
        """The next message (as :meth:`poll`), waiting for it; ``check()`` runs between
        sleeps and may raise (a lost peer), and passing ``deadline`` (``time.monotonic()``)
        raises :class:`CommTimeout`."""
        message = self.poll()
        if message is None:
            mapping = self._map
            self._wait(lambda: _U64.unpack_from(mapping, _HEAD)[0] != _U64.unpack_from(mapping, _TAIL)[0],
                       self._data_bell, _DATA_BELL, _DATA_SLEEPER, check, deadline, "a message")
            message = self.poll()
        return message

    # -- waiting and waking ----------------------------------------------------------------
    def _wait(self, ready, bell, bell_at, sleeper_at, check, deadline, what):
        if ready():
            return
        mapping = self._map
        stop = time.perf_counter() + self.spin
        while time.perf_counter() < stop:
            if ready():
                return
        while True:
            rung = _U32.unpack_from(mapping, bell_at)[0]
            _U32.pack_into(mapping, sleeper_at, 1)
            if ready():
                _U32.pack_into(mapping, sleeper_at, 0)
                return
            slice_ = SLEEP_SLICE if deadline is None else max(0.0, min(SLEEP_SLICE, deadline - time.monotonic()))
            _futex(bell, _FUTEX_WAIT, rung, slice_)
            _U32.pack_into(mapping, sleeper_at, 0)
            if ready():
                return
            if check is not None:
                check()
            if deadline is not None and time.monotonic() > deadline:
                raise CommTimeout(f"timed out waiting for {what}")

    def _ring_bell(self, bell, bell_at, sleeper_at):
        mapping = self._map
        _U32.pack_into(mapping, bell_at, (_U32.unpack_from(mapping, bell_at)[0] + 1) & 0xFFFFFFFF)
        if _U32.unpack_from(mapping, sleeper_at)[0]:
            _futex(bell, _FUTEX_WAKE, 1, None)

    def close(self):
        self._ring = None
        try:
            self._map.close()
        except BufferError:  # a message view is still alive; the mapping goes with it
            pass


def _futex(address, op, value, timeout):
    ts = None
    if timeout is not None:
        ts = _Timespec(int(timeout), int((timeout % 1) * 1e9))
    _libc.syscall(_SYS_FUTEX, address, op, ctypes.c_uint32(value),
                  ctypes.byref(ts) if ts is not None else None, None, 0)
