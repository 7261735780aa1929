"""The shared-memory channel (ringcomm.transport.channel) between real processes: order and
contents, wrap-around, a full channel, a sleeping receiver woken by its bell, a peer that
dies while the other spins or sleeps (its bell hangs up), the channel's files, and ranks that
outnumber the cores."""
import contextlib
import os
import select
import signal
import stat
import struct
import threading
import time

import numpy as np
import pytest

from ringcomm.errors import CommTimeout, FrameError, PeerLost
from ringcomm.transport import channel
from ringcomm.transport.channel import Channel, hush
from ringcomm.transport.peer_channels import PeerChannels

pytestmark = [pytest.mark.timeout(60),
              pytest.mark.skipif(not channel.supported(), reason="the channel needs Linux on x86-64")]


def message(i):
    """Message i: a length that walks through 0..300 bytes, contents that name i."""
    n = (i * 37) % 301
    return (np.arange(n, dtype=np.uint32) * 2654435761 + i).astype(np.uint8).tobytes()


def in_child(fn):
    """Fork; the child runs ``fn()`` and exits 0 (1 if it raised). Returns the pid."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            fn()
            code = 0
        finally:
            os._exit(code)
    return pid


def exited_ok(pid, timeout=30):
    """Whether child ``pid`` exited 0 within ``timeout`` s (one that has not is killed)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return status == 0
        time.sleep(0.01)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return False


