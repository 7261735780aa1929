"""Messages that arrived before anyone asked for them.

Messages from different peers arrive interleaved on one socket; the mailbox keeps each one
under its full identity (src, comm, space, seq, step, segment) until the algorithm asks for
exactly that one. It also remembers, per collective, the signature each peer announced, so a
rank that waits for one peer learns of a mismatch sent by any other, and the ABORTs other
ranks sent, as :class:`AbortNotice`: filed under their collective while it is still open
here, or as *late* news about a communicator when that collective already ended here. A wait
on the communicator raises the notice as it came; what it means to the caller (which error,
in which words, whether to tell the other ranks) is decided by :mod:`ringcomm.collective`.

A collective that finished is *retired*: late messages for it (from a collective that failed
half-way) are dropped, never delivered to a later collective; so are ABORTs of a collective
that failed here too (this rank has reported a failure already). Collective data more than
``window`` collectives past the last one retired comes from a peer that ignored its credits
(see :mod:`.credit`): it is refused, and the collective it was for fails naming that peer.
"""
import logging
import struct
from collections import defaultdict
from typing import NamedTuple

from ..errors import (TIMEOUT_CAUSES, CollectiveMismatch, CommError, CommTimeout, PeerLost, RanksLost, Revoked,
                      SignatureMismatch)
from .frame import COLLECTIVE, POINT_TO_POINT, Kind

log = logging.getLogger(__name__)

# an abort's signature field: error class, the rank it blames, why (a timeout's cause)
ABORT_SIG = struct.Struct("<BIB10x")
NO_RANK = 0xFFFFFFFF
MAX_REFUSALS = 1024  # refused collectives remembered (each fails naming its sender)
ABORT_CLASSES = {1: CollectiveMismatch, 2: CommTimeout, 3: PeerLost, 4: CommError, 5: Revoked, 6: Revoked,
                 7: RanksLost}
ABORT_CODES = {CollectiveMismatch: 1, CommTimeout: 2, PeerLost: 3, CommError: 4, Revoked: 5, RanksLost: 7}
# the codes of the revocations: of the collectives alone (two threads), of every call
# (comm.revoke()), of every call because ranks were lost (comm.shrink())
COLLECTIVES, EVERY_CALL, LOST = 5, 6, 7


class Revocation(NamedTuple):
    """Why every call on a communicator fails (``code``: :data:`COLLECTIVES`: its
    collectives alone; :data:`EVERY_CALL`, :data:`LOST`: its point-to-point calls too, and
    ``rank`` the first rank lost)."""

    why: str
    code: int = COLLECTIVES
    rank: int | None = None

    def error(self):
        return RanksLost(self.why, self.rank) if self.code == LOST else Revoked(self.why)


def abort_code(exc):
    """The wire code of an exception's class (its most specific known base)."""
    for cls in type(exc).__mro__:
        if cls in ABORT_CODES:
            return ABORT_CODES[cls]
    return 4


def abort_sig(exc, code=None):
    """An ABORT's ``sig`` for ``exc`` (a goodbye after a failure carries the same): its
    class's code (or ``code``), the rank it blames (``.rank``), a timeout's cause (``.cause``)."""
    blamed, cause = getattr(exc, "rank", None), getattr(exc, "cause", None)
    return ABORT_SIG.pack(abort_code(exc) if code is None else code,
                          blamed if type(blamed) is int and 0 <= blamed < NO_RANK else NO_RANK,
                          TIMEOUT_CAUSES.index(cause) if cause in TIMEOUT_CAUSES else 0)


class AbortNotice(CommError):
    """Rank ``src``'s ABORT of collective ``seq`` of communicator ``comm_id``, as it came: the
    class of its error (``kind``), the rank it blames (``rank``, or None), why (``cause``, for
    a timeout) and its message (``reason``)."""

    def __init__(self, src, comm_id, seq, kind, rank, cause, reason):
        super().__init__(f"rank {src} aborted collective #{seq}: {reason}")
        self.src, self.comm_id, self.seq = src, comm_id, seq
        self.kind, self.rank, self.cause, self.reason = kind, rank, cause, reason


