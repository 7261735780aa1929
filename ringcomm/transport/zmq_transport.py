"""The ZeroMQ transport: one PULL socket in, one PUSH socket out per peer, and shared memory
to the peers of its host.

:class:`ZmqTransport` sends, waits and delivers what arrives to its owner (a
:class:`ringcomm.session.Session`, which files it into the mailbox); two parts it owns
do the rest: ``connections`` (:class:`~.connections.Connections`: a PUSH socket to every
peer, connected at start-up so that a peer that dies is noticed even when this rank was not
talking to it; its monitor, the watched processes, the goodbyes and whom they blame) and
``same_host`` (:class:`~.same_host.SameHost`: the lanes, channels and bells to the peers of
this host). A child forked from this rank cannot use the transport (every call raises
:class:`CommError`) and closes its copies of the bells and pidfds at once.

Sends never block (no high-water mark). A message under ``ONE_FRAME_BYTES`` is one frame
(header, then payload); a larger one two frames, so that the payload can go out zero-copy.
Payloads of ``ZERO_COPY_BYTES`` or more go out zero-copy: ZeroMQ reads the caller's array
directly, so the caller must not modify it until :meth:`flush` returns, which the
communicator calls at the end of every collective; smaller ones (every segment with the
1 MiB segments used across hosts) are copied, which measured faster. Receives take
ZeroMQ's buffer as it is (``copy=False``); the algorithm reduces or copies straight from it.
To a same-host peer, small messages and slot notices go through its channel and large
segments through its lane instead (which go where: :mod:`.same_host`). A waiting rank spins
briefly on its channels, then sleeps in one poll of its sockets, pidfds and bells.

All sockets belong to the one thread that calls this object (ZeroMQ sockets are not
thread-safe); ``ringcomm.engine`` makes that the communication thread.
"""
import collections
import contextlib
import logging
import os
import select
import threading
import time

import zmq

from ..errors import CommError, CommTimeout, FrameError, PeerLost
from . import frame, liveness
from .base import Transport
from .connections import Connections
from .frame import Kind
from .same_host import VIA_ZMQ, SameHost

log = logging.getLogger(__name__)

# Payloads at least this large go out zero-copy (ZeroMQ reads the caller's array; a tracker
# says when it is done). Smaller ones are copied into ZeroMQ's own buffer: a copy of a few
# MiB runs at cache speed, and measured here it beats tracking each message through pyzmq's
# garbage-collector thread by ~10 % on 4 and 64 MiB all-reduces (bench/RESULTS.md).
ZERO_COPY_BYTES = int(os.environ.get("RINGCOMM_ZERO_COPY_BYTES", 4 << 20))
# Messages smaller than this travel as one frame, header and payload joined (one copy, which
# costs less than a second pyzmq send and receive call); larger ones as two frames.
ONE_FRAME_BYTES = 64 << 10

# How long close() waits for every peer's goodbye (one that is gone or stopped never sends it)
CLOSE_WAIT = 1.5
MONITOR_INTERVAL = 0.005  # how long zero-timeout pumps may skip polling the monitor sockets (s)
_POLLIN = int(zmq.POLLIN)  # a plain int: `x & zmq.POLLIN` builds an enum member each time
_KIND_AT = 5  # the kind's byte in a packed header (frame.HEADER)
# what a child forked from a rank may not call (see ZmqTransport._forked_child)
_PARENT_ONLY = ("send_data", "post", "send_slot", "take_slot", "pump", "_glance", "_drain",
                "_drain_pull", "flush", "open_lanes", "await_connections")


