"""The collective protocol (ringcomm.session) over a wire that is only a recording: aborts,
retirement, blame and news, without any transport; and the wire's interface kept thin."""
import inspect
import time

import pytest

from ringcomm import session as session_module
from ringcomm.errors import CommError, CommTimeout, PeerLost, RanksLost, Revoked
from ringcomm.session import FINISHED, INSIDE, NOT_REACHED, Session
from ringcomm.transport import frame
from ringcomm.transport.base import Transport
from ringcomm.transport.frame import COLLECTIVE, POINT_TO_POINT, Key, Kind
from ringcomm.transport.mailbox import ABORT_SIG, COLLECTIVES, LOST, AbortNotice, abort_sig

pytestmark = pytest.mark.timeout(30)
SIG = bytes(16)


class RecordingWire(Transport):
    """Posts are recorded (``gone`` peers refuse them); ``inbox`` is delivered at each pump,
    and ``on_pump(wire)`` may add to it (a peer answering)."""

    def __init__(self, rank=0, world_size=3, gone=()):
        super().__init__(rank, world_size)
        self.posted, self.inbox, self.gone, self.on_pump = [], [], set(gone), None

    def post(self, dst, header, payload, copy=False):
        if dst in self.gone:
            raise PeerLost(f"rank {dst} is gone", rank=dst)
        self.posted.append((dst, frame.unpack(header, len(payload), self.world_size, dst), bytes(payload)))

    def pump(self, timeout):
        if self.on_pump is not None:
            self.on_pump(self)
        inbox, self.inbox = self.inbox, []
        for header, payload in inbox:
            self.deliver(header, payload)

    def arrive(self, kind, src, key, payload=b"", sig=SIG):
        header = frame.pack(kind, src, key, len(payload), sig)
        self.inbox.append((frame.unpack(header, len(payload), self.world_size, self.rank), payload))


def test_the_wire_is_a_handful_of_methods():
    public = {name for name, _ in inspect.getmembers(Transport, inspect.isfunction) if not name.startswith("_")}
    assert public == {"attach", "post", "pump", "send_data", "check_peers", "lost", "forget", "has_left", "flush",
                      "wake", "close", "take_slot", "send_slot", "give_back_slot", "slot_of"}
    protocol = {"probe", "abort", "retire", "started", "raise_news", "revoke", "await_room", "recv", "poll"}
    assert not protocol & set(dir(Transport)), "the protocol belongs to the session, not the wire"


def test_arrivals_before_the_session_attaches_are_delivered_when_it_does():
    wire = RecordingWire()
    header = frame.unpack(frame.pack(Kind.DATA, 1, Key(0, COLLECTIVE, 0, 0, 0), 2, SIG), 2, 3, 0)
    wire.deliver(header, b"hi")  # (the wire's own receive loop, during start-up)
    s = Session(wire)
    assert bytes(s.recv(1, Key(0, COLLECTIVE, 0, 0, 0), SIG, time.monotonic() + 1, "test")) == b"hi"


def test_an_abort_tells_every_other_peer_why_and_a_gone_one_stops_no_one():
    wire = RecordingWire(rank=1, world_size=4, gone={2})
    s = Session(wire)
    s.abort([0, 1, 2, 3], 7, 12, PeerLost("rank 2 went away", rank=2))
    assert [(dst, h.kind, h.key.comm_id, h.key.seq) for dst, h, _ in wire.posted] == [
        (0, Kind.ABORT, 7, 12), (3, Kind.ABORT, 7, 12)]
    assert all(p == b"rank 2 went away" for *_, p in wire.posted)
    code, blamed, _ = ABORT_SIG.unpack(wire.posted[0][1].sig)
    assert blamed == 2 and code


def test_an_abort_that_arrives_is_raised_as_news_of_its_collective():
    wire = RecordingWire()
    s = Session(wire)
    reason = b"rank 2 timed out"
    wire.arrive(Kind.ABORT, 2, Key(5, COLLECTIVE, 3, 0, 0), reason,
                abort_sig(CommTimeout("x", rank=1)))
    s.raise_news(5)  # not the collective it names
    with pytest.raises(AbortNotice) as info:
        s.raise_news(5, 3)
    assert (info.value.src, info.value.seq, info.value.rank) == (2, 3, 1)
    assert info.value.reason == reason.decode()


def test_a_ping_is_answered_with_where_this_rank_is_in_that_collective():
    wire = RecordingWire()
    s = Session(wire)
    s.started(4, 2)
    s.retire(4, 1)
    for seq in (1, 2, 3):
        wire.arrive(Kind.PING, 1, Key(4, COLLECTIVE, seq, 0, 0))
    s.pump(0)
    answers = [(h.kind, h.key.seq, h.key.step) for _, h, _ in wire.posted]
    assert answers == [(Kind.PONG, 1, FINISHED), (Kind.PONG, 2, INSIDE), (Kind.PONG, 3, NOT_REACHED)]


def test_retiring_a_collective_moves_its_window_and_its_answer():
    s = Session(RecordingWire(), collective_window=2)
    s.started(0, 0)
    assert s._state(0, 0) == INSIDE
    s.retire(0, 0)
    assert s._state(0, 0) == FINISHED and s.mailbox.retired(0) == 0
    assert s.room(1, 0, 1)  # the receiver's side of the window is only known through GRANTs


