"""Asynchronous work, many collectives back to back, point-to-point, and subgroups."""
import time

import numpy as np
import pytest

from ringcomm import CommTimeout

pytestmark = pytest.mark.timeout(60)


def several_in_flight(comm):
    n, r = comm.world_size, comm.rank
    a = np.full(300_000, r, np.float32)
    b = np.arange(10, dtype=np.int64) * (r + 1)
    c = np.full(7, float(r))
    g = np.empty(3 * n, np.int32)
    works = [comm.all_reduce(a, async_op=True),
             comm.all_reduce(b, op="max", async_op=True),
             comm.broadcast(c, root=n - 1, async_op=True),
             comm.all_gather(g, np.full(3, r, np.int32), async_op=True)]
    for w in reversed(works):  # waiting out of order is fine; they complete in order
        w.wait()
    assert all(w.is_completed() for w in works)
    return a[:3], b, c, g


@pytest.mark.parametrize("n", [2, 3, 4])
def test_several_async_in_flight(pools, n):
    for a, b, c, g in pools(n).run(several_in_flight):
        assert np.all(a == sum(range(n)))
        assert np.array_equal(b, np.arange(10) * n)
        assert np.all(c == n - 1)
        assert np.array_equal(g, np.repeat(np.arange(n), 3))


def tiny_back_to_back(comm, count):
    n, r = comm.world_size, comm.rank
    total = 0
    for i in range(count):
        x = np.array([r + i], np.int64)
        if i % 3 == 0:
            comm.all_reduce(x, algorithm=("ring", "ps", "auto")[i % 9 // 3])
            assert x[0] == sum(range(n)) + n * i, (i, x)
        elif i % 3 == 1:
            comm.broadcast(x, root=i % n)
            assert x[0] == i % n + i
        else:
            comm.barrier()
        total += 1
    return total, comm.stats()["collectives"]


@pytest.mark.parametrize("n", [2, 4])
def test_300_tiny_collectives(pools, n):
    for done, counted in pools(n).run(tiny_back_to_back, 330):
        assert done == 330 and counted >= 330


def async_overlaps_compute(comm):
    x = np.full(2_000_000, comm.rank + 1.0, np.float32)
    work = comm.all_reduce(x, async_op=True)
    busy = float(np.sum(np.sqrt(np.arange(1_000_000.0))))  # the caller keeps computing
    work.wait()
    return busy > 0 and bool(np.all(x == sum(range(1, comm.world_size + 1))))


def test_async_with_compute(pools):
    assert pools(2).run(async_overlaps_compute) == [True, True]


def ring_exchange(comm):
    """Each rank sends to the right and receives from the left, several tags, large + small."""
    n, r = comm.world_size, comm.rank
    right, left = (r + 1) % n, (r - 1) % n
    big_in = np.empty(400_000, np.float64)
    small_in = np.empty(3, np.int32)
    recv_big = comm.recv(big_in, left, tag=7, async_op=True)     # posted before the send
    comm.send(np.full(3, r, np.int32), right, tag=1)
    comm.send(np.arange(400_000, dtype=np.float64) + r, right, tag=7)
    comm.recv(small_in, left, tag=1)
    recv_big.wait()
    return left, small_in, big_in[:2]


@pytest.mark.parametrize("n", [2, 3])
def test_send_recv(pools, n):
    for left, small, big in pools(n).run(ring_exchange):
        assert np.all(small == left) and list(big) == [left, left + 1]


def recv_waits_while_other_thread_sends(comm):
    """Rank 0 waits in a synchronous recv for what rank 1 sends only after it received what
    rank 0's second thread sends meanwhile: the waiting recv must not hold the transport."""
    import threading
    got = np.zeros(3)
    if comm.rank == 0:
        sender = threading.Thread(target=lambda: (time.sleep(0.2), comm.send(np.full(3, 5.0), 1)))
        sender.start()
        comm.recv(got, 1)
        sender.join()
    else:
        comm.recv(got, 0)
        comm.send(got * 2, 0)
    return got.tolist()


def test_waiting_recv_lets_another_thread_send(pools):
    assert pools(2).run(recv_waits_while_other_thread_sends) == [[10.0] * 3, [5.0] * 3]


def wait_with_timeout(comm):
    """wait(timeout) gives up on a slow peer without breaking the communicator."""
    if comm.rank == 0:
        x = np.zeros(4)
        work = comm.recv(x, 1, async_op=True)
        try:
            work.wait(timeout=0.2)
            early = "no timeout"
        except CommTimeout as exc:
            early = str(exc)
        work.wait()
        return early, x.tolist()
    time.sleep(0.6)
    comm.send(np.ones(4), 0)
    return None


def test_wait_timeout(pools):
    early, x = pools(2).run(wait_with_timeout)[0]
    assert "still running" in early and x == [1.0] * 4


def groups(comm):
    n, r = comm.world_size, comm.rank
    evens = comm.new_group([i for i in range(n) if i % 2 == 0])
    backwards = comm.new_group(list(reversed(range(n))))
    result = {}
    if evens is not None:
        x = np.array([float(r)])
        evens.all_reduce(x)
        result["evens"] = (evens.rank, evens.world_size, x[0], evens.stats()["bytes_sent"] > 0)
        g = np.empty(evens.world_size, np.int64)
        evens.all_gather(g, np.array([r], np.int64))
        result["evens_gather"] = g.tolist()
    else:
        result["evens"] = None
    y = np.array([r], np.int64)
    backwards.broadcast(y, root=0)  # group rank 0 is world rank n−1
    result["backwards"] = (backwards.rank, y[0])
    return result


@pytest.mark.parametrize("n", [3, 4])
def test_new_group(pools, n):
    evens = [i for i in range(n) if i % 2 == 0]
    for r, res in enumerate(pools(n).run(groups)):
        if r in evens:
            assert res["evens"] == (evens.index(r), len(evens), float(sum(evens)), True)
            assert res["evens_gather"] == evens
        else:
            assert res["evens"] is None
        assert res["backwards"] == (n - 1 - r, n - 1)


def members_only_groups(comm):
    """Ranks 1 and 2 make two groups of themselves, ranks 0 and 3 take no part; the two
    groups' collectives interleave without mixing, and the world goes on."""
    r = comm.rank
    result = None
    if r in (1, 2):
        first = comm.new_group([2, 1], members_only=True)
        second = comm.new_group([2, 1], members_only=True)
        x, y = np.array([float(r)]), np.array([10.0 * r])
        later = second.all_reduce(y, op="max", async_op=True)
        first.all_reduce(x)
        later.wait()
        result = (first.rank, first.ranks, x[0], y[0], first.comm_id != second.comm_id)
    z = np.array([1.0])
    comm.all_reduce(z)
    return result, z[0]


def test_members_only_groups(pools):
    for r, (group, world) in enumerate(pools(4).run(members_only_groups)):
        assert world == 4.0
        if r in (1, 2):
            assert group == (1 if r == 1 else 0, (2, 1), 3.0, 20.0, True)
        else:
            assert group is None


def members_disagree(comm):
    """Rank 1 asks for [0, 1], rank 0 for [0, 1, 2] (rank 2 never comes): both time out,
    and nobody waits forever; a non-member may not ask."""
    outcome = {}
    if comm.rank == 2:
        try:
            comm.new_group([0, 1], members_only=True)
        except ValueError as exc:
            outcome["outsider"] = str(exc)
        return outcome
    saved, comm.timeout = comm.timeout, 2.0
    try:
        comm.new_group([0, 1, 2] if comm.rank == 0 else [0, 1], members_only=True)
        outcome["error"] = None
    except CommTimeout as exc:
        outcome["error"] = type(exc).__name__
    finally:
        comm.timeout = saved
    return outcome


@pytest.mark.timeout(30)
def test_members_only_disagreement_times_out(pools):
    zero, one, two = pools(3).run(members_disagree)
    assert zero["error"] == one["error"] == "CommTimeout"
    assert "not in [0, 1]" in two["outsider"]


def done_callbacks(comm):
    import threading
    seen = []
    x = np.ones(100_000)
    work = comm.all_reduce(x, async_op=True)
    work.add_done_callback(lambda w: seen.append((threading.current_thread().name, w.is_completed())))
    work.wait()
    work.add_done_callback(lambda w: seen.append(("late", w.is_completed())))  # runs at once
    deadline = time.monotonic() + 5
    while len(seen) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    return [done for _, done in seen], seen[-1][0], x[0]


def test_done_callbacks(pools):
    for done, last, x in pools(2).run(done_callbacks):
        assert done == [True, True] and last == "late" and x == 2.0


def two_threads_unguarded(comm):
    """With guard_threads off, a second thread may issue collectives while the first has
    async work in flight (the caller orders them; here: the second waits for the first's)."""
    import threading
    comm.guard_threads = False
    x, y = np.full(10, 1.0), np.full(10, 2.0)
    first = comm.all_reduce(x, async_op=True)
    other = threading.Thread(target=lambda: comm.all_reduce(y))
    other.start()
    other.join()
    first.wait()
    comm.guard_threads = True
    return x[0], y[0]


def test_guard_threads_off(pools):
    assert pools(2).run(two_threads_unguarded) == [(2.0, 4.0)] * 2
