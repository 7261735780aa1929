"""The names each supported torch calls on a process group, and the spellings that
:class:`~ringcomm.torch.process_group.ProcessGroupRingcomm` answers besides its own.

torch.distributed renames the verbs it calls on a group between releases: torch 2.11 and
2.12 call ``group._allgather_base(out, x, opts)`` where 2.13 calls
``group.all_gather_single(out, x, opts)``. A name the Python class does not define falls
through to torch's C++ ``ProcessGroup``, which has no backend behind a Python group and
raises "No backend type associated with device type cpu". :data:`NAMES` lists, per torch
(major.minor), every verb torch's own Python calls on a group object, in distributed_c10d.py,
DDP's Python side and the checkpoint transport; FSDP, fully_shard, ZeroRedundancyOptimizer,
DeviceMesh, the functional collectives, Join and the DDP comm hooks reach a group only through
distributed_c10d's functions or the bookkeeping in :data:`BASE`. :class:`VersionNames`
answers the spellings process_group.py does not write by delegating to the ones it does;
every version passes the same arguments in the same order, with the same options classes.

>>> class ProcessGroupRingcomm(VersionNames, dist.ProcessGroup): ...
>>> pg._allgather_base(out, x, opts)        # torch 2.11 and 2.12: pg.all_gather_single(out, x, opts)
>>> "alltoall_base" in NAMES["2.11"]
True

tests/torch_backend/test_versions.py checks that the class defines every name here, and that
the installed torch calls no verb missing from its line (the rule: ``R.name(...)`` where R's
last identifier contains "pg" or "group" and name is a method of torch's ``ProcessGroup``).
"""
from datetime import timedelta

from torch.distributed.distributed_c10d import AllToAllOptions

# what every supported torch calls, under one spelling throughout 2.11 to 2.13
_COMMON = ("abort", "allgather", "allgather_coalesced", "allreduce", "allreduce_coalesced",
           "alltoall", "barrier", "broadcast", "gather", "monitored_barrier", "recv",
           "recv_anysource", "reduce", "reduce_scatter", "scatter", "send", "shutdown")

# the tensor ("single") forms: 2.13 renamed them, same arguments in the same order
_BEFORE_2_13 = ("_allgather_base", "_reduce_scatter_base", "alltoall_base",
                "allgather_into_tensor_coalesced", "reduce_scatter_tensor_coalesced")
_SINCE_2_13 = ("all_gather_single", "reduce_scatter_single", "all_to_all_single",
               "all_gather_single_coalesced", "reduce_scatter_single_coalesced")

NAMES = {
    # 2.11's _coalescing_manager calls allgather_into_tensor_coalesced(outputs, inputs)
    # without options; 2.12 passes them (the only difference between the two)
    "2.11": tuple(sorted(_COMMON + _BEFORE_2_13)),
    "2.12": tuple(sorted(_COMMON + _BEFORE_2_13)),
    "2.13": tuple(sorted(_COMMON + _SINCE_2_13)),
}

# The names torch calls on a group that torch's C++ ProcessGroup answers itself (rank and
# size, its backend table, names, pending-work bookkeeping). _start_coalescing and
# _end_coalescing are reached only for a group whose type is exactly ProcessGroup
# (batch_isend_irecv checks); split_group and get_group_store only from dist.split_group
# (DeviceMesh calls it only for a group bound to a CUDA device), which ringcomm does not offer.
BASE = frozenset({
    "rank", "size", "_get_backend", "_has_hooks", "_register_backend", "_set_default_backend",
    "_set_group_name", "_set_group_desc", "_wait_for_pending_works", "_start_coalescing",
    "_end_coalescing", "get_group_store", "split_group"})


class VersionNames:
    """The other versions' spellings of ProcessGroupRingcomm's verbs, each one the verb
    process_group.py writes. A mixin before ``dist.ProcessGroup`` in the class's bases: the
    class's own definitions come first, these before the C++ base's (which would raise)."""

    # -- torch 2.11 and 2.12 ------------------------------------------------------------------
    def _allgather_base(self, output, input, opts=None):
        return self.all_gather_single(output, input, opts)

    def _reduce_scatter_base(self, output, input, opts=None):
        return self.reduce_scatter_single(output, input, opts)

    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        # torch's own binding also takes a timeout in the options' place
        if isinstance(opts, timedelta):
            opts, timeout = AllToAllOptions(), opts
            opts.timeout = timeout
        return self.all_to_all_single(output, input, output_split_sizes, input_split_sizes, opts)

    # -- torch 2.13 ---------------------------------------------------------------------------
    # process_group.py writes the coalesced tensor forms under their 2.11 names; 2.13's
    # _coalescing_manager calls these (its C++ callers fall back to the old names themselves)
    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        return self.allgather_into_tensor_coalesced(outputs, inputs, opts)

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        return self.reduce_scatter_tensor_coalesced(outputs, inputs, opts)
