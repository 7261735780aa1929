"""The collective protocol above the wire: what a rank's messages mean, not how they move.

A :class:`Session` owns one transport (the *wire*, :class:`~ringcomm.transport.base.Transport`:
post, pump, flush, check peers, close, lane slots) and everything the layers above ask of
it: the mailbox the wire delivers every arrival into, sends and receives with deadlines, the
point-to-point credit windows (bytes in flight per peer, communicator and tag, returned by a
CREDIT as the receiver takes them), the collective window (:mod:`.transport.credit`), which
collective runs here (``started``/``retire``), the liveness check that finds whom to blame
when a wait times out (PING/PONG, ``probe``), aborts and the news of other ranks' aborts
(``abort``, ``raise_news``), revocation, and the agreements on lost ranks
(``agreements``, see :mod:`ringcomm.agreements`; ``accept_lost``).

The liveness check (:meth:`probe`): this rank asks the collective's other ranks (PING) and
each answers (PONG) whether it has not reached the collective, is inside it, or has finished
it. Whichever thread moves messages answers, so a rank answers while it waits, while it works
between calls (the communication thread moves messages when idle), but not when it is
stopped, hung in native code or gone.

>>> session = Session(hub.transport(0))          # rank 0 of an in-process hub
>>> session.send(1, key, sig, payload)           # rank 0: to rank 1
>>> session.recv(0, key, sig, deadline, "recv")  # rank 1: waits for it, names rank 0 at the deadline
"""
import collections
import contextlib
import struct
import time

from .agreements import Agreements
from .errors import CommError, CommTimeout
from .transport import frame
from .transport.credit import P2P_WINDOW_BYTES, CollectiveCredit
from .transport.frame import COLLECTIVE, POINT_TO_POINT, Kind
from .transport.mailbox import COLLECTIVES, Mailbox, Revocation, abort_sig

NOT_REACHED, INSIDE, FINISHED = 0, 1, 2  # a PONG's answer about one collective
PROBE_WAIT = 1.0  # seconds a liveness check waits for answers
CREDIT = struct.Struct("<Q8x")  # a CREDIT's signature field: the bytes taken


