"""Bad input gets a clear error and loses nothing; disagreeing ranks, dead peers and
deadlines end in a CommError on every rank, never in a hang."""
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import ringcomm
from harness import free_port, job_env, refusals, spawn_job
from ringcomm import CollectiveMismatch

pytestmark = pytest.mark.timeout(60)


def misuse(comm):
    """Each call is wrong in one way; each must raise before sending anything."""
    n = comm.world_size
    x = np.ones(8, np.float32)
    shared = np.ones(8 * n, np.float32)
    calls = {
        "out too small": lambda: comm.reduce_scatter(np.empty(1, np.float32), np.ones(8 * n + 1, np.float32)),
        "gather size": lambda: comm.all_gather(np.empty(n * 8 + 1, np.float32), x),
        "dtype pair": lambda: comm.all_gather(np.empty(n * 8, np.float64), x),
        "unsupported dtype": lambda: comm.all_reduce(np.ones(3, np.complex64)),
        "bitwise op on floats": lambda: comm.all_reduce(np.ones(3, np.float32), op="band"),
        "avg on bool": lambda: comm.all_reduce(np.ones(3, bool), op="avg"),
        "not an array": lambda: comm.all_reduce([1.0, 2.0]),
        "masked array": lambda: comm.all_reduce(np.ma.masked_array(np.ones(3, np.float32), mask=[0, 1, 0])),
        "matrix": lambda: comm.broadcast(np.asmatrix(np.ones((2, 2), np.float32))),
        "non-contiguous": lambda: comm.all_reduce(np.ones((4, 4), np.float32)[:, 1]),
        "read-only": lambda: comm.all_reduce(np.frombuffer(b"\0" * 16, np.float32)),
        "root too big": lambda: comm.broadcast(x, root=n),
        "root negative": lambda: comm.reduce(x, root=-1),
        "bool root": lambda: comm.broadcast(x, root=True),
        "unknown op": lambda: comm.all_reduce(x, op="xor"),
        "avg on int": lambda: comm.all_reduce(np.ones(3, np.int32), op="avg"),
        "unknown algorithm": lambda: comm.all_reduce(x, algorithm="tree"),
        "rd for broadcast": lambda: comm.broadcast(x, algorithm="rd"),
        "send to self": lambda: comm.send(x, comm.rank),
        "bad tag": lambda: comm.send(x, (comm.rank + 1) % n, tag=-1),
        "bool tag": lambda: comm.send(x, (comm.rank + 1) % n, tag=True),
        "overlap": lambda: comm.all_gather(shared, shared[1:9]),  # not the in-place slice
        "bad group": lambda: comm.new_group([0, 0]),
        "float rank": lambda: comm.new_group([0, 1.5]),
        "string rank": lambda: comm.new_group([0, "1"]),
        "bool rank": lambda: comm.new_group([0, True]),
    }
    before = comm.stats()
    raised = refusals(calls)
    unchanged = comm.stats() == before
    y = np.full(5, comm.rank, np.float32)
    comm.all_reduce(y)
    return raised, unchanged, float(y[0])


@pytest.mark.parametrize("n", [3])
def test_local_misuse_raises_before_sending(pools, n):
    for raised, unchanged, y in pools(n).run(misuse):
        assert all(raised.values()), f"no error for: {[k for k, v in raised.items() if v is None]}"
        assert raised["unsupported dtype"] == "TypeError" and raised["avg on int"] == "TypeError"
        assert raised["masked array"] == raised["matrix"] == "TypeError"
        assert raised["float rank"] == raised["string rank"] == raised["bool rank"] == "TypeError"
        assert raised["out too small"] == "ValueError" and raised["root too big"] == "ValueError"
        assert unchanged, "a rejected call sent or counted something"
        assert y == sum(range(n)), "the communicator is unusable after misuse"


def group_ranks(comm):
    """new_group's refusals of ranks that are not integers (int() would have made each of
    them rank 1), and a group of numpy integer ranks, used."""
    refused = []
    for ranks in ([0, 1.5], [0, "1"], [0, True], [0, np.float64(1)]):
        with pytest.raises(TypeError) as exc:
            comm.new_group(ranks)
        refused.append(str(exc.value))
    pair = comm.new_group(np.array([1, 0], np.int32))
    both = comm.new_group([np.int64(0), 1], members_only=True)
    x = np.full(2, comm.rank + 1.0)
    pair.all_reduce(x)
    both.all_reduce(x)
    return refused, pair.rank, float(x[0])


