"""The parameter-server baseline: everything goes through one root rank.

All-reduce on n ranks, buffer of S bytes, root 0:

- every other rank sends its whole buffer to the root (step 0);
- the root reduces them in rank order (so the result does not depend on arrival order),
  finishes it, and sends the result to every rank (step 1).

Traffic: the root receives (n−1)·S and sends (n−1)·S, growing with n; every other rank
sends S and receives S. That hot spot is what the ring removes (compare :mod:`.ring`).
Reduce-scatter and all-gather go through rank 0 (the *server*) the same way; broadcast,
reduce, gather and scatter talk to their root directly (gather and scatter of an S-byte
``out``/``x``: the root receives or sends (n−1)·S/n, every other rank S/n).
"""
import numpy as np

from ..ops import ReduceOp, finalize, reduce_into
from .chunks import receive_segments, segments, send_segments

SERVER = 0  # the rank all-reduce, reduce-scatter and all-gather go through
_EMPTY = np.empty(0, np.uint8)


def _gather_reduce(link, acc, op, root, source):
    """On ``root``: reduce every other rank's buffer into ``acc`` in rank order.
    Elsewhere: send ``source`` to the root. Step 0."""
    n, r = link.size, link.rank
    segs = segments(acc.size if r == root else source.size, (acc if r == root else source).itemsize,
                    link.segment_bytes)
    if r != root:
        send_segments(link, root, 0, source)
        return
    for j, sl in enumerate(segs):
        for peer in range(n):
            if peer != root:
                reduce_into(op, acc[sl], link.recv(peer, 0, j, sl.stop - sl.start))
    finalize(op, acc, n)


def _scatter_from(link, root, pieces, step):
    """``root`` sends ``pieces[peer]`` (flat arrays) to each peer in ``step``."""
    for peer in range(link.size):
        if peer != root:
            send_segments(link, peer, step, pieces[peer])


def all_reduce(link, x, op, root=SERVER):
    """In place: ranks send ``x`` to ``root``, which reduces and sends the result back."""
    _gather_reduce(link, x, op, root, x)
    if link.rank == root:
        _scatter_from(link, root, [x] * link.size, 1)
    else:
        receive_segments(link, root, 1, x)


def reduce(link, x, root, op):
    """``x`` on ``root`` gets the reduction; others only send."""
    _gather_reduce(link, x, op, root, x)


def broadcast(link, x, root):
    """In place: ``root`` sends ``x`` to every rank directly."""
    if link.rank == root:
        _scatter_from(link, root, [x] * link.size, 0)
    else:
        receive_segments(link, root, 0, x)


def reduce_scatter(link, out, x, op, root=SERVER):
    """The server reduces the whole of ``x`` (into a scratch copy) and sends each rank its chunk."""
    n, m = link.size, out.size
    acc = x.copy() if link.rank == root else None
    _gather_reduce(link, acc, op, root, x)
    if link.rank == root:
        pieces = [acc[p * m:(p + 1) * m] for p in range(n)]
        _scatter_from(link, root, pieces, 1)
        out[...] = pieces[root]
    else:
        receive_segments(link, root, 1, out)


def all_gather(link, out, x, root=SERVER):
    """The server gathers every rank's ``x`` into ``out`` and sends the whole of it back."""
    gather(link, out, x, root)
    if link.rank == root:
        _scatter_from(link, root, [out] * link.size, 1)
    else:
        receive_segments(link, root, 1, out)


def gather(link, out, x, root):
    """``out`` on ``root`` gets every rank's ``x`` in rank order; the others only send."""
    r, m = link.rank, x.size
    if r != root:
        send_segments(link, root, 0, x)
        return
    out[r * m:(r + 1) * m] = x
    for peer in range(link.size):
        if peer != root:
            receive_segments(link, peer, 0, out[peer * m:(peer + 1) * m])


def scatter(link, out, x, root):
    """``out`` on every rank gets its slice of ``root``'s ``x`` (slice r: ``x[r*m:(r+1)*m]``,
    m = out.size); ``x`` is read on the root only."""
    r, n, m = link.rank, link.size, out.size
    if r != root:
        receive_segments(link, root, 0, out)
        return
    _scatter_from(link, root, [x[p * m:(p + 1) * m] for p in range(n)], 0)
    out[...] = x[r * m:(r + 1) * m]


def barrier(link):
    """Returns once every rank has entered: an empty all-reduce through the server."""
    all_reduce(link, _EMPTY, ReduceOp.SUM)


__all__ = ["all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce", "gather", "scatter",
           "barrier"]
