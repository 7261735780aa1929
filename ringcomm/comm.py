"""The Communicator: the public face of ringcomm.

A communicator is a group of ranks that run collectives together. It checks arguments
locally (raising ``ValueError``/``TypeError`` before anything is sent), gives every
collective a sequence number, picks an algorithm, and hands the work to the process's
communication thread (:mod:`ringcomm.engine`). ``async_op=True`` returns a
:class:`~ringcomm.engine.Work` handle instead of waiting.

Algorithms (``algorithm=``): ``"ring"`` (ring reduce-scatter + all-gather; a pipelined chain
for broadcast and reduce), ``"ps"`` (parameter server: everything through a root, rank 0 for
all-reduce, reduce-scatter and all-gather), ``"rd"`` (recursive doubling, all-reduce only), ``"auto"`` (few-hop schedules for small messages — up to 64 KiB,
or 1 MiB for an all-reduce among ranks of one host — the ring otherwise; see
:func:`auto_algorithm`).

Every collective on every rank gets the same signature (collective, dtype, count, op, root,
algorithm); a rank that sees a different one raises :class:`CollectiveMismatch` describing
both sides and tells every other rank, which raise it too.

>>> comm = ringcomm.init()
>>> x = np.full(3, comm.rank + 1.0)
>>> comm.all_reduce(x)            # rank 0 and rank 1 of 2: x == [3., 3., 3.]
"""
import zlib
from collections import defaultdict

import numpy as np

from . import p2p, signature
from .algorithms import ps, rd, ring
from .algorithms.choice import (  # noqa: F401 - part of this module's interface
    LOCAL_ALL_REDUCE_RD_BYTES, SMALL_MESSAGE_BYTES, all_reduce_bytes, auto_algorithm)
from .errors import CollectiveMismatch, CommError
from .collective import Call
from .link import HOST, Stats
from .ops import parse_op
from .threads import ThreadGuard

ALGORITHMS = ("auto", "ring", "ps", "rd")


def _check_array(x, name, writable=True, device=None):
    if isinstance(x, np.ndarray) and type(x) not in (np.ndarray, np.memmap):
        # a masked array's mask, a matrix's 2-D rules: a subclass means more than its bytes
        raise TypeError(f"{name} must be a plain numpy array, got {type(x).__module__}.{type(x).__name__} "
                        f"(np.asarray(x) gives the plain array of its data)")
    if not isinstance(x, np.ndarray) and not (device is not None and device.is_array(x)):
        raise TypeError(f"{name} must be a numpy array{' or a CuPy array on this device' if device and device.kind == 'gpu' else ''}, "
                        f"got {type(x).__name__}")
    if not signature.dtype_supported(x.dtype):
        names = ", ".join(d.name for d in signature.DTYPES)
        raise TypeError(f"{name} has unsupported dtype {x.dtype}; supported: {names}")
    if not x.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous (use np.ascontiguousarray)")
    if writable and not getattr(x.flags, "writeable", True):
        raise ValueError(f"{name} is read-only, but this collective writes into it")
    return x.reshape(-1)


def _agreed(body):
    """``body`` after every rank has seen every other rank's signature (:meth:`Link.agree`).

    In a broadcast or a reduce some ranks only send (the root of a broadcast, the leaves of a
    reduce), so a rank that disagrees on the root could finish without noticing; agreeing
    first makes the mismatch fail that very call on every rank, and keeps any rank from
    running more than one rooted collective ahead of the others."""
    def agreed(link):
        link.agree()
        return body(link)
    return agreed


def _address(a):
    """Start address of an array's data (numpy or CuPy)."""
    return a.ctypes.data if isinstance(a, np.ndarray) else a.data.ptr


