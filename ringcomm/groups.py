"""Subgroups of a communicator: who takes part in making one, and how its ranks agree on
its name (the ``comm_id`` every message of the group carries).

Two ways, as :meth:`Communicator.new_group <ringcomm.comm.Communicator.new_group>` offers:

- every rank of the parent calls it, with the same list, in the same order of calls; the
  group is named by the parent and how many such groups it made before, and one all-gather
  over the parent checks that every rank asked for the same members (non-members get None);
- ``members_only``: the members alone call it (as torch.distributed asks of a backend, and
  as NCCL's communicator split without the others' call). The group is named by the parent,
  the member list and how many members-only groups of that list this rank made before, so
  members must make their groups of one list in the same order, and may interleave groups
  of other lists freely. One all-gather over the new group checks that every member made
  it; a member that asked for another list is never met, and the others time out naming it.

>>> evens = comm.new_group([0, 2])                      # on every rank
>>> pair = comm.new_group([1, 3], members_only=True)    # on ranks 1 and 3 alone
"""
import zlib
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np

from .errors import CollectiveMismatch, CommError


@dataclass
class Counters:
    """How many groups a communicator made: with every rank, and members-only per list."""
    everyone: int = 0
    members_only: defaultdict = field(default_factory=lambda: defaultdict(int))


def new_group(comm, ranks, members_only):
    given = list(ranks)
    members = [_member(r, given) for r in given]
    if not members or len(set(members)) != len(members) or \
            any(not 0 <= r < comm.world_size for r in members):
        raise ValueError(f"new_group needs distinct ranks in [0, {comm.world_size}), got {given}")
    if members_only and comm.rank not in members:
        raise ValueError(f"new_group(members_only=True) is called by the members alone; rank "
                         f"{comm.rank} of {comm.name} is not in {members}")
    comm._caller.check_open()
    return (_members_only if members_only else _with_everyone)(comm, members)


def _member(r, given):
    """Rank ``r`` of ``given`` as an int: an integer (Python's or numpy's), not a bool. int()
    alone would take 1.5 or "1" for rank 1, a group of other members than the caller wrote."""
    if isinstance(r, (bool, np.bool_)) or not isinstance(r, (int, np.integer)):
        raise TypeError(f"new_group needs integer ranks, got {r!r} ({type(r).__name__}) in {given}")
    return int(r)


def _with_everyone(comm, members):
    counters = comm._groups
    index = counters.everyone
    counters.everyone += 1
    digest = zlib.crc32(f"{comm.comm_id}/{index}/{members}".encode())
    everyone = np.empty(comm.world_size, np.int64)
    try:
        comm.all_gather(everyone, np.array([digest], np.int64))  # all ranks must agree on membership
    except CommError:
        counters.everyone = index  # refused or failed here: the next try uses the same index
        raise
    differing = [r for r in range(comm.world_size) if everyone[r] != digest]
    if differing:
        raise CollectiveMismatch(f"new_group #{index} on {comm.name}: rank {comm.rank} asked "
                                 f"for {members}, ranks {differing} asked for other members")
    if comm.rank not in members:
        return None
    return _made(comm, members, digest or 1, f"group{members}")


def _members_only(comm, members):
    made = comm._groups.members_only
    index = made[tuple(members)]
    made[tuple(members)] += 1
    digest = zlib.crc32(f"{comm.comm_id}/members/{members}/{index}".encode())
    group = _made(comm, members, digest or 1, f"group{members}#{index}")
    # every member made it: its first collective would otherwise be the first to know. A
    # failed try keeps its number (its name's first collective is retired here, so a retry
    # under the same name could never hear from the others): members retry alike or not at all
    group.all_gather(np.empty(len(members), np.int64), np.array([digest], np.int64))
    return group


def _made(comm, members, comm_id, name):
    """The communicator over ``members`` (group ranks of ``comm``), on one of them."""
    return type(comm)(comm._engine, ranks=[comm.ranks[r] for r in members], rank=members.index(comm.rank),
                      comm_id=comm_id, name=name, timeout=comm.timeout, segment_bytes=comm.segment_bytes,
                      is_world=False, device=comm._device)