class Mailbox:
    def __init__(self, window=None, collective_window=None):
        self.window = window  # point-to-point bytes a sender may leave unreceived here
        # how many collectives past the last retired one data may come for (None: any)
        self.collective_window = collective_window
        self._p2p_pending = defaultdict(int)  # (src, comm, tag) -> point-to-point bytes not taken
        self._flooded = {}                    # (src, comm, tag) -> why its data was refused
        self._too_early = {}                  # (comm, seq) -> rank whose data for it was refused
        self._messages = {}
        # the first segments of point-to-point messages here -> their order of arrival (a
        # receive from any source takes the first: see first_arrived)
        self._arrivals, self._arrived = {}, 0
        self._signatures = defaultdict(dict)  # (comm, seq) -> {src: sig}
        self._notices = {}                    # (comm, seq) -> AbortNotice of an open collective
        self._late = {}                       # comm -> AbortNotice of a collective ended here
        self._retired = {}                    # comm -> highest retired seq
        self._failed_upto = {}                # comm -> highest seq that failed here
        self.revoked = {}                     # comm -> why calls on it fail (a Revocation)
        # peer -> when it failed to answer a liveness check, until anything comes from it
        self.quiet = {}
        self.dropped = 0

    def put(self, header, payload):  # noqa: C901 - a hot path (once per message): one body, no helper calls
        """File one validated message."""
        if self.quiet:
            self.quiet.pop(header.src, None)
        key = header.key
        if header.kind == Kind.ABORT and key.space != COLLECTIVE:
            self.dropped += 1  # aborts concern collectives only
            return
        if header.kind == Kind.ABORT:
            code, lost, cause = ABORT_SIG.unpack(header.sig)
            notice = AbortNotice(header.src, key.comm_id, key.seq, ABORT_CLASSES.get(code, CommError),
                                 None if lost == NO_RANK else lost,
                                 TIMEOUT_CAUSES[cause] if cause < len(TIMEOUT_CAUSES) else None,
                                 bytes(payload).decode("utf-8", "replace"))
            if COLLECTIVES <= code <= LOST:  # revoked there: here too, whatever this rank has seen
                known = self.revoked.get(key.comm_id)
                if known is None or known.code < code:  # a stronger revocation replaces a weaker
                    self.revoked[key.comm_id] = Revocation(notice.reason, code, notice.rank)
                return  # every wait on it checks the revocation: no notice to keep
            if key.seq <= self._failed_upto.get(key.comm_id, -1):
                return  # this rank failed that collective, or a later one: it has told its caller
            if key.seq <= self._retired.get(key.comm_id, -1):
                self._late.setdefault(key.comm_id, notice)  # the first news, as for open ones
            else:
                self._notices.setdefault((key.comm_id, key.seq), notice)
            return
        retired = self._retired.get(key.comm_id, -1) if key.space == COLLECTIVE else None
        if retired is not None and key.seq <= retired:
            self.dropped += 1
            return
        if retired is not None and self.collective_window is not None and \
                key.seq > retired + self.collective_window:
            if not self._too_early:  # logged once: a flood must not flood the log too
                log.error("rank %d sends data for collective #%d while this rank has finished "
                          "only up to #%d, past the window of %d collectives it was granted: "
                          "refusing it", header.src, key.seq, retired, self.collective_window)
            if len(self._too_early) < MAX_REFUSALS:  # (memory for the evidence is bounded too)
                self._too_early.setdefault((key.comm_id, key.seq), (header.src, retired))
            self.dropped += 1
            return
        ident = (header.src, *key)
        if ident in self._messages:
            log.warning("dropping duplicate message %s from rank %d", key, header.src)
            self.dropped += 1
            return
        if key.space == POINT_TO_POINT and self.window is not None:
            flow = (header.src, key.comm_id, key.step)  # a window per peer, communicator and tag
            nbytes, pending = memoryview(payload).nbytes, self._p2p_pending[flow]
            if pending and pending + nbytes > self.window:  # a sender ignoring its window
                if flow not in self._flooded:
                    log.error("rank %d sends point-to-point data with tag %d past the "
                              "flow-control window (%d bytes unreceived): refusing it",
                              header.src, key.step, pending)
                self._flooded[flow] = (f"{pending} bytes of point-to-point data with tag {key.step} "
                                       f"unreceived, past the flow-control window of {self.window}")
                self.dropped += 1
                return
            self._p2p_pending[flow] = pending + nbytes
        self._messages[ident] = (header.sig, payload)
        if key.space == POINT_TO_POINT and key.segment == 0:
            self._arrivals[ident] = self._arrived
            self._arrived += 1
        if key.space == COLLECTIVE:
            self._signatures[(key.comm_id, key.seq)].setdefault(header.src, header.sig)

    def raise_late(self, comm_id):
        """Raise (once) the notice of an abort of a collective of ``comm_id`` that had already
        ended here."""
        if comm_id in self._late:
            raise self._late.pop(comm_id)

    def raise_notice(self, comm_id, seq):
        """Raise the notice of an abort of collective ``seq``, if one has arrived."""
        notice = self._notices.get((comm_id, seq))
        if notice is not None:
            raise notice

    def take(self, src, key, sig):  # noqa: C901 - a hot path (once per receive): one body, no helper calls
        """The payload of message ``key`` from ``src``, or ``None`` if it has not arrived.

        Raises an :class:`AbortNotice` another rank sent for this collective or for one that
        ended here, or :class:`SignatureMismatch` when any peer announced a different
        signature for it.
        """
        if key.space == COLLECTIVE:
            if self._late and key.comm_id in self._late:
                raise self._late.pop(key.comm_id)
            early = self._too_early.get((key.comm_id, key.seq)) if self._too_early else None
            if early is not None:
                done = f"only up to #{early[1]}" if early[1] >= 0 else "none"
                raise CommError(f"rank {early[0]} ignored its flow-control credits: it sent data "
                                f"for collective #{key.seq} while this rank had finished {done} "
                                f"(a window of {self.collective_window} collectives); its data "
                                f"was refused")
            if self._notices:
                self.raise_notice(key.comm_id, key.seq)
            signed = self._signatures.get((key.comm_id, key.seq))
            if signed:
                for peer, theirs in signed.items():
                    if theirs != sig:
                        raise SignatureMismatch(peer, theirs, sig)
        if key.space == POINT_TO_POINT and self._flooded:
            self._refuse_flooded(src, key)
        item = self._messages.pop((src, *key), None)
        if item is None:
            return None
        if key.space == POINT_TO_POINT:
            if key.segment == 0:
                self._arrivals.pop((src, *key), None)
            if self.window is not None:
                self._p2p_pending[(src, key.comm_id, key.step)] -= memoryview(item[1]).nbytes
        if item[0] != sig:
            raise SignatureMismatch(src, item[0], sig)
        return item[1]

    def first_arrived(self, candidates):
        """Of ``candidates`` (``(src, key)`` of point-to-point messages' first segments), the
        index of the one that arrived first; None if none is here. Raises like :meth:`take`
        for a candidate whose sender's data was refused.

        >>> box.first_arrived([(1, Key(0, 1, 4, 7, 0)), (2, Key(0, 1, 0, 7, 0))])  # 1 if rank 2's came first
        """
        first = None
        for i, (src, key) in enumerate(candidates):
            if self._flooded:
                self._refuse_flooded(src, key)
            order = self._arrivals.get((src, *key))
            if order is not None and (first is None or order < first[0]):
                first = (order, i)
        return None if first is None else first[1]

    def _refuse_flooded(self, src, key):
        flow = (src, key.comm_id, key.step)
        if flow in self._flooded:
            raise CommError(f"rank {src} sent more than a well-behaved rank can "
                            f"({self._flooded[flow]}); its data was refused")

    def forget(self, comm_id):
        """Drop every message and notice of ``comm_id`` (revoked and replaced: nothing of it
        will be taken)."""
        self._messages = {i: m for i, m in self._messages.items() if i[1] != comm_id}
        self._arrivals = {i: n for i, n in self._arrivals.items() if i[1] != comm_id}
        self._notices = {k: n for k, n in self._notices.items() if k[0] != comm_id}
        self._signatures = defaultdict(dict, {k: v for k, v in self._signatures.items() if k[0] != comm_id})
        self._p2p_pending = defaultdict(int, {f: n for f, n in self._p2p_pending.items() if f[1] != comm_id})
        self._late.pop(comm_id, None)

    def retired(self, comm_id):
        """The highest retired sequence number of ``comm_id`` (-1: none yet)."""
        return self._retired.get(comm_id, -1)

    def retire(self, comm_id, seq, failed=False):
        """Collective ``seq`` of ``comm_id`` is over: forget it and drop its stragglers."""
        self._retired[comm_id] = max(seq, self._retired.get(comm_id, -1))
        if failed:
            self._failed_upto[comm_id] = max(seq, self._failed_upto.get(comm_id, -1))
            late = self._late.get(comm_id)
            if late is not None and late.seq <= seq:
                # this failure has been reported on every rank already: news of an older
                # collective must not fail the next one a second time
                del self._late[comm_id]
        self._signatures.pop((comm_id, seq), None)
        self._notices.pop((comm_id, seq), None)
        if self._too_early:
            self._too_early = {k: v for k, v in self._too_early.items() if k[0] != comm_id or k[1] > seq}
        if self._messages:  # (most collectives end with nothing left over)
            stale = [i for i in self._messages if i[1] == comm_id and i[2] == 0 and i[3] <= seq]
            for ident in stale:
                del self._messages[ident]
            self.dropped += len(stale)
