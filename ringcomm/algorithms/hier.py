"""Hierarchical schedules: keep to the host first, cross the network once per rail.

For a group spread over H hosts with L ranks on each (words: :mod:`ringcomm.topology`;
rank r's host, local rank and rail come from ``link.topology``). Each phase runs an
existing schedule on a :class:`~ringcomm.link.SubLink` of the ranks it involves.

**All-reduce** of S bytes, in place:

1. reduce-scatter inside each host (ring over its L ranks, shared-memory lanes): local rank
   i ends with chunk i+1 (mod L) of the host's sum, S/L bytes;
2. all-reduce of that chunk along rail i (ring over the H hosts);
3. all-gather inside each host.

Inter-host bytes sent per rank: 2(H−1)/H · S/L. A flat ring over the same ranks (hosts in
group-rank order) makes every rank at a host boundary send 2(N−1)/N · S across it, N = HL:
about L times more on that link. Intra-host bytes per rank: 2(L−1)/L · S.

**Reduce-scatter** (``out`` of m elements from ``x`` of N·m): reduce-scatter inside the
host of a copy of ``x`` ordered by rail (local rank i keeps the H chunks of rail i), then
reduce-scatter along the rail; inter-host bytes per rank (H−1)·m. **All-gather** is the
mirror: along the rail first, then inside the host, then the chunks back into rank order.
Both hold a scratch buffer of N·m elements while they run (the flat ring needs none).

**Broadcast** and **reduce**: one chain across hosts through one rank per host (the root on
its own host, the lowest group rank elsewhere: the host's *leader*), and inside each host a
fan-out from the leader (reduce: into it) for messages up to ``SMALL_MESSAGE_BYTES``, a
pipelined chain above. Each host's network link carries S once.

Hosts holding different numbers of ranks: all-reduce reduces into each host's leader, runs
the ring among the leaders and broadcasts inside each host (the leader's link carries
2(H−1)/H · S); reduce-scatter and all-gather run the flat ring. A group on one host runs
the flat ring throughout; with one rank per host, all-reduce, reduce-scatter and
all-gather run the flat ring, and broadcast and reduce the chain through the leaders, which
is the ring's chain from the root.

The partial sums of phases 1 and 2 are reduced with ``op`` but not finished: ``avg`` divides
once, by N, where a chunk is finished, so every rank copies the same bits.
"""
import numpy as np

from ..ops import ReduceOp, finalize
from . import ps, ring
from .choice import SMALL_MESSAGE_BYTES
from .chunks import chunk_bounds

# the phases of one collective: each gets its own message keys (see SubLink)
HOST, RAIL, HOST_AGAIN = 1, 2, 3


def _partial(op):
    """The op that reduces partial results: ``avg`` sums, and divides once at the end."""
    return ReduceOp.SUM if op is ReduceOp.AVG else op


def all_reduce(link, x, op):
    """In place on flat ``x``: every rank ends with ``op`` over all ranks' ``x``."""
    top, n = link.topology, link.size
    if top is None or not top.layered:
        return ring.all_reduce(link, x, op)
    if top.per_host is None:
        return _all_reduce_via_leaders(link, x, op)
    host = link.sub(top.my_host, HOST)
    table, chunk = ring.chunk_table(x, host), _piece(x, host)  # chunk: finished here in phase 1
    ring.reduce_scatter_in_place(host, x, _partial(op), table)  # steps 0 .. L-2
    ring.all_reduce(link.sub(top.rail(host.rank), RAIL), chunk, _partial(op))
    finalize(op, chunk, n)
    ring.all_gather_in_place(host, x, table)  # steps L-1 .. 2L-3: keys of their own


def _all_reduce_via_leaders(link, x, op):
    """Uneven hosts: into each host's leader, the ring among the leaders, back out."""
    top = link.topology
    host, leaders, lead = _host_and_leaders(link, root=None)
    _reduce_in(host, x, lead, _partial(op), keep=False)
    if leaders is not None:
        ring.all_reduce(leaders, x, _partial(op))
        finalize(op, x, link.size)
    _broadcast_in(link.sub(top.my_host, HOST_AGAIN), x, lead)