def test_group_ranks_must_be_integers(pools):
    for rank, (refused, group_rank, total) in enumerate(pools(2).run(group_ranks)):
        named = ["got 1.5 (float) in [0, 1.5]", "got '1' (str) in [0, '1']", "got True (bool) in [0, True]",
                 "(float64) in [0, "]  # a numpy scalar's repr differs between numpy 1 and 2
        for message, entry in zip(refused, named, strict=True):
            assert message.startswith("new_group needs integer ranks, got ") and entry in message, message
        assert group_rank == 1 - rank and total == 6.0


def disagree(comm, how):
    """Rank 1 calls something different from everyone else; returns what each rank raised.

    A rank that only sent in a collective may finish it before the others' abort arrives;
    it learns at its next collective on the communicator, which then fails on every rank.
    Returns every error message and the result of the last of three all-reduces.
    """
    odd = comm.rank == 1
    x = np.ones(10, np.float32)
    errors = []
    try:
        if how == "count":
            comm.all_reduce(np.ones(11 if odd else 10, np.float32), algorithm="ring")
        elif how == "dtype":
            comm.all_reduce(np.ones(10, np.float64 if odd else np.float32), algorithm="ring")
        elif how == "op":
            comm.all_reduce(x, op="max" if odd else "sum", algorithm="ring")
        elif how == "collective":
            comm.broadcast(x, algorithm="ring") if odd else comm.all_reduce(x, algorithm="ring")
        elif how == "root":
            comm.broadcast(x, root=1 if odd else 0, algorithm="ring")
        elif how == "algorithm":
            comm.all_reduce(x, algorithm="ps" if odd else "ring")
    except CollectiveMismatch as exc:
        errors.append(str(exc))
    # Every rank runs the same calls. The next collective fails on every rank that only
    # sent in the broken one; under load a rank may even finish it before the abort comes,
    # and then fail the one after (the abort overtakes the peer's data for it: one socket
    # per pair keeps order). So the third call works everywhere, whatever the timing.
    for _ in range(3):
        y = np.full(3, comm.rank, np.int64)
        try:
            comm.all_reduce(y)
        except CollectiveMismatch as exc:
            errors.append(str(exc))
    return errors, int(y[0])


@pytest.mark.parametrize("how", ["count", "dtype", "op", "collective", "root", "algorithm"])
def test_mismatch_raises_on_every_rank(pools, how):
    n = 3
    results = pools(n).run(disagree, how)
    for rank, (errors, y) in enumerate(results):
        assert errors, f"rank {rank} did not notice the {how} mismatch"
        assert y == sum(range(n))
    detailed = [e for errors, _ in results for e in errors if "but rank" in e]
    assert detailed, "no rank described both sides"
    assert any(("count=11" in o) if how == "count" else ("float64" in o) if how == "dtype"
               else ("max" in o) if how == "op" else ("broadcast" in o) if how == "collective"
               else ("root=1" in o) if how == "root" else ("ps" in o) for o in detailed)


def p2p_mismatch(comm):
    try:
        if comm.rank == 0:
            comm.send(np.ones(4, np.float32), 1)
        else:
            comm.recv(np.ones(5, np.float32), 0)
        return "no error"
    except CollectiveMismatch as exc:
        return str(exc)


def test_send_recv_size_mismatch(pools):
    assert "count=4" in pools(2).run(p2p_mismatch)[1]


DIE = textwrap.dedent("""
    import os, signal, time, numpy as np, ringcomm
    comm = ringcomm.init()
    x = np.ones(2_000_000, np.float32)
    comm.all_reduce(x)
    if comm.rank == 2:
        time.sleep(0.5)  # let what it sent reach the others: it dies between collectives
        os.kill(os.getpid(), signal.SIGKILL)
    t = time.monotonic()
    try:
        for _ in range(1000):
            comm.all_reduce(x, algorithm="{algorithm}")
        print("no error")
    except ringcomm.PeerLost as exc:
        print(f"PeerLost rank={{exc.rank}} after={{time.monotonic() - t:.2f}} {{exc}}")
""")


