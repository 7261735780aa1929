"""Shared-memory lanes on their own, in one process: a slot carries exactly the bytes put in
it, stays taken while any array over it lives (also against a forked child), bad notices
and suspicious files are refused, and nothing is left behind."""
import errno
import gc
import os

import numpy as np
import pytest

from ringcomm.errors import FrameError
from ringcomm.transport import shm
from ringcomm.transport.shm import NOTICE, InLanes, OutLane, lane_path

pytestmark = pytest.mark.timeout(30)
SLOT = 4096
TOKEN = "ab" * 16


@pytest.fixture
def lane(tmp_path):
    """(sender's lane 0 -> 1, receiver's lanes with it mapped)."""
    out = OutLane(lane_path(str(tmp_path), TOKEN, 0, 1), 2, SLOT)
    inl = InLanes(2, SLOT)
    inl.open(0, out.path)
    yield out, inl
    inl.close()
    out.close()


def test_bytes_arrive_read_only(lane):
    out, inl = lane
    data = np.arange(1000, dtype=np.float32)
    got = inl.take(0, out.put(data.view(np.uint8)), data.nbytes)
    np.testing.assert_array_equal(np.frombuffer(got, np.float32), data)
    assert not got.flags.writeable
    with pytest.raises(ValueError):
        np.frombuffer(got, np.float32)[0] = 1


def test_the_name_is_gone_once_opened_and_private_until_then(tmp_path):
    out = OutLane(lane_path(str(tmp_path), TOKEN, 0, 1), 2, SLOT)
    assert os.listdir(tmp_path) == [os.path.basename(out.path)]
    assert os.stat(out.path).st_mode & 0o777 == 0o600  # no other user may map it
    InLanes(2, SLOT).open(0, out.path)
    assert os.listdir(tmp_path) == []  # nothing left behind if either process dies now
    out.close()


def test_a_slot_stays_taken_while_any_view_of_it_lives(lane):
    out, inl = lane
    first = inl.take(0, out.put(np.full(SLOT, 1, np.uint8)), SLOT)
    second = inl.take(0, out.put(np.full(SLOT, 2, np.uint8)), SLOT)
    assert out.put(np.full(SLOT, 3, np.uint8)) is None  # both slots in use: fall back
    assert out.fallbacks == 1
    # what an algorithm does: a typed view, then a slice of it; the raw array is dropped
    typed = np.frombuffer(first, np.float32)[10:20]
    del first
    gc.collect()
    assert out.put(np.full(SLOT, 3, np.uint8)) is None, "slot freed while a view still reads it"
    assert np.all(typed.view(np.uint8) == 1)
    del typed
    notice = out.put(np.full(SLOT, 4, np.uint8))
    assert notice is not None
    assert NOTICE.unpack(notice)[0] == 0  # the freed slot was reused
    assert np.all(second == 2), "the slot still in use was overwritten"
    assert np.all(inl.take(0, notice, SLOT) == 4)


def test_slots_cycle_through_many_generations(lane):
    out, inl = lane
    for i in range(50):
        payload = np.full(100 + i, i, np.uint8)
        got = inl.take(0, out.put(payload), payload.nbytes)
        np.testing.assert_array_equal(got, payload)
        del got
    assert out.fallbacks == 0


def test_a_forked_child_cannot_free_the_parents_slot(lane):
    out, inl = lane
    held = inl.take(0, out.put(np.full(SLOT, 7, np.uint8)), SLOT)
    out.put(np.full(SLOT, 8, np.uint8))  # the other slot, never freed
    pid = os.fork()
    if pid == 0:  # drops its copy of the view, then exits the normal way
        del held
        gc.collect()
        os._exit(0)
    os.waitpid(pid, 0)
    assert out.put(np.full(SLOT, 9, np.uint8)) is None, "the child's garbage freed the parent's slot"
    assert np.all(held == 7)


