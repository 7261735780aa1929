"""Bounded memory per peer: point-to-point sends wait for a busy receiver (flow control),
and a peer that ignores the window is refused with a clear error."""
import textwrap

import pytest

from harness import spawn_job

pytestmark = pytest.mark.timeout(90)
WINDOW = 8 << 20

BUSY_RECEIVER = textwrap.dedent("""
    import resource, time, numpy as np, ringcomm
    comm = ringcomm.init()
    n, size = 120, 1 << 18            # 120 messages of 1 MiB: 15 windows
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    x = np.empty(size, np.float32)
    t = time.monotonic()
    if comm.rank == 0:
        for i in range(n):
            x[:] = i
            comm.send(x, dst=1, tag=3)
        print(f"sent_after={time.monotonic() - t:.2f}")
    else:
        time.sleep(2.0)                 # busy elsewhere: the sender must wait, not pile up
        for i in range(n):
            comm.recv(x, src=0, tag=3)
            assert np.all(x == i), (i, x[:3])
        print("received", n)
    grew = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024
    print(f"grew_mib={grew:.0f}")
""")


def test_a_busy_receiver_holds_back_the_sender_and_memory_stays_bounded():
    results = spawn_job(BUSY_RECEIVER, 2, env={"RINGCOMM_P2P_WINDOW_BYTES": str(WINDOW)}, timeout=80)
    (c0, out0, err0), (c1, out1, err1) = results
    assert c0 == 0 and c1 == 0, err0 + err1
    assert "received 120" in out1
    assert float(out0.split("sent_after=")[1].split()[0]) > 1.5  # it waited for the receiver
    for out in (out0, out1):  # 120 MiB went through; a window's worth (plus slack) stayed
        assert float(out.split("grew_mib=")[1].split()[0]) < 60, out


FLOOD = textwrap.dedent("""
    import numpy as np, ringcomm
    from ringcomm import signature
    from ringcomm.transport import frame
    comm = ringcomm.init()
    size = 1 << 18
    if comm.rank == 0:                 # a peer that bypasses its window: 20 MiB at once
        sig = signature.pack("point_to_point", np.dtype(np.float32), None, None, 0, size)
        payload = np.ones(size, np.float32).view(np.uint8)

        def flood(transport):
            for i in range(20):
                key = frame.Key(comm.comm_id, 1, i, 3, 0)
                transport.wire.post(1, frame.pack(frame.Kind.DATA, 0, key, payload.nbytes, sig), payload, True)
        with comm._engine.lock:
            work = comm._engine.submit(flood, "flood")
        work.wait()
        comm.barrier()
    else:
        comm.barrier()

        def settle(transport):  # the barrier's small messages may overtake the flood's large ones
            transport.pump(0.2)
            return transport.mailbox.dropped
        for _ in range(50):
            with comm._engine.lock:
                work = comm._engine.submit(settle, "settle")
            dropped = work.wait()
            if dropped >= 12:
                break
        x = np.empty(size, np.float32)
        try:
            comm.recv(x, src=0, tag=3)
        except ringcomm.CommError as exc:
            print("refused:", exc)
        print("dropped", dropped)
""")


def test_a_peer_that_ignores_the_window_is_refused():
    results = spawn_job(FLOOD, 2, env={"RINGCOMM_P2P_WINDOW_BYTES": str(WINDOW)}, timeout=60)
    code, out, err = results[1]
    assert "refused: rank 0 sent more than a well-behaved rank can" in out, out + err
    assert "past the flow-control window" in out
    assert int(out.split("dropped ")[1].split()[0]) >= 20 - WINDOW // (1 << 20)


EXCHANGE = textwrap.dedent("""
    import numpy as np, ringcomm
    comm = ringcomm.init()
    peer = 1 - comm.rank
    mine = np.full(8 << 20, comm.rank + 1.0, np.float32)   # 32 MiB: four windows
    theirs = np.empty_like(mine)
    work = comm.send(mine, dst=peer, async_op=True)        # waits for credit off the thread
    comm.recv(theirs, src=peer)
    work.wait()
    print("ok", bool(np.all(theirs == peer + 1.0)))
""")


def test_sends_larger_than_the_window_both_ways_do_not_deadlock():
    for code, out, err in spawn_job(EXCHANGE, 2, env={"RINGCOMM_P2P_WINDOW_BYTES": str(WINDOW)}, timeout=60):
        assert code == 0 and "ok True" in out, err


OUT_OF_ORDER = textwrap.dedent("""
    import numpy as np, ringcomm
    comm = ringcomm.init(timeout=20)
    big = 6 << 18                                           # 6 MiB a message, window 8 MiB
    if comm.rank == 0:
        works = [comm.send(np.full(big, float(tag), np.float32), dst=1, tag=tag, async_op=True)
                 for tag in (1, 2)]
        for work in works:
            work.wait()
        print("sent")
    else:
        x = np.empty(big, np.float32)
        for tag in (2, 1):                                  # the other order
            comm.recv(x, src=0, tag=tag)
            assert np.all(x == tag)
        print("received")
""")


def test_receiving_tags_in_another_order_than_sent_does_not_deadlock():
    results = spawn_job(OUT_OF_ORDER, 2, env={"RINGCOMM_P2P_WINDOW_BYTES": str(WINDOW)}, timeout=60)
    assert "sent" in results[0][1] and "received" in results[1][1], results
