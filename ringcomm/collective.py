"""One call's life on the communication thread, from first message to retirement.

A communicator turns each call into a :class:`Call` (its identity: communicator, space,
sequence number, signature) and hands :meth:`Call.run` to the engine. ``run`` is where the
policy of a collective lives, once for every verb:

1. let arrived news in (goodbyes, aborts, lost peers) and raise the error an earlier
   collective left on this communicator (it failed on another rank after this one finished);
2. run the algorithm's body over a :class:`~ringcomm.link.Link`; a body that must wait for
   messages without holding the thread (a receive, a send waiting for credit) returns a
   :class:`~ringcomm.engine.Deferred`, which the call wraps so that its completion is
   counted and a mismatch it meets is described like any other;
3. wait until every byte sent may be reused (:meth:`flush`), then look once more for an
   abort of this collective sent by a rank that failed it;
4. on failure, tell every other rank why (an ABORT), describing a signature mismatch in
   words; in every case retire the sequence number so late messages for it are dropped.

Another rank's ABORT reaches a call as an :class:`~ringcomm.transport.mailbox.AbortNotice`
(see :func:`error_for`): an abort of this very collective is raised as the error it reports,
marked ``remote`` so that it is not sent round again; an abort of a collective that already
ended here (this rank only sent in it) fails this call instead, and this rank tells the
others, so no rank goes on as if nothing had happened.

Point-to-point calls (``Space.POINT_TO_POINT``) skip what only collectives need (poison,
aborts, retirement): they are numbered per peer and tag, not in the communicator's
collective order.
"""
import contextlib
import time
from dataclasses import dataclass

from . import signature
from .engine import Deferred
from .errors import CollectiveMismatch, CommError, CommTimeout, PeerLost, Revoked, SignatureMismatch
from .link import Link
from .transport.frame import COLLECTIVE, Space
from .transport.mailbox import AbortNotice


def describe_mismatch(what, me, exc):
    """The :class:`CollectiveMismatch` for a :class:`SignatureMismatch` seen by global rank
    ``me``: both sides in words."""
    return CollectiveMismatch(f"{what}: rank {me} called {signature.describe(exc.ours)} "
                              f"but rank {exc.src} called {signature.describe(exc.theirs)}")


def error_for(notice, seq):
    """The error collective ``seq`` raises for another rank's abort ``notice``."""
    if notice.seq == seq:
        exc = notice.kind(f"rank {notice.src} aborted: {notice.reason}")
        exc.remote = True
    else:
        exc = notice.kind(f"collective #{notice.seq} on this communicator failed on rank "
                          f"{notice.src}: {notice.reason}")
    if notice.rank is not None:
        exc.rank = notice.rank
    if isinstance(exc, CommTimeout):
        exc.cause = notice.cause
    return exc


