"""A one-way shared-memory channel between two processes of one host: small messages travel
inline, and a receiver that must wait spins briefly, then sleeps on the channel's *bell*, a
pipe the sender writes one byte to.

The transport keeps one channel per ordered pair of ranks on a host (:class:`~.peer_channels.PeerChannels`)
and sends every small message and lane notice through it; ZeroMQ stays for start-up,
goodbyes and other hosts. The transport sleeps in one poll of its sockets *and* its bells,
so a message through a channel wakes it as directly as one through ZeroMQ.

Words used here:

- **channel** — a shared mapping of a header and a *ring* of ``capacity`` bytes (a power of
  two), written by one *sender* and read by one *receiver*.
- **record** — one message in the ring: an 8-byte length, then the payload, padded to 8
  bytes. A record never wraps: when it would pass the end of the ring the sender writes a
  *skip* length and starts at 0.
- **head / tail** — bytes ever written / consumed (uint64, never wrap in practice), on their
  own cache lines. The ring holds ``head - tail`` bytes; the sender never lets it exceed
  ``capacity``.
- **bell** — a FIFO (or, for :meth:`Channel.pair`, a pipe) from sender to receiver. The
  receiver raises its *sleeper* flag before it sleeps in ``poll()`` on the bell's read end;
  a sender that publishes a record and sees the flag writes one byte. A sender that dies
  closes its end, and the receiver's poll returns at once (hang-up) — unless a child it
  forked still holds that end; then the receiver learns of the death the slower way (``check``).
  A transport's channels close their bells in every child forked from the rank
  (:meth:`.PeerChannels.forget_bells`, see :mod:`.liveness`), which also watches the peer's
  process itself.

Waiting: spin up to ``spin`` seconds (see :mod:`.spin`: long when every rank has a core, none
when ranks outnumber cores, where the waiter yields its core instead so that two ranks on
one core do not burn each other's time slices), then sleep on the bell in slices of at most
``SLEEP_SLICE`` seconds, calling ``check()`` between slices, so a peer that died
(``check`` raises) or a passed deadline ends the wait within one slice. A sender waiting for
room (the receiver is a whole ring behind) naps in short slices instead: the transport
never waits for room (it sends another way), so no bell runs that direction.

Memory ordering: the sender writes the payload, then stores ``head``; the receiver loads
``head``, then reads the payload, then stores ``tail``. x86-64 keeps stores in order and loads
in order, which is all this needs. Weaker models (ARM) would need a release fence before the
``head``/``tail`` stores and an acquire fence after their loads, which Python cannot issue:
on such machines this channel is not used. The sleeper flag is a store followed by a load
on each side (a Dekker pattern: receiver stores the flag then loads ``head``, sender stores
``head`` then loads the flag), which x86-64 may reorder, so both sides put a
:func:`~.fence.fence` between them; were a bell missed anyway, it would cost one sleep
slice, never a hang.

>>> a, b = Channel.pair(1 << 16)  # or Channel.create(path, capacity) / Channel.open(path, capacity)
>>> a.send(b"hello"); bytes(b.recv(check=lambda: None))
b'hello'
"""
import contextlib
import ctypes
import mmap
import os
import platform
import select
import stat
import struct
import time

import numpy as np

from ..errors import CommTimeout, FrameError
from .fence import fence
from .spin import SPIN, spin_until
from .spin import default_spin as default_spin  # also here: who makes a channel sizes its spin

HEADER = 256            # bytes before the ring: four 64-byte lines
SKIP = (1 << 64) - 1    # a record length that says "the rest of the ring is empty, go to 0"
SLEEP_SLICE = 0.05      # the longest one sleep on the bell lasts before check() runs again
ROOM_NAP = 100e-6       # a sender waiting for room sleeps this long between looks
CAPACITY = 1 << 20      # ring bytes of a transport's channel to one peer
# a record's length word (written before the record is published: no reader races it)
_LEN = struct.Struct("@Q")
# head, tail and the sleeper flag are read and written as ctypes words: one aligned load or
# store each, which another process never sees half done (struct's pack_into zeroes its
# target before writing, and a reader can see that zero)
_HEAD, _TAIL, _SLEEPER = 0, 64, 128  # byte offsets in the header, each on a line of its own
_RING = b"\x01"
_HANGUP = select.POLLHUP | select.POLLERR | select.POLLNVAL


def supported():
    """Whether this machine runs the channel: Linux on x86-64's memory order."""
    return os.name == "posix" and platform.system() == "Linux" and platform.machine() == "x86_64"


def hush(fd):
    """Empty the bell ``fd``; False if its sender's end is closed (the sender is gone)."""
    while True:
        try:
            if not os.read(fd, 4096):
                return False  # end of file: no sender holds the bell any more
        except BlockingIOError:
            return True


