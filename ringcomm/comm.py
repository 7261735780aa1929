"""The Communicator: the public face of ringcomm.

A communicator is a group of ranks that run collectives together. Each verb checks its
arguments on the calling rank (``TypeError``/``ValueError`` before anything is sent), picks
a schedule by name (:func:`ringcomm.algorithms.schedule`), and hands one
:class:`~ringcomm.collective.Call` to the process's communication thread
(:mod:`ringcomm.engine`), which a small synchronous call skips by running it in place.
``async_op=True`` returns a :class:`~ringcomm.engine.Work` handle instead of waiting.

Algorithms (``algorithm=``): ``"ring"`` (ring reduce-scatter + all-gather; a pipelined chain
for broadcast and reduce; all-to-all in ring order), ``"ps"`` (parameter server: everything
through one rank; gather and scatter straight to or from their root),
``"rd"`` (recursive doubling: all-reduce and barrier), ``"hier"`` (ranks on several hosts:
inside each host first, then across hosts; see :mod:`ringcomm.algorithms.hier`), ``"auto"``
(few-hop schedules for small messages, the ring or ``hier`` otherwise; see
:func:`ringcomm.algorithms.choice.auto_algorithm`).

Every rank signs each collective (collective, dtype, count, op, root, algorithm); a rank
that sees another signature raises :class:`CollectiveMismatch` naming both sides and tells
every other rank, which raise it too.

Costs below are per rank for n ranks and S bytes, with the ring.

>>> comm = ringcomm.init()
>>> x = np.full(3, comm.rank + 1.0)
>>> comm.all_reduce(x)            # rank 0 and rank 1 of 2: x == [3., 3., 3.]
"""
import math
import numbers
import time
from collections import defaultdict

import numpy as np

from . import groups, p2p, receives, signature
from .algorithms import SCHEDULES, schedule
from .algorithms.choice import auto_algorithm
from .checks import check_array, check_device_reduce, check_pair, check_peer, check_rank, check_tag, split_sizes
from .collective import Call
from .errors import CollectiveMismatch, CommError
from .link import HOST, Stats
from .transport.frame import COLLECTIVE, POINT_TO_POINT
from .ops import parse_op
from .threads import ThreadGuard
from .topology import Topology

ALGORITHMS = ("auto", *SCHEDULES)
_EMPTY = np.empty(0, np.uint8)  # what a barrier signs for: no data


