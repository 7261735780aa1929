"""Which algorithm ``algorithm="auto"`` runs, and what an all-reduce costs in bytes.

Few-hop schedules for small messages (recursive doubling for all-reduce, the parameter
server for broadcast and reduce), the ring otherwise; among ranks that share one host's
shared-memory lanes recursive doubling keeps the all-reduce up to a larger size. Where the
group spans several hosts and a host holds more than one rank, the hierarchical schedules
(:mod:`.hier`) take what the ring would have.

>>> auto_algorithm("all_reduce", 4, 256 << 10, local=True)     # 'rd'
>>> all_reduce_bytes(4, 4 << 20, "ring")                       # 6291456.0 = 2(n-1)/n * S
"""

# "auto" uses few-hop schedules at or below this size. Measured on one host of 2 cores
# (bench/collectives.py, medians): broadcast at N = 4 through the parameter server 0.33-0.43
# ms against the chain's 0.35-0.57 ms at 4 and 64 KiB, 0.76 against 0.80 ms at 1 MiB; reduce
# within noise of the chain (0.36-0.50 ms either way); at N = 2 both are one hop.
SMALL_MESSAGE_BYTES = 64 * 1024
# ... and for an all-reduce among ranks that share one host's shared-memory lanes, up to
# this size: there bytes cost memory speed and each of the ring's 2(n-1) steps costs a hop.
# Same host and bench, channels and lanes: 256 KiB recursive doubling 0.21/0.59 ms against
# the ring's 0.30/0.84 ms at N = 2/4; 1 MiB 0.21/1.23 against 0.30/1.31; 2 MiB (N = 4) 2.43
# against 2.18 and 4 MiB 0.95/6.0 against 0.78/4.3: there the ring is ahead.
LOCAL_ALL_REDUCE_RD_BYTES = 1 << 20


def auto_algorithm(collective, n, nbytes, local=False, topology=None):
    """What ``algorithm="auto"`` runs: few-hop schedules for small messages (recursive
    doubling for all-reduce, the parameter server for broadcast and reduce), the ring
    otherwise (all-to-all too); gather and scatter straight through their root; the
    dissemination barrier. ``local``: every rank of the group shares this host's lanes.
    ``topology`` (a :class:`~ringcomm.topology.Topology`): where it is layered, ``hier``
    instead of the ring (reduce-scatter and all-gather: with as many ranks on every host)."""
    if collective == "barrier":
        return "rd"
    if collective in ("gather", "scatter"):
        return "ps"  # straight to or from the root: each byte makes one hop
    layered = topology is not None and topology.layered
    if collective == "all_reduce" and n > 1:
        if nbytes <= (LOCAL_ALL_REDUCE_RD_BYTES if local else SMALL_MESSAGE_BYTES):
            return "rd"
        return "hier" if layered else "ring"
    if collective in ("broadcast", "reduce"):
        if nbytes <= SMALL_MESSAGE_BYTES:
            return "ps"
        return "hier" if layered else "ring"
    if collective in ("reduce_scatter", "all_gather") and topology is not None:
        return bandwidth_algorithm(topology)
    return "ring"


def bandwidth_algorithm(topology):
    """The schedule for large buffers whose traffic a training step's byte counts predict:
    ``hier`` where ``topology`` is layered with L ranks on every host, else ``ring``. Both
    send 2(N−1)/N·S per rank in an all-reduce ((N−1)/N·S in a reduce-scatter or
    all-gather); ``hier`` sends L times less of it across hosts (its reduce-scatter and
    all-gather hold one scratch copy of the full buffer while they run)."""
    return "hier" if topology.layered and topology.per_host else "ring"


def hier_all_reduce_bytes(hosts, per_host, nbytes):
    """Payload bytes every rank sends in a hierarchical all-reduce of ``nbytes`` on ``hosts``
    hosts of ``per_host`` ranks each, as (inside its host, across hosts):
    2(L−1)/L·S and 2(H−1)/(HL)·S."""
    inside = 2 * (per_host - 1) / per_host * nbytes
    across = 2 * (hosts - 1) / (hosts * per_host) * nbytes
    return inside, across


def all_reduce_bytes(n, nbytes, algorithm="auto", local=False):
    """Payload bytes one rank sends in an all-reduce of ``nbytes`` on ``n`` ranks with
    ``algorithm`` (``auto`` resolved as :func:`auto_algorithm` does): ring 2(n−1)/n·S,
    recursive doubling S·log2 n, parameter server (n−1)·S on the root (the busiest rank).
    ``hier`` sends the ring's total too: 2(L−1)/L·S inside the host plus 2(H−1)/(HL)·S
    across hosts is 2(n−1)/n·S."""
    if n == 1:
        return 0.0
    if algorithm == "auto":
        algorithm = auto_algorithm("all_reduce", n, nbytes, local)
    if algorithm == "rd":  # log2(p) exchanges, + the hand-back to an extra rank (p < n)
        p = 1 << (n.bit_length() - 1)
        return nbytes * ((p.bit_length() - 1) + (p < n))
    if algorithm == "ps":
        return (n - 1) * nbytes
    return 2 * (n - 1) / n * nbytes
