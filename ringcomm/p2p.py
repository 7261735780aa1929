"""Point-to-point transfers: one rank sends, one receives, with flow control.

A message is cut into segments like a collective's; segment j of the n-th message from rank
s to rank d with tag t travels under the key (``Space.POINT_TO_POINT``, seq n, step t,
segment j), so messages never overtake each other within one (peer, tag) and never meet
a collective's.

Flow control: a rank keeps at most ``window`` bytes (``RINGCOMM_P2P_WINDOW_BYTES``, default
64 MiB, the same on every rank) of point-to-point data in flight to each peer on each tag,
counted from sending a segment until the receiver's ``recv`` takes it (the receiver then
sends a CREDIT naming the bytes); so receiving tags in another order than they were sent
never deadlocks. A send that would pass the window waits, without holding the communication
thread (other work, a ``recv`` posted after it included, goes on), and times out naming the
receiver. The
receiver refuses data from a peer that ignores the window, so a busy or stopped receiver
costs its senders a bounded amount of memory, and a flooding peer costs it none.

A receive from any source (``src=None``) takes the message of whichever peer's arrived
first, whole, and gives that peer its credit back; which number it takes, and how it is
ordered with the other receives on its tag, is :mod:`ringcomm.receives`'.

>>> comm.send(x, dst=1, tag=7)        # rank 0
>>> comm.recv(y, src=0, tag=7)        # rank 1: y == x
>>> comm.recv(y, None, tag=7)         # rank 1, from any rank: returns 0
"""
from collections import deque

from .algorithms.chunks import segments
from .engine import Deferred
from .transport.frame import POINT_TO_POINT, Key


def send(link, flat, dst, tag):
    """The body of a send: segments go out while the window to ``dst`` allows; the rest as
    credits come back (a :class:`Deferred`)."""
    peer = link.ranks[dst]
    todo = deque(enumerate(segments(flat.size, flat.itemsize, link.segment_bytes)))
    # a send that must wait for credit outlives the call: its segments are copied (a zero-copy
    # send would need the caller's array until the network took it)
    fits = link.window_left(dst, tag) >= flat.nbytes

    def progress():
        while todo:
            j, sl = todo[0]
            if not link.window_open(dst, tag, (sl.stop - sl.start) * flat.itemsize):
                link.check(dst, f"{link.what}: rank {peer} has not received what this rank sent "
                           f"before on tag {tag} (flow-control window of {link.window} bytes full)")
                return False
            link.send(dst, tag, j, flat[sl], copy=not fits)
            todo.popleft()
        return True
    return None if fits and progress() else Deferred(progress)


def recv(link, flat, ticket, receives):
    """The body of a receive: completes as the segments arrive (a :class:`Deferred`). A
    receive that waits to bind (see :mod:`ringcomm.receives`) first waits for its turn; one
    from any source first finds its peer, and its result is that peer's group rank."""
    todo = deque(enumerate(segments(flat.size, flat.itemsize, link.segment_bytes)))
    deferred = Deferred(None)

    def progress():
        if link.seq is None:
            if not _bound(link, ticket, receives):
                return False
            if ticket.any:
                deferred.result = ticket.src
        while todo:
            j, sl = todo[0]
            if link.recv(ticket.src, ticket.tag, j, wait=False, into=flat[sl]) is None:
                return False
            todo.popleft()
        return True
    deferred.progress = progress
    return deferred


def _bound(link, ticket, receives):
    """True once ``ticket`` is bound (``link`` then carries its number); until then, what
    every wait checks: the deadline, this rank stopping, a lost peer. Peers that closed
    their communicator drop out of an any-source receive's choice once nothing of theirs
    is left to take; when every peer has, it raises PeerLost."""
    if ticket.any:
        peers = [p for p in range(link.size) if p != link.rank]
        if not receives.bind_any(ticket, lambda number: _first_arrived(link, ticket.tag, peers, number)):
            # nothing of theirs is here for this receive (one behind it waits its turn)
            if receives.at_head(ticket) and all(link.has_left(p) for p in peers):
                link.check(peers[0], f"{link.what}: every rank it may come from ({peers}) has closed")
            link.check(None, f"{link.what}: timed out waiting for a message from any of ranks {peers}")
            return False
        link.what = f"{link.what} (took rank {ticket.src}'s #{ticket.seq})"
    elif ticket.seq is None:
        link.check(ticket.src, f"{link.what}: timed out")
        return False
    else:
        link.what = f"{link.what} (#{ticket.seq})"
    link.seq = ticket.seq
    return True


def _first_arrived(link, tag, peers, number):
    """Of group ranks ``peers``, the one whose next message on ``tag`` (``number(peer)``)
    began to arrive first, or None if none has."""
    first = link.first_arrived([(p, Key(link.comm_id, POINT_TO_POINT, number(p), tag, 0)) for p in peers])
    return None if first is None else peers[first]
