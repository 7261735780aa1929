"""ThreadGuard's bookkeeping, on or off: who is inside, which async works are unfinished,
and wait_idle (what a group's close(grace=...) waits for)."""
import threading
import time

import pytest

from ringcomm.errors import CommError, Revoked
from ringcomm.threads import ThreadGuard


class FakeWork:
    def __init__(self):
        self.done = False

    def is_completed(self):
        return self.done


def in_other_thread(fn):
    t = threading.Thread(target=fn)
    t.start()
    t.join()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("enabled", [True, False])
def test_wait_idle_waits_for_another_threads_async_work(enabled):
    guard = ThreadGuard("g", revoke=lambda why: None)
    guard.enabled = enabled
    work = FakeWork()

    def issue():
        guard.leave(guard.enter("all_reduce"), work)
    in_other_thread(issue)
    assert not guard.wait_idle(time.monotonic() + 0.05)  # in flight: not idle at the deadline
    threading.Timer(0.1, lambda: setattr(work, "done", True)).start()
    began = time.monotonic()
    assert guard.wait_idle(time.monotonic() + 10)
    assert 0.05 < time.monotonic() - began < 5


@pytest.mark.timeout(30)
def test_guard_off_lets_a_second_thread_in_and_still_counts_it():
    revoked = []
    guard = ThreadGuard("g", revoke=revoked.append)
    guard.enabled = False
    inside = threading.Event()
    release = threading.Event()

    def blocking_call():
        user = guard.enter("all_reduce")
        inside.set()
        release.wait(10)
        guard.leave(user)
    t = threading.Thread(target=blocking_call)
    t.start()
    inside.wait(10)
    guard.leave(guard.enter("broadcast"))  # no refusal with the guard off
    guard.check_idle("close()")            # nor from check_idle
    assert not guard.wait_idle(time.monotonic() + 0.05)
    release.set()
    t.join()
    assert guard.wait_idle(time.monotonic() + 5) and not revoked


@pytest.mark.timeout(30)
def test_guard_on_after_unguarded_use_still_sees_the_work_in_flight():
    revoked = []
    guard = ThreadGuard("g", revoke=revoked.append)
    guard.enabled = False
    work = FakeWork()
    in_other_thread(lambda: guard.leave(guard.enter("all_reduce"), work))
    guard.enabled = True
    with pytest.raises(CommError):
        guard.check_idle("close()")
    with pytest.raises(Revoked):
        guard.enter("all_reduce")
    assert len(revoked) == 1 and "another has a collective in progress" in revoked[0]
    work.done = True
    guard.leave(guard.enter("all_reduce"))


@pytest.mark.timeout(30)
def test_the_guard_keeps_no_work_alive():
    """Only weak references: a work (and the result it holds) the caller dropped is freed,
    and one the engine no longer holds counts as ended."""
    import gc
    import weakref
    guard = ThreadGuard("g", revoke=lambda why: None)
    work = FakeWork()
    guard.leave(guard.enter("all_reduce"), work)
    alive = weakref.ref(work)
    assert not guard.wait_idle(time.monotonic() + 0.02)
    del work
    gc.collect()
    assert alive() is None and guard.wait_idle(time.monotonic() + 5)
