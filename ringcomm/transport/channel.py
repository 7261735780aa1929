"""A one-way shared-memory channel between two processes of one host: small messages travel
inline, and a side that must wait spins briefly, then sleeps on a futex the other side wakes.

The transport keeps one channel per ordered pair of ranks on a host (:class:`PeerChannels`)
and sends every small message and lane notice through it; ZeroMQ stays for start-up,
goodbyes, doorbells and other hosts.

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
load on each side (a Dekker pattern), which x86-64 may reorder, so both sides put a
:func:`fence` between them; were a wake-up lost anyway, it would cost one sleep slice, never
a hang.

>>> a, b = Channel.pair(1 << 16)          # or Channel.create(path) / Channel.open(path)
>>> a.send(b"hello"); bytes(b.recv(check=lambda: None))
b'hello'
"""
import ctypes
import mmap
import os
import platform
import stat
import struct
import time

import numpy as np

from ..errors import CommTimeout, FrameError

HEADER = 256            # bytes before the ring: four 64-byte lines
SKIP = (1 << 64) - 1    # a record length that says "the rest of the ring is empty, go to 0"
SLEEP_SLICE = 0.002     # the longest one futex sleep lasts before check() runs again
CAPACITY = 1 << 20      # ring bytes of a transport's channel to one peer
YIELD_BUDGET = 200e-6   # how long a waiter on an oversubscribed host yields before sleeping
# a record's length word (written before the record is published: no reader races it)
_LEN = struct.Struct("@Q")
# head, tail, bells and flags are read and written as ctypes words: one aligned load or store
# each, which another process never sees half done (struct's pack_into zeroes its target
# before writing, and a reader can see that zero)
# byte offsets in the header: head and tail on lines of their own, then the bells and the
# "may be asleep" flags
_HEAD, _TAIL = 0, 64
_DATA_BELL, _ROOM_BELL = 128, 136
_DATA_SLEEPER, _ROOM_SLEEPER = 192, 200
_OUTSIDE_SLEEPER = 208  # the receiver sleeps outside the channel (see doze)

_FUTEX_WAIT, _FUTEX_WAKE = 0, 1
_SYS_FUTEX = {"x86_64": 202, "aarch64": 98}.get(platform.machine())
_libc = ctypes.CDLL(None, use_errno=True)


_fence_lock = ctypes.c_int(0)
_libc.pthread_spin_init(ctypes.byref(_fence_lock), 0)
_fence_ref = ctypes.byref(_fence_lock)


