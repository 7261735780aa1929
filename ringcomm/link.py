"""The view an algorithm gets of one collective call.

A :class:`Link` translates group ranks to global ranks, stamps every message with the
collective's identity (communicator, sequence number, step, segment) and signature, checks
that what arrives has the dtype and length this rank expects, and counts payload bytes, and
separately those that cross to another host. A schedule that runs in phases among subsets of
the group (inside each host, then across hosts) gets a :class:`SubLink` for each phase.

>>> # rank 1 of a group of 2, in collective #7:
>>> link.send(0, step=0, segment=0, array=x[:4]); y = link.recv(0, 0, 0, count=4)
>>> link.recv(0, 0, 1, into=x[4:8])     # straight into x[4:8]
>>> rail = link.sub((1, 3), phase=2)   # on group rank 3: rail.rank == 1, rail.send(0, ...) -> rank 1
"""
from dataclasses import dataclass

import numpy as np

from .device import HostDevice
from .errors import CollectiveMismatch, CommTimeout
from .staging import StagingQueue
from .transport.frame import COLLECTIVE, Key, new_key


@dataclass
class Stats:
    """Payload traffic of one communicator (headers are not counted). ``as_dict`` splits the
    bytes into ``*_intra_host`` (to and from ranks of this host) and ``*_inter_host``."""

    bytes_sent: int = 0
    bytes_received: int = 0
    messages_sent: int = 0
    messages_received: int = 0
    collectives: int = 0
    bytes_sent_inter_host: int = 0
    bytes_received_inter_host: int = 0

    def as_dict(self):
        d = dict(self.__dict__)
        d["bytes_sent_intra_host"] = self.bytes_sent - self.bytes_sent_inter_host
        d["bytes_received_intra_host"] = self.bytes_received - self.bytes_received_inter_host
        return d


HOST = HostDevice()
AGREE_STEP = 0xFFFFFFFF  # the step of agree()'s messages: no algorithm reaches it


