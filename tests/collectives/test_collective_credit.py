"""Backpressure between collectives: a rank far ahead of a slow peer waits for its credit
(results unchanged, memory bounded), and only a peer that ignores its credits is refused."""
import re
import textwrap

import pytest

from harness import spawn_job

pytestmark = pytest.mark.timeout(90)

AHEAD = textwrap.dedent("""
    import time, numpy as np, ringcomm
    comm = ringcomm.init()
    me = comm.rank

    def held_back(transport):               # rank 2 asks for credit it cannot have yet
        transport.pump(0.05)
        return any(seq >= 5 for seq in transport.credit._wants.values())
    if me == 0:                             # descheduled while the others run far ahead,
        for _ in range(400):                # until rank 2 waits for it
            with comm._engine.lock:
                work = comm._engine.submit(held_back, "held back?")
            if work.wait():
                break
    outcomes = []
    for i in range(12):                     # rank 2 disagrees on the size: every call fails,
        x = np.ones(8 if me == 2 else 4, np.float32)   # ranks 1 and 2 without waiting for rank 0
        try:
            comm.all_reduce(x, algorithm="ring")
            outcomes.append("ok")
        except ringcomm.CollectiveMismatch:
            outcomes.append("mismatch")
        except ringcomm.CommError as exc:
            outcomes.append(repr(exc))
    x = np.full(1000, me + 1.0, np.float32)
    comm.all_reduce(x)                      # and then the job goes on
    assert np.array_equal(x, np.full(1000, 6.0, np.float32)), x[:4]
    print("outcomes", ",".join(sorted(set(outcomes))))
    print("stalls", comm._engine.session.credit.stalls)
""")


def test_ranks_far_ahead_of_a_slow_rank_wait_for_it_instead_of_being_refused():
    """After failures (here a size mismatch between ranks 1 and 2) ranks can honestly run
    many collectives ahead of a descheduled peer: they wait for its credit."""
    results = spawn_job(AHEAD, 3, env={"RINGCOMM_COLLECTIVE_WINDOW": "4"}, timeout=80)
    for rank, (code, out, err) in enumerate(results):
        assert code == 0 and "outcomes mismatch\n" in out, f"rank {rank}: {out}{err}"
    assert int(results[2][1].split("stalls ")[1].split()[0]) > 0  # rank 2 was held back


CHEAT = textwrap.dedent("""
    import time, numpy as np, ringcomm
    from ringcomm import signature
    from ringcomm.transport import frame
    comm = ringcomm.init()
    x = np.ones(4, np.float32)
    if comm.rank == 1:                      # sends collective #5's data before #0 ran anywhere
        sig = signature.pack("all_reduce", x.dtype, "sum", "ring", 0, x.size)
        def cheat(transport):
            key = frame.Key(comm.comm_id, 0, 5, 0, 0)
            transport.wire.post(0, frame.pack(frame.Kind.DATA, 1, key, 8, sig), x[:2].view(np.uint8), True)
        with comm._engine.lock:
            work = comm._engine.submit(cheat, "cheat")
        work.wait()
    else:                                   # run only once the cheat's frame came in (it may
        def refused(transport):             # travel another path than the calls' data)
            transport.pump(0.05)
            return len(transport.mailbox._too_early)
        for _ in range(200):
            with comm._engine.lock:
                work = comm._engine.submit(refused, "refused")
            if work.wait():
                break
    for i in range(6):
        try:
            comm.all_reduce(x.copy(), algorithm="ring")
        except ringcomm.CommError as exc:
            print(f"failed #{i}: {exc}")  # (#5 of the communicator: init ran one)
            break
    else:
        print("not refused")
""")


def test_a_peer_that_ignores_its_credits_is_refused_and_named():
    results = spawn_job(CHEAT, 2, env={"RINGCOMM_COLLECTIVE_WINDOW": "2"}, timeout=60)
    code, out, err = results[0]
    assert re.search(r"rank 1 ignored its flow-control credits: it sent data for collective #5 "
                     r"while this rank had finished (none|only up to #0) \(a window of 2", out), out + err
    assert out.split("failed #")[1].split(":")[0] == results[1][1].split("failed #")[1].split(":")[0]
    assert "ignored its flow-control credits" in results[1][1]  # the cheat learns why


HELD_BACK = textwrap.dedent("""
    import os, signal, subprocess, time, numpy as np, ringcomm
    comm = ringcomm.init(timeout=3)
    comm.barrier()
    if comm.rank == 0:                      # stopped past the deadline, then let go
        subprocess.Popen(["sh", "-c", f"sleep 10; kill -CONT {os.getpid()}"])
        os.kill(os.getpid(), signal.SIGSTOP)
        print("resumed")
    else:
        start = time.monotonic()
        try:
            for i in range(40):             # every call fails early (ranks 1 and 2 disagree)
                try:
                    comm.all_reduce(np.ones(8 if comm.rank == 2 else 4, np.float32), algorithm="ring")
                except ringcomm.CollectiveMismatch:
                    pass
            print("never held back")
        except ringcomm.CommTimeout as exc:
            print(f"held back {time.monotonic() - start:.1f} rank={exc.rank} cause={exc.cause}: {exc}")
        print("stalls", comm._engine.session.credit.stalls)
""")


def test_a_wait_for_credit_counts_toward_the_deadline_and_names_the_peer_holding_it_back():
    results = spawn_job(HELD_BACK, 3, env={"RINGCOMM_COLLECTIVE_WINDOW": "4"}, timeout=60)
    for rank in (1, 2):
        out = results[rank][1]
        assert "held back " in out, out + results[rank][2]
        took = float(out.split("held back ")[1].split()[0])
        assert took < 3 + 1 + 3, out  # the deadline, a liveness check, slack
        assert "rank=0 cause=silent" in out and "rank 0 stopped answering" in out, out
    assert int(results[2][1].split("stalls ")[1]) > 0  # rank 2 (it sends to rank 0) waited for credit
