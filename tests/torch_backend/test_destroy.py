"""destroy_process_group() with a collective in flight whose peer never joins: it returns
within a second or two, the communication thread is gone, the in-flight work fails here and
on the rank that waits with it, and the late rank's call fails naming the rank that left.

Three ranks, torchrun-style (tests/harness.py): ranks 0 and 1 start an all-reduce that rank 2
joins only 4 s later; rank 0 destroys the group 0.3 s after starting it. The group timeout is
60 s, so every error seen within seconds comes from the destroy, not a deadline.
"""
import re
import textwrap

import pytest

from harness import spawn_job

pytest.importorskip("torch", reason="the torch backend needs PyTorch (make test installs the CPU wheel)")
pytestmark = pytest.mark.timeout(120)

WORKER = textwrap.dedent("""
    import threading, time
    from datetime import timedelta
    import torch, torch.distributed as dist
    import ringcomm.torch

    dist.init_process_group("ringcomm", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    t = torch.ones(1000)
    if rank == 2:
        time.sleep(4)
    start = time.monotonic()
    work = dist.all_reduce(t, async_op=True)
    if rank == 0:
        time.sleep(0.3)
        began = time.monotonic()
        dist.destroy_process_group()
        print(f"destroyed in {time.monotonic() - began:.2f}", flush=True)
        left = [th.name for th in threading.enumerate() if th.name.startswith("ringcomm") and "completer" not in th.name]
        print(f"threads left {left}", flush=True)
    try:
        work.wait()
        print("no error", flush=True)
    except Exception as exc:
        print(f"raised {type(exc).__name__} after={time.monotonic() - start:.2f} {exc}", flush=True)
""")


def test_destroy_returns_and_fails_the_work_in_flight_everywhere():
    (c0, out0, err0), (c1, out1, err1), (c2, out2, err2) = spawn_job(WORKER, 3, timeout=90)
    assert c0 == c1 == c2 == 0, (err0[-2000:], err1[-2000:], err2[-2000:])
    took = float(re.search(r"destroyed in ([\d.]+)", out0)[1])
    assert took < 3.0, out0
    assert "threads left []" in out0, out0
    assert re.search(r"raised CommError .*closed while this call was in flight", out0), out0
    for out in (out1, out2):  # the rank that waited with it, and the one that came late
        found = re.search(r"raised (\w+) after=([\d.]+) (.*)", out)
        assert found and float(found[2]) < 10, out
        assert re.search(r"rank 0 (aborted|closed)|to rank 0\b|lost rank 0\b", found[3]), out


GROUP_WORKER = textwrap.dedent("""
    import threading, time
    from datetime import timedelta
    import torch, torch.distributed as dist
    import ringcomm.torch

    def attempt(call, name):
        try:
            call()
            print(f"{name} no error", flush=True)
        except Exception as exc:
            print(f"{name} raised {type(exc).__name__} after={time.monotonic() - start:.2f} {exc}", flush=True)

    dist.init_process_group("ringcomm", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    pair, other = dist.new_group([0, 1]), dist.new_group([0, 1])
    start = time.monotonic()
    if rank == 0:
        # a blocking call started while nothing is queued runs on its own thread, not on the
        # communication thread; the asynchronous one queues behind it
        blocked = threading.Thread(target=attempt, args=(lambda: dist.all_reduce(torch.ones(3), group=other), "sync"))
        blocked.start()
        time.sleep(0.2)
        work = dist.all_reduce(torch.ones(10), group=pair, async_op=True)
        time.sleep(0.1)
        began = time.monotonic()
        dist.destroy_process_group(pair)
        dist.destroy_process_group(other)
        print(f"destroyed in {time.monotonic() - began:.2f}", flush=True)
        attempt(work.wait, "async")
        blocked.join()
    elif rank == 1:
        time.sleep(5)  # long after rank 0 gave up on both groups
        attempt(lambda: dist.all_reduce(torch.ones(3), group=other), "sync")
        attempt(lambda: dist.all_reduce(torch.ones(10), group=pair), "async")
    world = torch.ones(2)
    dist.all_reduce(world)  # the world outlives the pair
    print(f"world {world.tolist()}", flush=True)
    dist.destroy_process_group()
""")


def test_destroying_a_group_revokes_its_collectives_on_every_member():
    results = spawn_job(GROUP_WORKER, 3, timeout=90)
    for code, out, err in results:
        assert code == 0, err[-2000:]
        assert "world [3.0, 3.0]" in out, out
    (_, out0, _), (_, out1, _), _ = results
    assert float(re.search(r"destroyed in ([\d.]+)", out0)[1]) < 3.0, out0  # both within one grace
    for out in (out0, out1):  # the calls in flight here (async, and blocking on a thread), the late member's
        for name in ("async", "sync"):
            assert re.search(name + r" raised Revoked .*rank 0 closed group\[0, 1\].* in flight", out), out
