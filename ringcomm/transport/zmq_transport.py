"""The ZeroMQ transport: one PULL socket in, one PUSH socket out per peer.

Each rank binds one PULL socket (``ipc://`` for peers on its host, ``tcp://`` for the rest)
and connects one PUSH socket to every peer at start-up, so a peer that dies is noticed even
when this rank was not talking to it. How a lost peer is told from one that closed (its
socket's monitor, its process, its goodbye and whom that goodbye blames) is
:mod:`.connections`'s. A child forked from this rank cannot use the transport (every call
raises :class:`CommError`) and closes its copies of the bells and pidfds at once.

Sends never block (no high-water mark). A message under ``ONE_FRAME_BYTES`` is one frame
(header, then payload); a larger one two frames, so that the payload can go out zero-copy.
Payloads of ``ZERO_COPY_BYTES`` or more go out zero-copy: ZeroMQ reads the caller's array
directly, so the caller must not modify it until :meth:`flush` returns, which the
communicator calls at the end of every collective; smaller ones (every segment with the
1 MiB segments used across hosts) are copied, which measured faster. Receives take
ZeroMQ's buffer as it is (``copy=False``); the algorithm reduces or copies straight from it.

Between ranks that share a host and its ``/dev/shm``, every message under the lane plan's
``channel_max_bytes`` and every slot notice travels through a shared-memory channel to that
peer (:mod:`.channel`), not through ZeroMQ; larger segments, up to one slot, through
shared-memory lanes (:mod:`.shm`), the receiver reducing straight out of the slot (where the
channel cannot run, lanes take segments from ``SHM_MIN_BYTES`` up). A rank waiting for
messages spins briefly on its channels, then sleeps in one poll of its sockets and its
channels' bells; a sender that finds it asleep writes a byte to the bell. BYE stays on
ZeroMQ, behind any data sent there, and the receiver empties the sender's channel before it
takes a BYE in.

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
from . import frame, goodbye, liveness
from .base import Transport
from .channel import largest_message, supported as channel_supported
from .connections import Connections
from .peer_channels import PeerChannels
from .frame import Kind
from .credit import window_from_env
from .same_host import VIA_ZMQ, SameHost
from .shm import InLanes

log = logging.getLogger(__name__)

# Payloads at least this large go out zero-copy (ZeroMQ reads the caller's array; a tracker
# says when it is done). Smaller ones are copied into ZeroMQ's own buffer: a copy of a few
# MiB runs at cache speed, and measured here it beats tracking each message through pyzmq's
# garbage-collector thread by ~10 % on 4 and 64 MiB all-reduces (bench/RESULTS.md).
ZERO_COPY_BYTES = int(os.environ.get("RINGCOMM_ZERO_COPY_BYTES", 4 << 20))
# Messages smaller than this travel as one frame, header and payload joined (one copy, which
# costs less than a second pyzmq send and receive call); larger ones as two frames.
ONE_FRAME_BYTES = 64 << 10
# Segments at least this large go through a shared-memory lane to same-host peers; below
# it a ZeroMQ copy costs less than the slot bookkeeping.
SHM_MIN_BYTES = int(os.environ.get("RINGCOMM_SHM_MIN_BYTES", 32 << 10))

# How long close() waits for every peer's goodbye (one that is gone or stopped never sends it)
CLOSE_WAIT = 1.5
MONITOR_INTERVAL = 0.005  # how long zero-timeout pumps may skip polling the monitor sockets (s)
_POLLIN = int(zmq.POLLIN)  # a plain int: `x & zmq.POLLIN` builds an enum member each time
_KIND_AT = 5  # the kind's byte in a packed header (frame.HEADER)
# what a child forked from a rank may not call (see ZmqTransport._forked_child)
_PARENT_ONLY = ("_send", "_post", "_send_slot", "take_slot", "_pump", "_glance", "_drain",
                "_drain_pull", "_drain_channels", "flush", "open_lanes", "await_connections")


class ZmqTransport(Connections, SameHost, Transport):
    """Messages between ranks over ZeroMQ.

    ``pull`` is this rank's bound PULL socket; ``endpoints[r]`` the address to reach rank r,
    ``socket_ids[r]`` the id its inbound socket published (what a connection proof names).
    ``lanes``: a :class:`~.same_host.LanePlan` for the shared-memory lanes to peers on this host (opened
    by :meth:`open_lanes`), or ``None`` to send everything through ZeroMQ. ``processes``:
    ``{peer: (pid, start time)}`` of the same-host peers whose processes to watch
    (:func:`.liveness.watched`).
    """

    def __init__(self, rank, world_size, context, pull, endpoints, socket_ids=None, grace=1.0,
                 close_wait=CLOSE_WAIT, cleanup=(), guard=None, lanes=None, bound=None,
                 processes=None):
        self.collective_window = window_from_env()  # (see .credit)
        super().__init__(rank, world_size)
        self.bound = dict(bound or {})  # where this rank listens: {"ipc", "tcp", "id"}
        self._plan = lanes
        self._out_lanes = {}  # peer -> OutLane
        self._in_lanes = InLanes(lanes.slots, lanes.slot_bytes) if lanes else None
        self._lanes_in = set()   # peers whose lane into this rank is mapped
        self._lane_errors = {}   # peer -> why its lane could not be mapped
        self._channels = PeerChannels(len(lanes.peers) + 1) if lanes and channel_supported() else None
        self._ctx, self._pull = context, pull
        # ZeroMQ's notification descriptor for the PULL socket: readable when something
        # may have arrived since the socket last processed its commands (see _glance)
        self._pull_signal = select.poll()
        self._pull_signal.register(pull.getsockopt(zmq.FD), select.POLLIN)
        self._cleanup = list(cleanup)  # files to remove at close (the ipc socket)
        self._guard = guard
        self.grace, self.close_wait = grace, close_wait
        self._poll_all = [(pull, zmq.POLLIN)]  # and every monitor socket, channel bell and pidfd
        self._bells = {}  # bell file descriptor -> the peer whose channel it belongs to
        self._channel_to = {}  # peer -> the channel this rank sends to it through
        # per space (collective, point-to-point): payloads below the first number go through
        # a channel (under the plan's channel_max_bytes, and small enough to fit one with
        # their header however that is set); lanes take segments from the second up; ZeroMQ
        # whatever falls between, or when a lane or channel is full. Point-to-point data may
        # wait long for its receive (a pipeline neighbour runs ahead): in a lane slot it waits
        # where it landed, out of a channel it would be copied into the receiver's heap as
        # soon as the receiver looks, so it keeps lanes from SHM_MIN_BYTES.
        inline_below = 0 if self._channels is None else \
            min(lanes.channel_max_bytes, largest_message(self._channels.capacity) - frame.HEADER.size + 1)
        self._limits = ((inline_below, max(SHM_MIN_BYTES, inline_below)),
                        (min(inline_below, SHM_MIN_BYTES), SHM_MIN_BYTES))
        self._connect(context, endpoints, socket_ids, guard, processes)  # (see .connections)
        self._in_flight = collections.deque()  # MessageTrackers of zero-copy sends
        self._monitors_seen = 0.0  # when the monitor sockets were last polled
        self.rejected = 0
        # another thread's way to cut a wait short (see wake): a pipe in the poll
        self._wake_in, self._wake_out = os.pipe()
        os.set_blocking(self._wake_in, False)
        os.set_blocking(self._wake_out, False)
        self._wake_lock = threading.Lock()  # a wake() racing close() never writes a closed fd
        self._poll_all.append((self._wake_in, zmq.POLLIN))
        self._owner = os.getpid()
        liveness.guard_fork(self)

    # -- sending -------------------------------------------------------------------------
    def _send(self, dst, key, sig, payload, nbytes, copy):
        self._check_open_to(dst)
        inline_below, lane_min = self._limits[key.space]
        header = frame.pack(Kind.DATA, self.rank, key, nbytes, sig)
        if nbytes < inline_below:
            channel = self._channel_to.get(dst)
            if channel is not None and channel.try_send(header, payload):
                return None
        elif nbytes >= lane_min:
            lane = self._out_lanes.get(dst)
            if lane is not None and nbytes <= lane.slot_bytes:
                notice = lane.put(payload)
                if notice is not None:
                    return self._post(dst, frame.pack(Kind.SHM, self.rank, key, nbytes, sig), notice, True)
        return self._post_zmq(dst, header, payload, nbytes, copy)  # (the channel was full or absent)

    def _post(self, dst, header, payload, copy=False):
        self._check_open_to(dst)
        nbytes = memoryview(payload).nbytes
        channel = self._channel_to.get(dst)
        if (channel is not None and nbytes < self._limits[0][0] and header[_KIND_AT] not in VIA_ZMQ
                and channel.try_send(header, payload)):  # not sent: full, use ZeroMQ
            return None
        return self._post_zmq(dst, header, payload, nbytes, copy)

    def _post_zmq(self, dst, header, payload, nbytes, copy):
        sock = self._push[dst]
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

    def flush(self, deadline, what):
        while self._in_flight:
            if self._in_flight[0].done:
                self._in_flight.popleft()
                continue
            self._check_waiting(None, None, what)
            if time.monotonic() > deadline:
                raise CommTimeout(f"{what}: rank {self.rank} could not hand its data to the "
                                  f"network before the deadline")
            self._pump(0.005)

    # -- receiving -----------------------------------------------------------------------
    def _pump(self, timeout):  # noqa: C901 - a hot path (once per wait): one body, no helper calls
        channels = self._channels
        dozing = False
        now = time.monotonic()
        if timeout > 0 and channels is not None:
            if channels.wait_briefly(self.eager()):
                if now - self._monitors_seen < MONITOR_INTERVAL:
                    self._drain_channels()  # what the spin found; ZeroMQ waits its turn
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
                    if sock in self._bells:
                        self._on_bell(sock)
                    elif sock == self._wake_in:
                        self._woken()
                    elif sock in self._watch.fds:  # that peer's process ended
                        self._poll_all = [item for item in self._poll_all if item[0] != sock]
                        self._on_exited(self._watch.exited(sock))
                else:
                    self._on_monitor(sock)
        finally:
            if dozing:
                channels.awake()
        if channels is not None:
            self._drain_channels()

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
        if header.kind < Kind.BYE or header.kind == Kind.SHM:  # data: the common case first
            self.mailbox.put(header, payload)
        elif header.kind == Kind.BYE:
            if self._channels is not None:  # what it sent before its goodbye comes first
                self._drain_channels(header.src)
            self._said_bye.add(header.src)
            if header.sig != goodbye.PLAIN:
                self._bye_why[header.src] = goodbye.reason(header.sig, self.world_size)
        elif not self._control(header):  # an ABORT
            self.mailbox.put(header, payload)

    def raise_news(self, comm_id, seq=None):
        # Transport.raise_news with the quick look inlined: it runs twice per collective
        if time.monotonic() - self._monitors_seen >= MONITOR_INTERVAL:
            self._pump(0)
        else:
            self._glance()
        if seq is None:
            self.mailbox.raise_late(comm_id)
        else:
            self.mailbox.raise_notice(comm_id, seq)

    def _glance(self):
        """File what arrived, asking ZeroMQ (a costly option read) only when its descriptor
        says something may have come. Every path that makes the socket process its commands
        (this, :meth:`_drain`, the poll in :meth:`_pump`) drains it until it says nothing is
        left, so a quiet descriptor means no message; and the full poll every
        ``MONITOR_INTERVAL`` would catch one missed anyway."""
        if self._channels is not None:
            self._drain_channels()
        if self._pull_signal.poll(0):
            self._drain_pull()

    def _drain(self):
        if self._channels is not None:
            self._drain_channels()
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
                if header.kind in (Kind.SHM, Kind.LANE) and self._plan is None:
                    raise FrameError("shared-memory message, but this rank uses no lanes")
                if header.kind == Kind.SHM:
                    payload = self._in_lanes.take(header.src, bytes(payload), header.nbytes)
                elif header.kind == Kind.LANE:
                    self._map_lane(header.src)
                    continue
            except FrameError as exc:
                self.rejected += 1
                log.warning("rank %d rejected a frame: %s", self.rank, exc)
                continue
            self._file(header, payload)

    # -- closing ---------------------------------------------------------------------------
    def close(self):
        """Say BYE to every peer (with what this rank's first failure blamed, if one did; see
        :mod:`.connections`), wait (bounded) until each said BYE or is gone, then close.
        After :meth:`stop` it neither flushes nor waits for BYEs: the owner asked not to wait."""
        # stopped: only the BYE itself is still delivered (the sockets' linger)
        deadline = time.monotonic() + (0 if self.stopping is not None else self.close_wait)
        try:
            if self.stopping is None:
                self.flush(deadline, "close")
        except Exception as exc:  # closing must not fail; the data is lost either way
            log.warning("rank %d closing with undelivered data: %s", self.rank, exc)
        self._say_goodbye(deadline)
        self._close_sockets_and_fds()
        for hook in self.before_unmap:
            try:
                hook()
            except Exception as exc:  # noqa: BLE001 - closing must not fail
                log.warning("rank %d: %s", self.rank, exc)
        for lane in self._out_lanes.values():
            lane.close()
        if self._channels is not None:
            self._channels.close()
        if self._in_lanes is not None:
            self._in_lanes.close()
        for path in self._cleanup:
            with contextlib.suppress(OSError):
                os.unlink(path)

    def _close_sockets_and_fds(self):
        """The ZeroMQ sockets (:meth:`_hang_up`, then the PULL socket), the wake pipe, the
        pidfds, the fork guard and the context."""
        self._hang_up()
        self._pull.close(linger=0)
        with self._wake_lock:
            wake_fds, (self._wake_in, self._wake_out) = (self._wake_in, self._wake_out), (-1, -1)
        for fd in wake_fds:
            os.close(fd)
        self._watch.close()
        liveness.unguard_fork(self)
        if self._guard is not None:
            self._guard.stop()
        self._ctx.term()

    def _forked_child(self):
        """In a child forked from this rank (see :mod:`.liveness`): close the child's copies
        of the bells and pidfds, and refuse every use. The ZeroMQ sockets stay as they are
        (closing them in a forked child is unsafe) and are never touched again here; nor is
        anything of the parent's removed at the child's exit."""
        self._watch.close()
        if self._channels is not None:
            self._channels.forget_bells()
        owner, rank = self._owner, self.rank

        def refuse(*args, **kwargs):
            raise CommError(f"rank {rank}'s communicator belongs to process {owner}; process "
                            f"{os.getpid()} was forked from it and cannot use it (it may make "
                            f"a communicator of its own)")
        for name in _PARENT_ONLY:
            setattr(self, name, refuse)
        self.close = lambda: None
