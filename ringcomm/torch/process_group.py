"""The torch.distributed process group that runs on one ringcomm communicator.

torch.distributed calls these verbs with group ranks and an options object; each lends its
tensors to ringcomm (:mod:`ringcomm.torch.tensors`), starts the collective and returns a
:class:`~ringcomm.torch.work.TorchWork`. A call made with ``opts.asyncOp`` False
(``async_op=False`` in torch.distributed) completes before it returns, in the calling
thread when ringcomm's communication thread is idle; an asynchronous one returns at once.
Point-to-point calls are always started asynchronously (torch waits on them itself).

Reduce ops: SUM, AVG, PRODUCT, MIN, MAX, BAND, BOR, BXOR are ringcomm's own; PREMUL_SUM
multiplies by its factor first, then sums. Collectives on one group are issued in one order
on every rank (torch.distributed's contract), from any thread: ringcomm's thread guard is off
for these communicators; its signatures still catch ranks whose calls differ.

>>> import ringcomm.torch; dist.init_process_group("ringcomm")
>>> dist.all_reduce(t)                   # ProcessGroupRingcomm.allreduce([t], opts)
"""
import math
import threading
import time
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import AllgatherOptions  # not re-exported by torch.distributed

from . import monitored, sparse
from .arguments import check_pieces, one, reduce_op, rows, viewed_as
from .tensors import check_op, lend, wire_count
from .versions import VersionNames
from .work import AllOf, TorchWork

SHUTDOWN_GRACE_S = 1.0  # destroy_process_group() waits this long for calls in flight
CHAINED_S = 0.5  # a shutdown this soon after another shares its grace (see _Teardown)


class _Teardown:
    """One grace for shutdowns that follow each other at once: torch's world destroy shuts
    every group down in turn, and each may have calls in flight behind the same stuck one,
    so the whole destroy, not each group, gets SHUTDOWN_GRACE_S."""

    def __init__(self):
        self._lock = threading.Lock()
        self._until, self._last_end = 0.0, -math.inf

    def grace(self):
        now = time.monotonic()
        with self._lock:
            if now - self._last_end > CHAINED_S:
                self._until = now + SHUTDOWN_GRACE_S
            return max(0.0, self._until - now)

    def ended(self):
        with self._lock:
            self._last_end = time.monotonic()


_teardown = _Teardown()


