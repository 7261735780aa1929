"""The ringcomm communicators behind torch.distributed's process groups.

The default group joins ringcomm's world at a port of its own, agreed through torch's store
(:func:`ringcomm.torchrun.agree`) on the rendezvous address (``MASTER_ADDR``, else
127.0.0.1; so across hosts, rank 0 runs on ``MASTER_ADDR``'s host, as under torchrun). So
torch's store keeps ``MASTER_PORT`` (torchrun's, or ringcomm's launcher's) and users set
nothing more. Every later group is a members-only group of that world: torch.distributed
asks a backend for a group on its members alone. Every wait is bounded by the group's torch
timeout (``init_process_group(timeout=...)``, torch's default 30 minutes).

>>> import ringcomm.torch                  # registers create() as the backend "ringcomm"
>>> dist.init_process_group("ringcomm")     # create(options): the world
>>> dist.new_group([0, 1])                  # create(options) on ranks 0 and 1 alone
"""
import os
import threading

from ..torchrun import agree
from .process_group import ProcessGroupRingcomm

_lock = threading.Lock()
_world = None  # the ringcomm world of the default group, while it lives


def create(options, backend_options=None):
    """torch.distributed's backend constructor (``extended_api=True``): a
    :class:`ProcessGroupRingcomm` for the group ``options`` describes."""
    global _world
    timeout = options.timeout.total_seconds()
    ranks = list(options.global_ranks_in_group)
    with _lock:
        if not ranks:  # the default group
            if _world is not None:
                raise RuntimeError("ringcomm: the default process group already exists in this "
                                   "process; destroy_process_group() it first")
            _world = _join(options.store, options.group_rank, options.group_size, timeout)
            return ProcessGroupRingcomm(_world, on_shutdown=_forget)
        if _world is None:
            raise RuntimeError("ringcomm: a process group was asked for before the default group "
                               "(init_process_group('ringcomm') comes first)")
        world = _world
    group = world.new_group(ranks, members_only=True)
    group.timeout = timeout
    if group.rank != options.group_rank:
        raise RuntimeError(f"ringcomm: torch puts this process at group rank {options.group_rank} "
                           f"of {ranks}, ringcomm at {group.rank}")
    return ProcessGroupRingcomm(group)


def _join(store, rank, size, timeout):
    import ringcomm
    if size == 1:
        return ringcomm.init(timeout=timeout, rank=0, world_size=1)
    addr, port, forget = agree(store, rank, os.environ.get("MASTER_ADDR") or "127.0.0.1", "default_pg")
    world = ringcomm.init(timeout=timeout, rank=rank, world_size=size, master_addr=addr, master_port=port)
    if rank == 0:  # every rank has joined (init ends with a barrier)
        forget()
    return world


def _forget(group):
    global _world
    with _lock:
        if _world is group.comm:
            _world = None