class Channel:
    """One end of a channel over ``mapping`` (an ``mmap`` of ``HEADER + capacity`` bytes);
    ``bell`` is the file descriptor of this end of the bell (the receiver's read end, the
    sender's write end), or -1 for none."""

    def __init__(self, mapping, capacity, spin=SPIN, bell=-1):
        _check_capacity(capacity)
        self._map, self.capacity, self.spin, self.bell = mapping, capacity, spin, bell
        self.largest = largest_message(capacity)
        self._ring = np.frombuffer(mapping, np.uint8, capacity, HEADER)
        self._taken = 0
        self._head = ctypes.c_uint64.from_buffer(mapping, _HEAD)
        self._tail = ctypes.c_uint64.from_buffer(mapping, _TAIL)
        self._sleeper = ctypes.c_uint32.from_buffer(mapping, _SLEEPER)

    # -- making one ------------------------------------------------------------------------
    @classmethod
    def create(cls, path, capacity, spin=SPIN):
        """The sender's end: a new file at ``path`` (mode 0600), zeroed, and its bell, a FIFO
        at ``path + "-bell"``."""
        _check_capacity(capacity)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        made, mapping = [path], None
        try:
            os.ftruncate(fd, HEADER + capacity)
            # pages reserved now: a full /dev/shm fails here, not with SIGBUS on a write
            os.posix_fallocate(fd, 0, HEADER + capacity)
            mapping = mmap.mmap(fd, HEADER + capacity)
            os.mkfifo(path + "-bell", 0o600)
            made.append(path + "-bell")
            # read-write: opening needs no reader yet, and a bell rung for a receiver that is
            # gone never raises SIGPIPE (its bytes just fill the pipe, then are refused)
            bell = os.open(path + "-bell", os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
        except BaseException:
            for name in made:  # only what this call made: never a file that was there before
                os.unlink(name)
            if mapping is not None:
                mapping.close()
            raise
        finally:
            os.close(fd)
        return cls(mapping, capacity, spin, bell)

    @classmethod
    def open(cls, path, capacity, spin=SPIN):
        """The receiver's end of the channel at ``path``: a private regular file of this user
        and its private FIFO bell, unlinked once opened (both ends hold them; nothing stays
        behind)."""
        _check_capacity(capacity)
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        try:
            _check_private(fd, path, stat.S_ISREG)
            if os.fstat(fd).st_size != HEADER + capacity:
                raise ValueError(f"{path} is not a channel of {capacity} bytes")
            mapping = mmap.mmap(fd, HEADER + capacity)
        finally:
            os.close(fd)
        bell = -1
        try:
            bell = os.open(path + "-bell", os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
            _check_private(bell, path + "-bell", stat.S_ISFIFO)
        except BaseException:
            if bell >= 0:
                os.close(bell)
            mapping.close()
            raise
        for name in (path, path + "-bell"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name)
        return cls(mapping, capacity, spin, bell)

    @classmethod
    def pair(cls, capacity, spin=SPIN):
        """Two ends over one anonymous shared mapping and a pipe (inherited by a forked
        child)."""
        mapping = mmap.mmap(-1, HEADER + capacity)
        read, write = os.pipe()
        os.set_blocking(read, False)
        os.set_blocking(write, False)
        return cls(mapping, capacity, spin, write), cls(mapping, capacity, spin, read)

    # -- sending ---------------------------------------------------------------------------
    def send(self, *parts, check=None, deadline=None):
        """Append one message made of ``parts`` (bytes-like, together at most
        ``capacity // 2 - 8`` bytes); waits for room while the receiver is behind."""
        if not self._put(parts, wait=True, check=check, deadline=deadline):
            raise AssertionError("unreachable: a waiting put always succeeds or raises")

    def try_send(self, *parts):
        """Like :meth:`send`, but returns False at once instead of waiting for room."""
        return self._put(parts, wait=False)

    def _put(self, parts, wait, check=None, deadline=None):
        views, n = [], 0
        for part in parts:
            view = part if type(part) is bytes else memoryview(part).cast("B")
            views.append(view)
            n += len(view)
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
            self._wait_for_room(head + skip + need - capacity, check, deadline)
        if skip:
            _LEN.pack_into(mapping, HEADER + pos, SKIP)
            head, pos = head + skip, 0
        start = HEADER + pos + 8
        for view in views:
            mapping[start:start + len(view)] = view
            start += len(view)
        _LEN.pack_into(mapping, HEADER + pos, n)
        self._head.value = head + need  # publishes it (stores stay in order on x86-64)
        fence()  # the head's store before the sleeper's load (see the module docstring)
        if self._sleeper.value:
            self.ring()
        return True

    def ring(self):
        """Wake the receiver if it sleeps on the bell (a byte into the bell; a full bell
        already wakes it)."""
        try:  # noqa: SIM105 - a hot path: try costs nothing, suppress ~0.5 µs
            os.write(self.bell, _RING)
        except BlockingIOError:
            pass

    def _wait_for_room(self, tail, check, deadline):
        """Until the receiver's tail reaches ``tail``."""
        if spin_until(lambda: self._tail.value >= tail, self.spin):
            return
        while self._tail.value < tail:
            time.sleep(ROOM_NAP)
            if check is not None:
                check()
            if deadline is not None and time.monotonic() > deadline:
                raise CommTimeout("timed out waiting for room in the channel")

    def receiver_dozing(self):
        """Sender side: whether the receiver said it may be asleep on the bell."""
        return self._sleeper.value != 0

    # -- receiving -------------------------------------------------------------------------
    def _next(self):
        """Where the next record's payload lies: (offset in the ring, length), or None."""
        mapping = self._map
        tail = self._tail.value
        head = self._head.value
        if head == tail:
            return None
        pos = tail % self.capacity
        n = _LEN.unpack_from(mapping, HEADER + pos)[0]
        if n == SKIP:
            tail += self.capacity - pos
            self._tail.value = tail
            pos = 0
            n = _LEN.unpack_from(mapping, HEADER)[0]
        self._taken = taken = 8 + (n + 7) // 8 * 8
        if n > self.largest or pos + taken > self.capacity or tail + taken > head:
            raise FrameError(f"a channel record of {n} bytes at offset {pos}: the sender broke the "
                             f"channel's format")
        return pos + 8, n

    def poll(self):
        """The next message as a read-only uint8 array over the ring (valid until
        :meth:`release`), or None if none has arrived."""
        where = self._next()
        if where is None:
            return None
        view = self._ring[where[0]:where[0] + where[1]]
        view.flags.writeable = False
        return view

    def take(self):
        """The next message as ``bytes`` (a copy; released from the ring already), or None
        if none has arrived."""
        where = self._next()
        if where is None:
            return None
        start = HEADER + where[0]
        data = self._map[start:start + where[1]]
        self._tail.value += self._taken
        return data

    def release(self):
        """Free the message :meth:`poll` or :meth:`recv` returned last."""
        self._tail.value += self._taken

    def ready(self):
        """Receiver side: whether a message is waiting."""
        return self._head.value != self._tail.value

    def doze(self, dozing=True):
        """Receiver side: say that this end may now sleep on its bell, or no longer; after
        ``doze()``, check :meth:`ready` once more before sleeping."""
        self._sleeper.value = 1 if dozing else 0
        if dozing:
            fence()

    def recv(self, check=None, deadline=None):
        """The next message (as :meth:`poll`), waiting for it; ``check()`` runs between
        sleeps and may raise (a lost peer), and passing ``deadline`` (``time.monotonic()``)
        raises :class:`CommTimeout`."""
        message = self.poll()
        if message is not None or spin_until(self.ready, self.spin):
            return message if message is not None else self.poll()
        sleeper = select.poll()
        sleeper.register(self.bell, select.POLLIN)
        while True:
            self.doze()
            try:
                if self.ready():
                    break
                slice_ = SLEEP_SLICE if deadline is None else max(0.0, min(SLEEP_SLICE, deadline - time.monotonic()))
                events = sleeper.poll(slice_ * 1000)
            finally:
                self.doze(False)
            if events and not hush(self.bell) or any(e & _HANGUP for _, e in events):
                sleeper.unregister(self.bell)  # the sender is gone: no bell will ring
                sleeper = _Napper()
            if self.ready():
                break
            if check is not None:
                check()
            if deadline is not None and time.monotonic() > deadline:
                raise CommTimeout("timed out waiting for a message")
        return self.poll()

    def close(self):
        self._ring = self._head = self._tail = self._sleeper = None
        if self.bell >= 0:
            os.close(self.bell)
            self.bell = -1
        # a message view is still alive; the mapping goes with it
        with contextlib.suppress(BufferError):
            self._map.close()


class _Napper:
    """What a receiver sleeps on once its bell hung up: short naps (``check`` then finds
    out why the sender is gone)."""

    def poll(self, ms):
        time.sleep(min(ms / 1000, ROOM_NAP * 10))
        return []


def largest_message(capacity):
    """The most bytes one message may hold in a ring of ``capacity``: a record this long
    (8-byte length included) fits wherever the ring stands."""
    return capacity // 2 - 8


def _check_capacity(capacity):
    if capacity & (capacity - 1) or capacity < 64:
        raise ValueError(f"capacity must be a power of two of at least 64 bytes, got {capacity}")


def _check_private(fd, path, is_kind):
    st = os.fstat(fd)
    if not is_kind(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
        raise ValueError(f"{path} is not a private {'FIFO' if is_kind is stat.S_ISFIFO else 'regular file'} "
                         f"of this user")