def _piece(buf, host):
    """The chunk of ``buf`` that the ring inside the host finishes on this rank, local rank
    + 1 (mod L), and that this rank's rail then works on (for a buffer ordered by rail, see
    Topology.by_rail: its H·m elements)."""
    lo, hi = chunk_bounds(buf.size, host.size)[(host.rank + 1) % host.size]
    return buf[lo:hi]


def reduce_scatter(link, out, x, op):
    """``out`` (m elements) gets chunk ``rank`` of ``op`` over all ranks' ``x`` (n·m);
    ``x`` is not modified."""
    top, n, m = link.topology, link.size, out.size
    if top is None or not top.layered or top.per_host is None:
        return ring.reduce_scatter(link, out, x, op)
    buf = np.empty_like(x)  # a CuPy array for a CuPy ``x``
    buf.reshape(n, m)[top.by_rail] = x.reshape(n, m)
    host = link.sub(top.my_host, HOST)
    ring.reduce_scatter_in_place(host, buf, _partial(op), ring.chunk_table(buf, host))
    ring.reduce_scatter(link.sub(top.rail(host.rank), RAIL), out, _piece(buf, host), _partial(op))
    finalize(op, out, n)


def all_gather(link, out, x):
    """``out`` (n·m elements) gets every rank's ``x`` (m elements), in rank order."""
    top, n, m = link.topology, link.size, x.size
    if top is None or not top.layered or top.per_host is None:
        return ring.all_gather(link, out, x)
    host = link.sub(top.my_host, HOST)
    buf = np.empty_like(out)
    ring.all_gather(link.sub(top.rail(host.rank), RAIL), _piece(buf, host), x)
    ring.all_gather_in_place(host, buf, ring.chunk_table(buf, host))
    out.reshape(n, m)[...] = buf.reshape(n, m)[top.by_rail]


def _host_and_leaders(link, root):
    """This rank's host as a SubLink, the leaders as one (``None`` unless this rank leads
    its host) and the leader's place in the host. Leaders are ordered host by host from the
    root's host on (host 0's without a root), so the root is leader 0."""
    top, me = link.topology, link.rank
    heads = [root if root is not None and top.hosts[root] == h else members[0]
             for h, members in enumerate(top.host_ranks)]
    members = top.my_host
    lead = members.index(heads[top.hosts[me]])
    first = 0 if root is None else top.hosts[root]
    heads = heads[first:] + heads[:first]
    return link.sub(members, HOST), (link.sub(heads, RAIL) if me in heads else None), lead


def _broadcast_in(host, x, lead):
    if host.size > 1:
        (ps if x.nbytes <= SMALL_MESSAGE_BYTES else ring).broadcast(host, x, lead)


def _reduce_in(host, x, lead, op, keep):
    """Reduce the host's ``x`` into its leader's; ``keep``: the leader reduces into a copy
    and returns it (its ``x`` must stay as it was). Returns the leader's result."""
    if host.size == 1:
        return x
    acc = x.copy() if keep and host.rank == lead else x
    (ps if x.nbytes <= SMALL_MESSAGE_BYTES else ring).reduce(host, acc, lead, op)
    return acc


def broadcast(link, x, root):
    """In place: ``x`` of ``root`` reaches every rank, crossing each host boundary once."""
    top = link.topology
    if top is None or top.num_hosts == 1:
        return ring.broadcast(link, x, root)
    host, leaders, lead = _host_and_leaders(link, root)
    if leaders is not None:  # several hosts: one leader each
        ring.broadcast(leaders, x, 0)
    _broadcast_in(host, x, lead)


def reduce(link, x, root, op):
    """``x`` on ``root`` gets ``op`` over all ranks; ``x`` elsewhere is left unchanged."""
    top = link.topology
    if top is None or top.num_hosts == 1:
        return ring.reduce(link, x, root, op)
    host, leaders, lead = _host_and_leaders(link, root)
    acc = _reduce_in(host, x, lead, _partial(op), keep=link.rank != root)
    if leaders is not None:
        ring.reduce(leaders, acc, 0, _partial(op))
        if link.rank == root:
            finalize(op, x, link.size)


__all__ = ["all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce"]