@pytest.mark.parametrize("algorithm", ["ring", "ps"])
def test_dead_peer_is_reported_within_seconds(algorithm):
    """Rank 2 is SIGKILLed; ranks 0, 1, 3 raise PeerLost naming rank 2, whether or not they
    were talking to it (with PS, rank 1 and 3 only talk to rank 0)."""
    results = spawn_job(DIE.format(algorithm=algorithm), 4, env={"RINGCOMM_TIMEOUT": "60"}, timeout=45)
    for rank in (0, 1, 3):
        code, out, err = results[rank]
        assert "PeerLost rank=2" in out, f"rank {rank}: {out}\n{err}"
        assert float(out.split("after=")[1].split()[0]) < 5.0


TIMEOUT = textwrap.dedent("""
    import time, numpy as np, ringcomm
    comm = ringcomm.init(timeout=1.0)
    x = np.ones(10, np.float32)
    comm.all_reduce(x)
    if comm.rank == 1:
        time.sleep(4)
        print("slept")
    else:
        t = time.monotonic()
        try:
            comm.all_reduce(x, algorithm="ring")
        except ringcomm.CommTimeout as exc:
            print(f"after={time.monotonic() - t:.2f} blames={exc.rank} cause={exc.cause!r} {exc}")
""")


def test_deadline_names_collective_and_rank():
    """Rank 1 is busy (alive, answering liveness checks) instead of joining the collective."""
    results = spawn_job(TIMEOUT, 2, timeout=30)
    out = results[0][1]
    assert "all_reduce #" in out and "blames=1" in out and "never started" in out, results[0]
    assert "cause='not started'" in out, results[0]
    assert 0.9 < float(out.split("after=")[1].split()[0]) < 3.0


HUNG = textwrap.dedent("""
    import os, signal, time, numpy as np, ringcomm
    comm = ringcomm.init(timeout=2.0)
    x = np.ones(1 << 16, np.float32)
    comm.all_reduce(x)
    if comm.rank == 2:
        os.kill(os.getpid(), signal.SIGSTOP)
    t = time.monotonic()
    try:
        comm.all_reduce(x)
    except ringcomm.CommTimeout as exc:
        print(f"after={time.monotonic() - t:.2f} blames={exc.rank} cause={exc.cause!r} remote={exc.remote} {exc}",
              flush=True)
        t = time.monotonic()
        comm.close()
        print(f"closed={time.monotonic() - t:.2f}", flush=True)
""")


def test_a_stopped_rank_is_named_by_every_survivor_and_close_is_quick():
    """Rank 2 is stopped (SIGSTOP) between collectives: ranks 0, 1 and 3 time out naming rank
    2 (not the rank each waited for), within the deadline and a liveness check, and close
    their communicator in about a second instead of waiting for its goodbye."""
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-c", HUNG], env=dict(os.environ, **job_env(r, 4, port)),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(4)]
    try:
        outs = {r: procs[r].communicate(timeout=40) for r in (0, 1, 3)}
    finally:
        for p in procs:
            p.kill()
            p.communicate()
    for rank, (out, err) in outs.items():
        assert "blames=2" in out and "rank 2 stopped answering" in out, f"rank {rank}: {out}\n{err}"
        assert "cause='silent'" in out, out  # also where it came as another rank's abort
        assert float(out.split("after=")[1].split()[0]) < 2.0 + 1.5, out
        assert float(out.split("closed=")[1].split()[0]) < 2.5, out


CLOSED = textwrap.dedent("""
    import numpy as np, ringcomm
    comm = ringcomm.init()
    comm.close()
    comm.close()
    try:
        comm.all_reduce(np.ones(3))
    except ringcomm.CommError as exc:
        print("closed:", exc)
""")


def test_use_after_close():
    for code, out, err in spawn_job(CLOSED, 2, timeout=30):
        assert code == 0 and "closed: world: communicator is closed" in out, err


