"""monitored_barrier on a ringcomm communicator: a barrier that names the ranks that did not
come, in Gloo's words, over point-to-point messages of a tag range of its own.

Every rank reports to group rank 0, which waits up to the timeout for them and then sends
each rank that came its *verdict* (-1: everyone came; else the first missing rank). Each
call has a tag of its own (ranks count their calls alike), so a rank late for one failed
call meets only that call.

>>> barrier(comm, 1, seconds_of(timedelta(seconds=2), comm))   # every rank; raises naming the missing
"""
import time
from datetime import timedelta

import numpy as np

from ..errors import CommError

MONITOR_TAG, MONITOR_TAGS = 0xFFFF_0000, 0xFFFF  # monitored_barrier's point-to-point tags


def seconds_of(timeout, comm):
    """The wait in seconds: ``timeout`` (a timedelta or a number; None: the group's)."""
    seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else \
        (comm.timeout if timeout is None else float(timeout))
    if not 0 <= seconds < float("inf"):  # refused on every rank alike, before any message
        raise ValueError(f"monitored_barrier: the timeout must be a finite number of seconds "
                         f">= 0, got {timeout!r}")
    # no wait of the group outlasts its timeout, and the other ranks' wait for the verdict
    # (their receive's deadline is the group's timeout) must outlast rank 0's
    return min(seconds, 0.8 * comm.timeout)


def barrier(comm, call, seconds, wait_all_ranks=False):
    """Call number ``call`` of monitored_barrier on ``comm``, waiting ``seconds`` (see
    :func:`seconds_of`) for the missing. Raises RuntimeError on every
    rank that came, naming the missing ranks (all with ``wait_all_ranks``, else the first):
    on rank 0 "Rank 0 timed out in monitoredBarrier after 2 s on world: Rank 1 failed to
    pass monitoredBarrier"; elsewhere "Rank 2 successfully reached monitoredBarrier, but
    received errors while waiting for send/recv from rank 0: ..."."""
    tag = MONITOR_TAG + call % MONITOR_TAGS
    if comm.rank != 0:
        return _report(comm, tag, seconds)
    waits = {r: comm.recv(np.empty(1, np.int64), r, tag, async_op=True) for r in range(1, comm.world_size)}
    missing, came, deadline = [], [], time.monotonic() + seconds
    for r, work in waits.items():
        try:
            work.wait(max(0.001, deadline - time.monotonic()))
            came.append(r)
        except CommError:  # timed out, or the rank left
            missing.append(r)
    verdict = np.full(1, missing[0] if missing else -1, np.int64)
    for r in came:
        comm.send(verdict, r, tag)
    if missing:
        which = (f"Ranks {', '.join(map(str, missing))}" if wait_all_ranks and len(missing) > 1
                 else f"Rank {missing[0]}")
        raise RuntimeError(f"Rank 0 timed out in monitoredBarrier after {seconds:g} s on "
                           f"{comm.name}: {which} failed to pass monitoredBarrier")
    return None


def _report(comm, tag, seconds):
    """A rank other than 0: it says it came, then waits for rank 0's verdict."""
    verdict = np.full(1, -1, np.int64)
    came = (f"Rank {comm.rank} successfully reached monitoredBarrier, but received errors while "
            f"waiting for send/recv from rank 0 of {comm.name}")
    comm.send(verdict, 0, tag)
    try:  # rank 0 may wait `seconds` for another rank before it answers
        comm.recv(verdict, 0, tag, async_op=True).wait(2 * seconds + 1)
    except CommError as exc:  # timed out, or rank 0 left
        raise RuntimeError(f"{came}: no verdict ({exc})") from None
    if verdict[0] >= 0:
        raise RuntimeError(f"{came}: rank {verdict[0]} failed to pass monitoredBarrier "
                           f"within {seconds:g} s (rank 0 says)")
    return None
