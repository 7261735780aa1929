"""The collective window's bookkeeping (ringcomm.transport.credit) without any transport:
what a sender may send, when it asks, and when a receiver grants."""
from ringcomm.transport import frame
from ringcomm.transport.credit import CollectiveCredit
from ringcomm.transport.frame import Kind


class Peer:
    """One rank's credit with its control messages captured as (dst, kind, comm, seq)."""

    def __init__(self, rank, window=4):
        self.sent, self.finished = [], {}
        self.credit = CollectiveCredit(rank, window, self._post, lambda c: self.finished.get(c, 0))

    def _post(self, dst, header, payload):
        parsed = frame.unpack(header, 0, 8, dst)
        self.sent.append((dst, parsed.kind, parsed.key.comm_id, parsed.key.seq))


def test_a_sender_in_step_never_waits_and_asks_half_a_window_ahead():
    a = Peer(0)
    assert a.credit.room(1, 0, 0) and a.credit.room(1, 0, 1) and not a.sent
    assert a.credit.room(1, 0, 2)                  # half the window: allowed, and it asks
    assert a.sent == [(1, Kind.WANT, 0, 2)]
    assert a.credit.room(1, 0, 3) and len(a.sent) == 1  # one question at a time
    assert not a.credit.room(1, 0, 4)              # 4 >= 0 + 4: must wait for the answer
    assert a.sent[-1] == (1, Kind.WANT, 0, 4)      # the question now names what it waits for
    a.credit.on_grant(1, 0, 3)                     # rank 1 finished #0..#2
    assert a.credit.room(1, 0, 4) and a.credit.room(1, 0, 5)
    assert a.credit.room(1, 7, 0)                  # another communicator has its own window


def test_a_receiver_grants_at_once_or_when_it_has_finished_enough():
    b = Peer(1)
    b.credit.on_want(0, 0, 2)                      # within the window of nothing finished
    assert b.sent == [(0, Kind.GRANT, 0, 0)]
    b.credit.on_want(0, 0, 6)                      # needs #2 finished: held
    b.credit.on_want(0, 0, 5)                      # an older question adds nothing
    assert len(b.sent) == 1
    for done in (1, 2):
        b.finished[0] = done
        b.credit.on_retire(0)
    assert len(b.sent) == 1                        # 6 < 2 + 4 is still false
    b.finished[0] = 3
    b.credit.on_retire(9)                          # another communicator's retirement
    assert len(b.sent) == 1
    b.credit.on_retire(0)
    assert b.sent[-1] == (0, Kind.GRANT, 0, 3)
    b.finished[0] = 4
    b.credit.on_retire(0)
    assert len(b.sent) == 2                        # answered once


def test_a_late_grant_for_an_older_question_keeps_the_newer_one_open():
    a = Peer(0)
    a.credit.room(1, 0, 2)                         # WANT #2
    assert not a.credit.room(1, 0, 4)              # WANT #4
    a.credit.on_grant(1, 0, 0)                     # the answer to WANT #2: not enough
    assert not a.credit.room(1, 0, 4) and len(a.sent) == 2  # no third question: #4 is pending
    a.credit.on_grant(1, 0, 1)
    assert a.credit.room(1, 0, 4)


def test_a_lost_peer_makes_no_error_here():
    def gone(dst, header, payload):
        from ringcomm.errors import PeerLost
        raise PeerLost("gone", rank=dst)
    credit = CollectiveCredit(0, 2, gone, lambda c: 0)
    assert not credit.room(1, 0, 2)                # the WANT could not go: the wait reports it
    credit.on_want(1, 0, 0)
