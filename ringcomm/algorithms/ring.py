"""Ring collectives: reduce-scatter, all-gather, all-reduce; chain broadcast and reduce.

Rank r sends only to its right neighbour r+1 and receives only from its left neighbour r−1.
The buffer is cut into n chunks (see :mod:`.chunks`). Ring all-reduce on 4 ranks, chunks
A B C D, where ``Xr`` is chunk X summed over some ranks and ``X*`` the finished chunk:

=====  ===============  ===============  ===============  ===============
step   rank 0 sends     rank 1 sends     rank 2 sends     rank 3 sends
=====  ===============  ===============  ===============  ===============
0      A0               B1               C2               D3
1      D30              A01              B12              C23
2      C230             D301             A012             B123
3      B*               C*               D*               A*
4      A*               B*               C*               D*
5      D*               A*               B*               C*
=====  ===============  ===============  ===============  ===============

Steps 0..n−2 are the **reduce-scatter**: each received chunk is reduced into the local copy
and forwarded next step; after them rank r holds the finished chunk r+1. Steps n−1..2n−3 are
the **all-gather**: finished chunks travel round once more and are copied. In step s rank r
sends chunk (r−s) mod n and receives chunk (r−s−1) mod n.

Cost per rank: 2(n−1) steps, 2(n−1)/n·S bytes sent and received, whatever n is; the sum over
ranks is exactly 2(n−1)·S. Each chunk is reduced at one place and then copied, so every rank
ends with bitwise-identical results.

Pipelining: every chunk is cut into the same number of segments and each segment travels
the ring on its own; segment j of step s is processed in *wave* s+j. While the ZeroMQ I/O
thread receives the next segments, this thread reduces the current one, and at most about
min(segments, steps) segments are in flight per link.
"""
from itertools import accumulate

import numpy as np

from ..ops import ReduceOp, finalize, reduce_into, reduced
from .chunks import receive_segments, segment_table, segments, send_segments

_EMPTY = np.empty(0, np.uint8)


def _pipeline(link, nsteps, nseg, first, count, on_receive, start=0, into=None):
    """Drive ring steps ``start`` .. ``start + nsteps − 1`` of ``nseg`` segments each, wave
    by wave.

    ``first(j)``: what to send in step ``start`` for segment j. ``count(step, j)``: how many
    elements arrive. ``into(step, j)``: where they land (None: a received buffer that the
    next receive may reuse). ``on_receive(step, j, data)``: use them; returns what to
    forward in step+1.
    """
    n, r = link.size, link.rank
    right, left = (r + 1) % n, (r - 1) % n
    stop = start + nsteps
    for wave in range(nsteps + nseg - 1):
        if wave < nseg:
            link.send(right, start, wave, first(wave))
        for j in range(max(0, wave - nsteps + 1), min(wave, nseg - 1) + 1):
            step = start + wave - j
            dst = into(step, j) if into else None
            forward = on_receive(step, j, link.recv(left, step, j, count(step, j), into=dst))
            if step + 1 < stop:
                link.send(right, step + 1, j, forward)


def _length(sl):
    return sl.stop - sl.start


def all_reduce(link, x, op):
    """In place on flat ``x``: every rank ends with ``op`` over all ranks' ``x``."""
    n = link.size
    if n == 1:
        finalize(op, x, 1)
        return
    _all_reduce_steps(link, x, op, chunk_table(x, link), 0, 2 * (n - 1))


def chunk_table(x, link):
    """The segment table the in-place ring cuts flat ``x`` by (see :mod:`.chunks`)."""
    return segment_table(x.size, link.size, x.itemsize, link.segment_bytes)


def reduce_scatter_in_place(link, x, op, table):
    """The first half of :func:`all_reduce`: rank r ends with chunk r+1 (mod n) of ``table``
    reduced over all ranks (and finished with ``finalize(op, ·, n)``); other chunks of ``x``
    hold partial results. n−1 steps, (n−1)/n·S bytes sent per rank."""
    if link.size > 1:
        _all_reduce_steps(link, x, op, table, 0, link.size - 1)


def all_gather_in_place(link, x, table):
    """The second half of :func:`all_reduce`: rank r holds chunk r+1 (mod n) of ``table``
    and ends with every rank's. n−1 steps, (n−1)/n·S bytes sent per rank."""
    n = link.size
    if n > 1:
        _all_reduce_steps(link, x, None, table, n - 1, 2 * (n - 1))


def _all_reduce_steps(link, x, op, table, start, stop):
    """Steps ``start`` .. ``stop − 1`` of the ring all-reduce on ``x`` cut by ``table``."""
    n, r = link.size, link.rank

    def chunk_of(step):
        return table[(r - step - 1) % n]

    def on_receive(step, j, data):
        seg = x[chunk_of(step)[j]]
        if step < n - 1:
            reduce_into(op, seg, data)
            if step == n - 2:  # this chunk is now finished here
                finalize(op, seg, n)
        return seg  # in the all-gather steps the data landed in seg

    def landing(step, j):  # the all-gather steps receive straight into x
        return x[chunk_of(step)[j]] if step >= n - 1 else None

    _pipeline(link, stop - start, len(table[0]), lambda j: x[chunk_of(start - 1)[j]],
              lambda step, j: _length(chunk_of(step)[j]), on_receive, start, landing)


