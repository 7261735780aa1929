"""How a communicator's checked calls reach the wire: a :class:`Caller`, one per
communicator, under its verbs (:mod:`ringcomm.comm`).

For each call it picks the schedule (``auto`` by size, locality and topology), signs what
every rank must agree on, takes the call's number — a collective the communicator's next
sequence number, a send the next number of its (peer, tag), a receive its number once it
binds (:mod:`ringcomm.receives`) — in submission order under the engine's lock, and runs
the :class:`~ringcomm.collective.Call` in the calling thread (a synchronous collective while
the communication thread is idle) or queues it there as a :class:`~ringcomm.engine.Work`.
Collectives are guarded against a second thread (:mod:`ringcomm.threads`).

>>> caller.collective("all_reduce", "auto", x.nbytes, x, (x.reshape(-1), op), x, async_op=False)
"""
import math
import numbers
import time
from collections import defaultdict

from . import receives, signature
from .algorithms import SCHEDULES, schedule
from .algorithms.choice import auto_algorithm
from .checks import check_device_reduce
from .collective import Call
from .errors import CommError
from .link import HOST
from .threads import ThreadGuard
from .topology import Topology
from .transport.frame import COLLECTIVE, POINT_TO_POINT
from .transport.mailbox import COLLECTIVES

ALGORITHMS = ("auto", *SCHEDULES)


