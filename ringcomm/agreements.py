"""The agreements a session takes part in: where their messages go, and how one is run to its
decision over the wire (the protocol itself is :mod:`ringcomm.agreement`'s).

An agreement is named by its communicator and its *epoch* (how many agreements that
communicator ran before; its members run them in the same order). Its messages travel as
AGREE frames (key: the communicator, the epoch as ``seq``, the message's kind as ``step``
and its round as ``segment``), whichever thread moves messages hands them in here, and what
an agreement answers goes out at once. Messages for an agreement this rank has not entered
yet are kept (a bounded number, the oldest dropped first) until it does. The evidence an
agreement goes on is the wire's :meth:`~ringcomm.transport.base.Transport.lost`.

A member that decided may still be needed: if every lower member is lost before all the
others heard the decision, it must lead the next round. So a decided agreement is on *duty*
until it is released: by the caller (a shrink, once the new communicator's first agreement
is decided), or when a later agreement of the same communicator is decided here (every
member that took part in that one had decided this one); meanwhile every wait of the
session, and every agreement running, tends it.

>>> agreements = Agreements(session)
>>> agreements.run(comm_id, 0, members=(0, 1, 2, 3), flag=True, deadline=..., what="shrink")
Value(flag=True, lost=frozenset({2}))
>>> agreements.release((comm_id, 0))
"""
import contextlib
import logging
import time

from . import agreement
from .errors import CommError, CommTimeout
from .transport import frame
from .transport.frame import COLLECTIVE, Kind

log = logging.getLogger(__name__)

EARLY_PER_AGREEMENT = 4  # messages kept per peer for an agreement not entered yet
EARLY_AGREEMENTS = 64    # agreements not entered yet that messages are kept for
TEND_S = 0.02            # how often a wait hands the decided agreements the latest evidence
_NO_SIG = bytes(16)


class Agreements:
    def __init__(self, session):
        self._session = session
        self._running = {}  # (comm id, epoch) -> the Agreement this rank entered
        self._early = {}    # (comm id, epoch) -> [(src, kind, round, body bytes)] before entering
        self.duties = {}    # (comm id, epoch) -> a decided Agreement that may still have to lead
        self.rejected = 0   # agreement messages refused as malformed
        self._next_tend = 0.0

    def deliver(self, header, payload):
        """An AGREE message from the wire."""
        key = header.key
        ident = (key.comm_id, key.seq)
        running = self._running.get(ident)
        if running is not None:
            self._feed(ident, running, header.src, key.step, key.segment, payload)
            return
        early = self._early.get(ident)
        if early is None:
            if len(self._early) >= EARLY_AGREEMENTS:  # the oldest goes: a fresh one must get in
                del self._early[next(iter(self._early))]
                self.rejected += 1
            early = self._early[ident] = []
        if len(early) < EARLY_PER_AGREEMENT * self._session.world_size:
            early.append((header.src, key.step, key.segment, bytes(payload)))
        else:
            self.rejected += 1

    def run(self, comm_id, epoch, members, flag, deadline, what):
        """Enter agreement ``epoch`` of ``comm_id`` over ``members`` (global ranks) with
        ``flag`` and wait for its :class:`~ringcomm.agreement.Value`. Raises
        :class:`CommTimeout` at ``deadline`` naming the ranks it waits for (alive, yet not
        taking part), :class:`CommError` when this rank is stopping or was told two values."""
        session, ident = self._session, (comm_id, epoch)
        if ident in self._running:
            raise CommError(f"{what}: agreement #{epoch} of this communicator ran already on this rank")
        running = self._running[ident] = agreement.Agreement(session.rank, members)
        for src, kind, round_, body in self._early.pop(ident, ()):
            self._feed(ident, running, src, kind, round_, body)
        for stale in [i for i in self._early if i[0] == comm_id and i[1] < epoch]:
            del self._early[stale]  # agreements this rank went past without entering
        self._send(ident, running.enter(flag, session.wire.lost()))
        while not running.idle:
            if session.stopping is not None:
                raise CommError(f"{what}: {session.stopping}")
            lost = session.wire.lost()
            self._send(ident, running.on_lost(lost))
            self._tend(lost)  # an earlier agreement may need this rank to lead meanwhile
            if running.idle:
                break
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                waiting = running.waiting_for()
                raise CommTimeout(f"{what}: ranks {waiting} neither took part in the agreement on "
                                  f"lost ranks nor were found lost; rank {session.rank} gave up",
                                  rank=waiting[0] if waiting else None)
            session.wire.pump(min(remaining, 0.05))
        if running.conflict is not None:
            raise CommError(f"{what}: rank {session.rank} was told two outcomes, {running.decision} "
                            f"and {running.conflict}: a rank found lost was still running")
        # every member that took part in this one has decided the earlier ones of comm_id
        for done in [i for i in self.duties if i[0] == comm_id and i[1] < epoch]:
            self.release(done)
        self.duties[ident] = running
        return running.decision

    def tend(self):
        """Give every decided agreement the latest evidence (one may have to lead a round);
        at most every ``TEND_S``."""
        now = time.monotonic()
        if now < self._next_tend:
            return
        self._next_tend = now + TEND_S
        self._tend(self._session.wire.lost())

    def _tend(self, lost):
        for ident, running in list(self.duties.items()):
            self._send(ident, running.on_lost(lost))

    def release(self, ident):
        """Agreement ``ident`` is decided on every member: it has nothing left to do, and no
        member will ask this rank about it again."""
        self.duties.pop(ident, None)
        self._running.pop(ident, None)

    def _feed(self, ident, running, src, kind, round_, data):
        try:
            body = agreement.unpack(data, self._session.world_size, running.members)
            answers = running.on_message(src, kind, round_, body)
        except (ValueError, TypeError) as exc:  # (on the thread that moves messages: never raise)
            self.rejected += 1
            log.warning("rank %d refused an agreement message from rank %d: %s", self._session.rank, src, exc)
            return
        self._send(ident, answers)

    def _send(self, ident, messages):
        session = self._session
        comm_id, epoch = ident
        for dst, kind, round_, body in messages:
            data = agreement.pack(body, session.world_size)
            header = frame.pack(Kind.AGREE, session.rank, frame.Key(comm_id, COLLECTIVE, epoch, kind, round_),
                                len(data), _NO_SIG)
            with contextlib.suppress(CommError):  # that member is gone: the evidence says so
                session.wire.post(dst, header, data)