def reap(pid):
    """Kill child ``pid`` if it still runs, and collect it."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, 0)


def alive(pid):
    def check():
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            raise PeerLost(f"process {pid} ended", rank=1)
    return check


@pytest.mark.parametrize("capacity, spin", [(1 << 16, 50e-6), (256, 0.0)])
def test_messages_arrive_in_order_and_intact_across_wrap_around(capacity, spin):
    """256 bytes of ring and messages up to 128 bytes: the ring wraps (with skips) every few
    messages and the sender often finds it full."""
    tx, rx = Channel.pair(capacity, spin)
    count = 3000
    limit = capacity // 2 - 8  # the largest message: it fits wherever the ring stands

    def send_all():
        deadline = time.monotonic() + 30  # a failed receiver must not leave this child behind
        for i in range(count):
            tx.send(message(i)[:limit], deadline=deadline)
    pid = in_child(send_all)
    for i in range(count):
        got = rx.recv(check=alive(pid), deadline=time.monotonic() + 20)
        assert bytes(got) == message(i)[:limit], i
        rx.release()
    assert exited_ok(pid)
    assert rx.poll() is None


def test_every_dtype_round_trips_bitwise():
    tx, rx = Channel.pair(1 << 16)
    rng = np.random.default_rng(1)
    for dtype in ("float16", "float32", "float64", "int8", "int16", "int32", "int64",
                  "uint8", "uint16", "uint32", "uint64"):
        x = rng.integers(0, 256, 4096, dtype=np.uint8).view(dtype)
        tx.send(x)
        got = rx.recv().view(dtype)
        assert got.tobytes() == x.tobytes()
        rx.release()


def test_a_full_channel_makes_the_sender_wait_then_go_on():
    tx, rx = Channel.pair(256, spin=0.0)
    for _ in range(3):
        tx.send(b"x" * 64)  # 3 x 72 bytes: 40 left, a 64-byte message does not fit
    with pytest.raises(CommTimeout, match="room in the channel"):
        tx.send(b"y" * 64, deadline=time.monotonic() + 0.05)
    done = threading.Event()

    def late_send():
        tx.send(b"z" * 64, deadline=time.monotonic() + 10)
        done.set()
    thread = threading.Thread(target=late_send, daemon=True)
    thread.start()
    time.sleep(0.05)
    assert not done.is_set()  # still waiting for room
    assert bytes(rx.recv()) == b"x" * 64
    rx.release()
    thread.join(5)
    assert done.is_set()
    for expected in (b"x" * 64, b"x" * 64, b"z" * 64):
        assert bytes(rx.recv()) == expected
        rx.release()


def test_the_largest_message_fits_wherever_the_ring_stands_and_a_larger_is_refused():
    tx, _ = Channel.pair(256)
    assert tx.largest == 120
    with pytest.raises(ValueError, match="does not fit"):
        tx.send(b"x" * 121)
    for offset in range(8, 256, 8):  # an empty ring whose position is `offset`
        tx, rx = Channel.pair(256)
        for record in (min(offset, 128), offset - min(offset, 128)):  # records of these sizes
            if record:
                tx.send(b"f" * (record - 8))
                rx.recv()
                rx.release()
        assert tx.try_send(b"L" * 120), offset
        assert bytes(rx.recv()) == b"L" * 120
        rx.release()


def test_a_sleeping_receiver_is_woken_by_the_sender_not_by_its_timeout(monkeypatch):
    """With one sleep lasting up to 2 s, a message sent 0.2 s into the wait arrives at once:
    the bell works across processes."""
    monkeypatch.setattr(channel, "SLEEP_SLICE", 2.0)
    tx, rx = Channel.pair(1 << 12, spin=0.0)

    def send_later():
        time.sleep(0.2)
        tx.send(b"wake")
    pid = in_child(send_later)
    start = time.monotonic()
    assert bytes(rx.recv(deadline=start + 10)) == b"wake"
    assert time.monotonic() - start < 1.0
    assert exited_ok(pid)


@pytest.mark.parametrize("spin", [0.0, 0.5])
def test_a_peer_that_dies_is_noticed_while_spinning_or_sleeping(spin):
    """The sender is SIGKILLed mid-wait: the receiver's check() sees it within a sleep slice
    after its spin budget."""
    tx, rx = Channel.pair(1 << 12, spin=spin)
    pid = in_child(lambda: time.sleep(30))
    killer = threading.Timer(0.1, os.kill, (pid, signal.SIGKILL))
    killer.start()
    start = time.monotonic()
    with pytest.raises(PeerLost):
        rx.recv(check=alive(pid), deadline=start + 20)
    assert time.monotonic() - start < 0.1 + spin + 0.5
    killer.join()  # no thread left running when the next test forks


def test_ranks_that_outnumber_the_cores_ping_pong_without_starving():
    """Four processes (two ping-pong pairs) on however few cores this machine has, with the
    spin budget for four ranks: 2000 round trips per pair finish in bounded time."""
    spin = channel.default_spin(4)
    if len(os.sched_getaffinity(0)) < 4:
        assert spin == 0.0
    rounds = 2000
    pids = []
    for _ in range(2):
        ping, pong_rx = Channel.pair(1 << 12, spin)
        pong, ping_rx = Channel.pair(1 << 12, spin)

        def echo(rx=pong_rx, tx=pong):
            for _ in range(rounds):
                got = bytes(rx.recv(deadline=time.monotonic() + 30))
                rx.release()
                tx.send(got)

        def drive(tx=ping, rx=ping_rx):
            for i in range(rounds):
                tx.send(i.to_bytes(4, "little"))
                assert int.from_bytes(bytes(rx.recv(deadline=time.monotonic() + 30)), "little") == i
                rx.release()
        pids += [in_child(echo), in_child(drive)]
    start = time.monotonic()
    assert all(exited_ok(pid) for pid in pids)
    assert time.monotonic() - start < 40


def test_files_are_private_checked_and_gone_once_opened(tmp_path):
    path = str(tmp_path / "ch")
    tx = Channel.create(path, 1 << 12)
    assert os.stat(path).st_mode & 0o777 == 0o600
    with pytest.raises(FileExistsError):
        Channel.create(path, 1 << 12)
    with pytest.raises(ValueError, match="not a channel"):
        Channel.open(path, 1 << 13)
    os.chmod(path, 0o644)
    with pytest.raises(ValueError, match="not a private regular file"):
        Channel.open(path, 1 << 12)
    os.chmod(path, 0o600)
    rx = Channel.open(path, 1 << 12)
    assert not os.path.exists(path)  # both ends hold the mapping; the name is gone
    tx.send(b"over ", b"a file")
    assert bytes(rx.recv()) == b"over a file"
    rx.release()


def test_try_send_never_waits_and_a_dozing_receiver_is_seen():
    tx, rx = Channel.pair(256)
    assert all(tx.try_send(b"x" * 64) for _ in range(3))
    assert tx.try_send(b"y" * 64) is False  # full: the caller sends another way
    assert not tx.receiver_dozing()
    rx.doze()
    assert tx.receiver_dozing() and rx.ready()
    rx.doze(False)
    assert not tx.receiver_dozing()


@pytest.mark.parametrize("length", [1 << 40, 64])
def test_a_record_that_breaks_the_format_is_refused_not_followed(length):
    """A length no sender writes, or one that runs past what the head published."""
    tx, rx = Channel.pair(256)
    tx.send(b"fine")
    struct.pack_into("@Q", tx._map, channel.HEADER, length)
    with pytest.raises(FrameError, match="broke the channel's format"):
        rx.poll()
    channels = PeerChannels(2)
    channels._in[3] = rx
    assert list(channels.messages()) == [] and 3 in channels.broken  # dropped, not raised again
    assert list(channels.messages()) == []


# -- the bell: its files, its hang-up, and hush() ----------------------------------------------

@pytest.mark.timeout(30)
def test_create_makes_the_file_and_a_private_fifo_bell_and_open_removes_both(tmp_path):
    path = str(tmp_path / "ch")
    tx = Channel.create(path, 1 << 12)
    bell = os.stat(path + "-bell", follow_symlinks=False)
    assert stat.S_ISREG(os.stat(path).st_mode) and os.stat(path).st_mode & 0o777 == 0o600
    assert stat.S_ISFIFO(bell.st_mode), "the bell is not a FIFO"
    assert bell.st_mode & 0o777 == 0o600 and bell.st_uid == os.geteuid()
    assert sorted(os.listdir(tmp_path)) == ["ch", "ch-bell"]  # nothing else
    rx = Channel.open(path, 1 << 12, spin=0.0)
    assert os.listdir(tmp_path) == [], "open left a name behind"
    assert stat.S_ISFIFO(os.fstat(rx.bell).st_mode) and stat.S_ISFIFO(os.fstat(tx.bell).st_mode)
    # the ends share the FIFO: a ring reaches the receiver's end (and a sleeping recv wakes)
    tx.ring()
    assert os.read(rx.bell, 16) == b"\x01"
    tx.send(b"through ", b"the file")
    assert bytes(rx.recv()) == b"through the file"
    rx.release()
    tx.close()
    rx.close()


@pytest.mark.timeout(30)
def test_open_refuses_a_bell_that_is_not_a_private_fifo(tmp_path):
    path = str(tmp_path / "ch")
    tx = Channel.create(path, 1 << 12)
    os.chmod(path + "-bell", 0o644)  # others may read it
    with pytest.raises(ValueError, match="-bell is not a private FIFO"):
        Channel.open(path, 1 << 12)
    assert os.path.exists(path) and os.path.exists(path + "-bell"), "a refused open removed the names"
    os.chmod(path + "-bell", 0o620)  # others... the group may write it
    with pytest.raises(ValueError, match="-bell is not a private FIFO"):
        Channel.open(path, 1 << 12)
    os.chmod(path + "-bell", 0o600)
    Channel.open(path, 1 << 12).close()  # the same files once private: accepted
    tx.close()

    tx = Channel.create(path, 1 << 12)
    os.unlink(path + "-bell")
    with open(path + "-bell", "wb"):  # a private regular file where the FIFO was
        pass
    os.chmod(path + "-bell", 0o600)
    with pytest.raises(ValueError, match="-bell is not a private FIFO"):
        Channel.open(path, 1 << 12)
    os.unlink(path + "-bell")
    os.mkfifo(str(tmp_path / "elsewhere"), 0o600)
    os.symlink(str(tmp_path / "elsewhere"), path + "-bell")  # a link to a private FIFO
    with pytest.raises(OSError):  # O_NOFOLLOW: never followed
        Channel.open(path, 1 << 12)
    os.unlink(path + "-bell")
    with pytest.raises(FileNotFoundError):  # no bell at all
        Channel.open(path, 1 << 12)
    tx.close()


@pytest.mark.timeout(30)
def test_a_failed_create_leaves_none_of_its_files_behind(tmp_path):
    path = str(tmp_path / "ch")
    with open(path + "-bell", "wb"):  # the bell's name is taken
        pass
    with pytest.raises(FileExistsError):
        Channel.create(path, 1 << 12)
    assert os.listdir(tmp_path) == ["ch-bell"]  # the file that was there is left alone
    os.unlink(path + "-bell")
    os.mkfifo(path + "-bell", 0o600)  # taken by a FIFO: the same
    with pytest.raises(FileExistsError):
        Channel.create(path, 1 << 12)
    assert os.listdir(tmp_path) == ["ch-bell"]
    # the names are free again: create works, and a second create of the same path does not
    # touch the first one's files
    if os.path.exists(path + "-bell"):
        os.unlink(path + "-bell")
    tx = Channel.create(path, 1 << 12)
    with pytest.raises(FileExistsError):
        Channel.create(path, 1 << 12)
    assert sorted(os.listdir(tmp_path)) == ["ch", "ch-bell"]
    Channel.open(path, 1 << 12).close()
    tx.close()


@pytest.mark.timeout(30)
def test_a_create_refused_for_its_capacity_leaves_no_files(tmp_path):
    path = str(tmp_path / "ch")
    with pytest.raises(ValueError, match="power of two"):
        Channel.create(path, 100)
    assert os.listdir(tmp_path) == []


@pytest.mark.timeout(30)
def test_hush_empties_the_bell_and_says_whether_its_sender_is_still_there():
    read, write = os.pipe()
    os.set_blocking(read, False)
    try:
        assert hush(read) is True  # empty, writer alive
        os.write(write, b"\x01" * 10000)  # more than one read's worth
        assert hush(read) is True
        with pytest.raises(BlockingIOError):  # emptied
            os.read(read, 1)
        assert select.select([read], [], [], 0)[0] == []
        os.write(write, b"\x01")
        os.close(write)
        write = -1
        assert hush(read) is False  # the byte, then end of file: the sender is gone
        assert hush(read) is False
    finally:
        os.close(read)
        if write >= 0:
            os.close(write)


def _sender_in_child(path, capacity, then):
    """Fork a child that creates the channel at ``path`` (so that it holds the bell's only
    write end), tells the parent, then runs ``then(tx)``; returns the child's pid once the
    files exist. The parent opens the receiver's end itself."""
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.close(ready_r)
            tx = Channel.create(path, capacity)
            os.write(ready_w, b"k")
            os.close(ready_w)
            then(tx)
            code = 0
        finally:
            os._exit(code)
    os.close(ready_w)
    try:
        if not select.select([ready_r], [], [], 20)[0] or os.read(ready_r, 1) != b"k":
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            raise AssertionError("the child did not create the channel")
    finally:
        os.close(ready_r)
    return pid