def two_threads(comm):
    """Rank 0: a thread blocks in an all-reduce on a group (rank 1 joins it late) while the
    main thread calls another collective on it: the call is refused before sending and the
    group is revoked, so the all-reduce in progress fails too, on both ranks, and so does
    every later collective on it; a point-to-point transfer on it meanwhile goes on. The
    same for an async work pending. The world, untouched, works as before."""
    import threading
    import time
    first = np.full(4, comm.rank + 1.0, np.float32)
    buf = np.zeros(4, np.float32)
    group, other_group = comm.new_group([0, 1]), comm.new_group([0, 1])
    if comm.rank == 1:  # late each time, so rank 0's calls are still in progress when tested
        time.sleep(1.0)
        failed = [_try(lambda: group.all_reduce(first))]
        group.send(np.arange(4, dtype=np.float32), 0)
        time.sleep(1.0)
        failed.append(_try(lambda: other_group.all_reduce(np.ones(2, np.float32))))
        refused, unchanged = None, True
    else:
        failed = []
        worker = threading.Thread(target=lambda: failed.append(_try(lambda: group.all_reduce(first))))
        worker.start()
        time.sleep(0.1)
        before = group.stats()
        refused = _try(lambda: group.broadcast(np.ones(4, np.float32)))
        unchanged = group.stats() == before
        receiver = threading.Thread(target=group.recv, args=(buf, 1))
        receiver.start()  # point-to-point: allowed beside the collective, and not revoked
        worker.join(10)
        receiver.join(10)
        pending = other_group.all_reduce(np.ones(2, np.float32), async_op=True)  # claims it until done
        other = []
        thread = threading.Thread(target=lambda: other.append(_try(other_group.barrier)))
        thread.start()
        thread.join(10)
        failed.append(_try(pending.wait))
        refused = (refused, other[0])
    still = _try(lambda: group.all_reduce(np.ones(3, np.float32)))  # revoked stays revoked
    y = np.full(3, comm.rank + 1.0, np.float32)
    comm.all_reduce(y)  # one thread after another is fine
    return refused, unchanged, buf.tolist(), failed + [still], float(y[0])


def _try(call):
    try:
        call()
        return None
    except ringcomm.CommError as exc:
        return f"{type(exc).__name__}: {exc}"


def test_concurrent_use_from_two_threads_revokes_the_communicator(pools):
    (refused, unchanged, got, failed0, y), (_, _, _, failed1, y1) = pools(2).run(two_threads)
    blocking, async_pending = refused
    assert blocking.startswith("Revoked: ") and \
        "broadcast called from one thread while another has a collective in progress" in blocking
    assert async_pending and "barrier called from one thread" in async_pending
    assert unchanged and got == [0.0, 1.0, 2.0, 3.0] and y == y1 == 3.0
    for rank, failed in enumerate((failed0, failed1)):  # in progress, pending, later: all fail
        assert len(failed) == 3 and all(f and f.startswith("Revoked: ") and "revoked on every rank" in f
                                        for f in failed), (rank, failed)


def root_disagree(comm, collective, algorithm):
    """Rank 1 names another root than the others: the call itself raises on every rank."""
    x = np.ones(10, np.float32)
    root = 1 if comm.rank == 1 else 0
    try:
        getattr(comm, collective)(x, root=root, algorithm=algorithm)
        raised = None
    except CollectiveMismatch as exc:
        raised = str(exc)
    y = np.full(3, comm.rank, np.int64)
    comm.all_reduce(y)  # nothing is left over to fail a later collective
    return raised, int(y[0])


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("algorithm", ["ring", "ps"])
@pytest.mark.parametrize("collective", ["broadcast", "reduce"])
def test_root_mismatch_fails_that_call_on_every_rank(pools, n, collective, algorithm):
    results = pools(n).run(root_disagree, collective, algorithm)
    for rank, (raised, y) in enumerate(results):
        assert raised is not None, f"rank {rank} finished the {collective} without noticing"
        assert y == sum(range(n))
    assert any("root=1" in raised and "root=0" in raised for raised, _ in results)


def close_during_a_collective(comm):
    """Rank 0 closes from a second thread while its first thread waits in an all-reduce."""
    import threading
    import time
    x = np.full(1000, comm.rank + 1.0)
    if comm.rank == 1:
        time.sleep(1.0)
        comm.all_reduce(x)
        return None, float(x[0])
    worker = threading.Thread(target=comm.all_reduce, args=(x,))
    worker.start()
    time.sleep(0.3)
    try:
        comm.close()
        raised = None
    except ringcomm.CommError as exc:
        raised = str(exc)
    worker.join(10)
    return raised, float(x[0])


def test_close_racing_a_collective_raises_comm_error(pools):
    (raised, x0), (_, x1) = pools(2).run(close_during_a_collective)
    assert raised and "another thread has a collective in progress" in raised
    assert x0 == x1 == 3.0  # the collective itself completed, and the communicator is open
    assert pools(2).run(close_during_a_collective)[0][1] == 3.0
