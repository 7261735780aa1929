"""Point-to-point transfers: one rank sends, one receives, with flow control.

A message is cut into segments like a collective's; segment j of the n-th message from rank
s to rank d with tag t travels under the key (space 1, seq n, step t, segment j), so messages
never overtake each other within one (peer, tag) and never meet a collective's.

Flow control: a rank keeps at most ``window`` bytes (``RINGCOMM_P2P_WINDOW_BYTES``, default
64 MiB, the same on every rank) of point-to-point data in flight to each peer on each tag,
counted from sending a segment until the receiver's ``recv`` takes it (the receiver then
sends a CREDIT naming the bytes); so receiving tags in another order than they were sent
never deadlocks. A send that would pass the window waits, without holding the communication
thread (other work, a ``recv`` posted after it included, goes on), and times out naming the
receiver. The
receiver refuses data from a peer that ignores the window, so a busy or stopped receiver
costs its senders a bounded amount of memory, and a flooding peer costs it none.

>>> comm.send(x, dst=1, tag=7)        # rank 0
>>> comm.recv(y, src=0, tag=7)        # rank 1: y == x
"""
from collections import deque

from .algorithms.chunks import segments
from .engine import Deferred


def send(link, flat, dst, tag):
    """The body of a send: segments go out while the window to ``dst`` allows; the rest as
    credits come back (a :class:`Deferred`)."""
    transport, peer = link.transport, link.ranks[dst]
    flow = (peer, link.comm_id, tag)
    todo = deque(enumerate(segments(flat.size, flat.itemsize, link.segment_bytes)))
    # a send that must wait for credit outlives the call: its segments are copied (a zero-copy
    # send would need the caller's array until the network took it)
    fits = transport.window_left(flow) >= flat.nbytes

    def progress():
        while todo:
            j, sl = todo[0]
            if not transport.window_open(flow, (sl.stop - sl.start) * flat.itemsize, link.staged_bytes):
                transport.check(peer, link.deadline, f"{link.what}: rank {peer} has not received "
                                f"what this rank sent before on tag {tag} (flow-control window "
                                f"of {transport.window} bytes full)")
                return False
            link.send(dst, tag, j, flat[sl], copy=not fits)
            todo.popleft()
        return True
    return None if fits and progress() else Deferred(progress)


def recv(link, flat, src, tag):
    """The body of a receive: completes as the segments arrive (a :class:`Deferred`)."""
    todo = deque(enumerate(segments(flat.size, flat.itemsize, link.segment_bytes)))

    def progress():
        while todo:
            j, sl = todo[0]
            if link.recv(src, tag, j, wait=False, into=flat[sl]) is None:
                return False
            todo.popleft()
        return True
    return Deferred(progress)
