"""One communicator's collectives, one thread at a time.

Ranks pair collectives by their order on each communicator, and every rank's communication
thread runs the collectives of all its communicators one after another in the order they were
submitted. Two threads issuing collectives at once could be paired in different orders on
different ranks and mix their data silently: rank 0 may number thread A's call #7 while rank
1 numbers thread B's. A refusal on one rank alone cannot prevent that (each rank would decide
alone which thread loses), so when a rank sees a collective called while another thread has
one in progress on the same communicator (a blocking call not yet returned, or an
``async_op`` work not yet complete), it **revokes** the communicator: the caller gets
:class:`~ringcomm.errors.Revoked`, the call in progress fails wherever it waits or before it
returns (a wake-up cuts its sleep short), the communication thread tells every member once
(a Revoked abort, which revokes it there too, and their waits fail at once), and every later
collective on it fails on every rank. No rank returns the result of a collective it was still
running when the revocation reached it, which with a call that waits on other ranks is every
call paired with the other thread's. A communicator that was revoked stays so; ``new_group``
makes a fresh one (``members_only=True`` from a revoked parent; one per thread, if threads
must overlap).

What no rank can see: a mix-up where the threads never overlap on any one rank (thread A's
call finished before thread B's began there, in another order on another rank), or a rank
that finished the mixed call before the revocation reached it (its next collective fails).
Every program must keep what makes that impossible: collectives on all communicators issued
in the same order on every rank. The pattern that works is one thread issuing them, with
``async_op=True`` for overlap; handing a communicator to another thread once its calls are
complete (an ``async_op`` call counts until its work is) is fine. Point-to-point calls are
numbered per peer and tag, and a receive does not hold the communication thread, so they are
neither guarded nor revoked.

>>> guard = ThreadGuard("world", revoke=lambda why: ...)
>>> user = guard.enter("all_reduce"); ...; guard.leave(user)
"""
import threading
import time
import weakref

from .errors import CommError, Revoked


class ThreadGuard:
    """Which threads have calls inside this communicator, and their async works not yet
    complete: kept whether or not the guard refuses (``enabled``), so that ``close`` can
    wait for what is in flight (:meth:`wait_idle`) with the guard on or off."""

    def __init__(self, name, revoke):
        self.name = name
        self.revoke = revoke  # revoke(why): revoke the communicator on every rank
        self.enabled = True  # off: a second thread is let in (the caller orders calls itself)
        # thread ident -> [calls inside, weak references to its works not yet complete]
        self._users = {}
        self._lock = threading.Lock()

    def enter(self, collective):
        """Claim the communicator for this thread's call; raises (and revokes) if another
        thread has a call in flight and the guard is on."""
        me = threading.get_ident()
        with self._lock:
            user = self._users.get(me)
            if user is not None and len(self._users) == 1 and not user[1]:
                user[0] += 1  # the one thread that uses it, with no async work pending
                return user
            if self._busy_elsewhere(me) and self.enabled:
                why = (f"{self.name}: {collective} called from one thread while another has a "
                       f"collective in progress on this communicator: ranks could pair one "
                       f"thread's calls with another's, so it is revoked on every rank; issue "
                       f"collectives from one thread at a time (new_group makes one per thread)")
                self.revoke(why)
                raise Revoked(why)
            self._users = {i: u for i, u in self._users.items() if u[0] or u[1] or i == me}
            user = self._users.setdefault(me, [0, []])
            user[0] += 1
            return user

    def check_idle(self, what):
        """Raise :class:`CommError` if the guard is on and a thread other than this one has
        a call in flight."""
        with self._lock:
            if self.enabled and self._busy_elsewhere(threading.get_ident()):
                raise CommError(f"{self.name}: {what} called while another thread has a "
                                f"collective in progress on this communicator; call it after "
                                f"that collective returns")

    def wait_idle(self, deadline):
        """Wait until no thread has a call inside or an async work unfinished, or until
        ``deadline`` (``time.monotonic()``); True if it became idle."""
        while True:
            with self._lock:
                if not self._busy_elsewhere(None):
                    return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.002)

    def _busy_elsewhere(self, me):
        """True if a thread other than ``me`` has a call inside or async work unfinished."""
        busy = False
        for ident, (inside, works) in self._users.items():
            works[:] = _unfinished(works)
            busy = busy or (ident != me and bool(inside or works))
        return busy

    def leave(self, user, work=None):
        """The call returned (or was interrupted while it waited); an unfinished ``work``
        keeps the claim until it completes."""
        if user is None:  # a point-to-point call, which is not claimed
            return
        with self._lock:
            user[0] -= 1
            if work is not None and not work.is_completed():
                user[1][:] = _unfinished(user[1])
                user[1].append(weakref.ref(work))


def _unfinished(refs):
    """The works still in flight; one no longer referenced anywhere is out of the engine's
    queue, so it has ended."""
    return [ref for ref in refs if (work := ref()) is not None and not work.is_completed()]
