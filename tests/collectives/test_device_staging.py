"""The GPU staging path, exercised on the CPU: an emulated device treats numpy buffers as
device memory and goes through the same staging buffers, lane slots and copy-in as CuPy
arrays do (ringcomm.device.StagedDevice)."""
import types

import numpy as np
import pytest

from harness import RankPool
from ringcomm.device import EmulatedDevice, HostDevice, select
from test_correctness import (assert_close, cases, make_input, numpy_reduce, run_all_gather,
                              run_all_reduce, run_broadcast, run_reduce_scatter)

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module", params=[2, 3])
def emulated(request):
    pool = RankPool(request.param, env={"RINGCOMM_DEVICE": "emulated", "RINGCOMM_SEGMENT_BYTES": "65536"})
    yield pool
    if not pool.broken:
        pool.close()


def staging_counts(comm):
    return comm.device, comm._device.copies_out, comm._device.copies_in


@pytest.mark.parametrize("algorithm", ["ring", "ps", "auto"])
def test_collectives_through_staging(emulated, algorithm):
    n = emulated.world_size
    (_, out_before, in_before), *_ = emulated.run(staging_counts)
    todo = [(dt, op, c) for dt, op, c in cases(n) if op in ("sum", "max")]
    results = emulated.run(run_all_reduce, algorithm, todo)
    for i, (dtype, op, count) in enumerate(todo):
        want = numpy_reduce([make_input(r, count, dtype, op) for r in range(n)], op, dtype)
        for r in range(n):
            assert results[r][i].tobytes() == results[0][i].tobytes()
        assert_close(results[0][i], want, dtype, f"staged all_reduce {algorithm} {op}")
    small = [(np.float32, "sum", c) for c in (0, 1, 1001)]
    for r, res in enumerate(emulated.run(run_reduce_scatter, algorithm, small)):
        for (dtype, op, count), got in zip(small, res, strict=True):
            full = numpy_reduce([make_input(q, count * n, dtype, op) for q in range(n)], op, dtype)
            assert_close(got, full[r * count:(r + 1) * count], dtype, "staged reduce_scatter")
    for res in emulated.run(run_all_gather, algorithm, [(np.int64, None, 777)]):
        assert np.array_equal(res[0], np.concatenate([make_input(q, 777, np.int64, None) for q in range(n)]))
    for res in emulated.run(run_broadcast, algorithm, [(np.float64, None, 5000)]):
        for root in range(n):
            assert np.array_equal(res[root], make_input(root, 5000, np.float64, None))
    (kind, out_after, in_after), *_ = emulated.run(staging_counts)
    assert kind == "emulated"
    assert out_after > out_before and in_after > in_before, "nothing went through the staging slots"


def test_two_staging_buffers_are_taken_in_turn_and_each_call_copies():
    dev = EmulatedDevice(slot_bytes=64)
    with pytest.raises(RuntimeError, match="never made the rank's device current"):
        dev.stage_out(np.zeros(2))  # as on a GPU: the thread must make the device current first
    dev.activate()
    staged = [dev.stage_out(np.full(4 - k, k, np.float64)) for k in range(2)]
    for k, s in enumerate(staged):
        assert s.done()  # the emulated copy is done at once (a GPU's is polled)
        assert np.array_equal(s.host, np.full(4 - k, k, np.float64))
    staged.append(dev.stage_out(np.full(2, 7.0)))
    assert not np.shares_memory(staged[0].host, staged[1].host), "segment k+1 overwrote segment k"
    assert np.shares_memory(staged[0].host, staged[2].host), "a new buffer per segment"
    assert dev.copies_out == 3


def test_received_segments_land_in_place_or_in_two_buffers_taken_in_turn():
    dev = EmulatedDevice(slot_bytes=64)
    dev.activate()
    landed = [dev.stage_in(np.arange(4.0) + k) for k in range(dev.LANDINGS + 1)]
    assert not np.shares_memory(landed[0], landed[1]), "segment k+1 landed over segment k"
    assert np.shares_memory(landed[0], landed[dev.LANDINGS]), "a fresh device buffer per received segment"
    assert np.array_equal(landed[1], np.arange(4.0) + 1) and np.array_equal(landed[-1], np.arange(4.0) + 2)
    third = dev.stage_in(np.arange(3, dtype=np.float32))  # another dtype in the same bytes
    assert np.shares_memory(third, landed[1]) and np.array_equal(third, np.arange(3, dtype=np.float32))
    dst = np.zeros(10)
    assert dev.stage_in(np.arange(4.0), into=dst[2:6]) is not None and np.array_equal(dst[2:6], np.arange(4.0))
    assert not any(np.shares_memory(dst, buffer) for buffer in dev._landings), \
        "a segment with a destination went via a landing buffer"
    strided = np.zeros(8)
    dev.stage_in(np.arange(4.0), into=strided[::2])  # a strided destination: via a landing buffer
    assert np.array_equal(strided[::2], np.arange(4.0)) and dev.copies_in == dev.LANDINGS + 4


def test_segment_larger_than_slot_is_refused():
    with pytest.raises(ValueError, match="exceeds"):
        EmulatedDevice(slot_bytes=16).stage_out(np.zeros(3, np.float64))