class Session:
    """The protocol over ``wire``. ``collective_window``: collectives a rank may run ahead
    of a peer (see :mod:`.transport.credit`); None: no window (the unit tests' in-process
    transport, whose tests number collectives freely)."""

    def __init__(self, wire, collective_window=None):
        self.wire = wire
        self.rank, self.world_size = wire.rank, wire.world_size
        self.collective_window = collective_window
        self.window = P2P_WINDOW_BYTES
        self.mailbox = Mailbox(self.window, collective_window)
        self.credit = None if collective_window is None else CollectiveCredit(
            self.rank, collective_window, lambda *message: self.wire.post(*message), lambda comm_id: self.mailbox.retired(comm_id) + 1)
        # comm id -> why every call on that communicator fails: set by a rank that revokes
        # it (from any thread: see ringcomm.threads) and by another rank's Revoked abort
        self.revoked = self.mailbox.revoked
        self.unannounced = {}  # comm id -> (members, why): a revocation not yet told to them
        # the first error a call on this rank failed with, set by the layers above: a rank
        # that closes after a failure says whom that error blamed (see .transport.connections)
        self.first_failure = None
        self.stopping = None  # why every wait now fails: the owner is closing (see stop)
        self._unacked = collections.defaultdict(int)  # (peer, comm, tag) -> bytes in flight
        self.running = {}   # comm id -> sequence number of the collective running here
        self._answers = {}  # peer -> its PONG state for the probe in progress
        self._probing = None  # (comm id, seq) of the probe in progress
        self.agreements = Agreements(self)  # on lost ranks (see ringcomm.agreements)
        self.members = {}  # comm id -> its members (global ranks), as each communicator is made
        # the wire's methods are looked up at each call, never bound here: in a child forked
        # from this rank the wire replaces them with refusals (see transport.liveness)
        wire.attach(self.deliver, lambda what: self._check_waiting(None, None, what))

    # what the wire itself is (hosts, lane peers, spin policy, refused frames) is read on
    # ``wire``; a staged device registers here what must run before the lanes are unmapped
    @property
    def before_unmap(self):
        """Called before shared memory is unmapped at close (see ringcomm.device)."""
        return self.wire.before_unmap

    # -- what arrives ------------------------------------------------------------------------
    def deliver(self, header, payload):
        """Every arrival the wire does not keep for itself (it keeps BYE and LANE): data into
        the mailbox; control messages answered here; an ABORT filed as a notice."""
        # data (the common case) first; a control message is answered; what is left, an ABORT
        if header.kind < Kind.BYE or header.kind == Kind.SHM or not self._control(header, payload):
            self.mailbox.put(header, payload)

    def started(self, comm_id, seq):
        """Collective ``seq`` of ``comm_id`` is running on this rank (for PONG answers)."""
        self.running[comm_id] = seq

    def _state(self, comm_id, seq):
        if seq <= self.mailbox.retired(comm_id):
            return FINISHED
        return INSIDE if self.running.get(comm_id) == seq else NOT_REACHED

    def _control(self, header, payload):
        """Handle a control message (PING, PONG, CREDIT, WANT, GRANT, AGREE); True if
        ``header`` was one."""
        if self.mailbox.quiet:  # it answers again
            self.mailbox.quiet.pop(header.src, None)
        if header.kind == Kind.PING:
            key = header.key
            answer = frame.Key(key.comm_id, COLLECTIVE, key.seq, self._state(key.comm_id, key.seq), 0)
            with contextlib.suppress(CommError):  # the asker is gone: nobody to answer
                self.wire.post(header.src, frame.pack(Kind.PONG, self.rank, answer, 0, bytes(16)), b"")
            return True
        if header.kind == Kind.CREDIT:
            flow = (header.src, header.key.comm_id, header.key.step)
            self._unacked[flow] = max(0, self._unacked[flow] - CREDIT.unpack(header.sig)[0])
            return True
        if header.kind == Kind.PONG:
            if self._probing == (header.key.comm_id, header.key.seq):
                self._answers[header.src] = header.key.step
            return True
        if header.kind == Kind.WANT or header.kind == Kind.GRANT:
            if self.credit is not None:
                on = self.credit.on_want if header.kind == Kind.WANT else self.credit.on_grant
                on(header.src, header.key.comm_id, header.key.seq)
            return True
        if header.kind == Kind.AGREE:
            self.agreements.deliver(header, payload)
            return True
        return False

    # -- blame -------------------------------------------------------------------------------
    def probe(self, peers, comm_id, seq, wait=PROBE_WAIT):
        """Ask ``peers`` (global ranks) about collective ``seq``; waits ``wait`` s at most.

        Returns ``(silent, not_reached)``: the peers that did not answer (stopped, hung, or
        gone) and those that answered but have not started the collective."""
        others = [p for p in peers if p != self.rank]
        self._probing, self._answers = (comm_id, seq), {}
        ping = frame.pack(Kind.PING, self.rank, frame.Key(comm_id, COLLECTIVE, seq, 0, 0), 0, bytes(16))
        for peer in others:
            with contextlib.suppress(Exception):  # a peer that cannot be asked stays silent
                self.wire.post(peer, ping, b"")
        deadline = time.monotonic() + wait
        while len(self._answers) < len(others) and time.monotonic() < deadline:
            self.wire.pump(0.02)
        answers, self._probing = self._answers, None
        silent = [p for p in others if p not in answers]
        now = time.monotonic()
        for peer in silent:  # until it is heard from, later waits for it fail at once
            self.mailbox.quiet.setdefault(peer, now)
        return silent, [p for p in others if answers.get(p) == NOT_REACHED]

    def _check_quiet(self, peer, what):
        """Raise :class:`CommTimeout` if ``peer`` failed a liveness check at least
        ``PROBE_WAIT`` ago and nothing came from it since (a late answer to that check
        clears it): a queue of calls behind a stopped rank fails call by call at once, not
        one deadline each."""
        since = self.mailbox.quiet.get(peer)
        if since is not None and time.monotonic() - since >= PROBE_WAIT:
            self.wire.pump(0)  # its answer may be in, unread
            since = self.mailbox.quiet.get(peer)
        if since is not None and time.monotonic() - since >= PROBE_WAIT:
            raise CommTimeout(f"{what}: rank {peer} stopped answering (it did not answer a "
                              f"liveness check {time.monotonic() - since:.1f} s ago and nothing "
                              f"came from it since); rank {self.rank} gave up",
                              rank=peer, cause="silent")

    def _check_waiting(self, peer, comm_id, what, space=COLLECTIVE):
        """What every wait for ``peer`` checks as it goes round: that it is not gone, nor
        quiet since a liveness check, and (``comm_id``: of the call's communicator; ``space``:
        whether it is a collective or a point-to-point call) that the call was not revoked."""
        if self.stopping is not None:
            raise CommError(f"{what}: {self.stopping}")
        if self.agreements.duties:  # before a loss raises below: it may be what they need
            self.agreements.tend()
        # a revocation first: the rank that revoked may have closed since, and its goodbye
        # must not hide why the call fails
        if self.revoked and comm_id is not None:
            self.check_revoked(comm_id, space == POINT_TO_POINT)
        # a loss fails the waits of the communicators it belongs to, not the others'
        self.wire.check_peers(what, peer, None if comm_id is None else self.members.get(comm_id))
        if self.mailbox.quiet:
            self._check_quiet(peer, what)

    # -- sending -----------------------------------------------------------------------------
    def send(self, dst, key, sig, payload, copy=False):
        """Send ``payload`` (a contiguous array or bytes) to global rank ``dst``; returns
        the tracker of a zero-copy send, else ``None``. ``copy=True``: never zero-copy."""
        nbytes = payload.nbytes if hasattr(payload, "nbytes") else len(payload)
        if key.space == POINT_TO_POINT:
            self._unacked[(dst, key.comm_id, key.step)] += nbytes
        return self.wire.send_data(dst, key, sig, payload, nbytes, copy)

    def take_slot(self, dst, key, nbytes):
        """A lane slot to ``dst`` for an ``nbytes`` segment of ``key`` (see the wire's):
        ``(slot, writable uint8 array)``, or ``None``. Fill it, then :meth:`send_slot`, or
        :meth:`give_back_slot`."""
        return self.wire.take_slot(dst, key, nbytes)

    def send_slot(self, dst, key, sig, slot, nbytes):
        """Send the ``nbytes`` segment written into the taken ``slot`` to ``dst``."""
        if key.space == POINT_TO_POINT:
            self._unacked[(dst, key.comm_id, key.step)] += nbytes
        self.wire.send_slot(dst, key, sig, slot, nbytes)

    def give_back_slot(self, dst, slot):
        """Free a slot taken with :meth:`take_slot` and never sent."""
        self.wire.give_back_slot(dst, slot)

    def slot_of(self, payload):
        """The whole lane slot (a uint8 array) a received ``payload`` lies in, or ``None``."""
        return self.wire.slot_of(payload)

    def flush(self, deadline, what):
        """Block until every payload handed to :meth:`send` may be reused by the caller."""
        self.wire.flush(deadline, what)

    # -- point-to-point flow control (see ringcomm.p2p) -------------------------------------
    def window_left(self, flow):
        """Bytes of point-to-point data this rank may still send on ``flow`` (peer,
        communicator id, tag) before the receiver takes any."""
        return self.window - self._unacked[flow]

    def window_open(self, flow, nbytes, staged=0):
        """True if ``nbytes`` more may go on ``flow`` now (always when nothing is in flight);
        ``staged``: bytes queued for ``flow`` but not yet handed over, counted as in flight."""
        in_flight = self._unacked[flow] + staged
        return in_flight == 0 or in_flight + nbytes <= self.window

    # -- stopping and revoking ---------------------------------------------------------------
    def wake(self):
        """Safe from any thread: cut short the sleep of a wait in progress."""
        self.wire.wake()

    def stop(self, why):
        """Safe from any thread: every wait in progress or to come fails with
        :class:`CommError` saying ``why`` (the owner closes without waiting for its calls)."""
        self.stopping = why
        self.wire.wake()

    def revoke(self, comm_id, members, why, code=COLLECTIVES, rank=None):
        """Safe from any thread: revoke ``comm_id`` here (its collectives fail, and with
        ``code`` :data:`~.transport.mailbox.EVERY_CALL` or ``LOST`` its point-to-point calls
        too, ``rank`` the first lost; a wait in progress wakes to see it) and note that
        ``members`` are still to be told (:meth:`announce_revoked`). False if it was revoked
        already as strongly (here or elsewhere, and then every member was told)."""
        known = self.revoked.get(comm_id)
        if known is not None and known.code >= code:  # a stronger one (more calls fail) replaces it
            return False
        revocation = Revocation(why, code, rank)
        self.unannounced[comm_id] = (members, revocation)
        self.revoked[comm_id] = revocation
        self.wire.wake()
        return True

    def announce_revoked(self, comm_id):
        """Tell every member of ``comm_id`` once that this rank revoked it (a Revoked abort,
        which revokes it there); a member that cannot be told does not stop the others."""
        pending = self.unannounced.pop(comm_id, None)
        if pending is None:
            return
        members, revocation = pending
        for dst in members:
            with contextlib.suppress(CommError):  # gone: its loss is reported on its own
                self.abort([dst], comm_id, 0, revocation.error(), revocation.code)

    def check_revoked(self, comm_id, point_to_point=False):
        """Raise :class:`Revoked` (:class:`RanksLost` when ranks were lost) if communicator
        ``comm_id`` was revoked here or elsewhere: its collectives fail; its point-to-point
        calls, numbered per peer and tag, go on after a revocation of the collectives
        alone (two threads)."""
        revocation = self.revoked.get(comm_id)
        if revocation is not None and not (point_to_point and revocation.code == COLLECTIVES):
            raise revocation.error()

    # -- collective flow control (see .transport.credit) -------------------------------------
    def room(self, dst, comm_id, seq):
        """True if data of collective ``seq`` of ``comm_id`` may go to ``dst`` now."""
        return self.credit is None or self.credit.room(dst, comm_id, seq)

    def await_room(self, dst, comm_id, seq, deadline, what):
        """Wait until data of collective ``seq`` of ``comm_id`` may go to global rank ``dst``
        (it has finished collective ``seq - window``); moves messages meanwhile. Raises
        :class:`CommTimeout` naming ``dst`` at ``deadline``, :class:`PeerLost` if it is gone."""
        credit = self.credit
        if credit is None or credit.room(dst, comm_id, seq):
            return
        credit.stalls += 1
        while not credit.room(dst, comm_id, seq):
            self._check_waiting(dst, comm_id, what)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise CommTimeout(
                    f"{what}: rank {dst} has not finished collective #{seq - credit.window} "
                    f"(this rank may run {credit.window} collectives ahead of it); rank "
                    f"{self.rank} gave up waiting", rank=dst)
            self.wire.pump(min(remaining, 0.05))

    # -- receiving ---------------------------------------------------------------------------
    def has_left(self, peer):
        """True once ``peer`` said goodbye: it sends nothing more, and what it sent before
        is in the mailbox already (a BYE is taken in behind its sender's data)."""
        return self.wire.has_left(peer)

    def check(self, peer, deadline, what, comm_id=None, space=POINT_TO_POINT):
        """Raise if ``peer`` (None: no one in particular) is gone, ``deadline`` passed, or
        (``comm_id`` given) the call, of ``space``, was revoked (for a wait outside
        :meth:`recv`)."""
        self._check_waiting(peer, comm_id, what, space)
        if time.monotonic() > deadline:
            raise CommTimeout(f"{what}; rank {self.rank} gave up", rank=peer)

    def _take(self, src, key, sig):
        """The mailbox's payload for ``key`` (or ``None``); taking point-to-point data
        returns its bytes to the sender's window (a CREDIT)."""
        payload = self.mailbox.take(src, key, sig)
        if payload is not None and key.space == POINT_TO_POINT:
            credit = CREDIT.pack(memoryview(payload).nbytes)
            try:  # noqa: SIM105 - every receive passes here: try costs nothing, suppress ~0.5 µs
                self.wire.post(src, frame.pack(Kind.CREDIT, self.rank, key, 0, credit), b"")
            except CommError:  # the sender is gone: nobody waits for the credit
                pass
        return payload

    def pump(self, timeout):
        """Let arrived messages in (used by the engine while deferred work waits)."""
        self.wire.pump(timeout)

    def poll(self, src, key, sig, deadline, what):
        """Like :meth:`recv` but never waits: the payload, or ``None`` if not here yet."""
        payload = self._take(src, key, sig)
        if payload is None:
            self._check_waiting(src, key.comm_id, what, key.space)
            if time.monotonic() > deadline:
                raise CommTimeout(f"{what}: timed out waiting for rank {src}; rank {self.rank} gave up")
        return payload

    def recv(self, src, key, sig, deadline, what):
        """The payload of message ``key`` from global rank ``src`` (a buffer), waiting
        until ``deadline`` (``time.monotonic()``) at most."""
        while True:
            payload = self._take(src, key, sig)
            if payload is not None:
                return payload
            self._check_waiting(src, key.comm_id, what, key.space)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise CommTimeout(
                    f"{what}: timed out waiting for rank {src} "
                    f"(step {key.step}, segment {key.segment}); rank {self.rank} gave up")
            self.wire.pump(min(remaining, 0.1))

    # -- the news of other ranks' failures, and this rank's ------------------------------------
    def raise_news(self, comm_id, seq=None):
        """Let arrived messages in, then raise what other ranks reported about communicator
        ``comm_id`` (an :class:`~.transport.mailbox.AbortNotice`): without ``seq``, an abort
        of a collective that had already ended here; with ``seq``, an abort of collective
        ``seq``."""
        self.wire.pump(0)
        if seq is None:
            self.mailbox.raise_late(comm_id)
        else:
            self.mailbox.raise_notice(comm_id, seq)

    def abort(self, peers, comm_id, seq, exc, code=None):
        """Tell ``peers`` (global ranks) that collective ``seq`` failed here, and why
        (``code``: the wire code, when not that of ``exc``'s class)."""
        reason = str(exc).encode("utf-8")[: frame.MAX_ABORT_BYTES]
        sig, key = abort_sig(exc, code), frame.Key(comm_id, COLLECTIVE, seq, 0, 0)
        for dst in peers:
            if dst != self.rank:
                # that peer is gone (its loss is reported on its own); the rest must hear
                with contextlib.suppress(CommError):
                    self.wire.post(dst, frame.pack(Kind.ABORT, self.rank, key, len(reason), sig), reason)

    def accept_lost(self, comm_id, lost):
        """The survivors of ``comm_id`` agreed that ``lost`` (global ranks) are lost: waits
        for other peers stop failing for them, what ``comm_id`` still holds is dropped, and
        the failure that started it no longer colours this rank's goodbye."""
        self.wire.forget(lost)
        self.mailbox.forget(comm_id)
        self.first_failure = None

    def retire(self, comm_id, seq, failed=False):
        """Collective ``seq`` of ``comm_id`` ended here (``failed``: with an error)."""
        self.mailbox.retire(comm_id, seq, failed)
        if self.credit is not None:
            self.credit.on_retire(comm_id)

    def close(self):
        """Tell peers this rank is done (with whom its first failure blamed) and release the
        wire; after :meth:`stop` (before this or while it waits), without waiting any more."""
        self.wire.close(failure=self.first_failure, waiting=lambda: self.stopping is None)
