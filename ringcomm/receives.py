"""Which message each receive takes: the numbering of receives, any-source ones included.

The n-th send from rank s to rank d with tag t pairs with the n-th receive on d from s with
tag t: both take number n of their route (see :mod:`ringcomm.p2p`). A receive from a named
rank takes its number when it is posted. A receive from any source cannot: its peer is known
only once a message is there. So the receives of one communicator on one tag are *bound*
(given their peer and number) in posting order, as MPI matches them:

- an any-source receive binds once it is the oldest unbound receive on its tag and a
  message is there: the one whose first segment arrived first, from whichever peer; that
  advances that peer's number alone, and its whole message (every segment) is taken;
- a receive posted on tag t while an any-source receive on t is unbound waits behind it, and
  binds, in turn, once every receive posted before it on t has bound;
- with no any-source receive waiting on a tag, receives on it bind at once, as they always did.

A named receive uses up its number however it ends, as it always did (a failed one's
message is left to nobody), also one that failed while it waited for its turn; an
any-source receive that ends before it bound (a timeout) takes no number, and the receives
behind it bind as if it had never been posted.

>>> # rank 0 of 3; rank 1 sends a, then a2, rank 2 sends b, all with tag 5; a arrives first
>>> w = comm.recv(x, None, tag=5, async_op=True)   # any source: a, rank 1's #0
>>> comm.recv(y, 1, tag=5)                         # bound once w is: a2, rank 1's #1
>>> comm.recv(z, None, tag=5)                      # b, rank 2's #0: returns 2
>>> w.wait()                                       # 1
"""
import threading
from collections import defaultdict, deque

ANY_SOURCE = None  # recv(x, ANY_SOURCE, tag): the first message from any rank with that tag


class Ticket:
    """One receive of ``tag`` from group rank ``src`` (None: any source). ``seq``: its
    message number once bound (``src`` then names the peer it takes from)."""

    __slots__ = ("src", "tag", "seq", "any")

    def __init__(self, src, tag):
        self.src, self.tag, self.seq, self.any = src, tag, None, src is None

    def describe(self, name):
        """The receive in words, for its errors (``name``: the communicator's), as posted."""
        if self.any:
            return f"recv from any rank (tag {self.tag}) on {name}"
        if self.seq is None:
            return f"recv from rank {self.src} (tag {self.tag}, behind a receive from any source) on {name}"
        return f"recv from rank {self.src} (tag {self.tag}, #{self.seq}) on {name}"


class Receives:
    """The receive numbers of one communicator. :meth:`post` is called in submission order
    (under the engine's lock); :meth:`bind_any` and :meth:`cancel` by whichever thread runs
    the receives; a lock of its own, taken last, orders them."""

    def __init__(self):
        self._lock = threading.Lock()
        self._next = defaultdict(int)  # (peer, tag) -> the number of its next message
        self._unbound = {}             # tag -> tickets waiting to bind, oldest first

    def post(self, ticket):
        """Post ``ticket``; its number, or None while it waits to bind (an any-source
        receive, or a receive behind one)."""
        with self._lock:
            waiting = self._unbound.get(ticket.tag)
            if not ticket.any and not waiting:
                return self._bind(ticket, ticket.src)
            self._unbound.setdefault(ticket.tag, deque()).append(ticket)
            return None

    def bind_any(self, ticket, pick):
        """Bind any-source ``ticket`` if it is the oldest unbound on its tag and
        ``pick(number_of)`` names a peer whose message ``number_of(peer)`` is here (None:
        none is); True once it is bound."""
        with self._lock:
            waiting = self._unbound.get(ticket.tag)
            if ticket.seq is not None:
                return True
            if not waiting or waiting[0] is not ticket:
                return False
            peer = pick(lambda p: self._next[(p, ticket.tag)])
            if peer is None:
                return False
            waiting.popleft()
            self._bind(ticket, peer)
            self._settle(ticket.tag)
        return True

    def at_head(self, ticket):
        """True if ``ticket`` is the oldest unbound receive on its tag (the next to take a
        message there)."""
        with self._lock:
            waiting = self._unbound.get(ticket.tag)
            return bool(waiting) and waiting[0] is ticket

    def cancel(self, ticket):
        """Withdraw any-source ``ticket`` if it never bound (its receive ended without a
        message): it takes no number, and the receives behind it may bind."""
        with self._lock:
            waiting = self._unbound.get(ticket.tag)
            if ticket.seq is not None or not waiting or ticket not in waiting:
                return
            waiting.remove(ticket)
            self._settle(ticket.tag)

    def _bind(self, ticket, peer):
        route = (peer, ticket.tag)
        ticket.src, ticket.seq = peer, self._next[route]  # src first: seq says it is bound
        self._next[route] += 1
        return ticket.seq

    def _settle(self, tag):
        """Bind the named receives now at the head of ``tag``'s queue, up to the next
        any-source one."""
        waiting = self._unbound[tag]
        while waiting and not waiting[0].any:
            named = waiting.popleft()
            self._bind(named, named.src)
        if not waiting:
            del self._unbound[tag]
