"""Collective schedules. They see only a :class:`~ringcomm.link.Link` (their rank, the group
size, the segment size, send and receive of array segments to group peers) and flat 1-D
views of the caller's buffers; they know nothing of sockets, threads or argument checking.

- :mod:`.ring`: ring reduce-scatter / all-gather / all-reduce, chain broadcast and reduce,
  all-to-all in ring order.
- :mod:`.ps`: the parameter-server baseline, everything through one rank; gather and
  scatter through their root.
- :mod:`.rd`: recursive doubling for small all-reduces, the dissemination barrier.
- :mod:`.hier`: for groups spread over several hosts: inside each host first, then across
  hosts, one rail per local rank (all-reduce, reduce-scatter, all-gather, broadcast, reduce).
- :mod:`.choice`: which of them ``algorithm="auto"`` runs, and the all-reduce byte formulas.

Every schedule has the same form, ``module.<collective>(link, buffers..., root, op)`` (only
the parameters its collective has, in that order), and each module's ``__all__`` lists the
collectives it runs, so a communicator finds one by name:

>>> schedule("ring", "reduce_scatter")(link, out, x, ReduceOp.SUM)
>>> schedule("ps", "reduce")(link, x, 0, ReduceOp.MAX)          # root 0
"""
from . import hier, ps, rd, ring

SCHEDULES = {"ring": ring, "ps": ps, "rd": rd, "hier": hier}


def schedule(algorithm, collective):
    """The function that runs ``collective`` with ``algorithm``; ``ValueError`` if that
    algorithm has no such collective (recursive doubling only all-reduces and barriers)."""
    module = SCHEDULES.get(algorithm)
    if module is None:
        raise ValueError(f"unknown algorithm {algorithm!r}; expected one of {('auto', *SCHEDULES)}")
    if collective not in module.__all__:
        offers = ", ".join(name for name in SCHEDULES if collective in SCHEDULES[name].__all__)
        raise ValueError(f"algorithm {algorithm!r} has no {collective}; {collective} runs with: auto, {offers}")
    return getattr(module, collective)