def test_device_selection():
    assert isinstance(select("cpu"), HostDevice) and select("cpu").kind == "cpu"
    assert select("emulated").kind == "emulated"
    with pytest.raises(ValueError, match="unknown device"):
        select("tpu")
    from ringcomm.device import gpu_available
    if not gpu_available():
        assert select("auto").kind == "cpu"
        with pytest.raises(ValueError, match="needs CuPy and a CUDA device"):
            select("gpu")


def receive_only_all_to_all(comm):
    """Rank 0 sends nothing and receives 4 elements from rank 1: its call must still be
    staged (its received block is copied in as device memory)."""
    r = comm.rank
    ins = [0, 0] if r == 0 else [4, 0]
    outs = [0, 4] if r == 0 else [0, 0]
    x = np.full(sum(ins), 7.0, np.float32)
    out = np.zeros(sum(outs), np.float32)
    before = comm._device.copies_in  # what the splits' agreement (an all-gather) copies in
    comm.all_gather(np.empty(2 * 2 * comm.world_size, np.int64), np.zeros(2 * comm.world_size, np.int64))
    agreement = comm._device.copies_in - before
    before = comm._device.copies_in
    comm.all_to_all(out, x, out_splits=outs, in_splits=ins)
    return out, comm._device.copies_in - before - agreement


def test_an_uneven_all_to_all_that_only_receives_is_staged(emulated):
    if emulated.world_size != 2:
        pytest.skip("the case is written for two ranks")
    (out, copies), _ = emulated.run(receive_only_all_to_all)
    assert np.array_equal(out, np.full(4, 7.0, np.float32))
    assert copies == 1, "rank 0's received block did not go through the device's copy-in"


def receive_handed_over(comm):
    """Rank 0's synchronous receive of a device array starts in this thread; a send that
    another thread queues meanwhile makes the communication thread take the receive over and
    finish it (an empty send: it stages nothing, so it makes the device current nowhere)."""
    import threading
    import time
    device, copied_in_by = comm._device, set()
    stage_in = device.stage_in

    def recorded(host, into=None, slot=None):
        copied_in_by.add(threading.get_ident())
        return stage_in(host, into, slot)
    device.stage_in = recorded
    x = np.zeros(50_000)
    if comm.rank == 0:
        other = threading.Thread(target=lambda: (time.sleep(0.2), comm.send(np.zeros(0), dst=1, tag=7)))
        other.start()
        comm.recv(x, src=1, tag=3)
        other.join()
    else:
        time.sleep(0.6)
        comm.send(np.full(50_000, 2.0), dst=0, tag=3)
        comm.recv(np.zeros(0), src=0, tag=7)
    return float(x.sum()), bool(copied_in_by - {threading.get_ident()})  # another thread copied in


def test_a_receive_finished_by_the_communication_thread_uses_the_ranks_device(emulated):
    """On a GPU the communication thread's copies would go to device 0 unless it makes the
    rank's device current; the emulated device raises instead."""
    if emulated.world_size != 2:
        pytest.skip("the case is written for two ranks")
    assert emulated.run(receive_handed_over)[0] == (100_000.0, True)


class _SlotTransport:
    """A transport with one lane slot, recording what the link does with it."""

    def __init__(self):
        self.before_unmap, self.done, self.window = [], [], np.zeros(64, np.uint8)

    def take_slot(self, dst, key, nbytes):
        return 5, self.window

    def send_slot(self, dst, key, sig, slot, nbytes):
        self.done.append(("sent", dst, slot, bytes(self.window[:nbytes])))

    def give_back_slot(self, dst, slot):
        self.done.append(("given back", dst, slot))


class _SlowCopies(EmulatedDevice):
    """Copies that are never done when polled (a busy GPU): staged segments stay queued."""

    def _to_host(self, array, host):
        super()._to_host(array, host)
        return types.SimpleNamespace(done=False, synchronize=lambda: None)


def _slot_link(transport, device):
    from ringcomm.link import Link, Stats
    return Link(transport, ranks=(0, 1), rank=0, comm_id=3, space=1, seq=0, sig=bytes(16),
                dtype=np.float32, segment_bytes=64, deadline=0.0, what="test", stats=Stats(),
                device=device)


def test_a_segment_goes_through_its_lane_slot_and_a_failed_call_gives_the_slot_back():
    from ringcomm.collective import _drained
    transport, device = _SlotTransport(), _SlowCopies(slot_bytes=64)
    device.activate()
    link = _slot_link(transport, device)
    assert transport.before_unmap, "the device did not ask to hear before the lanes are unmapped"
    link.send(1, 0, 0, np.arange(4, dtype=np.float32))
    assert transport.done == [] and link.staged_bytes == 16  # its copy is not done yet
    link.drain()
    assert transport.done == [("sent", 1, 5, np.arange(4, dtype=np.float32).tobytes())]
    assert device.slot_copies == 1
    transport.done.clear()

    def fails():
        link.send(1, 0, 1, np.ones(4, np.float32))
        raise RuntimeError("the call failed")
    with pytest.raises(RuntimeError, match="failed"):
        _drained(link, fails)
    assert transport.done == [("given back", 1, 5)] and link.staged_bytes == 0
