"""One communicator, one thread at a time.

Ranks pair collectives by their order on each communicator. Two threads calling collectives
on one communicator at once could be paired in different orders on different ranks and mix
their data silently, so a call made while another thread has one in progress (a blocking
call not yet returned, or an ``async_op`` work not yet complete) raises :class:`CommError`
before anything is sent. One thread after another is fine; for real concurrency, give each
thread its own communicator (``new_group``).

>>> guard = ThreadGuard("world")
>>> user = guard.enter("all_reduce"); ...; guard.leave(user)
"""
import threading

from .errors import CommError


class ThreadGuard:
    def __init__(self, name):
        self.name = name
        self._users = {}  # thread ident -> [calls inside, async works not yet complete]
        self._lock = threading.Lock()

    def enter(self, collective):
        """Claim the communicator for this thread's call (raises if another thread has it)."""
        me = threading.get_ident()
        with self._lock:
            for ident, (inside, works) in self._users.items():
                works[:] = [w for w in works if not w.is_completed()]
                if ident != me and (inside or works):
                    raise CommError(f"{self.name}: {collective} called from one thread while another has a "
                                    f"collective in progress on this communicator; use it from one thread at a "
                                    f"time (new_group makes one per thread)")
            self._users = {i: u for i, u in self._users.items() if u[0] or u[1] or i == me}
            user = self._users.setdefault(me, [0, []])
            user[0] += 1
            return user

    def leave(self, user, work=None):
        """The call returned; an unfinished ``work`` keeps the claim until it completes."""
        with self._lock:
            user[0] -= 1
            if work is not None and not work.is_completed():
                user[1].append(work)
