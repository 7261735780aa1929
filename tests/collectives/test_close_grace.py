"""close(grace=...) lets calls in flight finish within the grace, then fails what is left.

Rank 0 starts asynchronous point-to-point calls (receives from any source and from rank 1,
or a send larger than the window, which waits for rank 1's receive) and closes with a grace
of 3 s; rank 1 answers 0.5 s later: every call completes with its data. A bad grace is
refused before anything is closed.
"""
import textwrap

import pytest

from harness import spawn_job

pytestmark = pytest.mark.timeout(90)

JOB = textwrap.dedent("""
    import os, time, numpy as np, ringcomm
    kind = os.environ["TEST_KIND"]
    comm = ringcomm.init()
    comm.barrier()
    if comm.rank == 0:
        for bad in ("1", -1.0, float("nan"), True):
            try:
                comm.close(grace=bad)
                print("accepted", repr(bad))
            except ValueError:
                pass
        if kind == "recv":
            a, b = np.zeros(1000), np.zeros(3)
            works = [comm.recv(a, None, 4, async_op=True), comm.recv(b, 1, 4, async_op=True)]
        else:
            works = [comm.send(np.ones(3_000_000), 1, 4, async_op=True)]
        comm.close(grace=np.float32(3.0))  # any real number of seconds
        results = [w.wait() for w in works]
        if kind == "recv":
            print("got", results[0], a.min(), a.max(), b.tolist())
        else:
            print("sent", results)
    else:
        time.sleep(0.5)
        if kind == "recv":
            comm.send(np.full(1000, 1.0), 0, 4)
            comm.send(np.full(3, 2.0), 0, 4)
            print("sent both")
        else:
            y = np.zeros(3_000_000)
            comm.recv(y, 0, 4)
            print("received", y.min(), y.max())
        comm.close()
""")


@pytest.mark.parametrize("kind", ["recv", "send"])
def test_calls_in_flight_finish_within_the_grace(kind):
    (c0, out0, err0), (c1, out1, err1) = spawn_job(JOB, 2, env={"TEST_KIND": kind}, timeout=60)
    assert c0 == c1 == 0, (err0[-2000:], err1[-2000:])
    assert "accepted" not in out0, out0
    if kind == "recv":
        assert "got 1 1.0 1.0 [2.0, 2.0, 2.0]" in out0 and "sent both" in out1, (out0, out1)
    else:
        assert "sent [None]" in out0 and "received 1.0 1.0" in out1, (out0, out1)