class ProcessGroupRingcomm(VersionNames, dist.ProcessGroup):
    """A torch.distributed process group whose verbs run on ``comm`` (a ringcomm
    communicator over the group's members, group rank i = communicator rank i)."""

    def __init__(self, comm, on_shutdown=None):
        super().__init__(comm.rank, comm.world_size)
        self.comm = comm
        comm.guard_threads = False
        self._gpu = comm.device == "gpu"
        self._gpu_index = comm._device.index if self._gpu else None  # where CUDA tensors must be
        self._on_shutdown = on_shutdown
        self._group_name = self._group_desc = ""
        self._monitored = 0  # monitored_barrier calls so far

    def getBackendName(self):
        return "ringcomm"

    # torch names its groups through these (DeviceMesh and FSDP2 look groups up by name)
    def setGroupName(self, name):
        self._group_name = name

    def getGroupName(self):
        return self._group_name

    def setGroupDesc(self, desc):
        self._group_desc = desc

    def getGroupDesc(self):
        return self._group_desc

    def __repr__(self):
        return f"<ProcessGroupRingcomm {self.comm.name} rank {self.comm.rank}/{self.comm.world_size}>"

    # -- helpers ----------------------------------------------------------------------------
    def _lend(self, tensors, **kw):
        return lend(tensors, gpu=self._gpu, device_index=self._gpu_index, **kw)

    def _start(self, opts, loans, result, call, after=None):
        """Start ``call(async_op)``, signed with the loans' view; a TorchWork over what it
        returns."""
        async_op = opts is None or getattr(opts, "asyncOp", True)
        with viewed_as(loans):
            if async_op or self._gpu:
                # on a GPU even a synchronous call goes through TorchWork's wait, which blocks
                # until the device work is done before the copies back run on torch's stream
                work = TorchWork(call(True), loans, result, after)
                if not async_op:
                    work.wait()
                return work
            call(False)
        return TorchWork(None, loans, result, after)

    def _reduction(self, tensors, opts):
        op, factor = reduce_op(opts.reduceOp)
        check_op(tensors, op, factor)
        return op, factor

    # -- reductions -------------------------------------------------------------------------
    def allreduce(self, tensors, opts=None):
        if isinstance(tensors, torch.Tensor):  # DDP's Join hook passes a bare tensor
            tensors = [tensors]
        tensor, opts = one(tensors, "allreduce"), opts or dist.AllreduceOptions()
        if tensor.is_sparse:  # an nn.Embedding(sparse=True)'s gradient under DDP, for one
            return self._sparse_all_reduce(tensor, opts, tensors)
        return self._all_reduce([tensor], opts, tensors)

    def _sparse_all_reduce(self, tensor, opts, result):
        """The sum of sparse COO tensors (see ringcomm.torch.sparse): the headers' all-gather
        runs here; the indices' and values' all-gathers as the call asks, summed into
        ``tensor`` once both are in."""
        op, factor = reduce_op(opts.reduceOp)
        if op != "sum" or factor is not None:
            raise ValueError(f"ringcomm all-reduces sparse tensors with SUM only, not {opts.reduceOp}")
        if self._gpu:  # the same on every rank of the group: refused before any message
            raise ValueError("ringcomm: sparse tensors are all-reduced on CPU groups only")
        local, n = tensor.detach().coalesce(), self.comm.world_size
        heads = np.empty((n, sparse.HEADER), np.int64)
        self.comm.all_gather(heads.reshape(-1), sparse.header(local))
        sparse.check_alike(heads, self.comm.rank)
        max_nnz = int(heads[:, 0].max())
        indices, values = sparse.padded(local, max_nnz)
        every_index = torch.empty((n, *indices.shape), dtype=torch.int64)
        every_value = torch.empty((n, *values.shape), dtype=values.dtype)

        @torch.no_grad()
        def add_up():
            tensor.copy_(sparse.summed(local, heads, every_index, every_value))
        if max_nnz == 0:  # no rank has an entry
            return TorchWork(None, [], result, add_up)
        works = [self._all_gather([every_index], indices, None, None),
                 self._all_gather([every_value], values, None, None)]
        work = TorchWork(AllOf(works), [], result, add_up)
        if not getattr(opts, "asyncOp", True):
            work.wait()
        return work

    def allreduce_coalesced(self, tensors, opts=None):
        """One all-reduce over the tensors laid end to end (one dtype)."""
        return self._all_reduce(tensors, opts or dist.AllreduceCoalescedOptions(), tensors)

    def _all_reduce(self, tensors, opts, result):
        op, factor = self._reduction(tensors, opts)
        loan = self._lend(tensors, reducing=True)
        if factor is not None:
            loan.array *= factor
        return self._start(opts, [loan], result,
                           lambda a: self.comm.all_reduce(loan.array, op, async_op=a))

    def reduce(self, tensors, opts=None):
        opts = opts or dist.ReduceOptions()
        tensor = one(tensors, "reduce")
        op, factor = self._reduction([tensor], opts)
        loan = self._lend([tensor], reducing=True)
        root, target, after = opts.rootRank, loan.array, None
        if factor is not None:  # scaled in a copy: ranks other than the root keep their tensor
            target = loan.array * factor
            if self.comm.rank == root:
                def after():
                    loan.array[...] = target
        return self._start(opts, [loan], tensors,
                           lambda a: self.comm.reduce(target, root, op, async_op=a), after)

    def reduce_scatter(self, output_tensors, input_tensors, opts=None):
        out = one(output_tensors, "reduce_scatter")
        pieces = one(input_tensors, "reduce_scatter")
        self._check_pieces(pieces, out, "reduce_scatter", "input")
        return self._reduce_scatter(out, pieces, opts, output_tensors)

    def reduce_scatter_single(self, output, input, opts=None):
        return self._reduce_scatter(output, [input], opts, [output])

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        return self._each(self.reduce_scatter_single, outputs, inputs, opts)

    def _reduce_scatter(self, out, pieces, opts, result):
        opts = opts or dist.ReduceScatterOptions()
        op, factor = self._reduction([out, *pieces], opts)
        x = self._lend(pieces, reducing=True, output=False)
        y = self._lend([out], reducing=True, copy_in=False)
        source = x.array * factor if factor is not None else x.array  # the inputs stay as they were
        return self._start(opts, [x, y], result,
                           lambda a: self.comm.reduce_scatter(y.array, source, op, async_op=a))

    # -- data movement ------------------------------------------------------------------------
    def broadcast(self, tensors, opts=None):
        opts = opts or dist.BroadcastOptions()
        loan = self._lend([one(tensors, "broadcast")])
        root = opts.rootRank
        return self._start(opts, [loan], tensors,
                           lambda a: self.comm.broadcast(loan.array, root, async_op=a))

    def allgather(self, output_tensors, input_tensors, opts=None):
        outs = one(output_tensors, "allgather")
        x = one(input_tensors, "allgather")
        self._check_pieces(outs, x, "allgather", "output")
        return self._all_gather(outs, x, opts, output_tensors)

    def all_gather_single(self, output, input, opts=None):
        return self._all_gather([output], input, opts, [output])

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        return self._each(self.all_gather_single, outputs, inputs, opts)

    def allgather_coalesced(self, output_lists, input_list, opts=None):
        """torch's layout: ``output_lists[r][i]`` receives rank r's ``input_list[i]``."""
        n, k = self.comm.world_size, len(input_list)
        if len(output_lists) != n or any(len(outs) != k for outs in output_lists):
            raise ValueError(f"ringcomm allgather_coalesced: {n} output lists (one per rank) of {k} "
                             f"tensors (one per input) expected, got {[len(o) for o in output_lists]}")
        by_input = [[output_lists[r][i] for r in range(n)] for i in range(k)]
        return self._chain([self.allgather([outs], [x], opts) for outs, x in zip(by_input, input_list, strict=True)],
                           output_lists)

    def _each(self, verb, outputs, inputs, opts):
        """A coalesced call: ``verb(output, input, opts)`` for each pair, one work for all."""
        return self._chain([verb(o, i, opts) for o, i in zip(outputs, inputs, strict=True)], outputs)

    def _all_gather(self, outs, x, opts, result):
        opts = opts or AllgatherOptions()
        xs = self._lend([x], output=False)
        ys = self._lend(outs, copy_in=False)
        return self._start(opts, [xs, ys], result,
                           lambda a: self.comm.all_gather(ys.array, xs.array, async_op=a))

    def gather(self, output_tensors, input_tensors, opts=None):
        opts = opts or dist.GatherOptions()
        x = self._lend([one(input_tensors, "gather")], output=False)
        ys = self._root_pieces(opts.rootRank, output_tensors, input_tensors[0], "gather", "output", copy_in=False)
        return self._start(opts, [x, *([ys] if ys else [])], output_tensors,
                           lambda a: self.comm.gather(ys and ys.array, x.array, opts.rootRank, async_op=a))

    def scatter(self, output_tensors, input_tensors, opts=None):
        opts = opts or dist.ScatterOptions()
        y = self._lend([one(output_tensors, "scatter")], copy_in=False)
        xs = self._root_pieces(opts.rootRank, input_tensors, output_tensors[0], "scatter", "input", output=False)
        return self._start(opts, [y, *([xs] if xs else [])], output_tensors,
                           lambda a: self.comm.scatter(y.array, xs and xs.array, opts.rootRank, async_op=a))

    def _root_pieces(self, root, tensors, like, what, side, **lend):
        """On ``root``: its list of per-rank tensors (``side`` of ``what``), checked against
        ``like`` and lent as one buffer; ``None`` on every other rank."""
        if self.comm.rank != root:
            return None
        pieces = one(tensors, what)
        self._check_pieces(pieces, like, what, side)
        return self._lend(pieces, **lend)

    def alltoall(self, output_tensors, input_tensors, opts=None):
        opts = opts or dist.AllToAllOptions()
        n = self.comm.world_size
        if len(output_tensors) != n or len(input_tensors) != n:
            raise ValueError(f"ringcomm alltoall takes {n} input and {n} output tensors, got "
                             f"{len(input_tensors)} and {len(output_tensors)}")
        xs = self._lend(input_tensors, output=False)
        ys = self._lend(output_tensors, copy_in=False)
        # the blocks' sizes are this rank's own: another rank's may differ even where these
        # are equal, so the splits always go to ringcomm (which checks them across ranks)
        ins = [b - a for _, a, b in xs.bounds]
        outs = [b - a for _, a, b in ys.bounds]
        return self._start(opts, [xs, ys], output_tensors,
                           lambda a: self.comm.all_to_all(ys.array, xs.array, outs, ins, async_op=a))

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        opts = opts or dist.AllToAllOptions()
        n = self.comm.world_size
        outs = rows(output, output_split_sizes, n, "output_split_sizes")
        ins = rows(input, input_split_sizes, n, "input_split_sizes")
        for tensor, splits, name in ((input, ins, "input"), (output, outs, "output")):
            if splits is None and tensor.dim() and tensor.shape[0] % n:
                raise ValueError(f"ringcomm all_to_all_single: the {name}'s first dimension "
                                 f"({tensor.shape[0]}) does not split evenly over {n} ranks")
        if (outs is None) != (ins is None):  # one side uneven: name both sides' counts
            outs = outs or [wire_count(output) // n] * n
            ins = ins or [wire_count(input) // n] * n
        xs = self._lend([input], output=False)
        ys = self._lend([output], copy_in=False)
        return self._start(opts, [xs, ys], [output],
                           lambda a: self.comm.all_to_all(ys.array, xs.array, outs, ins, async_op=a))

    # -- synchronisation and point-to-point ---------------------------------------------------
    def barrier(self, opts=None):
        return self._start(opts, [], [], lambda a: self.comm.barrier(async_op=a))

    def monitored_barrier(self, timeout=None, wait_all_ranks=False):
        """A barrier that names the ranks that did not come (see ringcomm.torch.monitored);
        ``torch.distributed.monitored_barrier`` reaches it (see ringcomm.torch)."""
        seconds = monitored.seconds_of(timeout, self.comm)  # refused before this call is counted
        self._monitored += 1
        return monitored.barrier(self.comm, self._monitored, seconds, wait_all_ranks)

    def send(self, tensors, dstRank, tag=0):
        loan = self._lend([one(tensors, "send")], output=False)
        with viewed_as([loan]):
            return TorchWork(self.comm.send(loan.array, dstRank, tag, async_op=True), [loan], tensors)

    def recv(self, tensors, srcRank, tag=0):
        loan = self._lend([one(tensors, "recv")])
        with viewed_as([loan]):
            work = TorchWork(self.comm.recv(loan.array, srcRank, tag, async_op=True), [loan], tensors)
        work.source = srcRank  # what _source_rank() reports, as Gloo's named receives do
        return work

    def recv_anysource(self, tensors, tag=0):
        """``dist.recv(t)`` / ``dist.irecv(t)`` without ``src``: the first message any rank
        of the group sent with ``tag``; the work's ``_source_rank()`` names its sender."""
        loan = self._lend([one(tensors, "recv")])
        with viewed_as([loan]):
            return TorchWork(self.comm.recv(loan.array, None, tag, async_op=True), [loan], tensors)

    # -- lifetime -------------------------------------------------------------------------
    def shutdown(self):
        """destroy_process_group(): the calls still in flight get SHUTDOWN_GRACE_S to
        finish (the groups of one destroy share it), then fail here and on every rank that
        waits for this one (a group's collectives: revoked on every member)."""
        if self._on_shutdown is not None:
            self._on_shutdown(self)
        try:
            self.comm.close(grace=_teardown.grace())
        finally:
            _teardown.ended()

    abort = shutdown

    # -----------------------------------------------------------------------------------------
    def _check_pieces(self, pieces, tensor, verb, side):
        check_pieces(pieces, tensor, self.comm.world_size, verb, side)

    def _chain(self, works, result):
        """One work over several started in order (ringcomm completes them in order)."""
        last = works[-1] if works else TorchWork(None, [], result)
        return TorchWork(None if last._work is None else AllOf(works), [], result)


_torch_monitored_barrier = dist.distributed_c10d.monitored_barrier


def monitored_barrier(group=None, timeout=None, wait_all_ranks=False):
    """``torch.distributed.monitored_barrier``, which takes Gloo groups only, made to take
    ringcomm's too (their :meth:`ProcessGroupRingcomm.monitored_barrier`); any other group
    goes to torch's own function. ``import ringcomm.torch`` installs it.

    >>> dist.monitored_barrier(timeout=timedelta(seconds=5))   # every rank of the default group
    """
    c10d = dist.distributed_c10d
    if c10d._rank_not_in_group(group):  # as torch's: a rank outside the group does nothing
        return None
    pg = c10d._get_default_group() if group is None else group
    if not isinstance(pg, ProcessGroupRingcomm):
        return _torch_monitored_barrier(group, timeout, wait_all_ranks)
    if timeout is not None and not isinstance(timeout, timedelta):
        timeout = timedelta(seconds=timeout)
    return pg.monitored_barrier(timeout, wait_all_ranks)
