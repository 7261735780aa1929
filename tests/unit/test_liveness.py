"""ringcomm.transport.liveness on real processes: what a rank announces, which peers it watches,
a pidfd and /proc each seeing a process end (a zombie too, and a pid reused is no survivor),
and what a child forked from a rank may no longer touch."""
import os
import select
import signal
import subprocess
import sys
import time

import pytest
import zmq

from ringcomm.errors import CommError
from ringcomm.session import Session
from ringcomm.transport import liveness
from ringcomm.transport.frame import Key
from ringcomm.transport.peer_channels import PeerChannels
from ringcomm.transport.zmq_transport import ZmqTransport

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def sleeper():
    """A child process that sleeps until killed (never reaped by the fixture's user)."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    yield proc
    proc.kill()
    proc.wait()


def test_identity_names_this_process():
    me = liveness.identity()
    with open("/proc/self/stat") as f:
        assert me["start"] == int(f.read().rsplit(")", 1)[1].split()[19])  # field 22
    assert me["pid"] == os.getpid() and me["pidns"] == os.readlink("/proc/self/ns/pid")


def test_only_same_host_same_namespace_peers_with_a_usable_announcement_are_watched(monkeypatch):
    me = {"host": "h", "pid": 10, "start": 5, "pidns": "pid:[1]"}
    table = [me,
             {"host": "h", "pid": 11, "start": 6, "pidns": "pid:[1]"},     # watched
             {"host": "other", "pid": 12, "start": 6, "pidns": "pid:[1]"},  # another host
             {"host": "h", "pid": 13, "start": 6, "pidns": "pid:[2]"},      # another namespace
             {"host": "h", "pid": True, "start": 6, "pidns": "pid:[1]"},    # malformed
             {"host": "h", "pid": 15, "start": "6", "pidns": "pid:[1]"},
             {"host": "h", "pid": 10, "start": 6, "pidns": "pid:[1]"},      # claims this pid
             {"host": "h", "ipc": "ipc://x"}]                                # announced nothing
    assert liveness.watched(0, table) == {1: (11, 6)}
    monkeypatch.setattr(liveness, "WATCH", False)
    assert liveness.watched(0, table) == {}


def _readable(fds, within):
    poller = select.poll()
    for fd in fds:
        poller.register(fd, select.POLLIN)
    return [fd for fd, _ in poller.poll(within * 1000)]


def test_a_pidfd_turns_readable_when_the_process_is_killed(sleeper):
    watch = liveness.Watch({3: (sleeper.pid, liveness.start_time(sleeper.pid))})
    try:
        assert list(watch.fds.values()) == [3] and not watch.gone and not watch.polled
        assert _readable(watch.fds, 0.2) == []
        sleeper.send_signal(signal.SIGKILL)  # a zombie until reaped: dead all the same
        [fd] = _readable(watch.fds, 5)
        assert watch.exited(fd) == 3 and not watch.fds
    finally:
        watch.close()


def test_a_pid_whose_start_time_differs_is_gone_at_once(sleeper):
    watch = liveness.Watch({1: (sleeper.pid, liveness.start_time(sleeper.pid) - 1)})  # reused
    assert watch.gone == [1] and not watch.fds


def test_without_pidfd_proc_is_read(sleeper, monkeypatch):
    def refused(pid):
        raise OSError(38, "pidfd_open not implemented")
    monkeypatch.setattr(os, "pidfd_open", refused)
    watch = liveness.Watch({2: (sleeper.pid, liveness.start_time(sleeper.pid))})
    assert watch.polled and not watch.fds and watch.look() == []
    sleeper.send_signal(signal.SIGKILL)
    deadline = time.monotonic() + 5
    while not (ended := watch.look()) and time.monotonic() < deadline:  # state Z, then gone
        time.sleep(0.02)
    assert ended == [2] and not watch.polled


def test_a_forked_child_closes_its_bells_and_cannot_use_the_transport(tmp_path):
    # the bell: a sender end (this process) and its receiver end; a child holds a copy of both
    channels = PeerChannels(ranks_on_host=2)
    out = channels.create(1, str(tmp_path / "channel"))
    inbound = PeerChannels(ranks_on_host=2)
    bell = inbound.open(0, str(tmp_path / "channel"))
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.bind("inproc://liveness-fork")
    transport = ZmqTransport(0, 1, ctx, pull, ["inproc://liveness-fork"])
    transport.same_host.channels = channels  # (a one-rank world has none of its own)
    session = Session(transport)  # what the layers above call: it must reach the refusals
    read, write = os.pipe()
    go_read, go_write = os.pipe()  # closed by this process when the child may exit
    pid = os.fork()
    if pid == 0:  # the child: its bells are closed, every use refused
        os.close(read)
        os.close(go_write)
        try:
            try:
                session.send(0, Key(0, 0, 0, 0, 0), bytes(16), b"x")
                said = b"sent"
            except CommError as exc:
                said = b"refused" if b"forked" in str(exc).encode() else b"other"
            session.close()  # a no-op: nothing of the parent's is touched
            os.write(write, said + (b" closed" if out.bell == -1 else b" open"))
            os.read(go_read, 1)  # alive, holding whatever it did not close, until told
        finally:
            os._exit(0)
    os.close(write)
    os.close(go_read)
    try:
        assert os.read(read, 100) == b"refused closed"
        # the sender end dies here while the child lives: the child kept no copy of it, so
        # the bell hangs up
        os.close(out.bell)
        out.bell = -1
        events = select.poll()
        events.register(bell, select.POLLIN)
        assert any(e & select.POLLHUP for _, e in events.poll(1000))
        assert session.flush(time.monotonic() + 1, "flush") is None  # the parent's is intact
    finally:
        os.close(go_write)
        os.waitpid(pid, 0)
        os.close(read)
        inbound.close()
        transport.same_host.channels = None
        channels.close()
        session.close()