def test_blame_falls_on_the_silent_peer_and_a_later_wait_for_it_fails_at_once(monkeypatch):
    monkeypatch.setattr(session_module, "PROBE_WAIT", 0.1)
    wire = RecordingWire()
    s = Session(wire)

    def rank_1_answers(w):  # rank 1 answers the ping it was sent; rank 2 never does
        for dst, h, _ in list(w.posted):
            if dst == 1 and h.kind == Kind.PING:
                w.posted.remove((dst, h, _))
                w.arrive(Kind.PONG, 1, Key(h.key.comm_id, COLLECTIVE, h.key.seq, NOT_REACHED, 0))
    wire.on_pump = rank_1_answers
    silent, not_reached = s.probe([0, 1, 2], 0, 9, wait=0.2)
    assert (silent, not_reached) == ([2], [1])
    time.sleep(0.1)
    start = time.monotonic()
    with pytest.raises(CommTimeout, match="rank 2 stopped answering") as info:
        s.recv(2, Key(0, COLLECTIVE, 9, 0, 0), SIG, time.monotonic() + 10, "all_reduce")
    assert info.value.rank == 2 and time.monotonic() - start < 1


def test_a_revoked_communicator_fails_its_waits_and_is_told_to_its_members_once():
    wire = RecordingWire()
    s = Session(wire)
    assert s.revoke(3, [1, 2], "two threads") and not s.revoke(3, [1, 2], "again")
    with pytest.raises(Revoked, match="two threads"):
        s.recv(1, Key(3, COLLECTIVE, 0, 0, 0), SIG, time.monotonic() + 10, "all_reduce")
    s.announce_revoked(3)
    s.announce_revoked(3)
    assert [(dst, h.kind) for dst, h, _ in wire.posted] == [(1, Kind.ABORT), (2, Kind.ABORT)]


def test_a_stronger_revocation_replaces_a_weaker_one_and_is_told_again():
    """Two threads revoked the collectives alone; a shrink then revokes every call: the
    point-to-point calls that went on fail too, and the members hear of it once more."""
    wire = RecordingWire()
    s = Session(wire)
    assert s.revoke(3, [1], "two threads")
    s.announce_revoked(3)
    assert s.poll(1, Key(3, POINT_TO_POINT, 0, 5, 0), SIG, time.monotonic() + 10, "recv") is None  # goes on
    assert s.revoke(3, [1], "lost ranks [2]", LOST, 2) and not s.revoke(3, [1], "weaker", COLLECTIVES)
    with pytest.raises(RanksLost, match=r"lost ranks \[2\]") as info:
        s.poll(1, Key(3, POINT_TO_POINT, 0, 5, 0), SIG, time.monotonic() + 10, "recv")
    assert info.value.rank == 2 and isinstance(info.value, PeerLost)
    s.announce_revoked(3)
    codes = [ABORT_SIG.unpack(h.sig)[0] for _, h, _ in wire.posted]
    assert codes == [COLLECTIVES, LOST]


def test_a_stopped_session_fails_every_wait_and_closes_the_wire_without_waiting():
    closed = []

    class Wire(RecordingWire):
        def close(self, failure=None, waiting=lambda: True):
            closed.append((failure, waiting()))
    s = Session(Wire())
    s.first_failure = PeerLost("rank 2 went away", rank=2)
    s.stop("the owner closed")
    with pytest.raises(CommError, match="the owner closed"):
        s.recv(1, Key(0, COLLECTIVE, 0, 0, 0), SIG, time.monotonic() + 10, "all_reduce")
    s.close()
    assert closed == [(s.first_failure, False)]


def test_a_stop_while_close_waits_for_goodbyes_ends_the_wait(tmp_path):
    """Over the ZeroMQ wire (two ranks in this process): rank 0 closes while rank 1 has not;
    another thread stops rank 0's session 0.3 s in (an engine's close after its grace), and
    close returns then, not after the whole wait for rank 1's goodbye."""
    import threading

    import zmq

    from ringcomm.transport.zmq_transport import ZmqTransport
    endpoints = [f"ipc://{tmp_path}/rank{r}" for r in range(2)]
    contexts = [zmq.Context() for _ in range(2)]
    pulls = [ctx.socket(zmq.PULL) for ctx in contexts]
    for pull, endpoint in zip(pulls, endpoints, strict=True):
        pull.bind(endpoint)
    sessions = [Session(ZmqTransport(r, 2, contexts[r], pulls[r], endpoints, close_wait=5.0)) for r in range(2)]
    deadline = time.monotonic() + 10
    while not all(s.wire.connections.connected(deadline) for s in sessions):
        for s in sessions:
            s.pump(0.01)
    stopper = threading.Timer(0.3, sessions[0].stop, ("closing now",))
    stopper.start()
    start = time.monotonic()
    try:
        sessions[0].close()
        took = time.monotonic() - start
    finally:
        stopper.join()
        sessions[1].stop("done")
        sessions[1].close()
    assert 0.25 < took < 2.5, f"close took {took:.2f} s (stopped after 0.3 s; it would wait 5 s)"
