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
            elif me == slow:
                time.sleep(0.05)
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
    trials = 150
    results = spawn_job(RACE.replace("TRIALS", str(trials)), 3, timeout=110)
    for rank, (code, out, err) in enumerate(results):
        assert code == 0 and "wrong 0 " in out, f"rank {rank}: {out}{err[-3000:]}"
        assert "world 6" in out, out
        assert "other []" in out, out  # every failure says the communicator was revoked
        revoked = int(out.split("revoked ")[1].split()[0])
        assert revoked >= trials, out  # the race was seen (and revoked) in every trial