@dataclass(eq=False, kw_only=True)  # a call is itself: never equal to another with equal fields
class Call:
    """One collective or point-to-point call of a communicator (``comm``)."""

    comm: object      # the Communicator: ranks, rank, comm_id, timeout, segment size, stats
    body: object      # body(link) -> None, or a Deferred that completes the call
    space: Space
    seq: int
    sig: bytes
    dtype: object
    what: str         # names the call in every error: "all_reduce #7 on world"
    device: object    # stages device arrays, or the host device
    result: object    # what the caller gets back
    ready: object = None       # device.ready() on the submitting thread
    completion: object = None  # device.done() once the device work is all queued

    def run(self, session):  # noqa: C901 - a hot path (every call runs it once): one body, no helper calls
        comm, space, seq = self.comm, self.space, self.seq
        link = Link(session, ranks=comm.ranks, rank=comm.rank, comm_id=comm.comm_id, space=space,
                    seq=seq, sig=self.sig, dtype=self.dtype, segment_bytes=comm.segment_bytes,
                    deadline=time.monotonic() + comm.timeout, what=self.what, stats=comm._stats,
                    device=self.device, topology=comm.topology)
        failed = True
        try:
            if space == COLLECTIVE:
                session.raise_news(comm.comm_id)
                if session.revoked:
                    session.check_revoked(comm.comm_id)
            else:
                session.pump(0)
                if session.revoked:  # every call fails after comm.revoke() or a loss
                    session.check_revoked(comm.comm_id, point_to_point=True)
            if self.device.staged:  # the host device has nothing to order or stage
                deferred = self._on_device(self.ready, lambda: _drained(link, lambda: self.body(link)),
                                           lambda d: d is None)
            else:
                deferred = self.body(link)
            if deferred is not None:  # a deferred send copies what it sends: nothing to flush
                return self._finishing(link, deferred)
            session.flush(link.deadline, self.what)
            if space == COLLECTIVE:  # another rank may have aborted a collective this one only sent in
                session.raise_news(comm.comm_id, seq)
                if session.revoked:  # revoked while it ran: its data may be another thread's
                    session.check_revoked(comm.comm_id)
            failed = False
        except SignatureMismatch as exc:
            error = describe_mismatch(self.what, comm.ranks[comm.rank], exc)
            self._abort(session, error)
            raise error from None
        except AbortNotice as notice:
            raise self._told(session, notice) from None
        except PeerLost as exc:
            # a peer that aborted this collective and closed: its ABORT may travel another
            # path than its goodbye and be read after it; it, not the goodbye, says why
            notice = self._notice(session) if space == COLLECTIVE else None
            if notice is None:
                self._abort(session, exc)
                raise
            raise self._told(session, notice) from None
        except CommTimeout as exc:
            error = exc.after(comm.timeout)
            self._abort(session, error)
            raise error from None
        except Exception as exc:
            self._abort(session, exc)
            raise
        finally:
            if space == COLLECTIVE:
                session.retire(comm.comm_id, seq, failed)
        comm._stats.collectives += 1
        if session.first_failure is not None:  # recovered: a goodbye now blames nobody
            session.first_failure = None
        return self.result

    def _on_device(self, ready, step, finished):
        """``step()`` with its device work on the device's stream, after ``ready``; once
        ``finished(what step returned)``, the call's completion event is recorded."""
        with self.device.running(ready):
            outcome = step()
            if finished(outcome):
                self.completion = self.device.done()
        return outcome

    def join(self, synchronize=False):
        """On the thread that waited for this call: order its next device work after the
        call's (``synchronize``: block until the device work is done); see ringcomm.device."""
        if self.completion is not None:
            self.device.join(self.completion, synchronize)

    def _finishing(self, link, deferred):
        """The call's :class:`Deferred` over a point-to-point body's ``deferred``: counted
        once when it completes; its result is the body's where the body has one (a receive
        from any source: the peer it took from), else the call's. It may go on in another
        thread than the one that started it (a receive handed over to the communication
        thread): each step enters the device's stream context there."""
        staged, progress = self.device.staged, deferred.progress
        outer = Deferred(None, self.result)

        def finishing():
            try:  # the submission's event was waited for in run: no ready event here
                done = self._on_device(None, lambda: _drained(link, progress), bool) \
                    if staged else progress()
            except SignatureMismatch as exc:
                error = describe_mismatch(self.what, link.ranks[link.rank], exc)
                _noted(link.session, error)
                raise error from None
            except Exception as exc:
                _noted(link.session, exc)
                raise
            if done:
                self.comm._stats.collectives += 1
                if deferred.result is not None:
                    outer.result = deferred.result
            return done
        outer.progress = finishing
        return outer

    def _told(self, session, notice):
        """The error this call raises for another rank's abort ``notice``; an abort of an
        earlier collective is passed on, since the others may wait in this one."""
        error = error_for(notice, self.seq)
        if not error.remote:
            self._abort(session, error)
        _noted(session, error)
        return error

    def _notice(self, session):
        """Another rank's ABORT of this collective, if one is here by now (else None)."""
        try:
            session.raise_news(self.comm.comm_id, self.seq)
        except AbortNotice as notice:
            return notice
        except CommError:  # the wire itself failed: the original error stands
            pass
        return None

    def _abort(self, session, exc):
        _noted(session, exc)
        if isinstance(exc, Revoked):  # told once, by the revoking rank alone
            session.announce_revoked(self.comm.comm_id)
            return
        if self.space != COLLECTIVE:
            return
        with contextlib.suppress(Exception):  # the original error is what matters
            session.abort(self.comm.ranks, self.comm.comm_id, self.seq, exc)


def _noted(session, exc):
    """Keep the first error a call failed with on this rank (its goodbye names whom it
    blamed, so that peers still waiting blame the rank that failed first)."""
    if session.first_failure is None:
        session.first_failure = exc


def _drained(link, step):
    """What ``step()`` (a body or a progress step) returns, once the segments it staged are
    all handed to the session: none may wait across another call's work. If it fails,
    they are dropped and their lane slots given back."""
    try:
        outcome = step()
        link.drain()
    except BaseException:
        link.discard()
        raise
    return outcome
