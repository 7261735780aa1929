"""Collective schedules. They see only a :class:`~ringcomm.link.Link` (their rank, the group
size, send and receive of array segments to group peers) and flat 1-D numpy views of the
caller's buffers; they know nothing of sockets, threads or argument checking.

- :mod:`.ring`: ring reduce-scatter / all-gather / all-reduce, chain broadcast and reduce.
- :mod:`.ps`: the parameter-server baseline, everything through one root.
- :mod:`.rd`: recursive doubling for small all-reduces, dissemination barrier.
- :mod:`.choice`: which of them ``algorithm="auto"`` runs, and the all-reduce byte formulas.
"""