class Link:
    __slots__ = ("session", "ranks", "rank", "size", "comm_id", "space", "seq", "sig", "dtype",
                 "segment_bytes", "deadline", "what", "stats", "device", "topology", "_remote",
                 "_staged", "_room")

    def __init__(self, session, *, ranks, rank, comm_id, space, seq, sig, dtype,
                 segment_bytes, deadline, what, stats, device=HOST, topology=None):
        self.session = session
        self.ranks = ranks          # group rank -> global rank
        self.rank = rank            # this process's group rank
        self.size = len(ranks)
        self.comm_id, self.space, self.seq, self.sig = comm_id, space, seq, sig
        self.dtype = np.dtype(dtype)
        self.segment_bytes = segment_bytes
        self.deadline, self.what, self.stats = deadline, what, stats
        self.device = device  # stages device segments through pinned host buffers
        self._staged = StagingQueue(session, device, sig) if device.staged else None
        # which group ranks share which host (None: all of them share this one)
        self.topology = topology
        self._remote = None if topology is None else topology.remote
        # global ranks this collective may send to (their window has room; see
        # ringcomm.transport.credit); point-to-point data has a window of its own
        self._room = set() if space == COLLECTIVE else None
        if space == COLLECTIVE:
            session.started(comm_id, seq)

    def send(self, peer, step, segment, array, copy=False):
        """Queue ``array`` (flat, contiguous) for group rank ``peer``. Large arrays are sent
        zero-copy unless ``copy``: do not modify them before the collective ends. A device
        segment is staged (see :mod:`ringcomm.staging`): its copy to the host starts here
        and it is handed to the session once that copy is done, at the latest before this
        rank next waits for a message or the call's body ends."""
        key = new_key((self.comm_id, self.space, self.seq, step, segment))
        dst = self.ranks[peer]
        if self._room is not None and dst not in self._room:
            self._await_room(dst)
        if self._staged is not None:
            self._staged.put(dst, key, array)
        else:
            self.session.send(dst, key, self.sig, array.view(np.uint8), copy=copy)
        stats = self.stats
        stats.bytes_sent += array.nbytes
        stats.messages_sent += 1
        if self._remote is not None and self._remote[peer]:
            stats.bytes_sent_inter_host += array.nbytes

    @property
    def staged_bytes(self):
        """Bytes staged here but not yet handed to the session (flow control counts them)."""
        return self._staged.nbytes if self._staged else 0

    def drain(self):
        """Hand every staged segment to the session, waiting for its copy."""
        if self._staged:
            self._staged.drain()

    def discard(self):
        """Drop what is staged (the call failed); see :meth:`StagingQueue.discard`."""
        if self._staged:
            self._staged.discard()

    def recv(self, peer, step, segment, count=None, wait=True, into=None):
        """The ``count`` elements group rank ``peer`` sent for (step, segment): a read-only
        array over the received buffer, or, for device collectives, a device array in a
        landing buffer that a later receive overwrites (use it before receiving again). With
        ``into`` (a flat array of ``count`` elements) they are copied straight there and
        ``into`` is returned. With ``wait=False``: ``None`` if not arrived yet."""
        if count is None:
            if into is None:
                raise TypeError("recv needs count or into")
            count = into.size
        key = new_key((self.comm_id, self.space, self.seq, step, segment))
        if self._staged:
            payload = self._staged.take(self._take, self.ranks[peer], key, wait)
        else:
            payload = self._take(self.ranks[peer], key, wait)
        if payload is None:
            return None
        nbytes = memoryview(payload).nbytes
        if nbytes != count * self.dtype.itemsize:
            where = f"step {step}" if step < 1 << SubLink.PHASE_BITS else \
                f"phase {step >> SubLink.PHASE_BITS} step {step & ((1 << SubLink.PHASE_BITS) - 1)}"
            raise CollectiveMismatch(
                f"{self.what}: rank {self.ranks[peer]} sent {nbytes} bytes for {where} "
                f"segment {segment}; rank {self.ranks[self.rank]} expects "
                f"{count} x {self.dtype.name} = {count * self.dtype.itemsize} bytes")
        stats = self.stats
        stats.bytes_received += nbytes
        stats.messages_received += 1
        if self._remote is not None and self._remote[peer]:
            stats.bytes_received_inter_host += nbytes
        received = np.frombuffer(payload, self.dtype, count)
        if self.device.staged:
            return self.device.stage_in(received, into, self.session.slot_of(payload))
        if into is None:
            return received
        into[...] = received
        return into

    # -- what a point-to-point transfer asks of the session (see ringcomm.p2p) ----------
    def window_left(self, peer, tag):
        """Bytes this rank may still send to group rank ``peer`` on ``tag`` now."""
        return self.session.window_left((self.ranks[peer], self.comm_id, tag))

    def window_open(self, peer, tag, nbytes):
        """Whether ``nbytes`` more fit the window to group rank ``peer`` on ``tag``, the
        bytes staged here but not yet handed over counted."""
        return self.session.window_open((self.ranks[peer], self.comm_id, tag), nbytes, self.staged_bytes)

    @property
    def window(self):
        return self.session.window

    def check(self, peer, why):
        """Between waits: raise if the deadline passed (``why`` says what was waited for),
        this rank is stopping, group rank ``peer`` (None: any) was lost, or the call was
        revoked."""
        self.session.check(None if peer is None else self.ranks[peer], self.deadline, why, self.comm_id,
                             self.space)

    def has_left(self, peer):
        """Whether group rank ``peer`` closed its communicator."""
        return self.session.has_left(self.ranks[peer])

    def first_arrived(self, keys):
        """Of ``keys`` (group rank, Key), the index of the one whose message began to arrive
        first, or None if none has."""
        return self.session.mailbox.first_arrived([(self.ranks[p], key) for p, key in keys])

    def sub(self, members, phase):
        """A :class:`SubLink` over the group ranks ``members`` (this rank among them)."""
        return SubLink(self, members, phase)

    def agree(self):
        """Exchange an empty message with every other rank of the group, so that each rank
        checks every other's signature (a mismatch raises here, on every rank). Costs one
        message latency and n−1 empty messages per rank."""
        key = Key(self.comm_id, self.space, self.seq, AGREE_STEP, 0)
        others = [r for i, r in enumerate(self.ranks) if i != self.rank]
        self.drain()
        for peer in others:
            if peer not in self._room:
                self._await_room(peer)
            self.session.send(peer, key, self.sig, b"")
        for peer in others:
            self._take(peer, key)

    def _await_room(self, dst):
        """Wait until global rank ``dst`` has room for this collective's data: a rank far
        ahead of it is held back (see ringcomm.transport.credit); a timeout names whoever a
        liveness check finds to blame."""
        session = self.session
        if self._staged and not session.room(dst, self.comm_id, self.seq):
            self.drain()  # no staged segment waits behind the wait
        try:
            session.await_room(dst, self.comm_id, self.seq, self.deadline, self.what)
        except CommTimeout as exc:
            blamed = self._blame(exc, dst)
            if blamed.rank == dst and blamed.cause == "not started":  # alive, but far behind
                exc.rank, exc.cause = dst, "not started"
                raise exc from None
            raise blamed from None
        self._room.add(dst)

    def _take(self, src, key, wait=True):
        """The payload of ``key`` from global rank ``src`` (``None``: not here, ``wait=False``);
        a timeout names whoever a liveness check finds to blame."""
        get = self.session.recv if wait else self.session.poll
        try:
            return get(src, key, self.sig, self.deadline, self.what)
        except CommTimeout as exc:
            raise self._blame(exc, src) from None

    def _blame(self, timeout, src):
        """The timeout to raise after asking who stopped answering (see Session.probe)."""
        if timeout.cause == "silent":  # a rank that failed a liveness check before: no new one
            return timeout
        me = self.ranks[self.rank]
        peers = self.ranks if self.space == COLLECTIVE else [src]
        silent, behind = self.session.probe(peers, self.comm_id, self.seq)
        silent = sorted(silent, key=lambda p: p != src)  # the rank waited on first, if it is one
        behind = sorted(behind, key=lambda p: p != src)
        if silent:
            return CommTimeout(
                f"{self.what}: rank {silent[0]} stopped answering (no reply to a liveness check: "
                f"it is stopped, hung outside Python, or unreachable); rank {me} timed out "
                f"waiting for rank {src}", rank=silent[0], cause="silent")
        if behind and self.space == COLLECTIVE:
            return CommTimeout(
                f"{self.what}: rank {behind[0]} is alive but never started this collective (it "
                f"is busy elsewhere, or the ranks issue collectives in different orders); rank "
                f"{me} timed out waiting for rank {src}", rank=behind[0], cause="not started")
        timeout.rank = src
        return timeout