class Communicator:
    """A group of ranks. Create the world with :func:`ringcomm.init`, subgroups with
    :meth:`new_group`.

    ``rank``/``world_size`` are this process's position and the group size; ``ranks`` the
    group's members as global ranks; ``device`` "cpu" or "gpu"; ``local_rank`` and
    ``local_world_size`` (the world only) this process's place among the ranks of its host.
    ``guard_threads`` (default True) refuses a collective called from one thread while
    another thread has one in progress and revokes the communicator on every rank
    (:mod:`ringcomm.threads`); set it False where the
    caller itself orders collectives across threads identically on every rank (the contract
    torch.distributed gives its backends). Off, it still counts what each thread has in
    flight (a group's ``close(grace=...)`` waits for it), so turning it back on while another
    thread's ``async_op`` work is unfinished makes the next collective from this one revoke.
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
        self._seq = 0                      # the next collective's sequence number
        self._p2p_seq = defaultdict(int)   # ("to", peer, tag) -> next message number
        self._receives = receives.Receives()  # the numbers of receives (see ringcomm.receives)
        self._groups = groups.Counters()
        self._local = None  # see the `local` property
        self._topology = None  # see the `topology` property
        self._schedules = {}  # (algorithm, collective) -> its function, found once
        self._stats = Stats()
        self._closed = False
        self._threads = ThreadGuard(name, self._revoke)

    # -- collectives ---------------------------------------------------------------------
    def all_reduce(self, x, op="sum", algorithm="auto", async_op=False):
        """In place: every rank's ``x`` becomes ``op`` over all ranks' ``x``; returns ``x``.
        Every rank ends with bitwise-identical values. 2(n−1) steps, 2(n−1)/n·S bytes sent.

        >>> x = np.array([rank + 1.0])       # rank 0: [1.], rank 1: [2.]
        >>> comm.all_reduce(x, op="sum")     # both: [3.]
        """
        flat = self._array(x, "x")
        op = parse_op(op, x.dtype)
        return self._collective("all_reduce", algorithm, x.nbytes, x, (flat, op), x, async_op, op=op)

    def reduce_scatter(self, out, x, op="sum", algorithm="auto", async_op=False):
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

    def all_gather(self, out, x, algorithm="auto", async_op=False):
        """``out`` gets every rank's ``x`` in rank order (``out.size == world_size * x.size``).
        Returns ``out``. In place when ``x`` is exactly this rank's slice of ``out``. n−1
        steps, (n−1)/n·S bytes sent (S of out).

        >>> x = np.array([rank])             # rank 0: [0], rank 1: [1]
        >>> comm.all_gather(out, x)          # both: out == [0, 1]
        """
        flat_out, flat = self._array(out, "out"), self._array(x, "x", writable=False)
        check_pair(out, x, self.rank, out.size, self.world_size * x.size, "out.size", "world_size * x.size")
        return self._collective("all_gather", algorithm, out.nbytes, x, (flat_out, flat), out, async_op)

    def broadcast(self, x, root=0, algorithm="auto", async_op=False):
        """In place: every rank's ``x`` becomes ``root``'s ``x``. Returns ``x``. A chain of
        n−1 hops, pipelined by segment; every rank but the last sends S.

        >>> x = np.array([7.0]) if rank == 0 else np.zeros(1)
        >>> comm.broadcast(x, root=0)        # every rank: [7.]
        """
        flat = self._array(x, "x", writable=self.world_size > 1)
        check_rank(root, self.world_size, "root", self.name)
        return self._collective("broadcast", algorithm, x.nbytes, x, (flat, root), x, async_op, root=root)

    def reduce(self, x, root=0, op="sum", algorithm="auto", async_op=False):
        """``x`` on ``root`` becomes ``op`` over all ranks; ``x`` elsewhere is unchanged.
        Returns ``x``. A chain of n−1 hops ending at ``root``; every rank but ``root`` sends S.

        >>> x = np.array([rank + 1.0])
        >>> comm.reduce(x, root=1)           # rank 1: [3.]; rank 0 still [1.]
        """
        flat = self._array(x, "x")
        check_rank(root, self.world_size, "root", self.name)
        op = parse_op(op, x.dtype)
        return self._collective("reduce", algorithm, x.nbytes, x, (flat, root, op), x, async_op, op=op, root=root)

    def gather(self, out, x, root=0, algorithm="auto", async_op=False):
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

    def scatter(self, out, x, root=0, algorithm="auto", async_op=False):
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

    def all_to_all(self, out, x, out_splits=None, in_splits=None, algorithm="auto", async_op=False):
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
        if algorithm not in ALGORITHMS:  # refused here, before the splits are exchanged
            raise ValueError(f"unknown algorithm {algorithm!r}; expected one of {ALGORITHMS}")
        schedule("ring" if algorithm == "auto" else algorithm, "all_to_all")
        if out_splits is None and in_splits is None:
            if out.size != x.size:
                raise ValueError(f"out.size = {out.size} but x.size = {x.size}; equal splits need them equal")
            return self._collective("all_to_all", algorithm, x.nbytes, x, (flat_out, flat, outs, ins), out,
                                    async_op)
        self._check_open()
        user = self._threads.enter("all_to_all")  # one claim for both calls
        try:
            self._agree_splits(outs, ins)
            # signed for count 0 (the ranks' sizes differ; the splits were agreed above); the
            # array that has data decides whether the call is staged on a device
            return self._collective("all_to_all", algorithm, x.nbytes, x if x.size else out,
                                    (flat_out, flat, outs, ins), out, async_op, count=0)
        finally:
            self._threads.leave(user)

    def _agree_splits(self, outs, ins):
        """Every rank's splits, all-gathered: CollectiveMismatch on every rank if any rank's
        in_splits[s] differs from rank s's out_splits[r]."""
        n = self.world_size
        mine = np.array(list(ins) + list(outs), np.int64)
        table = np.empty(2 * n * n, np.int64)
        self.all_gather(table, mine)
        table = table.reshape(n, 2, n)  # [rank, in/out, peer]
        bad = [(r, s) for r in range(n) for s in range(n) if table[r, 0, s] != table[s, 1, r]]
        if bad:
            r, s = bad[0]
            raise CollectiveMismatch(f"all_to_all on {self.name}: rank {r} sends {table[r, 0, s]} elements "
                                     f"to rank {s}, which expects {table[s, 1, r]} from it")

    def barrier(self, algorithm="auto", async_op=False):
        """Returns once every rank of the group has entered. ``auto``/``rd``: dissemination,
        ceil(log2 n) rounds; ``ring``/``ps``: an empty all-reduce with that algorithm."""
        return self._collective("barrier", algorithm, 0, _EMPTY, (), None, async_op)

    # -- point-to-point ------------------------------------------------------------------
    def send(self, x, dst, tag=0, async_op=False):
        """Send ``x`` to rank ``dst``; the matching :meth:`recv` names this rank and ``tag``.
        Returns once ``x`` may be modified again (not when it was received). At most
        ``RINGCOMM_P2P_WINDOW_BYTES`` go unreceived to one peer on one tag; past that a send
        waits for the receiver (see :mod:`ringcomm.p2p`)."""
        flat = self._array(x, "x", writable=False)
        check_peer(dst, "dst", tag, self.rank, self.world_size, self.name)
        return self._point_to_point(("to", dst, tag), lambda link: p2p.send(link, flat, dst, tag),
                                    x, None, async_op)

    def recv(self, x, src, tag=0, async_op=False):
        """In place: ``x`` gets what rank ``src`` sent with ``tag`` (same dtype and size).
        Returns ``x``.

        ``src=None`` (``ringcomm.ANY_SOURCE``): the first message any other rank of the group
        sent with ``tag``, taken whole from that rank; returns that rank (its group rank), as
        does the Work's ``wait()`` with ``async_op=True``. The receives on one tag take their
        messages in posting order, from a named rank or not, as in MPI; a rank that closed
        drops out once nothing of its is left (``PeerLost`` when none is left); a timeout
        names the ranks waited for (see :mod:`ringcomm.receives`).

        >>> comm.recv(y, None, tag=3)      # rank 0 of 3, rank 2's message first: returns 2
        >>> w = comm.recv(y, None, tag=3, async_op=True)
        >>> w.wait()                       # 1: y holds rank 1's message
        """
        flat = self._array(x, "x")
        if src is None:
            check_tag(tag)
            if self.world_size < 2:
                raise ValueError(f"recv from any source on {self.name}: it has no other rank")
        else:
            check_peer(src, "src", tag, self.rank, self.world_size, self.name)
        ticket = receives.Ticket(src, tag)
        return self._point_to_point(ticket, lambda link: p2p.recv(link, flat, ticket, self._receives),
                                    x, x, async_op)

    # -- groups, statistics, closing -------------------------------------------------------
    def new_group(self, ranks, *, members_only=False):
        """A communicator over ``ranks`` (ranks of this communicator; group rank i is
        ``ranks[i]``); ranks outside the group get ``None``. By default every rank of this
        communicator calls it, with the same list, in the same order of calls (one
        all-gather over this communicator checks that). ``members_only=True``: the members
        alone call it, nobody else takes part (see :mod:`ringcomm.groups`).

        >>> evens = comm.new_group([0, 2])   # rank 0 -> group rank 0, rank 2 -> group rank 1
        >>> pair = comm.new_group([1, 3], members_only=True)   # called by ranks 1 and 3 alone
        """
        return groups.new_group(self, ranks, members_only)

    def _group(self, members, comm_id, name):
        return Communicator(self._engine, ranks=[self.ranks[r] for r in members], rank=members.index(self.rank),
                            comm_id=comm_id, name=name, timeout=self.timeout,
                            segment_bytes=self.segment_bytes, is_world=False, device=self._device)

    def stats(self):
        """Payload bytes and messages this rank sent and received on this communicator."""
        return self._stats.as_dict()

    def _revoke(self, why):
        """Make every collective on this communicator fail, here and on every other rank
        (see ringcomm.threads); safe from any thread: the running call sees it as it waits."""
        engine, comm_id = self._engine, self.comm_id
        if not engine.transport.revoke(comm_id, self.ranks, why):
            return
        # every member is told once, by whichever comes first: the call in progress as it
        # fails, or the communication thread (work queued before it may block for long)
        with engine.lock:
            if not engine.closed:
                engine.submit(lambda t: t.announce_revoked(comm_id), f"revoke {self.name}")

    def reset_stats(self):
        self._stats = Stats()

    def close(self, grace=None):
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
        if grace is not None and (isinstance(grace, bool) or not isinstance(grace, numbers.Real)
                                  or not 0 <= grace < math.inf):
            raise ValueError(f"close(grace=...) takes a finite number of seconds >= 0, got {grace!r}")
        grace = None if grace is None else float(grace)  # numpy scalars: Thread.join takes floats
        if self._closed:
            return
        if self._engine.forked:  # a child's copy: nothing of it is this process's to close
            self._closed = True  # (its guard may even be locked by a thread the child lacks)
            return
        self._threads.check_idle("close()")
        self._closed = True
        if self._is_world:
            self._engine.close(grace=grace)
        elif grace is not None and not self._threads.wait_idle(time.monotonic() + grace):
            self._revoke(f"rank {self.ranks[self.rank]} closed {self.name} while this "
                         f"collective was in flight")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        return f"<Communicator {self.name} rank {self.rank}/{self.world_size}>"

    @property
    def local(self):
        """True when every other rank of this group shares this host's shared-memory lanes
        (then every member says so: sharing lanes is an equivalence between ranks)."""
        if self._local is None:
            lanes = self._engine.transport.lane_peers
            me = self.ranks[self.rank]
            self._local = all(r == me or r in lanes for r in self.ranks)
        return self._local

    @property
    def guard_threads(self):
        return self._threads.enabled

    @guard_threads.setter
    def guard_threads(self, on):
        self._threads.enabled = bool(on)

    @property
    def topology(self):
        """Which ranks of this group share a host: a :class:`~ringcomm.topology.Topology`
        (``comm.topology.hosts[r]``: the host number of group rank r), the same on every
        rank. ``algorithm="hier"`` and ``stats()``'s intra/inter-host split follow it."""
        if self._topology is None:
            ids = self._engine.transport.host_ids
            self._topology = Topology.of([ids[g] for g in self.ranks], self.rank)
        return self._topology

    # -- the route of a call -----------------------------------------------------------------
    def _array(self, x, name, writable=True):
        return check_array(x, name, writable, self._device)

    def _check_open(self):
        if self._engine.forked:
            raise CommError(f"{self.name}: this process was forked from the one that owns the "
                            f"communicator and cannot use it (it may make one of its own)")
        if self._closed or self._engine.closed:
            raise CommError(f"{self.name}: communicator is closed")

    def _collective(self, collective, algorithm, nbytes, x, args, result, async_op, op=None, root=None,
                    count=None):
        """Run the schedule ``algorithm`` names for ``collective`` (``auto`` picks by
        ``nbytes``) as ``schedule(link, *args)``; ``x`` is the array every rank signs for
        (dtype, element count or ``count``), with ``op`` and ``root``."""
        if op is not None:  # a reduction: on a GPU, only what reduce.cu can do
            check_device_reduce(x, op, self._device)
        if algorithm not in ALGORITHMS:
            raise ValueError(f"unknown algorithm {algorithm!r}; expected one of {ALGORITHMS}")
        if algorithm == "auto":
            local = self._local if self._local is not None else self.local
            topology = self._topology if self._topology is not None else self.topology
            algorithm = auto_algorithm(collective, self.world_size, nbytes, local, topology)
        run = self._schedules.get((algorithm, collective))
        if run is None:
            run = self._schedules[(algorithm, collective)] = schedule(algorithm, collective)
        sig = signature.pack(collective, x.dtype, op, algorithm, root or 0, x.size if count is None else count,
                             signature.current_view())
        if root is not None:
            # some ranks of a rooted collective only send, so a rank that disagrees on the
            # root could finish without noticing: agreeing first fails the call on every rank
            def body(link):
                link.agree()
                return run(link, *args)
        else:
            def body(link):
                return run(link, *args)
        return self._submit(body, sig, x, result, async_op, collective, route=None)

    def _point_to_point(self, route, body, x, result, async_op):
        sig = signature.pack("point_to_point", x.dtype, None, None, 0, x.size, signature.current_view())
        return self._submit(body, sig, x, result, async_op, "point_to_point", route=route)

    def _submit(self, body, sig, x, result, async_op, verb, route):
        """Run ``body(link)`` as one call: a collective (``route`` None) takes the next
        sequence number, a send the next number of its ("to", peer, tag), a receive (``route``
        a :class:`~ringcomm.receives.Ticket`) its number once it binds.
        Point-to-point calls are not guarded against other threads: they are numbered per
        route, so two threads' sends cannot be paired in the wrong order across ranks."""
        self._check_open()
        # see ringcomm.threads
        user = self._threads.enter(verb) if route is None else None
        work = None
        try:
            call, work = self._queue(body, sig, x, result, async_op, verb, route)
            if work is None:  # this thread holds the transport: the call runs here and now
                try:
                    result = call.run(self._engine.transport)
                finally:
                    self._engine.release()
                call.join()
                return result
            return work if async_op else work.wait()
        finally:
            # a blocking call interrupted in its wait leaves its work queued: it still counts
            self._threads.leave(user, work)

    def _queue(self, body, sig, x, result, async_op, verb, route):
        """The call, and its queued :class:`~ringcomm.engine.Work` (None: a synchronous
        collective this thread runs itself, holding the transport)."""
        # an empty device array is still a device array: its (empty) segments must not reach
        # the transport unstaged, which takes host memory only
        staged = self._device.staged and self._device.is_array(x)
        device = self._device if staged else HOST
        ready = device.ready()  # on this thread, outside the lock the communication thread takes
        engine = self._engine
        with engine.lock:  # numbers are taken in submission order, which every rank shares
            if engine.closed:
                raise CommError(f"{self.name}: communicator is closed")
            if route is None:
                space, seq = COLLECTIVE, self._seq
                self._seq += 1
                what = f"{verb} #{seq} on {self.name}"
            elif isinstance(route, receives.Ticket):
                space, seq = POINT_TO_POINT, self._receives.post(route)
                what = route.describe(self.name)
            else:
                space, seq = POINT_TO_POINT, self._p2p_seq[route]
                self._p2p_seq[route] += 1
                _, peer, tag = route
                what = f"send to rank {peer} (tag {tag}, #{seq}) on {self.name}"
            call = Call(comm=self, body=body, space=space, seq=seq, sig=sig, dtype=x.dtype, what=what,
                        device=device, result=result, ready=ready)
            if route is None and not async_op and engine.hold():
                return call, None  # a collective never defers: nothing for the thread to finish
            work = engine.submit(call.run, what, inline=not async_op)
            if isinstance(route, receives.Ticket) and route.any:
                # however it ends, a receive from any source that found no message must not
                # hold back the receives posted behind it on its tag
                work.add_done_callback(lambda _: self._receives.cancel(route))
            if staged:
                work.joins(call.join)
        if work.inline:  # outside engine.lock: other threads may queue behind it meanwhile
            engine.run_inline(work)
        return call, work
