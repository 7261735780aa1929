"""Few-hop schedules for small messages: recursive doubling and the dissemination barrier.

**Recursive doubling all-reduce**: in round k rank r exchanges its whole buffer with rank
r XOR 2^k and reduces (ranks beyond the largest power of two fold in first and get the
result back last). log2(n) rounds instead of the ring's 2(n−1) steps,
at the price of S·log2(n) bytes per rank instead of 2(n−1)S/n — the right trade when hop
latency, not bandwidth, dominates. Both partners compute ``x_lower op x_higher`` (the lower
rank's values first), so all ranks hold identical bits even where IEEE max/min of ±0 or NaN
payloads are not commutative.

**Dissemination barrier**: in round k rank r signals r+2^k and waits for r−2^k; after
ceil(log2 n) rounds every rank has heard, directly or not, from every other.
"""
import numpy as np

from ..ops import finalize, reduce_into, reduced
from .chunks import segments

_EMPTY = np.empty(0, np.uint8)


def _exchange(link, peer, rnd, x, segs, op):
    for j, sl in enumerate(segs):
        link.send(peer, rnd, j, x[sl], copy=True)  # x changes below: the send must not read it later
    for j, sl in enumerate(segs):
        incoming = link.recv(peer, rnd, j, sl.stop - sl.start)
        if peer > link.rank:
            reduce_into(op, x[sl], incoming)
        else:  # the lower rank's values first on both sides: identical bits even for ±0, NaN
            reduced(op, incoming, x[sl], out=x[sl])


def all_reduce(link, x, op):
    """In place on flat ``x``, any group size.

    With n = p + e, p the largest power of two ≤ n, the e extra ranks first fold their
    buffer into rank r − p ("step" 0), the p core ranks run log2(p) rounds of recursive
    doubling, and the core ranks hand the result back to their extra partner: 2 + log2(p)
    hops. The core ranks reduce ``x_r op x_{r+p}`` and then commutative pairs, so every rank
    holds the same bits.
    """
    n, r = link.size, link.rank
    segs = segments(x.size, x.itemsize, link.segment_bytes)
    p = 1 << (n.bit_length() - 1)
    last = p.bit_length()  # the hand-back's round number: after every recursive-doubling round
    if r >= p:  # an extra rank: fold in, then wait for the result
        for j, sl in enumerate(segs):
            link.send(r - p, 0, j, x[sl])
        for j, sl in enumerate(segs):
            link.recv(r - p, last, j, into=x[sl])
        return
    if r + p < n:
        for j, sl in enumerate(segs):
            reduce_into(op, x[sl], link.recv(r + p, 0, j, sl.stop - sl.start))
    dist, rnd = 1, 1
    while dist < p:
        _exchange(link, r ^ dist, rnd, x, segs, op)
        dist, rnd = dist * 2, rnd + 1
    finalize(op, x, n)
    if r + p < n:
        for j, sl in enumerate(segs):
            link.send(r + p, last, j, x[sl])


def barrier(link):
    """Returns once every rank of the group has entered."""
    n, r = link.size, link.rank
    dist, rnd = 1, 0
    while dist < n:
        link.send((r + dist) % n, rnd, 0, _EMPTY)
        link.recv((r - dist) % n, rnd, 0, 0)
        dist, rnd = dist * 2, rnd + 1


__all__ = ["all_reduce", "barrier"]
