"""Shared-memory lanes on their own, in one process: a slot carries exactly the bytes put in
it, stays taken while any array over it lives, and bad notices are refused."""
import gc
import os

import numpy as np
import pytest

from ringcomm.errors import FrameError
from ringcomm.transport.shm import NOTICE, InLanes, OutLane

pytestmark = pytest.mark.timeout(30)
SLOT = 4096


@pytest.fixture
def lanes(tmp_path):
    out = OutLane(2, SLOT, directory=str(tmp_path))
    yield out, InLanes(2, SLOT, directory=str(tmp_path)), tmp_path
    out.close()


def test_bytes_arrive_read_only_and_the_name_is_gone_once_opened(lanes, tmp_path):
    out, inl, _ = lanes
    data = np.arange(1000, dtype=np.float32)
    notice = out.put(data.view(np.uint8))
    assert os.listdir(tmp_path) == [out.name]
    got = inl.take(0, notice, data.nbytes)
    assert os.listdir(tmp_path) == []  # nothing left behind if either process dies now
    np.testing.assert_array_equal(np.frombuffer(got, np.float32), data)
    assert not got.flags.writeable
    with pytest.raises(ValueError):
        np.frombuffer(got, np.float32)[0] = 1


def test_a_slot_stays_taken_while_any_view_of_it_lives(lanes):
    out, inl, _ = lanes
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


def test_slots_cycle_through_many_generations(lanes):
    out, inl, _ = lanes
    for i in range(50):
        payload = np.full(100 + i, i, np.uint8)
        got = inl.take(0, out.put(payload), payload.nbytes)
        np.testing.assert_array_equal(got, payload)
        del got
    assert out.fallbacks == 0


@pytest.mark.parametrize("change", ["name", "slot", "length", "size"])
def test_bad_notices_are_refused(lanes, change):
    out, inl, tmp_path = lanes
    notice = out.put(np.zeros(16, np.uint8))
    slot, _, generation, name = NOTICE.unpack(notice)
    nbytes = 16
    if change == "name":
        notice = NOTICE.pack(slot, 0, generation, b"../../etc/passwd")
    elif change == "slot":
        notice = NOTICE.pack(2, 0, generation, name)
    elif change == "length":
        nbytes = SLOT + 1
    else:
        os.truncate(tmp_path / out.name, 10)
    with pytest.raises(FrameError):
        inl.take(0, notice, nbytes)


def test_a_lane_that_was_never_opened_is_removed_at_close(tmp_path):
    out = OutLane(4, SLOT, directory=str(tmp_path))
    assert os.listdir(tmp_path) == [out.name]
    assert os.stat(tmp_path / out.name).st_mode & 0o777 == 0o600  # no other user may map it
    out.close()
    assert os.listdir(tmp_path) == []


def test_a_missing_lane_is_a_frame_error(tmp_path):
    out = OutLane(1, SLOT, directory=str(tmp_path))
    notice = out.put(np.zeros(8, np.uint8))
    out.close()
    with pytest.raises(FrameError, match="cannot be opened"):
        InLanes(1, SLOT, directory=str(tmp_path)).take(0, notice, 8)
