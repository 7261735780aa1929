"""One communicator's collectives, one thread at a time.

Ranks pair collectives by their order on each communicator, and every rank's communication
thread runs the collectives of all its communicators one after another in the order they were
submitted. Two threads issuing collectives at once could be paired in different orders on
different ranks and mix their data silently, so a collective called while another thread has
one in progress on the same communicator (a blocking call not yet returned, or an
``async_op`` work not yet complete) raises :class:`CommError` before anything is sent. The
refusal is local: a peer whose call was not refused waits for it until its deadline.

What this cannot see, and every program must keep: collectives on all communicators are
issued in the same order on every rank. The pattern that works is one thread issuing them,
with ``async_op=True`` for overlap. Point-to-point calls are numbered per peer and tag, and a
receive does not hold the communication thread, so they are not guarded.

>>> guard = ThreadGuard("world")
>>> user = guard.enter("all_reduce"); ...; guard.leave(user)
"""
import threading

from .errors import CommError


class ThreadGuard:
    def __init__(self, name):
        self.name = name
        self.enabled = True  # off: every claim is granted (the caller orders calls itself)
        self._users = {}  # thread ident -> [calls inside, async works not yet complete]
        self._lock = threading.Lock()

    def enter(self, collective):
        """Claim the communicator for this thread's call (raises if another thread has it);
        ``None`` when the guard is off."""
        if not self.enabled:
            return None
        me = threading.get_ident()
        with self._lock:
            user = self._users.get(me)
            if user is not None and len(self._users) == 1 and not user[1]:
                user[0] += 1  # the one thread that uses it, with no async work pending
                return user
            if self._busy_elsewhere(me):
                raise CommError(f"{self.name}: {collective} called from one thread while another has a "
                                f"collective in progress on this communicator; use it from one thread at a "
                                f"time (new_group makes one per thread)")
            self._users = {i: u for i, u in self._users.items() if u[0] or u[1] or i == me}
            user = self._users.setdefault(me, [0, []])
            user[0] += 1
            return user

    def check_idle(self, what):
        """Raise :class:`CommError` if a thread other than this one has a call in progress."""
        with self._lock:
            if self._busy_elsewhere(threading.get_ident()):
                raise CommError(f"{self.name}: {what} called while another thread has a "
                                f"collective in progress on this communicator; call it after "
                                f"that collective returns")

    def _busy_elsewhere(self, me):
        """True if a thread other than ``me`` has a call inside or async work unfinished."""
        busy = False
        for ident, (inside, works) in self._users.items():
            works[:] = [w for w in works if not w.is_completed()]
            busy = busy or (ident != me and bool(inside or works))
        return busy

    def leave(self, user, work=None):
        """The call returned; an unfinished ``work`` keeps the claim until it completes."""
        if user is None:
            return
        with self._lock:
            user[0] -= 1
            if work is not None and not work.is_completed():
                user[1].append(work)