@pytest.mark.timeout(30)
def test_a_receiver_asleep_on_the_bell_wakes_at_once_when_its_sender_is_killed(tmp_path, monkeypatch):
    """One sleep may last 5 s; the sender (the only holder of the bell's write end) is
    SIGKILLed 0.3 s into it: the hang-up ends the sleep, and check() then raises, long
    before the slice would have ended."""
    monkeypatch.setattr(channel, "SLEEP_SLICE", 5.0)
    path = str(tmp_path / "ch")
    pid = _sender_in_child(path, 1 << 12, lambda tx: time.sleep(30))
    rx = Channel.open(path, 1 << 12, spin=0.0)
    checks = []

    def check():
        checks.append(time.monotonic())
        alive(pid)()
    killer = threading.Timer(0.3, os.kill, (pid, signal.SIGKILL))
    start = time.monotonic()
    killer.start()
    try:
        with pytest.raises(PeerLost):
            rx.recv(check=check, deadline=start + 20)
        elapsed = time.monotonic() - start
    finally:
        killer.cancel()
        killer.join()
        reap(pid)
    assert 0.25 < elapsed < 0.3 + 1.0, elapsed  # slept until the kill; woke long before 5 s
    assert checks[0] - start > 0.25, "check() ran before the kill: the receiver did not sleep"
    rx.close()


@pytest.mark.timeout(30)
def test_a_sleeping_receiver_gets_what_a_killed_sender_sent_before_it_died(tmp_path, monkeypatch):
    """The sender sends while the receiver sleeps (the bell rings), then dies: the message
    arrives, and the next recv wakes on the hang-up and raises from check()."""
    monkeypatch.setattr(channel, "SLEEP_SLICE", 5.0)
    path = str(tmp_path / "ch")

    def send_then_die(tx):
        time.sleep(0.2)
        tx.send(b"last words")
        os.kill(os.getpid(), signal.SIGKILL)
    pid = _sender_in_child(path, 1 << 12, send_then_die)
    rx = Channel.open(path, 1 << 12, spin=0.0)
    start = time.monotonic()
    try:
        assert bytes(rx.recv(check=alive(pid), deadline=start + 20)) == b"last words"
        rx.release()
        with pytest.raises(PeerLost):
            rx.recv(check=alive(pid), deadline=start + 20)
        elapsed = time.monotonic() - start
    finally:
        reap(pid)
    assert elapsed < 0.2 + 1.0, elapsed
    rx.close()
