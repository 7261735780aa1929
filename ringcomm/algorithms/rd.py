"""Few-hop schedules for small messages: recursive doubling and the dissemination barrier.

**Recursive doubling all-reduce** (n a power of two): in round k rank r exchanges its whole
buffer with rank r XOR 2^k and reduces. log2(n) rounds instead of the ring's 2(n−1) steps,
at the price of S·log2(n) bytes per rank instead of 2(n−1)S/n — the right trade when hop
latency, not bandwidth, dominates. Partners compute ``a op b`` and ``b op a``; sum, product,
max and min are commutative in IEEE arithmetic, so all ranks still hold identical bits.

**Dissemination barrier**: in round k rank r signals r+2^k and waits for r−2^k; after
ceil(log2 n) rounds every rank has heard, directly or not, from every other.
"""
import numpy as np

from ..ops import finalize, reduce_into
from .chunks import segments

_EMPTY = np.empty(0, np.uint8)


def is_applicable(n):
    return n & (n - 1) == 0


def all_reduce(link, x, op):
    """In place on flat ``x``; needs a power-of-two group size."""
    n, r = link.size, link.rank
    if not is_applicable(n):
        raise ValueError(f"recursive doubling needs a power-of-two group size, got {n}")
    segs = segments(x.size, x.itemsize, link.segment_bytes)
    dist, rnd = 1, 0
    while dist < n:
        peer = r ^ dist
        snapshot = x.copy()  # x changes below while ZeroMQ may still be reading the send
        for j, sl in enumerate(segs):
            link.send(peer, rnd, j, snapshot[sl])
        for j, sl in enumerate(segs):
            reduce_into(op, x[sl], link.recv(peer, rnd, j, sl.stop - sl.start))
        dist, rnd = dist * 2, rnd + 1
    finalize(op, x, n)


def barrier(link):
    """Returns once every rank of the group has entered."""
    n, r = link.size, link.rank
    dist, rnd = 1, 0
    while dist < n:
        link.send((r + dist) % n, rnd, 0, _EMPTY)
        link.recv((r - dist) % n, rnd, 0, 0)
        dist, rnd = dist * 2, rnd + 1