class ZmqTransport(Transport):
    """Messages between ranks over ZeroMQ.

    ``pull`` is this rank's bound PULL socket; ``endpoints[r]`` the address to reach rank r,
    ``socket_ids[r]`` the id its inbound socket published (what a connection proof names).
    ``lanes``: a :class:`~.same_host.LanePlan` for the shared-memory lanes to peers on this
    host (opened by :meth:`open_lanes`), or ``None`` to send everything through ZeroMQ.
    ``processes``: ``{peer: (pid, start time)}`` of the same-host peers whose processes to
    watch (:func:`.liveness.watched`). Its parts, ``connections`` and ``same_host``, are
    made here from these (see the module).
    """

    def __init__(self, rank, world_size, context, pull, endpoints, socket_ids=None, grace=1.0,
                 close_wait=CLOSE_WAIT, cleanup=(), guard=None, lanes=None, bound=None,
                 processes=None):
        super().__init__(rank, world_size)
        self.bound = dict(bound or {})  # where this rank listens: {"ipc", "tcp", "id"}
        self._ctx, self._pull = context, pull
        # ZeroMQ's notification descriptor for the PULL socket: readable when something
        # may have arrived since the socket last processed its commands (see _glance)
        self._pull_signal = select.poll()
        self._pull_signal.register(pull.getsockopt(zmq.FD), select.POLLIN)
        self._cleanup = list(cleanup)  # files to remove at close (the ipc socket)
        self._guard, self.close_wait = guard, close_wait
        self.same_host = SameHost(rank=rank, world_size=world_size, plan=lanes, file=self._file,
                                  bells_changed=self._repoll)
        self.connections = Connections(rank=rank, world_size=world_size, context=context,
                                       endpoints=endpoints, socket_ids=socket_ids, guard=guard,
                                       processes=processes, grace=grace,
                                       drain=lambda: self._drain())  # (a forked child's refusal holds)
        # answered by the connections themselves (no call of the transport's own per wait)
        self.check_peers, self._said_bye = self.connections.check_peers, self.connections.said_bye
        self.lost, self.forget = self.connections.lost, self.connections.forget
        self._in_flight = collections.deque()  # MessageTrackers of zero-copy sends
        self._monitors_seen = 0.0  # when the monitor sockets were last polled
        self._rejected = 0  # frames through ZeroMQ refused (see rejected)
        # another thread's way to cut a wait short (see wake): a pipe in the poll
        self._wake_in, self._wake_out = os.pipe()
        os.set_blocking(self._wake_in, False)
        os.set_blocking(self._wake_out, False)
        self._wake_lock = threading.Lock()  # a wake() racing close() never writes a closed fd
        self._repoll()
        self._owner = os.getpid()
        liveness.guard_fork(self)

    def _repoll(self):
        """Rebuild the poll of every wait: the PULL socket, every monitor socket and pidfd
        (:attr:`connections`), the wake pipe, and every channel bell (:attr:`same_host`)."""
        parts = (self._pull, *self.connections.monitors, *self.connections.watch.fds, self._wake_in,
                 *self.same_host.bells)
        self._poll_all = [(item, _POLLIN) for item in parts]

    def attach(self, deliver, check):
        super().attach(deliver, check)
        self.same_host.file = deliver  # a channel carries no BYE: its records skip _file

    @property
    def lane_peers(self):  # (see Transport)
        return self.same_host.peers

    @property
    def rejected(self):
        """Frames refused (malformed, or from the wrong sender), through ZeroMQ or a channel."""
        return self._rejected + self.same_host.rejected

    def await_connections(self, deadline):
        """Block until every peer connection completed its handshake (secret proven)."""
        while not self.connections.connected(deadline):
            self.pump(0.05)

    def open_lanes(self, deadline):
        """Create this rank's lanes to its same-host peers, announce them (LANE), and wait
        until every peer's lane into this rank is mapped. Raises :class:`CommError` naming
        the peer when a lane cannot be made or mapped."""
        same_host = self.same_host
        if same_host.plan is None:
            return
        lane = frame.pack(Kind.LANE, self.rank, frame.Key(0, frame.COLLECTIVE, 0, 0, 0), 0, bytes(16))
        for peer in same_host.plan.peers:
            same_host.create(peer)
            self.post(peer, lane, b"")
        while not same_host.mapped(deadline, self._said_bye):
            self.check_peers("opening shared-memory lanes")
            self.pump(0.05)

    # -- sending -------------------------------------------------------------------------
    def send_data(self, dst, key, sig, payload, nbytes, copy):
        if dst in self._said_bye:
            self.connections.refuse_send(dst)
        same_host = self.same_host
        inline_below, lane_min = same_host.limits[key.space]
        header = frame.pack(Kind.DATA, self.rank, key, nbytes, sig)
        if nbytes < inline_below:
            channel = same_host.channel_to.get(dst)
            if channel is not None and channel.try_send(header, payload):
                return None
        elif nbytes >= lane_min:
            lane = same_host.out_lanes.get(dst)
            if lane is not None and nbytes <= lane.slot_bytes:
                notice = lane.put(payload)
                if notice is not None:
                    return self.post(dst, frame.pack(Kind.SHM, self.rank, key, nbytes, sig), notice, True)
        return self._post_zmq(dst, header, payload, nbytes, copy)  # (the channel was full or absent)

    def post(self, dst, header, payload, copy=False):
        if dst in self._said_bye:
            self.connections.refuse_send(dst)
        nbytes = memoryview(payload).nbytes
        same_host = self.same_host
        channel = same_host.channel_to.get(dst)
        if (channel is not None and nbytes < same_host.limits[0][0] and header[_KIND_AT] not in VIA_ZMQ
                and channel.try_send(header, payload)):  # not sent: full, use ZeroMQ
            return None
        return self._post_zmq(dst, header, payload, nbytes, copy)

    def _post_zmq(self, dst, header, payload, nbytes, copy):
        sock = self.connections.push[dst]
        try:
            if nbytes < ONE_FRAME_BYTES:  # one ZeroMQ frame: half the send and receive calls
                sock.send(b"".join((header, payload)), zmq.NOBLOCK)
                return None
            if not copy and nbytes >= ZERO_COPY_BYTES:
                tracker = sock.send_multipart([header, payload], zmq.NOBLOCK, copy=False, track=True)
                self._in_flight.append(tracker)
                return tracker
            sock.send_multipart([header, payload], zmq.NOBLOCK)
            return None
        except zmq.Again:  # no high-water mark: only a connection that is gone does this
            raise PeerLost(f"rank {self.rank} cannot send to rank {dst}: not connected", rank=dst) from None

    # -- lane slots a device fills and reads directly (Transport.take_slot) -----------------
    def take_slot(self, dst, key, nbytes):
        return self.same_host.take_slot(dst, key, nbytes)

    def send_slot(self, dst, key, sig, slot, nbytes):
        if dst in self._said_bye:  # nothing announced: the slot is free again
            self.same_host.give_back_slot(dst, slot)  # (once the notice is out, the receiver frees it)
            self.connections.refuse_send(dst)
        notice = self.same_host.notice(dst, slot)
        self.post(dst, frame.pack(Kind.SHM, self.rank, key, nbytes, sig), notice, True)

    def give_back_slot(self, dst, slot):
        self.same_host.give_back_slot(dst, slot)

    def slot_of(self, payload):
        return self.same_host.slot_of(payload)

    def flush(self, deadline, what):
        while self._in_flight:
            if self._in_flight[0].done:
                self._in_flight.popleft()
                continue
            self.check(what)
            if time.monotonic() > deadline:
                raise CommTimeout(f"{what}: rank {self.rank} could not hand its data to the "
                                  f"network before the deadline")
            self.pump(0.005)

    # -- receiving -----------------------------------------------------------------------
    def pump(self, timeout):  # noqa: C901 - a hot path (once per wait): one body, no helper calls
        same_host = self.same_host
        channels = same_host.channels
        dozing = False
        now = time.monotonic()
        if timeout > 0 and channels is not None:
            if channels.wait_briefly(self.eager()):
                if now - self._monitors_seen < MONITOR_INTERVAL:
                    same_host.drain()  # what the spin found; ZeroMQ waits its turn
                    return
                timeout = 0  # no sleep, but a look at every socket
            else:
                dozing = True  # the channels' senders now ring their bells
        if timeout <= 0 and now - self._monitors_seen < MONITOR_INTERVAL:
            # the quick look a collective takes at its start and end; a lost peer's monitor
            # event waits a few ms, well inside its grace
            self._glance()
            return
        self._monitors_seen = now
        try:
            for sock, _ in zmq.zmq_poll(self._poll_all, int(timeout * 1000)):
                if sock is self._pull:
                    self._drain_pull()  # the channels are drained below
                elif type(sock) is int:  # a bell or a pidfd (one dropped earlier: skipped)
                    if sock in same_host.bells:
                        same_host.on_bell(sock)
                    elif sock == self._wake_in:
                        self._woken()
                    elif sock in self.connections.watch.fds:  # that peer's process ended
                        self.connections.on_pidfd(sock)
                        self._repoll()
                else:
                    self.connections.on_monitor(sock)
        finally:
            if dozing:
                channels.awake()
        if channels is not None:
            same_host.drain()

    def wake(self):
        """Safe from any thread: end the current wait's sleep now (a revocation must reach
        the call waiting in it at once, not at its next look)."""
        with self._wake_lock:
            if self._wake_out < 0:  # closed
                return
            try:  # noqa: SIM105 - a hot path: try costs nothing, suppress ~0.5 µs
                os.write(self._wake_out, b"w")
            except BlockingIOError:  # full: a wake-up is pending anyway
                pass

    def _woken(self):
        try:
            while os.read(self._wake_in, 64):
                pass
        except OSError:
            pass

    def _file(self, header, payload):
        if header.kind != Kind.BYE:  # everything but a goodbye goes to the owner
            self.deliver(header, payload)
            return
        if self.same_host.channels is not None:  # what it sent before its goodbye comes first
            self.same_host.drain(header.src)
        self.connections.on_bye(header.src, header.sig)

    def has_left(self, peer):
        return peer in self._said_bye

    def _glance(self):
        """File what arrived, asking ZeroMQ (a costly option read) only when its descriptor
        says something may have come. Every path that makes the socket process its commands
        (this, :meth:`_drain`, the poll in :meth:`pump`) drains it until it says nothing is
        left, so a quiet descriptor means no message; and the full poll every
        ``MONITOR_INTERVAL`` would catch one missed anyway."""
        if self.same_host.channels is not None:
            self.same_host.drain()
        if self._pull_signal.poll(0):
            self._drain_pull()

    def _drain(self):
        if self.same_host.channels is not None:
            self.same_host.drain()
        self._drain_pull()

    def _drain_pull(self):
        pull = self._pull
        # ZMQ_EVENTS is cheaper than a failed receive's exception, but may say "readable"
        # for a pipe that turns out to hold only its end (a peer's dropped connection)
        while pull.get(zmq.EVENTS) & _POLLIN:
            try:
                parts = pull.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            try:
                if len(parts) == 1:  # header and payload in one frame
                    whole = parts[0].buffer
                    head, payload = whole[:frame.HEADER.size], whole[frame.HEADER.size:]
                elif len(parts) == 2:
                    head, payload = parts[0].buffer, parts[1].buffer
                else:
                    raise FrameError(f"message of {len(parts)} frames, expected 1 or 2")
                header = frame.unpack(head, len(payload), self.world_size, self.rank)
                if header.kind in (Kind.SHM, Kind.LANE) and self.same_host.plan is None:
                    raise FrameError("shared-memory message, but this rank uses no lanes")
                if header.kind == Kind.SHM:
                    payload = self.same_host.segment(header.src, payload, header.nbytes)
                elif header.kind == Kind.LANE:
                    self.same_host.map_lane(header.src)
                    continue
            except FrameError as exc:
                self._rejected += 1
                log.warning("rank %d rejected a frame: %s", self.rank, exc)
                continue
            self._file(header, payload)

    # -- closing ---------------------------------------------------------------------------
    def close(self, failure=None, waiting=lambda: True):
        """Say BYE to every peer (with what ``failure``, this rank's first, blamed, if one did;
        see :mod:`.connections`), wait (bounded) until each said BYE or is gone, then close.
        Once ``waiting()`` is false (the owner was stopped, perhaps meanwhile, from another
        thread) it neither flushes nor waits for BYEs any more."""
        # not waiting: only the BYE itself is still delivered (the sockets' linger)
        deadline = time.monotonic() + (self.close_wait if waiting() else 0)
        try:
            if waiting():
                self.flush(deadline, "close")  # (a stop meanwhile ends it: see Session.stop)
        except Exception as exc:  # closing must not fail; the data is lost either way
            log.warning("rank %d closing with undelivered data: %s", self.rank, exc)
        self.connections.say_goodbye(failure)
        while self.connections.owed_goodbye() and time.monotonic() < deadline and waiting():
            self.pump(0.05)
        self._close_sockets_and_fds()
        for hook in self.before_unmap:
            try:
                hook()
            except Exception as exc:  # noqa: BLE001 - closing must not fail
                log.warning("rank %d: %s", self.rank, exc)
        self.same_host.close()
        for path in self._cleanup:
            with contextlib.suppress(OSError):
                os.unlink(path)

    def _close_sockets_and_fds(self):
        """The connections (sockets, pidfds), the PULL socket, the wake pipe, the guards, the context."""
        self.connections.close()
        self._pull.close(linger=0)
        with self._wake_lock:
            wake_fds, (self._wake_in, self._wake_out) = (self._wake_in, self._wake_out), (-1, -1)
        for fd in wake_fds:
            os.close(fd)
        liveness.unguard_fork(self)
        if self._guard is not None:
            self._guard.stop()
        self._ctx.term()

    def _forked_child(self):
        """In a child forked from this rank (see :mod:`.liveness`): close the child's copies
        of the bells and pidfds, and refuse every use. The ZeroMQ sockets stay as they are
        (closing them in a forked child is unsafe), never touched again; nor is anything of
        the parent's removed at the child's exit."""
        self.connections.watch.close()
        self.same_host.forget_bells()
        owner, rank = self._owner, self.rank

        def refuse(*args, **kwargs):
            raise CommError(f"rank {rank}'s communicator belongs to process {owner}; process "
                            f"{os.getpid()} was forked from it and cannot use it (it may make "
                            f"a communicator of its own)")
        for name in _PARENT_ONLY:
            setattr(self, name, refuse)
        self.close = lambda *args, **kwargs: None
