"""The engine on an in-process transport: the communication thread, done-callbacks, and
where a wait may spin."""
import threading
import time

import pytest

from ringcomm.engine import Engine
from ringcomm.session import Session
from ringcomm.transport.local import LocalHub

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def engine():
    e = Engine(lambda: Session(LocalHub(1).transport(0)), name="test-engine")
    yield e
    e.close()


def submit(engine, fn):
    with engine.lock:
        return engine.submit(fn, fn.__name__)


def test_a_constructor_descheduled_after_start_up_leaves_the_engine_working(monkeypatch):
    """On a loaded machine the thread that builds the engine may not run for longer than the
    communication thread's idle pump waits: that pump must find the transport already, or
    the engine dies at start-up (an honest job failed so beside two busy loops)."""
    from ringcomm import engine as engine_module
    wait = engine_module.Work.wait

    def late_wait(self, *args, **kwargs):
        if self.what == "start-up":
            time.sleep(3 * engine_module.IDLE_PUMP_S)  # the idle pump runs meanwhile
        return wait(self, *args, **kwargs)
    monkeypatch.setattr(engine_module.Work, "wait", late_wait)
    e = Engine(lambda: Session(LocalHub(1).transport(0)), name="test-late-engine")
    try:
        assert not e.closed
        assert submit(e, lambda session: session is e.session).wait() is True
    finally:
        e.close()


def test_only_a_waited_for_thread_spins(engine):
    """The caller's thread spins (it runs synchronous calls inline); the communication thread
    spins only while some thread is blocked in Work.wait, else it leaves the core to compute."""
    assert engine.eager() and engine.session.wire.eager()

    def unwatched(transport):
        return transport.wire.eager()
    quiet = submit(engine, unwatched)
    deadline = time.monotonic() + 5
    while not quiet.is_completed() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert quiet.wait() is False

    def watched(transport):
        time.sleep(0.3)  # the test's thread is in wait() by now
        return transport.wire.eager()
    assert submit(engine, watched).wait() is True


def test_done_callbacks_run_once_where_the_work_finishes(engine):
    seen = []
    gate = threading.Event()
    work = submit(engine, lambda _: gate.wait(5))
    work.add_done_callback(lambda w: seen.append((threading.current_thread().name, w.is_completed())))
    gate.set()
    work.wait()
    work.add_done_callback(lambda w: seen.append((threading.current_thread().name, w.is_completed())))
    assert seen == [("test-engine", True), (threading.current_thread().name, True)]
