"""Same-host shared-memory lanes between real processes: results equal numpy and equal the
pure-ZeroMQ path bit for bit, starved lanes fall back to ZeroMQ without losing a byte, and
nothing is left in /dev/shm."""
import glob

import numpy as np
import pytest

from harness import RankPool

pytestmark = pytest.mark.timeout(120)
COUNT = 300_007  # 1.2 MB of float32: many 64 KiB segments, uneven chunks
# many small segments, and lanes from 32 KiB (not the channels' 256 KiB): the lanes are tested
SMALL_SEGMENTS = {"RINGCOMM_SEGMENT_BYTES": str(64 << 10), "RINGCOMM_CHANNEL_MAX_BYTES": str(32 << 10)}


def lane_files():
    return set(glob.glob("/dev/shm/ringcomm-*"))


def inputs(rank):
    return np.random.default_rng(rank).standard_normal(COUNT).astype(np.float32)


def run_collectives(comm, rounds):
    """All-reduce, reduce-scatter and all-gather, ``rounds`` times; results and lane use."""
    n, r = comm.world_size, comm.rank
    out = {}
    for i in range(rounds):
        x = inputs(r) * (i + 1)
        comm.all_reduce(x, algorithm="ring")
        chunk = np.empty(COUNT // n * n // n, np.float32)
        comm.reduce_scatter(chunk, inputs(r)[:chunk.size * n], algorithm="ring")
        gathered = np.empty(chunk.size * n, np.float32)
        comm.all_gather(gathered, chunk, algorithm="ring")
        out = {"all_reduce": x, "reduce_scatter": chunk, "all_gather": gathered}
    lanes = comm._engine.session.wire.same_host.out_lanes.values()
    out["fallbacks"] = sum(lane.fallbacks for lane in lanes)
    out["puts"] = sum(lane.puts for lane in lanes)
    out["lanes"] = len(lanes)
    return out


def expected(n, rounds):
    total = np.sum([inputs(r).astype(np.float64) for r in range(n)], axis=0)
    return total * rounds, total[:COUNT // n * n]


@pytest.mark.parametrize("slots", ["8", "1"])
def test_lanes_match_numpy_and_zeromq_bit_for_bit(slots):
    n, rounds = 3, 4
    before = lane_files()
    results = {}
    for shm in ("1", "0"):
        env = {**SMALL_SEGMENTS, "RINGCOMM_SHM": shm, "RINGCOMM_SHM_SLOTS": slots}
        pool = RankPool(n, env=env)
        try:
            # lanes are mapped during init and their names unlinked at once: a rank killed
            # from here on leaves nothing in /dev/shm
            assert lane_files() <= before, "lane files still named after init"
            results[shm] = pool.run(run_collectives, rounds)
        finally:
            pool.close()
    assert lane_files() <= before, "lane files left in /dev/shm"
    all_reduce, scattered = expected(n, rounds)
    m = COUNT // n
    for rank, got in enumerate(results["1"]):
        assert got["lanes"] == n - 1  # one to every other rank of the host
        assert got["puts"] > 0, "no segment went through a lane"
        if slots == "1":
            assert got["fallbacks"] > 0, "one slot per lane should have starved"
        np.testing.assert_allclose(got["all_reduce"], all_reduce, rtol=1e-5, atol=1e-4)
        np.testing.assert_allclose(got["reduce_scatter"], scattered[rank * m:(rank + 1) * m], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(got["all_gather"], scattered, rtol=1e-5, atol=1e-5)
        plain = results["0"][rank]
        assert plain["lanes"] == 0
        for name in ("all_reduce", "reduce_scatter", "all_gather"):
            assert got[name].tobytes() == plain[name].tobytes(), f"{name} differs from the ZeroMQ path"


def traffic(comm):
    comm.reset_stats()
    lanes = comm._engine.session.wire.same_host.out_lanes.values()
    before = sum(lane.puts for lane in lanes)
    comm.all_reduce(np.ones(1 << 20, np.float32), algorithm="ring")
    return comm.stats()["bytes_sent"], sum(lane.puts for lane in lanes) - before


def test_lanes_keep_the_traffic_formula():
    n = 4
    pool = RankPool(n)
    try:
        sent = pool.run(traffic)
    finally:
        pool.close()
    assert [b for b, _ in sent] == [2 * (n - 1) * (4 << 20) // n] * n
    assert all(puts == 2 * (n - 1) for _, puts in sent), "the segments did not go through lanes"