class Communicator:
    """A group of ranks. Create the world with :func:`ringcomm.init`, subgroups with
    :meth:`new_group`.

    ``rank``/``world_size`` are this process's position and the group size; ``ranks`` the
    group's members as global ranks.
    """

    def __init__(self, engine, ranks, rank, comm_id, name, timeout, segment_bytes, is_world,
                 device=None):
        self._engine = engine
        self._device = device or HOST
        self.ranks = tuple(ranks)
        self.rank = rank
        self.world_size = len(ranks)
        self.comm_id, self.name = comm_id, name
        self.timeout, self.segment_bytes = timeout, segment_bytes
        self.device = self._device.kind  # "cpu", "gpu" or "emulated"
        self._is_world = is_world
        self._seq = 0
        self._p2p_seq = defaultdict(int)
        self._groups = 0
        self._local = None  # see the `local` property
        self._stats = Stats()
        self._closed = False
        self._threads = ThreadGuard(name)

    # -- collectives ---------------------------------------------------------------------
    def all_reduce(self, x, op="sum", algorithm="auto", async_op=False):
        """In place: every rank's ``x`` becomes ``op`` over all ranks' ``x``; returns ``x``.

        Every rank ends with bitwise-identical values. Ring cost per rank: 2(n−1) steps,
        2(n−1)/n·S bytes sent.

        >>> x = np.array([rank + 1.0])       # rank 0: [1.], rank 1: [2.]
        >>> comm.all_reduce(x, op="sum")     # both: [3.]
        """
        flat = self._check_array(x, "x")
        op = parse_op(op, x.dtype)
        algo = self._algorithm(algorithm, "all_reduce", x.nbytes)
        body = {"ring": lambda link: ring.all_reduce(link, flat, op, link.segment_bytes),
                "ps": lambda link: ps.all_reduce(link, flat, op),
                "rd": lambda link: rd.all_reduce(link, flat, op)}[algo]
        return self._submit("all_reduce", body, x.dtype, x.size, op, algo, 0, async_op, x, staged=x)

    def reduce_scatter(self, out, x, op="sum", algorithm="auto", async_op=False):
        """``out`` gets the reduced slice ``[rank*out.size:(rank+1)*out.size]`` of flat ``x``
        (``x.size == world_size * out.size``); ``x`` is unchanged. Returns ``out``.
        In place when ``out`` is exactly that slice of ``x`` (then the rest of ``x`` is
        left unchanged too).

        >>> x = np.arange(4.0)               # on both of 2 ranks
        >>> comm.reduce_scatter(out, x)      # rank 0: out == [0., 2.], rank 1: [4., 6.]
        """
        flat_out, flat = self._check_array(out, "out"), self._check_array(x, "x", writable=False)
        self._check_pair(out, x, x.size, self.world_size * out.size, "x.size", "world_size * out.size")
        op = parse_op(op, x.dtype)
        algo = self._algorithm(algorithm, "reduce_scatter", x.nbytes)
        body = {"ring": lambda link: ring.reduce_scatter(link, flat_out, flat, op, link.segment_bytes),
                "ps": lambda link: ps.reduce_scatter(link, flat_out, flat, op)}[algo]
        return self._submit("reduce_scatter", body, x.dtype, x.size, op, algo, 0, async_op, out, staged=x)

    def all_gather(self, out, x, algorithm="auto", async_op=False):
        """``out`` gets every rank's ``x`` in rank order (``out.size == world_size * x.size``).
        Returns ``out``. In place when ``x`` is exactly this rank's slice of ``out``.

        >>> x = np.array([rank])             # rank 0: [0], rank 1: [1]
        >>> comm.all_gather(out, x)          # both: out == [0, 1]
        """
        flat_out, flat = self._check_array(out, "out"), self._check_array(x, "x", writable=False)
        self._check_pair(out, x, out.size, self.world_size * x.size, "out.size", "world_size * x.size")
        algo = self._algorithm(algorithm, "all_gather", out.nbytes)
        body = {"ring": lambda link: ring.all_gather(link, flat_out, flat, link.segment_bytes),
                "ps": lambda link: ps.all_gather(link, flat_out, flat)}[algo]
        return self._submit("all_gather", body, x.dtype, x.size, None, algo, 0, async_op, out, staged=x)

    def broadcast(self, x, root=0, algorithm="auto", async_op=False):
        """In place: every rank's ``x`` becomes ``root``'s ``x``. Returns ``x``.

        >>> x = np.array([7.0]) if rank == 0 else np.zeros(1)
        >>> comm.broadcast(x, root=0)        # every rank: [7.]
        """
        flat = self._check_array(x, "x", writable=self.world_size > 1)
        self._check_root(root)
        algo = self._algorithm(algorithm, "broadcast", x.nbytes)
        body = {"ring": lambda link: ring.broadcast(link, flat, root, link.segment_bytes),
                "ps": lambda link: ps.broadcast(link, flat, root)}[algo]
        return self._submit("broadcast", _agreed(body), x.dtype, x.size, None, algo, root, async_op, x, staged=x)

    def reduce(self, x, root=0, op="sum", algorithm="auto", async_op=False):
        """``x`` on ``root`` becomes ``op`` over all ranks; ``x`` elsewhere is unchanged.

        >>> x = np.array([rank + 1.0])
        >>> comm.reduce(x, root=1)           # rank 1: [3.]; rank 0 still [1.]
        """
        flat = self._check_array(x, "x")
        self._check_root(root)
        op = parse_op(op, x.dtype)
        algo = self._algorithm(algorithm, "reduce", x.nbytes)
        body = {"ring": lambda link: ring.reduce(link, flat, root, op, link.segment_bytes),
                "ps": lambda link: ps.reduce(link, flat, root, op)}[algo]
        return self._submit("reduce", _agreed(body), x.dtype, x.size, op, algo, root, async_op, x, staged=x)

    def barrier(self, algorithm="auto", async_op=False):
        """Returns once every rank of the group has entered. ``auto``: dissemination
        (ceil(log2 n) rounds); ``ring``/``ps``: an empty all-reduce with that algorithm."""
        if algorithm == "auto":
            body, algo = rd.barrier, "dissemination"
        else:
            algo = self._algorithm(algorithm, "barrier", 0)
            empty = np.empty(0, np.uint8)
            body = {"ring": lambda link: ring.all_reduce(link, empty, parse_op("sum", np.uint8), 1),
                    "ps": lambda link: ps.all_reduce(link, empty, parse_op("sum", np.uint8))}[algo]
        return self._submit("barrier", body, np.uint8, 0, None, algo, 0, async_op, None)

    def send(self, x, dst, tag=0, async_op=False):
        """Send ``x`` to rank ``dst``; the matching :meth:`recv` names this rank and ``tag``.
        Returns once ``x`` may be modified again (not when it was received). At most
        ``RINGCOMM_P2P_WINDOW_BYTES`` go unreceived to one peer; past that a send waits for
        the receiver (see :mod:`ringcomm.p2p`)."""
        flat = self._check_array(x, "x", writable=False)
        self._check_peer(dst, "dst", tag)
        return self._submit("send", lambda link: p2p.send(link, flat, dst, tag), x.dtype, x.size,
                            None, None, 0, async_op, None, p2p=("to", dst, tag), staged=x)

    def recv(self, x, src, tag=0, async_op=False):
        """In place: ``x`` gets what rank ``src`` sent with ``tag`` (same dtype and size).
        Returns ``x``."""
        flat = self._check_array(x, "x")
        self._check_peer(src, "src", tag)
        return self._submit("send", lambda link: p2p.recv(link, flat, src, tag, x),
                            x.dtype, x.size, None, None, 0, async_op, x, p2p=("from", src, tag), staged=x)

    # -- groups, statistics, closing -------------------------------------------------------
    def new_group(self, ranks):
        """A communicator over ``ranks`` (ranks of this communicator; group rank i is
        ``ranks[i]``). Every rank of this communicator must call it, with the same list, in
        the same order of calls; ranks outside the group get ``None``.

        >>> evens = comm.new_group([0, 2])   # rank 0 -> group rank 0, rank 2 -> group rank 1
        """
        members = [int(r) for r in ranks]
        if not members or len(set(members)) != len(members) or \
                any(not 0 <= r < self.world_size for r in members):
            raise ValueError(f"new_group needs distinct ranks in [0, {self.world_size}), got {list(ranks)}")
        self._check_open()
        index = self._groups
        self._groups += 1
        digest = zlib.crc32(f"{self.comm_id}/{index}/{members}".encode())
        mine = np.array([digest], np.int64)
        everyone = np.empty(self.world_size, np.int64)
        try:
            self.all_gather(everyone, mine)  # all ranks must agree on membership
        except CommError:
            self._groups = index  # refused or failed here: the next try uses the same index
            raise
        differing = [r for r in range(self.world_size) if everyone[r] != digest]
        if differing:
            raise CollectiveMismatch(f"new_group #{index} on {self.name}: rank {self.rank} asked "
                                     f"for {members}, ranks {differing} asked for other members")
        if self.rank not in members:
            return None
        return Communicator(self._engine, [self.ranks[r] for r in members], members.index(self.rank),
                            digest or 1, f"group{members}", self.timeout, self.segment_bytes, False,
                            self._device)

    def stats(self):
        """Payload bytes and messages this rank sent and received on this communicator."""
        return self._stats.as_dict()

    def reset_stats(self):
        self._stats = Stats()

    def close(self):
        """Release the communicator. Closing the world also stops the communication thread
        after the queued work and says goodbye to every peer; idempotent. Raises
        :class:`CommError` (and closes nothing) while another thread has a collective in
        progress on it."""
        if self._closed:
            return
        self._threads.check_idle("close()")
        self._closed = True
        if self._is_world:
            self._engine.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        return f"<Communicator {self.name} rank {self.rank}/{self.world_size}>"

    # -- internals -------------------------------------------------------------------------
    def _check_array(self, x, name, writable=True):
        return _check_array(x, name, writable, self._device)

    def _check_open(self):
        if self._closed or self._engine.closed:
            raise CommError(f"{self.name}: communicator is closed")

    def _check_root(self, root):
        if not isinstance(root, (int, np.integer)) or not 0 <= root < self.world_size:
            raise ValueError(f"root {root!r} is not a rank of {self.name} (size {self.world_size})")

    def _check_peer(self, peer, name, tag):
        self._check_root(peer)
        if peer == self.rank:
            raise ValueError(f"{name}={peer} is this rank itself")
        if not isinstance(tag, (int, np.integer)) or not 0 <= tag < 2 ** 32:
            raise ValueError(f"tag must be an integer in [0, 2**32), got {tag!r}")

    def _check_pair(self, out, x, got, want, got_name, want_name):
        if out.dtype != x.dtype:
            raise TypeError(f"out has dtype {out.dtype}, x has {x.dtype}; they must match")
        if got != want:
            raise ValueError(f"{got_name} = {got} but {want_name} = {want}")
        if type(out) is not type(x):
            raise TypeError(f"out is a {type(out).__name__}, x a {type(x).__name__}; they must match")
        if self._overlap(out, x) and not self._in_place(out, x):
            raise ValueError("out and x overlap; they may only overlap in place, with the small "
                             "buffer being exactly this rank's slice of the large one")

    def _in_place(self, out, x):
        """NCCL's in-place forms: reduce_scatter with ``out`` = this rank's slice of ``x``,
        all_gather with ``x`` = this rank's slice of ``out``."""
        big, small = (x, out) if x.size > out.size else (out, x)
        offset = self.rank * small.size * small.itemsize
        return _address(small) == _address(big) + offset

    @staticmethod
    def _overlap(a, b):
        if isinstance(a, np.ndarray):
            return np.shares_memory(a, b)
        lo_a, lo_b = _address(a), _address(b)
        return lo_a < lo_b + b.nbytes and lo_b < lo_a + a.nbytes

    def _algorithm(self, algorithm, collective, nbytes):
        if algorithm not in ALGORITHMS:
            raise ValueError(f"unknown algorithm {algorithm!r}; expected one of {ALGORITHMS}")
        n = self.world_size
        if algorithm == "rd" and collective != "all_reduce":
            raise ValueError(f"algorithm 'rd' (recursive doubling) is for all_reduce, not {collective}")
        if algorithm != "auto":
            return algorithm
        return auto_algorithm(collective, n, nbytes, self.local)

    @property
    def local(self):
        """True when every other rank of this group shares this host's shared-memory lanes
        (then every member says so: sharing lanes is an equivalence between ranks)."""
        if self._local is None:
            lanes = self._engine.transport.lane_peers
            me = self.ranks[self.rank]
            self._local = all(r == me or r in lanes for r in self.ranks)
        return self._local

    def _submit(self, collective, body, dtype, count, op, algorithm, root, async_op, result, p2p=None,
                staged=None):
        """Queue ``body(link)`` on the communication thread as one collective call.
        ``staged``: an array of the call; a device array makes the link stage segments."""
        self._check_open()
        user = self._threads.enter(collective) if p2p is None else None  # see ringcomm.threads
        work = None
        try:
            work = self._queue(collective, body, dtype, count, op, algorithm, root, async_op, result, p2p, staged)
            return work if async_op else work.wait()
        finally:
            if user is not None:
                self._threads.leave(user, work if async_op else None)

    def _queue(self, collective, body, dtype, count, op, algorithm, root, async_op, result, p2p, staged):
        device = self._device if self._device.staged and staged is not None and \
            self._device.is_array(staged) else HOST
        sig = signature.pack(collective, dtype, op, algorithm, root, count)
        engine = self._engine
        with engine.lock:
            if engine.closed:
                raise CommError(f"{self.name}: communicator is closed")
            if p2p is None:
                space, seq = 0, self._seq
                self._seq += 1
                what = f"{collective} #{seq} on {self.name}"
            else:
                space, seq = 1, self._p2p_seq[p2p]
                self._p2p_seq[p2p] += 1
                what = f"{'send to' if p2p[0] == 'to' else 'recv from'} rank {p2p[1]} (tag {p2p[2]}, #{seq}) on {self.name}"

            call = Call(self, body, space, seq, sig, dtype, what, device, result)
            work = engine.submit(call.run, what, inline=not async_op)
        if work.inline:  # outside engine.lock: other threads may queue behind it meanwhile
            engine.run_inline(work)
        return work
