"""The Communicator: the public face of ringcomm.

A communicator is a group of ranks that run collectives together. Each verb checks its
arguments on the calling rank (``TypeError``/``ValueError`` before anything is sent) and
hands the call to its :class:`~ringcomm.caller.Caller`, which picks the schedule, numbers the
call and runs it in place or on the communication thread (:mod:`ringcomm.engine`).
``async_op=True`` returns a :class:`~ringcomm.engine.Work` handle instead of waiting.

Algorithms (``algorithm=``): ``"ring"``, ``"ps"`` (the parameter server), ``"rd"``
(recursive doubling), ``"hier"`` (inside each host, then across hosts; see
:mod:`ringcomm.algorithms`), and ``"auto"`` (few-hop schedules for small messages, the ring
or ``hier`` otherwise; see :func:`ringcomm.algorithms.choice.auto_algorithm`).

Every rank signs each collective (collective, dtype, count, op, root, algorithm): a
mismatch raises :class:`CollectiveMismatch` on every rank, naming both sides. Costs below
are per rank for n ranks and S bytes, with the ring.

>>> comm = ringcomm.init()
>>> x = np.full(3, comm.rank + 1.0)
>>> comm.all_reduce(x)            # rank 0 and rank 1 of 2: x == [3., 3., 3.]
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from . import elastic, groups, p2p, receives
from .algorithms import schedule
from .arrays import Array
from .caller import Caller
from .checks import agree_splits, check_array, check_pair, check_peer, check_rank, check_source, split_sizes
from .engine import Work
from .link import HOST, Stats
from .ops import Op, parse_op
from .topology import Topology

_EMPTY = np.empty(0, np.uint8)  # what a barrier signs for: no data

class Communicator:
    """A group of ranks. Create the world with :func:`ringcomm.init`, subgroups with
    :meth:`new_group`.

    ``rank``/``world_size`` are this process's position and the group size; ``ranks`` the
    group's members as global ranks; ``device`` "cpu" or "gpu"; ``local_rank`` and
    ``local_world_size`` (the world only) this process's place among the ranks of its host.
    ``guard_threads`` (default True) refuses a collective called from one thread while
    another thread has one in progress and revokes the communicator on every rank
    (:mod:`ringcomm.threads`); set it False where the caller itself orders collectives across
    threads identically on every rank (the contract torch.distributed gives its backends).
    Off, it still counts what each thread has in flight (a group's ``close(grace=...)`` waits
    for it), so turning it back on while another thread's ``async_op`` work is unfinished
    makes the next collective from this one revoke.
    """

    def __init__(self, engine, *, ranks, rank, comm_id, name, timeout, segment_bytes, is_world,
                 device=None, local_rank=None, local_world_size=None):
        self._engine = engine
        self._device = device or HOST
        self.ranks = tuple(ranks)
        self.rank = rank
        self.world_size = len(ranks)
        self.comm_id, self.name = comm_id, name
        self.timeout, self.segment_bytes = timeout, segment_bytes
        self.device = self._device.kind
        self.local_rank, self.local_world_size = local_rank, local_world_size
        self._is_world = is_world
        self._groups = groups.Counters()
        self._stats = Stats()
        self._caller = Caller(self, engine, self._device)
        engine.session.members[comm_id] = frozenset(self.ranks)  # (see Session._check_waiting)
        self._collective = self._caller.collective  # (collective, algorithm, nbytes, x, args, ...)
        self._point_to_point = self._caller.point_to_point  # (route, body, x, result, async_op)

    def _array(self, x, name, writable=True):
        return check_array(x, name, writable, self._device)

    def all_reduce(self, x: Array, op: Op = "sum", algorithm: str = "auto", async_op: bool = False) -> Array | Work:
        """In place: every rank's ``x`` becomes ``op`` over all ranks' ``x``; returns ``x``.
        Every rank ends with bitwise-identical values. 2(n−1) steps, 2(n−1)/n·S bytes sent.

        >>> x = np.array([rank + 1.0])       # rank 0: [1.], rank 1: [2.]
        >>> comm.all_reduce(x, op="sum")     # both: [3.]
        """
        flat = self._array(x, "x")
        op = parse_op(op, x.dtype)
        return self._collective("all_reduce", algorithm, x.nbytes, x, (flat, op), x, async_op, op=op)

    def reduce_scatter(self, out: Array, x: Array, op: Op = "sum", algorithm: str = "auto",
                       async_op: bool = False) -> Array | Work:
        """``out`` gets the reduced slice ``[rank*out.size:(rank+1)*out.size]`` of flat ``x``
        (``x.size == world_size * out.size``); ``x`` is unchanged. Returns ``out``. In place
        when ``out`` is exactly that slice of ``x``. n−1 steps, (n−1)/n·S bytes sent (S of x).

        >>> x = np.arange(4.0)               # on both of 2 ranks
        >>> comm.reduce_scatter(out, x)      # rank 0: out == [0., 2.], rank 1: [4., 6.]
        """
        flat_out, flat = self._array(out, "out"), self._array(x, "x", writable=False)
        check_pair(out, x, self.rank, x.size, self.world_size * out.size, "x.size", "world_size * out.size")
        op = parse_op(op, x.dtype)
        return self._collective("reduce_scatter", algorithm, x.nbytes, x, (flat_out, flat, op), out, async_op, op=op)

    def all_gather(self, out: Array, x: Array, algorithm: str = "auto", async_op: bool = False) -> Array | Work:
        """``out`` gets every rank's ``x`` in rank order (``out.size == world_size * x.size``).
        Returns ``out``. In place when ``x`` is exactly this rank's slice of ``out``. n−1
        steps, (n−1)/n·S bytes sent (S of out).

        >>> x = np.array([rank])             # rank 0: [0], rank 1: [1]
        >>> comm.all_gather(out, x)          # both: out == [0, 1]
        """
        flat_out, flat = self._array(out, "out"), self._array(x, "x", writable=False)
        check_pair(out, x, self.rank, out.size, self.world_size * x.size, "out.size", "world_size * x.size")
        return self._collective("all_gather", algorithm, out.nbytes, x, (flat_out, flat), out, async_op)

    def broadcast(self, x: Array, root: int = 0, algorithm: str = "auto", async_op: bool = False) -> Array | Work:
        """In place: every rank's ``x`` becomes ``root``'s ``x``. Returns ``x``. A chain of
        n−1 hops, pipelined by segment; every rank but the last sends S.

        >>> x = np.array([7.0]) if rank == 0 else np.zeros(1)
        >>> comm.broadcast(x, root=0)        # every rank: [7.]
        """
        flat = self._array(x, "x", writable=self.world_size > 1)
        check_rank(root, self.world_size, "root", self.name)
        return self._collective("broadcast", algorithm, x.nbytes, x, (flat, root), x, async_op, root=root)

    def reduce(self, x: Array, root: int = 0, op: Op = "sum", algorithm: str = "auto",
               async_op: bool = False) -> Array | Work:
        """``x`` on ``root`` becomes ``op`` over all ranks; ``x`` elsewhere is unchanged.
        Returns ``x``. A chain of n−1 hops ending at ``root``; every rank but ``root`` sends S.

        >>> x = np.array([rank + 1.0])
        >>> comm.reduce(x, root=1)           # rank 1: [3.]; rank 0 still [1.]
        """
        flat = self._array(x, "x")
        check_rank(root, self.world_size, "root", self.name)
        op = parse_op(op, x.dtype)
        return self._collective("reduce", algorithm, x.nbytes, x, (flat, root, op), x, async_op, op=op, root=root)

    def gather(self, out: Array | None, x: Array, root: int = 0, algorithm: str = "auto",
               async_op: bool = False) -> Array | None | Work:
        """``out`` on ``root`` gets every rank's ``x`` in rank order (``out.size == world_size
        * x.size`` there); ``out`` elsewhere is not used (may be None). Returns ``out``. The
        root receives (n−1)·|x|, every other rank sends |x|.

        >>> x = np.array([rank])             # rank 0: [0], rank 1: [1]
        >>> comm.gather(out, x, root=0)      # rank 0: out == [0, 1]
        """
        flat = self._array(x, "x", writable=False)
        check_rank(root, self.world_size, "root", self.name)
        flat_out = None
        if self.rank == root:
            flat_out = self._array(out, "out")
            check_pair(out, x, self.rank, out.size, self.world_size * x.size, "out.size", "world_size * x.size")
        return self._collective("gather", algorithm, x.nbytes, x, (flat_out, flat, root), out, async_op, root=root)

    def scatter(self, out: Array, x: Array | None, root: int = 0, algorithm: str = "auto",
                async_op: bool = False) -> Array | Work:
        """``out`` on every rank gets its slice of ``root``'s ``x`` (``x.size == world_size *
        out.size`` there; rank r gets ``x[r*out.size:(r+1)*out.size]``); ``x`` elsewhere is not
        used (may be None). Returns ``out``. The root sends (n−1)·|out|.

        >>> x = np.array([10, 11])           # on rank 0
        >>> comm.scatter(out, x, root=0)     # rank 0: out == [10], rank 1: [11]
        """
        flat_out = self._array(out, "out")
        check_rank(root, self.world_size, "root", self.name)
        flat = None
        if self.rank == root:
            flat = self._array(x, "x", writable=False)
            check_pair(out, x, self.rank, x.size, self.world_size * out.size, "x.size", "world_size * out.size")
        return self._collective("scatter", algorithm, out.nbytes, out, (flat_out, flat, root), out, async_op, root=root)

    def all_to_all(self, out: Array, x: Array, out_splits: Sequence[int] | None = None,
                   in_splits: Sequence[int] | None = None, algorithm: str = "auto",
                   async_op: bool = False) -> Array | Work:
        """Rank r's block for rank s lands in rank s's ``out`` in rank order. ``in_splits[s]``:
        elements this rank sends to rank s (they sum to ``x.size``), ``out_splits[s]``:
        elements it receives from rank s (they sum to ``out.size``); None: equal blocks
        (``x.size`` divisible by the world size). Uneven splits are first checked across ranks
        (one small all-gather, run before the call returns even with ``async_op=True``, and
        counted in ``stats()``): rank r's ``in_splits[s]`` must be rank s's ``out_splits[r]``;
        every rank passes splits, or none does. Returns ``out``. n−1 steps; (n−1)/n of ``x``
        sent for equal splits.

        >>> # 2 ranks: x = [a0, a1] on rank 0, [b0, b1] on rank 1
        >>> comm.all_to_all(out, x)          # rank 0: out == [a0, b0]; rank 1: [a1, b1]
        """
        flat_out, flat = self._array(out, "out"), self._array(x, "x", writable=False)
        n = self.world_size
        outs = split_sizes(out_splits, out.size, n, "out", "out_splits")
        ins = split_sizes(in_splits, x.size, n, "x", "in_splits")
        check_pair(out, x, self.rank, 0, 0, "", "", allow_in_place=False)
        schedule("ring" if algorithm == "auto" else algorithm, "all_to_all")  # refused before the splits go
        if out_splits is None and in_splits is None:
            if out.size != x.size:
                raise ValueError(f"out.size = {out.size} but x.size = {x.size}; equal splits need them equal")
            return self._collective("all_to_all", algorithm, x.nbytes, x, (flat_out, flat, outs, ins), out,
                                    async_op)
        # signed for count 0 (the ranks' sizes differ; the splits are agreed first); the
        # array that has data decides whether the call is staged on a device
        return self._caller.agreed_first(lambda: agree_splits(self, outs, ins), "all_to_all", algorithm,
                                         x.nbytes, x if x.size else out, (flat_out, flat, outs, ins), out,
                                         async_op, count=0)

    def barrier(self, algorithm: str = "auto", async_op: bool = False) -> None | Work:
        """Returns once every rank of the group has entered. ``auto``/``rd``: dissemination,
        ceil(log2 n) rounds; ``ring``/``ps``: an empty all-reduce with that algorithm."""
        return self._collective("barrier", algorithm, 0, _EMPTY, (), None, async_op)

    def send(self, x: Array, dst: int, tag: int = 0, async_op: bool = False) -> None | Work:
        """Send ``x`` to rank ``dst``; the matching :meth:`recv` names this rank and ``tag``.
        Returns once ``x`` may be modified again (not when it was received). At most
        ``RINGCOMM_P2P_WINDOW_BYTES`` go unreceived to one peer on one tag; past that a send
        waits for the receiver (see :mod:`ringcomm.p2p`)."""
        flat = self._array(x, "x", writable=False)
        check_peer(dst, "dst", tag, self.rank, self.world_size, self.name)
        return self._point_to_point(("to", dst, tag), lambda link: p2p.send(link, flat, dst, tag), x, None, async_op)

    def recv(self, x: Array, src: int | None, tag: int = 0, async_op: bool = False) -> Array | int | Work:
        """In place: ``x`` gets what rank ``src`` sent with ``tag`` (same dtype and size).
        Returns ``x``.

        ``src=None`` (``ringcomm.ANY_SOURCE``): the first message any other rank of the group
        sent with ``tag``, taken whole from that rank; returns that rank (its group rank), as
        does the Work's ``wait()`` with ``async_op=True``. The receives on one tag take their
        messages in posting order, from a named rank or not, as in MPI (ranks that closed,
        timeouts: :mod:`ringcomm.receives`).

        >>> comm.recv(y, None, tag=3)      # rank 0 of 3, rank 2's message first: returns 2
        >>> w = comm.recv(y, None, tag=3, async_op=True)
        >>> w.wait()                       # 1: y holds rank 1's message
        """
        flat = self._array(x, "x")
        check_source(src, tag, self.rank, self.world_size, self.name)
        ticket, numbers = receives.Ticket(src, tag), self._caller.receives
        return self._point_to_point(ticket, lambda link: p2p.recv(link, flat, ticket, numbers), x, x, async_op)

    def new_group(self, ranks: Sequence[int], *, members_only: bool = False) -> Communicator | None:
        """A communicator over ``ranks`` (ranks of this communicator; group rank i is
        ``ranks[i]``); ranks outside the group get ``None``. By default every rank of this
        communicator calls it, with the same list, in the same order of calls (one
        all-gather over this communicator checks that). ``members_only=True``: the members
        alone call it, nobody else takes part (see :mod:`ringcomm.groups`).

        >>> evens = comm.new_group([0, 2])   # rank 0 -> group rank 0, rank 2 -> group rank 1
        >>> pair = comm.new_group([1, 3], members_only=True)   # called by ranks 1 and 3 alone
        """
        return groups.new_group(self, ranks, members_only)

    def shrink(self) -> Communicator:
        """On every survivor, after a :class:`PeerLost`: the communicator over the members not
        lost (the same on every survivor), ranks renumbered in order; this one is revoked
        (calls on it fail on every survivor with :class:`RanksLost`). See :mod:`ringcomm.elastic`.

        >>> comm = comm.shrink()           # ranks 0, 1, 3 of 4 after rank 2 died: 0, 1, 2 of 3
        """
        return elastic.shrink(self)

    def agree(self, flag: bool) -> tuple[bool, tuple[int, ...]]:
        """``(AND of the members' flags, group ranks found lost)``, the same on every member
        that returns, even if ranks die meanwhile (see :mod:`ringcomm.elastic`)."""
        return elastic.agree(self, flag)

    def revoke(self) -> None:
        """Every pending and later call on this communicator fails on every member (Revoked)."""
        elastic.revoke(self)

    def stats(self) -> dict[str, int]:
        """Payload bytes and messages this rank sent and received on this communicator."""
        return self._stats.as_dict()

    def reset_stats(self) -> None:
        self._stats = Stats()

    def close(self, grace: float | None = None) -> None:
        """Release the communicator. Closing the world also stops the communication thread
        after the queued work and says goodbye to every peer; idempotent. Raises
        :class:`CommError` (and closes nothing) while another thread has a collective in
        progress on it, unless ``guard_threads`` is off.

        ``grace`` (seconds): queued and running calls may take this long to finish; then
        on the world every one left fails with :class:`CommError` and the close ends within
        about a second more (peers still waiting for this rank then fail, naming it); on a
        group, one of its collectives left revokes it on every member (the collectives left
        fail here and wherever a member waits in them, naming this rank; its point-to-point
        calls go on). Without it, they finish or fail within their deadline first."""
        self._caller.close(grace, self._is_world)

    def __enter__(self) -> Communicator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<Communicator {self.name} rank {self.rank}/{self.world_size}>"

    @property
    def local(self) -> bool:
        """True when every other rank of this group shares this host's shared-memory lanes
        (then every member says so: sharing lanes is an equivalence between ranks)."""
        return self._caller.local

    @property
    def guard_threads(self) -> bool:
        return self._caller.threads.enabled

    @guard_threads.setter
    def guard_threads(self, on: bool) -> None:
        self._caller.threads.enabled = bool(on)

    @property
    def topology(self) -> Topology:
        """Which ranks of this group share a host: a :class:`~ringcomm.topology.Topology`
        (``comm.topology.hosts[r]``: the host number of group rank r), the same on every
        rank. ``algorithm="hier"`` and ``stats()``'s intra/inter-host split follow it."""
        return self._caller.topology
