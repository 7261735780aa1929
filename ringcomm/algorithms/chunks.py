"""How a flat buffer is cut for the ring.

Words used throughout ``ringcomm.algorithms``:

- **chunk**: one of the ``n`` contiguous pieces a buffer is cut into for ``n`` ranks. Rank r
  finishes (reduces) exactly one chunk in a ring reduce-scatter. Lengths differ by at most
  one element: the first ``count % n`` chunks get the extra element.
- **segment**: the unit on the wire. Each chunk is cut into the same number of segments, so
  that while segment k+1 is on the wire, segment k is being reduced (pipelining). The segment
  count depends only on the buffer, the rank count and the segment size in bytes, so every
  rank derives the same schedule.
- **step**: one hop along the ring. A ring all-reduce takes 2(n−1) steps.

>>> chunk_bounds(10, 4)
[(0, 3), (3, 6), (6, 8), (8, 10)]
>>> split(0, 3, 2)
[(0, 2), (2, 3)]
"""


def split(start, stop, parts):
    """Cut ``[start, stop)`` into ``parts`` contiguous ranges, the first ones one longer."""
    base, extra = divmod(stop - start, parts)
    bounds, lo = [], start
    for i in range(parts):
        hi = lo + base + (i < extra)
        bounds.append((lo, hi))
        lo = hi
    return bounds


def chunk_bounds(count, n):
    """The ``n`` chunks of a buffer of ``count`` elements, as ``(start, stop)`` pairs."""
    return split(0, count, n)


def num_segments(max_elems, itemsize, segment_bytes):
    """How many segments each chunk is cut into: enough that none exceeds ``segment_bytes``."""
    per_segment = max(1, segment_bytes // max(1, itemsize))
    return max(1, -(-max_elems // per_segment))


def segment_table(count, n, itemsize, segment_bytes):
    """``table[c][j] = slice`` of segment j of chunk c, for a buffer of ``count`` elements."""
    chunks = chunk_bounds(count, n)
    nseg = num_segments(chunks[0][1] - chunks[0][0], itemsize, segment_bytes)
    return [[slice(lo, hi) for lo, hi in split(c0, c1, nseg)] for c0, c1 in chunks]


def segments(count, itemsize, segment_bytes):
    """A whole buffer of ``count`` elements cut into segments of at most ``segment_bytes``."""
    if count * itemsize <= segment_bytes:  # one segment: the common small call
        return [slice(0, count)]
    return [slice(lo, hi) for lo, hi in split(0, count, num_segments(count, itemsize, segment_bytes))]


def send_segments(link, peer, step, src):
    """Send flat ``src`` to group rank ``peer`` in ``step``, one message per segment (an
    empty ``src`` still sends one, so the receiver never waits for nothing)."""
    for j, sl in enumerate(segments(src.size, src.itemsize, link.segment_bytes)):
        link.send(peer, step, j, src[sl])


def receive_segments(link, peer, step, dst):
    """Fill flat ``dst`` with what :func:`send_segments` sent from ``peer`` in ``step``."""
    for j, sl in enumerate(segments(dst.size, dst.itemsize, link.segment_bytes)):
        link.recv(peer, step, j, into=dst[sl])