def fence():
    """A full memory barrier (a locked instruction inside a spin lock; about 0.3 µs through
    ctypes): a store before it is visible before any load after it."""
    _libc.pthread_spin_lock(_fence_ref)
    _libc.pthread_spin_unlock(_fence_ref)


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
        self.largest = capacity // 2 - 8  # a record this long fits wherever the ring stands
        self._ring = np.frombuffer(mapping, np.uint8, capacity, HEADER)
        self._taken = 0
        self._head = ctypes.c_uint64.from_buffer(mapping, _HEAD)
        self._tail = ctypes.c_uint64.from_buffer(mapping, _TAIL)
        self._word = {at: ctypes.c_uint32.from_buffer(mapping, at)
                      for at in (_DATA_BELL, _ROOM_BELL, _DATA_SLEEPER, _ROOM_SLEEPER, _OUTSIDE_SLEEPER)}
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
            # pages reserved now: a full /dev/shm fails here, not with SIGBUS on a write
            os.posix_fallocate(fd, 0, HEADER + capacity)
            mapping = mmap.mmap(fd, HEADER + capacity)
        except BaseException:
            os.unlink(path)
            raise
        finally:
            os.close(fd)
        return cls(mapping, capacity, spin)

    @classmethod
    def open(cls, path, capacity, spin=50e-6):
        """The receiver's end of the channel at ``path``: a private regular file of this user,
        unlinked once mapped (both ends hold the mapping; nothing stays behind)."""
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
                raise ValueError(f"{path} is not a private regular file of this user")
            if st.st_size != HEADER + capacity:
                raise ValueError(f"{path} is not a channel of {capacity} bytes")
            mapping = mmap.mmap(fd, HEADER + capacity)
        finally:
            os.close(fd)
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        return cls(mapping, capacity, spin)

    @classmethod
    def pair(cls, capacity, spin=50e-6):
        """Two ends over one anonymous shared mapping (inherited by a forked child)."""
        mapping = mmap.mmap(-1, HEADER + capacity)
        return cls(mapping, capacity, spin), cls(mapping, capacity, spin)

    # -- sending ---------------------------------------------------------------------------
    def send(self, *parts, check=None, deadline=None):
        """Append one message made of ``parts`` (bytes-like, together at most
        ``capacity // 2`` bytes); waits for room while the receiver is behind."""
        if not self._put(parts, wait=True, check=check, deadline=deadline):
            raise AssertionError("unreachable: a waiting put always succeeds or raises")

    def try_send(self, *parts):
        """Like :meth:`send`, but returns False at once instead of waiting for room."""
        return self._put(parts, wait=False)

    def _put(self, parts, wait, check=None, deadline=None):
        views = [memoryview(part).cast("B") for part in parts]
        n = sum(view.nbytes for view in views)
        if n > self.largest:
            raise ValueError(f"a message of {n} bytes does not fit a channel of {self.capacity} "
                             f"(at most {self.largest})")
        need = 8 + (n + 7) // 8 * 8
        mapping, capacity = self._map, self.capacity
        head = self._head.value
        pos = head % capacity
        skip = capacity - pos if pos + need > capacity else 0
        if head + skip + need - self._tail.value > capacity:
            if not wait:
                return False
            self._wait(lambda: head + skip + need - self._tail.value <= capacity,
                       self._room_bell, _ROOM_BELL, _ROOM_SLEEPER, check, deadline, "room in the channel")
        if skip:
            _LEN.pack_into(mapping, HEADER + pos, SKIP)
            head, pos = head + skip, 0
        start = HEADER + pos + 8
        for view in views:
            mapping[start:start + view.nbytes] = view
            start += view.nbytes
        _LEN.pack_into(mapping, HEADER + pos, n)
        self._head.value = head + need  # publishes it (stores stay in order on x86-64)
        self._ring_bell(self._data_bell, _DATA_BELL, _DATA_SLEEPER)
        return True

    def receiver_dozing(self):
        """Sender side, right after a send (whose bell already put a fence after the head's
        store): whether the receiver said it may sleep elsewhere (:meth:`doze`), so that the
        message must be announced to it some other way."""
        return self._word[_OUTSIDE_SLEEPER].value != 0

    # -- receiving -------------------------------------------------------------------------
    def poll(self):
        """The next message as a read-only uint8 array over the ring (valid until
        :meth:`release`), or None if none has arrived."""
        mapping = self._map
        tail = self._tail.value
        if self._head.value == tail:
            return None
        pos = tail % self.capacity
        n = _LEN.unpack_from(mapping, HEADER + pos)[0]
        if n == SKIP:
            self._tail.value = tail + self.capacity - pos
            pos = 0
            n = _LEN.unpack_from(mapping, HEADER)[0]
        taken = 8 + (n + 7) // 8 * 8
        if n > self.largest or pos + taken > self.capacity or self._tail.value + taken > self._head.value:
            raise FrameError(f"a channel record of {n} bytes at offset {pos}: the sender broke the "
                             f"channel's format")
        self._taken = taken
        view = self._ring[pos + 8:pos + 8 + n]
        view.flags.writeable = False
        return view

    def release(self):
        """Free the message :meth:`poll` or :meth:`recv` returned last."""
        self._tail.value += self._taken
        self._ring_bell(self._room_bell, _ROOM_BELL, _ROOM_SLEEPER)

    def ready(self):
        """Receiver side: whether a message is waiting."""
        return self._head.value != self._tail.value

    def doze(self, dozing=True):
        """Receiver side: say that this end may now sleep somewhere else (the transport's
        poll of its sockets), or no longer; after ``doze()``, check :meth:`ready` once more
        before sleeping."""
        self._word[_OUTSIDE_SLEEPER].value = 1 if dozing else 0
        if dozing:
            fence()

    def recv(self, check=None, deadline=None):
        """The next message (as :meth:`poll`), waiting for it; ``check()`` runs between
        sleeps and may raise (a lost peer), and passing ``deadline`` (``time.monotonic()``)
        raises :class:`CommTimeout`."""
        message = self.poll()
        if message is None:
            self._wait(lambda: self._head.value != self._tail.value,
                       self._data_bell, _DATA_BELL, _DATA_SLEEPER, check, deadline, "a message")
            message = self.poll()
        return message

    # -- waiting and waking ----------------------------------------------------------------
    def _wait(self, ready, bell, bell_at, sleeper_at, check, deadline, what):
        if ready():
            return
        stop = time.perf_counter() + self.spin
        while time.perf_counter() < stop:
            if ready():
                return
        while True:
            rung = self._word[bell_at].value
            self._word[sleeper_at].value = 1
            fence()
            if ready():
                self._word[sleeper_at].value = 0
                return
            slice_ = SLEEP_SLICE if deadline is None else max(0.0, min(SLEEP_SLICE, deadline - time.monotonic()))
            _futex(bell, _FUTEX_WAIT, rung, slice_)
            self._word[sleeper_at].value = 0
            if ready():
                return
            if check is not None:
                check()
            if deadline is not None and time.monotonic() > deadline:
                raise CommTimeout(f"timed out waiting for {what}")

    def _ring_bell(self, bell, bell_at, sleeper_at):
        word = self._word[bell_at]
        word.value = (word.value + 1) & 0xFFFFFFFF
        fence()
        if self._word[sleeper_at].value:
            _futex(bell, _FUTEX_WAKE, 1, None)

    def close(self):
        self._ring = self._head = self._tail = self._word = None
        self._data_bell = self._room_bell = None
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


