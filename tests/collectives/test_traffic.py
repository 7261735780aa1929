"""Byte accounting: what ``comm.stats()`` counts matches the traffic formulas exactly.

Ring all-reduce of S bytes on n ranks: 2(n−1)·S summed over ranks, 2(n−1) chunks (≈S/n
each) per rank. Parameter server: rank 0 sends and receives (n−1)·S, every other rank S.
"""
import numpy as np
import pytest

from ringcomm.algorithms.chunks import chunk_bounds
from ringcomm.algorithms.choice import all_reduce_bytes, auto_algorithm

pytestmark = pytest.mark.timeout(60)

COUNT = 250_007  # float32, not divisible by 2, 3 or 4
ITEM = 4
S = COUNT * ITEM


def traffic(comm, collective, algorithm, root=0):
    x = np.ones(COUNT, np.float32)
    comm.reset_stats()
    if collective == "all_reduce":
        comm.all_reduce(x, algorithm=algorithm)
    elif collective == "broadcast":
        comm.broadcast(x, root=root, algorithm=algorithm)
    elif collective == "reduce":
        comm.reduce(x, root=root, algorithm=algorithm)
    elif collective == "reduce_scatter":
        comm.reduce_scatter(np.empty(COUNT, np.float32), np.ones(COUNT * comm.world_size, np.float32),
                            algorithm=algorithm)
    elif collective == "all_gather":
        comm.all_gather(np.empty(COUNT * comm.world_size, np.float32), x, algorithm=algorithm)
    stats = comm.stats()
    return stats["bytes_sent"], stats["bytes_received"]


def ring_all_reduce_bytes(rank, n):
    """Rank r sends chunk (r − s) mod n in step s = 0 … 2n−3."""
    chunks = chunk_bounds(COUNT, n)
    return sum((chunks[(rank - s) % n][1] - chunks[(rank - s) % n][0]) * ITEM for s in range(2 * (n - 1)))


@pytest.mark.parametrize("n", [2, 3, 4])
def test_ring_all_reduce_bytes(pools, n):
    result = pools(n).run(traffic, "all_reduce", "ring")
    sent = [s for s, _ in result]
    assert sum(sent) == 2 * (n - 1) * S
    assert sum(r for _, r in result) == 2 * (n - 1) * S
    for rank in range(n):
        assert sent[rank] == ring_all_reduce_bytes(rank, n)
        assert abs(sent[rank] - 2 * (n - 1) * S / n) <= 2 * (n - 1) * ITEM


@pytest.mark.parametrize("n", [2, 3, 4])
def test_parameter_server_all_reduce_bytes(pools, n):
    result = pools(n).run(traffic, "all_reduce", "ps")
    assert result[0] == ((n - 1) * S, (n - 1) * S)
    for rank in range(1, n):
        assert result[rank] == (S, S)


@pytest.mark.parametrize("n", [3, 4])
def test_ring_versus_ps_hot_spot(pools, n):
    """The point of the ring: no rank carries more than ~2S, while PS rank 0 carries (n−1)S."""
    ring = pools(n).run(traffic, "all_reduce", "ring")
    ps = pools(n).run(traffic, "all_reduce", "ps")
    assert max(s for s, _ in ring) < 2 * S
    assert ps[0][0] == (n - 1) * S > max(s for s, _ in ring)


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("collective", ["reduce_scatter", "all_gather"])
def test_ring_reduce_scatter_all_gather_bytes(pools, n, collective):
    # S here is one rank's share; the full n-rank buffer is n·S, each rank sends (n−1)·S
    for sent, received in pools(n).run(traffic, collective, "ring"):
        assert sent == received == (n - 1) * S


@pytest.mark.parametrize("n", [3, 4])
@pytest.mark.parametrize("root", [0, 2])
def test_chain_broadcast_and_reduce_bytes(pools, n, root):
    last_of_broadcast = (root - 1) % n
    for rank, (sent, received) in enumerate(pools(n).run(traffic, "broadcast", "ring", root)):
        assert sent == (0 if rank == last_of_broadcast else S)
        assert received == (0 if rank == root else S)
    for rank, (sent, received) in enumerate(pools(n).run(traffic, "reduce", "ring", root)):
        assert sent == (0 if rank == root else S)
        assert received == (0 if rank == (root + 1) % n else S)


@pytest.mark.parametrize("n", [3, 4])
def test_ps_broadcast_bytes(pools, n):
    for rank, (sent, received) in enumerate(pools(n).run(traffic, "broadcast", "ps", 1)):
        assert (sent, received) == (((n - 1) * S, 0) if rank == 1 else (0, S))


@pytest.mark.parametrize("n", [3, 4])
@pytest.mark.parametrize("nbytes", [4 << 10, 256 << 10, 4 << 20])
def test_auto_all_reduce_on_one_host_sends_what_its_formula_says(pools, n, nbytes):
    """Among ranks that share the host's lanes `auto` runs recursive doubling up to 1 MiB
    (elsewhere up to 64 KiB); the formula helper follows the same rule."""
    results = pools(n).run(auto_all_reduce_traffic, nbytes)
    assert all(local for local, _ in results)
    assert auto_algorithm("all_reduce", n, nbytes, True) == ("rd" if nbytes <= 1 << 20 else "ring")
    busiest = max(sent for _, sent in results)  # the helper's figure: the busiest rank's bytes
    assert busiest == pytest.approx(all_reduce_bytes(n, nbytes, "auto", local=True), rel=1e-3)
    assert busiest != pytest.approx(all_reduce_bytes(n, nbytes, "auto", local=False), rel=1e-3) or \
        nbytes <= 64 << 10 or nbytes > 1 << 20


def auto_all_reduce_traffic(comm, nbytes):
    comm.reset_stats()
    comm.all_reduce(np.ones(nbytes // 4, np.float32))
    return comm.local, comm.stats()["bytes_sent"]


def test_auto_rule():
    assert auto_algorithm("all_reduce", 4, 64 << 10) == "rd"
    assert auto_algorithm("all_reduce", 4, (64 << 10) + 4) == "ring"           # across hosts
    assert auto_algorithm("all_reduce", 4, 1 << 20, local=True) == "rd"        # one host
    assert auto_algorithm("all_reduce", 4, (1 << 20) + 4, local=True) == "ring"
    assert auto_algorithm("all_reduce", 1, 4, local=True) == "ring"
    assert auto_algorithm("broadcast", 4, 64 << 10, local=True) == "ps"
    assert auto_algorithm("broadcast", 4, 1 << 20, local=True) == "ring"
    assert auto_algorithm("reduce_scatter", 4, 4) == "ring"