@pytest.mark.parametrize("change", ["slot", "length", "size", "stranger"])
def test_bad_notices_are_refused(lane, change):
    out, inl = lane
    notice, src, nbytes = out.put(np.zeros(16, np.uint8)), 0, 16
    slot, _, generation = NOTICE.unpack(notice)
    if change == "slot":
        notice = NOTICE.pack(2, 0, generation)
    elif change == "length":
        nbytes = SLOT + 1
    elif change == "size":
        notice = notice + b"\0"
    else:
        src = 3  # no lane from that rank
    with pytest.raises(FrameError):
        inl.take(src, notice, nbytes)


def test_a_full_dev_shm_makes_segments_fall_back_without_retrying_at_once(lane, monkeypatch):
    out, _ = lane
    calls = []

    def no_space(fd, offset, length):
        calls.append(offset)
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(shm.os, "posix_fallocate", no_space)
    assert out.put(np.zeros(16, np.uint8)) is None
    assert out.put(np.zeros(16, np.uint8)) is None
    assert out.fallbacks == 2 and out.puts == 0
    assert len(calls) == 1, "a failed reservation was retried at once"


def test_the_lowest_free_slot_is_filled_first(tmp_path):
    # a slot used a moment ago is still in the cache of both ends
    out = OutLane(lane_path(str(tmp_path), TOKEN, 0, 1), 3, SLOT)
    inl = InLanes(3, SLOT)
    inl.open(0, out.path)
    first = inl.take(0, out.put(np.zeros(8, np.uint8)), 8)
    second = inl.take(0, out.put(np.zeros(8, np.uint8)), 8)
    del first
    assert NOTICE.unpack(out.put(np.zeros(8, np.uint8)))[0] == 0  # not slot 2, next in turn
    assert out.puts == 3
    del second
    inl.close()
    out.close()


def test_only_a_private_regular_file_of_the_right_size_is_mapped(tmp_path):
    out = OutLane(lane_path(str(tmp_path), TOKEN, 0, 1), 2, SLOT)
    link = tmp_path / "link"
    link.symlink_to(out.path)
    with pytest.raises(OSError):
        InLanes(2, SLOT).open(0, str(link))  # never follows a symlink
    with pytest.raises(ValueError, match="bytes"):
        InLanes(3, SLOT).open(0, out.path)   # another slot count: another size
    os.chmod(out.path, 0o644)
    with pytest.raises(ValueError, match="private"):
        InLanes(2, SLOT).open(0, out.path)
    out.close()
    assert os.listdir(tmp_path) == ["link"]


def test_lane_names_come_only_from_tokens():
    with pytest.raises(ValueError):
        lane_path("/dev/shm", "../../etc/passwd", 0, 1)


def test_a_taken_slot_is_filled_in_place_then_announced_or_given_back(lane):
    """What a device does: take a slot, copy into it, announce it; a slot taken for a
    segment that is never sent is given back, else the lane would lose it for good."""
    out, inl = lane
    slot, window = out.take_slot()
    assert window.flags.writeable and window.nbytes == SLOT
    window[:8] = np.arange(8, dtype=np.uint8)
    assert out.take_slot()[0] != slot, "a taken slot was handed out again"
    assert out.take_slot() is None  # both taken
    got = inl.take(0, out.notice(slot), 8)
    assert np.array_equal(got, np.arange(8, dtype=np.uint8))
    whole = inl.slot_of(np.frombuffer(got, np.uint8)[3:5])
    assert whole.nbytes == SLOT and np.shares_memory(whole, got) and not whole.flags.writeable
    assert inl.slot_of(np.zeros(8, np.uint8)) is None  # memory outside the lanes
    out.give_back(1 - slot)  # the other slot, taken and never announced
    again, other = out.take_slot()
    assert again == 1 - slot
    other[:4] = 9
    later = inl.take(0, out.notice(again), 4)
    assert np.shares_memory(inl.slot_of(later), later) and inl.slot_of(later)[0] == 9
    del later
    del got, whole
    gc.collect()
    assert out.take_slot()[0] == slot  # acknowledged by the receiver
