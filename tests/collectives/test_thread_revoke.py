"""Two threads issuing collectives on one communicator at once: whichever thread each rank
lets in first, no result ever combines one thread's data with another's. The rank that sees
the race revokes the communicator, and every rank's calls on it fail."""
import textwrap

import pytest

from harness import spawn_job

pytestmark = pytest.mark.timeout(120)

RACE = textwrap.dedent("""
    import threading, time, numpy as np, ringcomm
    comm = ringcomm.init()
    n, me, trials = comm.world_size, comm.rank, TRIALS
    wrong, revoked, clean, other = 0, 0, 0, []
    for trial in range(trials):
        group = comm.new_group(list(range(n)))
        slow = trial % n                    # joins late: the first calls wait for it
        first = "A" if (me == 0) == (trial % 2 == 0) else "B"   # the winner differs by rank
        started = threading.Event()
        values = {"A": 1.0, "B": 1000.0}
        results = {}

        def run(name):
            if name != first:
                started.wait(5)
                time.sleep(0.0003)          # a moment after the first thread's call began
            elif me == slow:                # (long beside any scheduling delay of a thread)
                time.sleep(0.15)
            out = []
            for _ in range(2):
                x = np.full(4, values[name], np.float32)
                if name == first:
                    started.set()
                try:
                    group.all_reduce(x)
                    out.append(float(x[0]))
                except ringcomm.Revoked:
                    out.append("revoked")
                except ringcomm.CommError as exc:
                    out.append(type(exc).__name__ + ": " + str(exc)[:200])
            results[name] = out
        threads = [threading.Thread(target=run, args=(name,)) for name in "AB"]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        for name, out in results.items():
            for got in out:
                if got == "revoked":
                    revoked += 1
                elif isinstance(got, float):
                    clean += 1
                    wrong += got != n * values[name]
                else:
                    other.append(got)
        comm.barrier()                      # the world is untouched: the next trial starts together
    x = np.full(4, me + 1.0)
    comm.all_reduce(x)
    print(f"wrong {wrong} revoked {revoked} clean {clean} world {x[0]:.0f}")
    print("other", other[:3])
""")


def test_threads_racing_on_a_communicator_never_mix_results():
    trials = 200
    results = spawn_job(RACE.replace("TRIALS", str(trials)), 3, timeout=110)
    for rank, (code, out, err) in enumerate(results):
        assert code == 0 and "wrong 0 " in out, f"rank {rank}: {out}{err[-3000:]}"
        assert "world 6" in out, out
        assert "other []" in out, out  # every failure says the communicator was revoked
        revoked = int(out.split("revoked ")[1].split()[0])
        assert revoked >= trials, out  # the race was seen (and revoked) in every trial


REVOKED_ONCE = textwrap.dedent("""
    import threading, time, numpy as np, ringcomm
    comm = ringcomm.init()
    group = comm.new_group([0, 1])

    def catch(call):
        try:
            call()
        except ringcomm.CommError as exc:
            return exc
    if comm.rank == 0:
        failed = []
        worker = threading.Thread(target=lambda: failed.append(
            type(catch(lambda: group.all_reduce(np.ones(4)))).__name__))
        worker.start()
        time.sleep(0.2)
        first = catch(group.barrier)         # the second thread: refused, the group revoked
        worker.join(10)
        errors = {type(catch(group.barrier)).__name__ for _ in range(2000)}  # a retry loop
        print("rank0", type(first).__name__, failed, sorted(errors))
    comm.barrier()                          # (rank 1 never called a collective on the group)
    if comm.rank == 1:
        start = time.monotonic()
        exc = catch(lambda: group.all_reduce(np.ones(4)))
        took = time.monotonic() - start
        def held(transport):
            box = transport.mailbox
            return len(box._notices) + len(box._late)
        with comm._engine.lock:
            work = comm._engine.submit(held, "held")
        print("rank1", type(exc).__name__, f"{took:.2f}", work.wait())
    x = np.ones(3)
    comm.all_reduce(x)
    print("world", x[0])
""")


def test_a_revocation_reaches_every_member_once_and_a_retry_loop_sends_nothing():
    (c0, out0, err0), (c1, out1, err1) = spawn_job(REVOKED_ONCE, 2, timeout=60)
    assert c0 == 0 and c1 == 0, err0 + err1
    assert "rank0 Revoked ['Revoked'] ['Revoked']" in out0, out0
    name, took, held = out1.split("rank1 ")[1].split()[:3]
    assert name == "Revoked" and float(took) < 1.0, out1  # told at once, not at a deadline
    assert int(held) == 0, out1                           # 2000 failed retries sent no abort
    assert "world 2.0" in out0 and "world 2.0" in out1


FORKED = textwrap.dedent("""
    import os, time, numpy as np, ringcomm
    comm = ringcomm.init()
    x = np.ones(1 << 20)
    work = comm.all_reduce(x, async_op=True)   # the communication thread may be busy at the fork
    pid = os.fork()
    if pid == 0:
        start = time.monotonic()
        try:
            comm.all_reduce(np.ones(4))
            outcome = "ran"
        except ringcomm.CommError as exc:
            outcome = "refused: " + str(exc)
        try:
            work.wait()                        # a handle the parent made: nobody here finishes it
            waited = "waited"
        except ringcomm.CommError as exc:
            waited = "refused: " + str(exc)
        print(f"child {time.monotonic() - start:.2f} {outcome} | {waited}", flush=True)
        os._exit(0)
    os.waitpid(pid, 0)
    work.wait()
    comm.all_reduce(x)
    print("parent", x[0])
""")


def test_a_forked_child_is_refused_at_once_even_with_work_in_flight():
    for code, out, err in spawn_job(FORKED, 2, timeout=60):
        assert code == 0 and "parent 4.0" in out, out + err
        took = float(out.split("child ")[1].split()[0])
        assert took < 1.0 and "refused: world: this process was forked from the one" in out, out
        assert "| refused: all_reduce #1 on world: this process was forked from the one" in out, out


BEHIND = textwrap.dedent("""
    import threading, time, numpy as np, ringcomm
    comm = ringcomm.init()
    g, h = comm.new_group([0, 1]), comm.new_group([0, 1])

    def catch(call):
        try:
            call()
            return "ok"
        except ringcomm.CommError as exc:
            return type(exc).__name__
    if comm.rank == 0:
        out = {}
        a = threading.Thread(target=lambda: out.__setitem__("a", catch(lambda: g.all_reduce(np.ones(4)))))
        a.start()                             # in progress on g: rank 1 is not there yet
        time.sleep(0.2)
        pending = h.all_reduce(np.ones(4), async_op=True)  # queued work that waits for rank 1
        out["refused"] = catch(g.barrier)     # a second thread on g: revoked
        a.join(10)
        out["h"] = catch(pending.wait)
        print("rank0", out)
    else:
        time.sleep(0.5)
        start = time.monotonic()
        got = catch(lambda: g.all_reduce(np.ones(4)))
        print(f"rank1 {got} {time.monotonic() - start:.2f}", catch(lambda: h.all_reduce(np.ones(4))))
""")


def test_a_revocation_is_told_at_once_even_with_blocking_work_queued_behind_it():
    (c0, out0, err0), (c1, out1, err1) = spawn_job(BEHIND, 2, timeout=60)
    assert c0 == 0 and c1 == 0, err0 + err1
    assert "'a': 'Revoked'" in out0 and "'refused': 'Revoked'" in out0 and "'h': 'ok'" in out0, out0
    got, took, h = out1.split("rank1 ")[1].split()
    assert got == "Revoked" and float(took) < 2.0 and h == "ok", out1