class Caller:
    def __init__(self, comm, engine, device):
        self.comm, self.engine, self.device = comm, engine, device
        self.seq = 0                      # the next collective's sequence number
        self.p2p_seq = defaultdict(int)   # ("to", peer, tag) -> next message number
        self.receives = receives.Receives()  # the numbers of receives (see ringcomm.receives)
        self.threads = ThreadGuard(comm.name, self.revoke)
        self.closed = False
        self.agreements = 0  # agreements on lost ranks this communicator ran (see ringcomm.elastic)
        self._schedules = {}  # (algorithm, collective) -> its function, found once
        self._local = self._topology = None  # found once, on first use

    # -- what the ranks of the group share -------------------------------------------------
    @property
    def local(self):
        """True when every other rank of the group shares this host's shared-memory lanes."""
        if self._local is None:
            comm, lanes = self.comm, self.engine.session.wire.lane_peers
            me = comm.ranks[comm.rank]
            self._local = all(r == me or r in lanes for r in comm.ranks)
        return self._local

    @property
    def topology(self):
        """Which ranks of the group share a host (the same on every rank)."""
        if self._topology is None:
            ids, comm = self.engine.session.wire.host_ids, self.comm
            self._topology = Topology.of([ids[g] for g in comm.ranks], comm.rank)
        return self._topology

    def check_open(self):
        name = self.comm.name
        if self.engine.forked:
            raise CommError(f"{name}: this process was forked from the one that owns the "
                            f"communicator and cannot use it (it may make one of its own)")
        if self.closed or self.engine.closed:
            raise CommError(f"{name}: communicator is closed")

    def revoke(self, why, code=COLLECTIVES, rank=None):
        """Make every collective on the communicator fail, here and on every other rank (see
        ringcomm.threads), and with ``code`` EVERY_CALL or LOST every point-to-point call too
        (see ringcomm.elastic); safe from any thread: the running call sees it as it waits."""
        engine, comm = self.engine, self.comm
        if not engine.session.revoke(comm.comm_id, comm.ranks, why, code, rank):
            return
        # every member is told once, by whichever comes first: the call in progress as it
        # fails, or the communication thread (work queued before it may block for long)
        with engine.lock:
            if not engine.closed:
                engine.submit(lambda t: t.announce_revoked(comm.comm_id), f"revoke {comm.name}")

    def close(self, grace, is_world):
        """Close the communicator (see Communicator.close); ``is_world``: its engine too."""
        if grace is not None and (isinstance(grace, bool) or not isinstance(grace, numbers.Real)
                                  or not 0 <= grace < math.inf):
            raise ValueError(f"close(grace=...) takes a finite number of seconds >= 0, got {grace!r}")
        grace = None if grace is None else float(grace)  # numpy scalars: Thread.join takes floats
        if self.closed:
            return
        if self.engine.forked:  # a child's copy: nothing of it is this process's to close
            self.closed = True  # (its guard may even be locked by a thread the child lacks)
            return
        self.threads.check_idle("close()")
        self.closed = True
        comm = self.comm
        if is_world:
            self.engine.close(grace=grace)
        elif grace is not None and not self.threads.wait_idle(time.monotonic() + grace):
            self.revoke(f"rank {comm.ranks[comm.rank]} closed {comm.name} while this "
                        f"collective was in flight")

    # -- the route of a call ---------------------------------------------------------------
    def collective(self, collective, algorithm, nbytes, x, args, result, async_op, op=None, root=None,
                   count=None):
        """Run the schedule ``algorithm`` names for ``collective`` (``auto`` picks by
        ``nbytes``) as ``schedule(link, *args)``; ``x`` is the array every rank signs for
        (dtype, element count or ``count``), with ``op`` and ``root``."""
        if op is not None:  # a reduction: on a GPU, only what reduce.cu can do
            check_device_reduce(x, op, self.device)
        if algorithm not in ALGORITHMS:
            raise ValueError(f"unknown algorithm {algorithm!r}; expected one of {ALGORITHMS}")
        if algorithm == "auto":
            local = self._local if self._local is not None else self.local
            topology = self._topology if self._topology is not None else self.topology
            algorithm = auto_algorithm(collective, self.comm.world_size, nbytes, local, topology)
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
        return self.submit(body, sig, x, result, async_op, collective, route=None)

    def agreed_first(self, agree, *args, **kwargs):
        """:meth:`collective` after ``agree()`` (a collective of its own that checks what
        the ranks pass), the thread claimed once for both."""
        self.check_open()
        user = self.threads.enter(args[0])
        try:
            agree()
            return self.collective(*args, **kwargs)
        finally:
            self.threads.leave(user)

    def point_to_point(self, route, body, x, result, async_op):
        sig = signature.pack("point_to_point", x.dtype, None, None, 0, x.size, signature.current_view())
        return self.submit(body, sig, x, result, async_op, "point_to_point", route=route)

    def submit(self, body, sig, x, result, async_op, verb, route):
        """Run ``body(link)`` as one call: a collective (``route`` None) takes the next
        sequence number, a send the next number of its ("to", peer, tag), a receive (``route``
        a :class:`~ringcomm.receives.Ticket`) its number once it binds.
        Point-to-point calls are not guarded against other threads: they are numbered per
        route, so two threads' sends cannot be paired in the wrong order across ranks."""
        self.check_open()
        user = self.threads.enter(verb) if route is None else None
        work = None
        try:
            call, work = self._queue(body, sig, x, result, async_op, verb, route)
            if work is None:  # this thread holds the session: the call runs here and now
                try:
                    result = call.run(self.engine.session)
                finally:
                    self.engine.release()
                call.join()
                return result
            return work if async_op else work.wait()
        finally:
            # a blocking call interrupted in its wait leaves its work queued: it still counts
            self.threads.leave(user, work)

    def _queue(self, body, sig, x, result, async_op, verb, route):
        """The call, and its queued :class:`~ringcomm.engine.Work` (None: a synchronous
        collective this thread runs itself, holding the session)."""
        # an empty device array is still a device array: its (empty) segments must not reach
        # the wire unstaged, which takes host memory only
        staged = self.device.staged and self.device.is_array(x)
        device = self.device if staged else HOST
        ready = device.ready()  # on this thread, outside the lock the communication thread takes
        engine, name = self.engine, self.comm.name
        with engine.lock:  # numbers are taken in submission order, which every rank shares
            if engine.closed:
                raise CommError(f"{name}: communicator is closed")
            if route is None:
                space, seq = COLLECTIVE, self.seq
                self.seq += 1
                what = f"{verb} #{seq} on {name}"
            elif isinstance(route, receives.Ticket):
                space, seq = POINT_TO_POINT, self.receives.post(route)
                what = route.describe(name)
            else:
                space, seq = POINT_TO_POINT, self.p2p_seq[route]
                self.p2p_seq[route] += 1
                _, peer, tag = route
                what = f"send to rank {peer} (tag {tag}, #{seq}) on {name}"
            call = Call(comm=self.comm, body=body, space=space, seq=seq, sig=sig, dtype=x.dtype, what=what,
                        device=device, result=result, ready=ready)
            if route is None and not async_op and engine.hold():
                return call, None  # a collective never defers: nothing for the thread to finish
            work = engine.submit(call.run, what, inline=not async_op)
            if isinstance(route, receives.Ticket) and route.any:
                # however it ends, a receive from any source that found no message must not
                # hold back the receives posted behind it on its tag
                work.add_done_callback(lambda _: self.receives.cancel(route))
            if staged:
                work.joins(call.join)
        if work.inline:  # outside engine.lock: other threads may queue behind it meanwhile
            engine.run_inline(work)
        return call, work