class PeerChannels:
    """A rank's channels to and from its same-host peers, for a transport that also waits on
    sockets: a sleeping receiver is woken by a *doorbell* the sender sends another way (the
    transport's ``ring(peer)``), since a poll of sockets cannot wait on a futex.

    >>> channels.create(peer, path)              # at start-up, this rank's end to ``peer``
    >>> channels.open(peer, path)                # ``peer``'s channel into this rank
    >>> channels.try_send(peer, header, payload)  # False: not sent (full, or no channel)
    >>> for src, message in channels.messages(): ...
    """

    def __init__(self, ranks_on_host, capacity=CAPACITY):
        self.capacity, self.spin = capacity, default_spin(ranks_on_host)
        self._out, self._in, self._paths = {}, {}, []
        self.broken = {}  # peer -> why its channel into this rank is no longer read

    def create(self, peer, path):
        self._out[peer] = Channel.create(path, self.capacity, self.spin)
        self._paths.append(path)

    def open(self, peer, path):
        self._in[peer] = Channel.open(path, self.capacity, self.spin)

    def __contains__(self, peer):
        return peer in self._out

    def try_send(self, peer, *parts):
        """Send through the channel to ``peer``; returns (sent, the receiver may be asleep
        and wants a doorbell)."""
        channel = self._out[peer]
        if not channel.try_send(*parts):
            return False, False
        return True, channel.receiver_dozing()

    def messages(self, only=None):
        """Every waiting message (from ``only``, or from every peer), as ``(src, bytes)``: a
        copy, each released from its channel before it is handed out, so that nothing the
        caller does with it can hold or release the channel twice."""
        for src, channel in list(self._in.items()) if only is None else [(only, self._in.get(only))]:
            if channel is None:
                continue
            while True:
                try:
                    message = channel.poll()
                except FrameError as exc:  # nothing more is read from it: that peer's data times out
                    self.broken[src] = str(exc)
                    del self._in[src]
                    break
                if message is None:
                    break
                data = message.tobytes()
                del message
                channel.release()
                yield src, data

    def ready(self):
        return any(channel.ready() for channel in self._in.values())

    def wait_briefly(self):
        """Spin up to the spin budget for a message; True if one came, else every channel
        is marked dozing (undo with :meth:`awake`) and False returned unless one came
        meanwhile."""
        if not self._in:
            return False
        # ranks outnumber cores: give the core away (the sender may be the one waiting for
        # it) for a while instead of spinning on it or sleeping at once
        spin, pause = (self.spin, None) if self.spin else (YIELD_BUDGET, os.sched_yield)
        stop = time.perf_counter() + spin
        while True:
            if self.ready():
                return True
            if time.perf_counter() >= stop:
                break
            if pause is not None:
                pause()
        for channel in self._in.values():
            channel.doze()
        return self.ready()

    def awake(self):
        for channel in self._in.values():
            channel.doze(False)

    def close(self):
        for path in self._paths:  # a peer that never opened its channel leaves the name
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        for channel in (*self._out.values(), *self._in.values()):
            channel.close()