class SubLink:
    """Some of a :class:`Link`'s ranks, as a group of their own, for one phase of a schedule.

    ``members``: the parent's group ranks, in the sub-group's rank order. Every step of
    phase p is sent as step ``p << 24 | step`` of the parent's collective, so the phases of
    one collective never share a message key; traffic is counted by the parent.

    >>> # group ranks 0..3, two hosts {0, 1} and {2, 3}; on rank 3:
    >>> host = link.sub((2, 3), phase=1)     # host.rank == 1, host.size == 2
    >>> host.send(0, 0, 0, x)                # to group rank 2, step 1 << 24
    """
    __slots__ = ("parent", "members", "rank", "size", "segment_bytes", "device", "_base")

    PHASE_BITS = 24

    def __init__(self, parent, members, phase):
        if not 0 < phase < 255:  # phase 255 would reach agree()'s step
            raise ValueError(f"phase must be in [1, 254], got {phase}")
        self.parent, self.members = parent, tuple(members)
        self.rank, self.size = self.members.index(parent.rank), len(self.members)
        self.segment_bytes, self.device = parent.segment_bytes, parent.device
        self._base = phase << self.PHASE_BITS

    def send(self, peer, step, segment, array, copy=False):
        self.parent.send(self.members[peer], self._base | step, segment, array, copy)

    def recv(self, peer, step, segment, count=None, wait=True, into=None):
        return self.parent.recv(self.members[peer], self._base | step, segment, count, wait, into)
