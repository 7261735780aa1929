"""Order and errors at the edges: a synchronous call never overtakes queued async work (the
inline fast path), an abort reaches a rank that only sends, a send to a closed peer raises,
and every algorithm is bitwise identical across ranks for signed zeros and NaN."""
import textwrap

import numpy as np
import pytest

from harness import spawn_job

pytestmark = pytest.mark.timeout(60)

ORDER = textwrap.dedent("""
    import queue, time
    import ringcomm.engine as E

    class SlowQueue(queue.SimpleQueue):  # widen the gap between taking work and running it
        def get(self, *a, **k):
            item = super().get(*a, **k)
            time.sleep(0.002)
            return item

    E.queue = type("q", (), {"SimpleQueue": SlowQueue, "Empty": queue.Empty})
    import numpy as np, ringcomm
    comm = ringcomm.init(timeout=5)
    a, b = np.ones(8, np.float32), np.ones(8, np.float32)
    for i in range(20):
        a[:] = 1; b[:] = 2
        w = comm.all_reduce(a, async_op=True)
        time.sleep(0.001)
        comm.all_reduce(b)          # synchronous: must not overtake the async one
        w.wait()
        assert a[0] == comm.world_size and b[0] == 2 * comm.world_size, (i, a[0], b[0])
    print("order ok")
""")


def test_sync_call_never_overtakes_queued_async_work():
    for code, out, err in spawn_job(ORDER, 2, timeout=50):
        assert code == 0 and "order ok" in out, err


LATE_ROOT = textwrap.dedent("""
    import time, numpy as np, ringcomm
    comm = ringcomm.init(timeout=1)
    x = np.arange(4.0) if comm.rank == 0 else np.zeros(4)
    if comm.rank == 0:
        time.sleep(2.5)  # rank 1 gives up on the broadcast and aborts it
    try:
        comm.broadcast(x, root=0, algorithm="ps")   # rank 0 only sends here
        print("returned normally")
    except ringcomm.CommError as exc:
        print("raised", type(exc).__name__)
    time.sleep(3.0)  # rank 1 stays until rank 0 has tried
""")


def test_abort_reaches_a_rank_that_only_sends():
    for _code, out, err in spawn_job(LATE_ROOT, 2, timeout=40):
        assert "raised CommTimeout" in out and "returned normally" not in out, (out, err)


SEND_TO_CLOSED = textwrap.dedent("""
    import time, numpy as np, ringcomm
    comm = ringcomm.init(timeout=4)
    if comm.rank == 1:
        comm._engine.session.wire.close_wait = 1.0
        comm.close()
    else:
        time.sleep(2.0)
        try:
            comm.send(np.ones(1 << 16), dst=1)
            print("sent")
        except ringcomm.PeerLost as exc:
            print("PeerLost", exc.rank)
        comm._engine.session.wire.close_wait = 1.0
        comm.close()
""")


def test_send_to_a_closed_peer_raises_peer_lost():
    results = spawn_job(SEND_TO_CLOSED, 2, timeout=40)
    assert "PeerLost 1" in results[0][1], results[0]


def signed_zero_and_nan(comm):
    x = np.array([0.0, np.nan], np.float32) if comm.rank == 0 else np.array([-0.0, -np.nan], np.float32)
    out = {}
    for algorithm in ("rd", "ring", "ps"):
        y = x.copy()
        comm.all_reduce(y, op="max", algorithm=algorithm)
        out[algorithm] = y.tobytes()
    return out


@pytest.mark.parametrize("n", [2, 3])
def test_every_algorithm_is_bitwise_identical_for_signed_zero_and_nan(pools, n):
    results = pools(n).run(signed_zero_and_nan)
    for algorithm in ("rd", "ring", "ps"):
        assert len({r[algorithm] for r in results}) == 1, algorithm
