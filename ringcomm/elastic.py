"""Going on after a lost rank: revoke the communicator, agree on who is lost, shrink to the rest.

- :func:`revoke` (``comm.revoke()``): every pending and later call on the communicator, point
  to point included, fails with :class:`~ringcomm.errors.Revoked` on every member (the
  revocation reaches a wait in progress at once).
- :func:`agree` (``comm.agree(flag)``): every member that returns gets the same
  ``(flag, lost)``: the AND of the flags of the members that took part and the group ranks
  found lost (a commit point: whether a step happened everywhere is decided once for all).
- :func:`shrink` (``comm.shrink()``), on every survivor after a
  :class:`~ringcomm.errors.PeerLost`: the communicator is revoked (every call in flight on it
  fails on every survivor with :class:`~ringcomm.errors.RanksLost` naming the lost ranks),
  the survivors agree on which members are lost (:mod:`ringcomm.agreement`: every survivor
  decides the same set, even when another rank dies while they agree), and each gets a new
  communicator over the rest, ranks renumbered in their old order. Before it returns, the
  new communicator's first agreement proves that every member reached it; a member lost
  meanwhile shows in its outcome, alike on every survivor, and the survivors shrink again,
  so a communicator comes back only once its every member has agreed on it.

What it guarantees: every survivor that returns from ``shrink`` returns a communicator over
the same members, under the same name and id, and no call of the old communicator completes
on one survivor after another has left it (revoked). On one host the evidence of a loss is
definite (the process ended, or said goodbye); across hosts a connection dropped for longer
than its grace is taken for a death, so a network partition that long could split the job.
A rank that stops answering without any of these holds the agreement up until the
communicator's timeout, which names it; a rank the others found lost gets no communicator
(told so when it hears the outcome, else at its timeout). Sub-groups shrink the same way,
their members alone; a group that held a lost rank and is not shrunk fails on its next wait
for that rank. The old communicator stays revoked (the shrunk world owns the engine from
then on: closing the old world closes nothing else).

Agreements and shrinks of one communicator are numbered in the order each member calls
them: every member calls them in the same order.

>>> try:
...     comm.all_reduce(x)
... except ringcomm.PeerLost:
...     comm = comm.shrink()   # ranks 0, 1, 3 of 4 after rank 2 died: ranks 0, 1, 2 of 3
>>> comm.agree(step_ok)        # rank 1 of 3 passed False: (False, ()) on every rank
"""
import atexit
import time
import zlib

import numpy as np

from .errors import CommError
from .transport.mailbox import EVERY_CALL, LOST


def revoke(comm):
    """Make every pending and later call on ``comm`` fail on every member."""
    comm._caller.check_open()
    me = comm.ranks[comm.rank]
    comm._caller.revoke(f"rank {me} revoked {comm.name}", EVERY_CALL)


def shrink(comm):
    """The communicator over ``comm``'s members not lost (see the module)."""
    while True:
        comm, decided = _agreed(comm)
        # the first agreement of the new communicator: every member that took part has
        # decided the old one; a member lost since makes every survivor shrink again, alike
        _, lost = comm.agree(True)
        _on_engine(comm, lambda session, done=decided: session.agreements.release(done), "release")
        if not lost:
            return comm


def _agreed(comm):
    """Revoke ``comm``, agree on its lost members, and make the communicator of the rest;
    returns it and the agreement's name (``comm``'s id, the epoch)."""
    caller = comm._caller
    caller.check_open()
    me, members = comm.ranks[comm.rank], comm.ranks
    epoch, what = _next_epoch(comm, "shrink")
    known = sorted(_on_engine(comm, lambda session: session.wire.lost() & set(members), what))
    # RanksLost even before this rank's own evidence is in (it may have heard of the loss
    # from another rank): a survivor's call in flight raises a PeerLost, as it expects
    caller.revoke(f"{comm.name} lost ranks {known or '(not yet seen here)'}; rank {me} shrinks it", LOST,
                  known[0] if known else None)
    deadline = time.monotonic() + comm.timeout
    value = _on_engine(comm, lambda session: session.agreements.run(
        comm.comm_id, epoch, members, True, deadline, what), what)
    if me in value.lost:
        raise CommError(f"{what}: the other ranks found rank {me} lost (its connections dropped); "
                        f"it is not in the shrunk communicator")
    _on_engine(comm, lambda session: session.accept_lost(comm.comm_id, value.lost), what)
    survivors = [r for r in members if r not in value.lost]
    comm_id = zlib.crc32(f"{comm.comm_id}/shrink/{epoch}/{survivors}".encode()) or 1
    return _made(comm, survivors, comm_id, f"{comm.name}/shrink{epoch}"), (comm.comm_id, epoch)


def agree(comm, flag):
    """``(flag, lost)``: the AND of every surviving member's ``flag`` and the group ranks
    found lost, the same on every member that returns (see the module)."""
    comm._caller.check_open()
    if not isinstance(flag, (bool, np.bool_)):
        raise TypeError(f"agree() takes a bool, got {flag!r} ({type(flag).__name__})")
    epoch, what = _next_epoch(comm, "agree")
    deadline = time.monotonic() + comm.timeout
    value = _on_engine(comm, lambda session: session.agreements.run(
        comm.comm_id, epoch, comm.ranks, bool(flag), deadline, what), what)
    return value.flag, tuple(comm.ranks.index(r) for r in sorted(value.lost))


def _next_epoch(comm, verb):
    """The number of the communicator's next agreement (its members run them in one order)."""
    caller = comm._caller
    epoch = caller.agreements
    caller.agreements += 1
    return epoch, f"{verb} (agreement #{epoch}) of {comm.name}"


def _made(comm, survivors, comm_id, name):
    me = comm.ranks[comm.rank]
    local_rank = local_world_size = None
    if comm.local_rank is not None:  # the world: its place among the survivors of its host
        hosts = comm._engine.session.wire.host_ids
        here = [r for r in survivors if hosts[r] == hosts[me]]
        local_rank, local_world_size = here.index(me), len(here)
    shrunk = type(comm)(comm._engine, ranks=survivors, rank=survivors.index(me), comm_id=comm_id, name=name,
                        timeout=comm.timeout, segment_bytes=comm.segment_bytes, is_world=comm._is_world,
                        device=comm._device, local_rank=local_rank, local_world_size=local_world_size)
    shrunk.guard_threads = comm.guard_threads
    if comm._is_world:  # the shrunk world now owns the engine: closing the old one frees it alone
        comm._is_world = False
        atexit.register(shrunk.close)
    return shrunk



def _on_engine(comm, fn, what):
    """``fn(session)`` on the thread that holds the session (this one when it is idle)."""
    engine = comm._engine
    with engine.lock:
        if engine.closed:
            raise CommError(f"{what}: communicator is closed")
        work = engine.submit(fn, what, inline=True)
    if work.inline:
        engine.run_inline(work)
    return work.wait()