def reduce_scatter(link, out, x, op):
    """``out`` (m elements) gets chunk ``rank`` of ``op`` over all ranks' ``x`` (n·m elements).

    ``x`` is not modified: partial sums travel in fresh arrays (on a GPU, in the received
    segment's landing buffer). Chunk indices are shifted by
    one against :func:`all_reduce` so that rank r finishes chunk r.
    """
    n, r, m = link.size, link.rank, out.size
    if n == 1:
        out[...] = x
        finalize(op, out, 1)
        return
    table = chunk_table(x, link)

    def chunk_index(step):
        return (r - step - 2) % n

    def on_receive(step, j, data):
        c = chunk_index(step)
        sl = table[c][j]
        if step < n - 2:  # passed on at once: a received device segment takes the sum (safe
            # because send queues its copy out before the next receive lands, on one stream)
            return reduced(op, x[sl], data, reuse_b=True)
        dst = out[sl.start - c * m: sl.stop - c * m]
        reduced(op, x[sl], data, out=dst)
        finalize(op, dst, n)
        return None

    _pipeline(link, n - 1, len(table[0]), lambda j: x[table[(r - 1) % n][j]],
              lambda step, j: _length(table[chunk_index(step)][j]), on_receive)


def all_gather(link, out, x):
    """``out`` (n·m elements) gets every rank's ``x`` (m elements), in rank order."""
    n, r, m = link.size, link.rank, x.size
    out[r * m:(r + 1) * m] = x
    if n == 1:
        return
    table = chunk_table(out, link)

    def segment(step, j):
        return out[table[(r - step - 1) % n][j]]

    _pipeline(link, n - 1, len(table[0]), lambda j: out[table[r][j]],
              lambda step, j: _length(table[(r - step - 1) % n][j]),
              lambda step, j, data: data, into=segment)


def broadcast(link, x, root):
    """In place: ``x`` of ``root`` flows down the chain root → root+1 → … → root−1.

    Segments are forwarded as soon as they arrive, so the chain is a pipeline: time
    ≈ (n − 1 + segments − 1) segment hops. Every rank but the last sends S.
    """
    n, r = link.size, link.rank
    pos = (r - root) % n
    for j, sl in enumerate(segments(x.size, x.itemsize, link.segment_bytes)):
        if pos > 0:
            link.recv((r - 1) % n, 0, j, into=x[sl])
        if pos < n - 1:
            link.send((r + 1) % n, 0, j, x[sl])


def reduce(link, x, root, op):
    """``x`` on ``root`` gets ``op`` over all ranks; ``x`` elsewhere is left unchanged.

    Partial results flow down the chain root+1 → root+2 → … → root, one segment at a time.
    """
    n, r = link.size, link.rank
    pos = (r - root - 1) % n  # root+1 starts the chain at position 0; root ends it
    if n == 1:
        finalize(op, x, 1)
        return
    right, left = (r + 1) % n, (r - 1) % n
    for j, sl in enumerate(segments(x.size, x.itemsize, link.segment_bytes)):
        if pos == 0:
            link.send(right, 0, j, x[sl])
            continue
        data = link.recv(left, 0, j, _length(sl))
        if pos == n - 1:
            finalize(op, reduce_into(op, x[sl], data), n)
        else:
            link.send(right, 0, j, reduced(op, x[sl], data, reuse_b=True))


def barrier(link):
    """Returns once every rank has entered: an empty all-reduce, 2(n−1) steps."""
    all_reduce(link, _EMPTY, ReduceOp.SUM)


def all_to_all(link, out, x, out_splits, in_splits):
    """Rank r's block for rank s (``x`` from offset sum(in_splits[:s]), ``in_splits[s]``
    elements) lands in rank s's ``out`` at offset sum(out_splits[:r]). In ring order: in step
    k (1..n−1) rank r sends its block for r+k and receives the block of r−k, so every pair
    exchanges once and each step's traffic is a shifted ring. n−1 steps; every rank sends
    what it does not keep, (n−1)/n·S for equal splits of an S-byte ``x``.

    >>> # 2 ranks, equal splits: x = [a0, a1] on rank 0, [b0, b1] on rank 1
    >>> all_to_all(link, out, x, [1, 1], [1, 1])   # rank 0: out = [a0, b0]; rank 1: [a1, b1]
    """
    n, r = link.size, link.rank
    out_at = list(accumulate(out_splits, initial=0))  # block s: out[out_at[s]:out_at[s + 1]]
    in_at = list(accumulate(in_splits, initial=0))
    out[out_at[r]:out_at[r + 1]] = x[in_at[r]:in_at[r + 1]]
    for k in range(1, n):
        dst, src = (r + k) % n, (r - k) % n
        send_segments(link, dst, k, x[in_at[dst]:in_at[dst + 1]])
        receive_segments(link, src, k, out[out_at[src]:out_at[src + 1]])


__all__ = ["all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce", "all_to_all", "barrier"]
