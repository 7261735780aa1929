"""Delivery, duplicates, signatures, aborts and retirement in the mailbox
(ringcomm.transport.mailbox), plus the abort path through the in-process transport."""
import time

import numpy as np
import pytest

from ringcomm.errors import (CollectiveMismatch, CommError, CommTimeout, FrameError, PeerLost, RanksLost, Revoked,
                             SignatureMismatch)
from ringcomm.transport.frame import Header, Key, Kind
from ringcomm.session import Session
from ringcomm.transport.local import LocalHub
from ringcomm.collective import error_for
from ringcomm.transport.mailbox import (ABORT_CLASSES, ABORT_SIG, NO_RANK, AbortNotice, Mailbox, Revocation,
                                       abort_code)

pytestmark = pytest.mark.timeout(30)

SIG_A = b"A" * 16
SIG_B = b"B" * 16


def data(src, key, payload=b"", sig=SIG_A):
    return Header(Kind.DATA, src, key, len(payload), sig), payload


def abort(src, comm_id, seq, code, reason=b"it broke", lost=NO_RANK, cause=0):
    sig = ABORT_SIG.pack(code, lost, cause)
    return Header(Kind.ABORT, src, Key(comm_id, 0, seq, 0, 0), len(reason), sig), reason


def put(box, message):
    box.put(*message)


# -- delivery by exact key ------------------------------------------------------------------------

def test_delivered_by_exact_key_only():
    box = Mailbox()
    key = Key(comm_id=3, space=0, seq=5, step=1, segment=2)
    put(box, data(1, key, b"payload"))
    others = [
        (2, key),                      # another source
        (1, key._replace(comm_id=4)),
        (1, key._replace(space=1)),
        (1, key._replace(seq=6)),
        (1, key._replace(step=0)),
        (1, key._replace(segment=3)),
    ]
    for src, other in others:
        assert box.take(src, other, SIG_A) is None, (src, other)
    assert box.take(1, key, SIG_A) == b"payload"
    assert box.take(1, key, SIG_A) is None  # delivered once only


def test_out_of_order_arrival():
    box = Mailbox()
    keys = [Key(0, 0, 0, step, seg) for step in range(3) for seg in range(4)]
    for key in reversed(keys):
        put(box, data(1, key, f"{key.step}/{key.segment}".encode()))
    for key in keys:
        assert box.take(1, key, SIG_A) == f"{key.step}/{key.segment}".encode()
    assert box.dropped == 0


def test_interleaved_peers_kept_apart():
    box = Mailbox()
    key = Key(0, 0, 0, 0, 0)
    put(box, data(2, key, b"from 2"))
    put(box, data(1, key, b"from 1"))
    assert box.take(1, key, SIG_A) == b"from 1"
    assert box.take(2, key, SIG_A) == b"from 2"


@pytest.mark.parametrize("key", [Key(0, 0, 0, 0, 0), Key(0, 1, 0, 7, 0)], ids=["collective", "point-to-point"])
def test_duplicates_dropped(key):
    box = Mailbox()
    put(box, data(1, key, b"first"))
    put(box, data(1, key, b"second"))
    assert box.dropped == 1
    assert box.take(1, key, SIG_A) == b"first"
    assert box.take(1, key, SIG_A) is None


# -- signatures -----------------------------------------------------------------------------------

def test_signature_mismatch_on_the_message_itself():
    box = Mailbox()
    key = Key(0, 0, 0, 0, 0)
    put(box, data(1, key, b"x", sig=SIG_B))
    with pytest.raises(SignatureMismatch) as info:
        box.take(1, key, SIG_A)
    assert (info.value.src, info.value.theirs, info.value.ours) == (1, SIG_B, SIG_A)


def test_signature_mismatch_from_another_peer_names_that_peer():
    box = Mailbox()
    put(box, data(2, Key(0, 0, 4, 3, 1), b"x", sig=SIG_B))
    # this rank waits for rank 1 (nothing from it yet) in the same collective (comm 0, seq 4)
    with pytest.raises(SignatureMismatch) as info:
        box.take(1, Key(0, 0, 4, 0, 0), SIG_A)
    exc = info.value
    assert isinstance(exc, CollectiveMismatch)
    assert (exc.src, exc.theirs, exc.ours) == (2, SIG_B, SIG_A)
    assert "rank 2" in str(exc)
    assert SIG_B.hex() in str(exc) and SIG_A.hex() in str(exc)


def test_signature_of_other_collective_or_p2p_is_not_a_mismatch():
    box = Mailbox()
    put(box, data(2, Key(0, 0, 5, 0, 0), b"x", sig=SIG_B))   # next collective
    put(box, data(2, Key(1, 0, 4, 0, 0), b"x", sig=SIG_B))   # other communicator
    put(box, data(2, Key(0, 1, 4, 0, 0), b"x", sig=SIG_B))   # point-to-point
    put(box, data(1, Key(0, 0, 4, 0, 0), b"mine"))
    assert box.take(1, Key(0, 0, 4, 0, 0), SIG_A) == b"mine"


def test_point_to_point_checks_only_its_own_message():
    box = Mailbox()
    put(box, data(2, Key(0, 1, 0, 9, 0), b"x", sig=SIG_B))
    assert box.take(1, Key(0, 1, 0, 9, 0), SIG_A) is None
    assert box.take(2, Key(0, 1, 0, 9, 0), SIG_B) == b"x"


# -- aborts --------------------------------------------------------------------------------------

FILED = sorted((code, cls) for code, cls in ABORT_CLASSES.items() if not issubclass(cls, Revoked))  # see below


@pytest.mark.parametrize("code, cls", FILED + [(0, CommError), (99, CommError)])
def test_abort_interrupts_every_wait_of_its_collective_with_the_notice_as_it_came(code, cls):
    box = Mailbox()
    put(box, abort(3, comm_id=2, seq=8, code=code, reason="died \u2620".encode()))
    for key in (Key(2, 0, 8, 0, 0), Key(2, 0, 8, 5, 7)):
        with pytest.raises(AbortNotice) as info:
            box.take(1, key, SIG_A)
        notice = info.value
        assert (notice.src, notice.comm_id, notice.seq, notice.kind) == (3, 2, 8, cls)
        assert notice.reason == "died \u2620" and notice.rank is None and notice.cause is None


@pytest.mark.parametrize("code, cls", FILED + [(99, CommError)])
def test_the_collective_raises_an_abort_of_itself_as_the_remote_error(code, cls):
    box = Mailbox()
    put(box, abort(3, comm_id=2, seq=8, code=code, reason="died \u2620".encode()))
    with pytest.raises(AbortNotice) as info:
        box.take(1, Key(2, 0, 8, 0, 0), SIG_A)
    exc = error_for(info.value, 8)
    assert type(exc) is cls and exc.remote is True
    assert str(exc) == "rank 3 aborted: died \u2620"


def test_abort_signature_layout():
    assert ABORT_SIG.size == 16
    assert ABORT_SIG.pack(3, 7, 1) == bytes([3, 7, 0, 0, 0, 1]) + bytes(10)


def test_abort_carries_lost_rank():
    box = Mailbox()
    put(box, abort(1, 0, 2, code=3, lost=4))
    with pytest.raises(AbortNotice) as info:
        box.take(1, Key(0, 0, 2, 0, 0), SIG_A)
    exc = error_for(info.value, 2)
    assert isinstance(exc, PeerLost) and exc.rank == 4 and exc.remote


def test_abort_without_lost_rank():
    box = Mailbox()
    put(box, abort(1, 0, 2, code=3))
    with pytest.raises(AbortNotice) as info:
        box.take(1, Key(0, 0, 2, 0, 0), SIG_A)
    assert info.value.rank is None and error_for(info.value, 2).rank is None


@pytest.mark.parametrize("cause, name", [(1, "silent"), (2, "not started"), (0, None), (9, None)])
def test_abort_carries_a_timeouts_cause(cause, name):
    box = Mailbox()
    put(box, abort(1, 0, 2, code=2, lost=3, cause=cause))
    with pytest.raises(AbortNotice) as info:
        box.take(1, Key(0, 0, 2, 0, 0), SIG_A)
    exc = error_for(info.value, 2)
    assert isinstance(exc, CommTimeout) and exc.cause == name and exc.rank == 3


def test_abort_mapping_is_the_documented_one():
    assert {1: CollectiveMismatch, 2: CommTimeout, 3: PeerLost, 4: CommError, 5: Revoked, 6: Revoked,
            7: RanksLost} == ABORT_CLASSES


def test_a_revoked_abort_revokes_the_communicator_here_whatever_its_collective():
    """A Revoked abort is not filed as a notice: the communicator is revoked, and every wait
    on it checks that (Transport.check_revoked)."""
    box = Mailbox()
    box.retire(0, 3, failed=True)                   # this rank failed #3 (and told its caller)
    put(box, abort(1, comm_id=0, seq=3, code=5))    # the news of #3 itself is dropped ...
    assert box.revoked == {0: Revocation("it broke", 5)}  # ... but the revocation holds from now on
    put(box, abort(2, comm_id=7, seq=9, code=5, reason=b"other"))
    assert box.revoked == {0: Revocation("it broke", 5), 7: Revocation("other", 5)}
    put(box, abort(1, comm_id=7, seq=10, code=5, reason=b"later"))
    assert box.revoked[7].why == "other"            # the first reason stays
    assert box.take(1, Key(7, 0, 9, 0, 0), SIG_A) is None  # no notice: the revocation raises


def test_revocations_of_every_call_and_for_lost_ranks_keep_their_kind():
    box = Mailbox()
    put(box, abort(1, comm_id=4, seq=0, code=6, reason=b"revoked"))
    put(box, abort(1, comm_id=5, seq=0, code=7, lost=2, reason=b"lost ranks [2, 3]"))
    assert box.revoked == {4: Revocation("revoked", 6, None), 5: Revocation("lost ranks [2, 3]", 7, 2)}
    plain, lost = box.revoked[4].error(), box.revoked[5].error()
    assert type(plain) is Revoked and str(plain) == "revoked"
    assert type(lost) is RanksLost and isinstance(lost, PeerLost) and isinstance(lost, Revoked)
    assert lost.rank == 2 and "[2, 3]" in str(lost)


def test_abort_precedes_pending_message_and_does_not_touch_others():
    box = Mailbox()
    put(box, data(1, Key(0, 0, 8, 0, 0), b"late"))
    put(box, data(1, Key(0, 0, 9, 0, 0), b"next"))
    put(box, data(1, Key(0, 1, 8, 0, 0), b"p2p"))
    put(box, data(1, Key(1, 0, 8, 0, 0), b"other comm"))
    put(box, abort(1, comm_id=0, seq=8, code=2))
    with pytest.raises(AbortNotice):
        box.take(1, Key(0, 0, 8, 0, 0), SIG_A)
    assert box.take(1, Key(0, 0, 9, 0, 0), SIG_A) == b"next"
    assert box.take(1, Key(0, 1, 8, 0, 0), SIG_A) == b"p2p"
    assert box.take(1, Key(1, 0, 8, 0, 0), SIG_A) == b"other comm"


def test_abort_precedes_signature_mismatch():
    box = Mailbox()
    put(box, data(2, Key(0, 0, 1, 0, 0), sig=SIG_B))
    put(box, abort(2, 0, 1, code=3))
    with pytest.raises(AbortNotice) as info:
        box.take(1, Key(0, 0, 1, 0, 0), SIG_A)
    assert info.value.kind is PeerLost


def test_local_errors_are_not_remote():
    assert CommError.remote is False
    assert CommTimeout("x").remote is False


@pytest.mark.parametrize("exc, code", [
    (CollectiveMismatch("x"), 1),
    (SignatureMismatch(1, SIG_A, SIG_B), 1),
    (CommTimeout("x"), 2),
    (PeerLost("x", rank=1), 3),
    (CommError("x"), 4),
    (FrameError("x"), 4),
    (ValueError("x"), 4),
    (KeyboardInterrupt(), 4),
])
def test_abort_code(exc, code):
    assert abort_code(exc) == code


# -- retirement -----------------------------------------------------------------------------------

def test_retire_drops_stragglers_but_not_p2p_or_later_seqs():
    box = Mailbox()
    put(box, data(1, Key(0, 0, 2, 0, 0), b"old"))
    put(box, data(1, Key(0, 0, 3, 1, 0), b"straggler"))
    put(box, data(2, Key(0, 0, 3, 0, 1), b"straggler"))
    put(box, data(1, Key(0, 1, 3, 0, 0), b"p2p"))
    put(box, data(1, Key(0, 0, 4, 0, 0), b"next"))
    put(box, data(1, Key(5, 0, 3, 1, 0), b"other comm"))
    box.retire(0, 3)
    assert box.dropped == 3
    assert box.take(1, Key(0, 0, 2, 0, 0), SIG_A) is None
    assert box.take(1, Key(0, 0, 3, 1, 0), SIG_A) is None
    assert box.take(2, Key(0, 0, 3, 0, 1), SIG_A) is None
    assert box.take(1, Key(0, 1, 3, 0, 0), SIG_A) == b"p2p"
    assert box.take(1, Key(0, 0, 4, 0, 0), SIG_A) == b"next"
    assert box.take(1, Key(5, 0, 3, 1, 0), SIG_A) == b"other comm"


def test_retire_drops_late_arrivals_for_retired_seqs():
    box = Mailbox()
    box.retire(0, 3)
    put(box, data(1, Key(0, 0, 3, 0, 0), b"late"))
    put(box, data(1, Key(0, 0, 1, 0, 0), b"later still"))
    assert box.dropped == 2
    assert box.take(1, Key(0, 0, 3, 0, 0), SIG_A) is None
    assert box.take(1, Key(0, 0, 1, 0, 0), SIG_A) is None
    put(box, data(1, Key(0, 1, 3, 0, 0), b"p2p"))
    put(box, data(1, Key(0, 0, 4, 0, 0), b"next"))
    put(box, data(1, Key(1, 0, 3, 0, 0), b"other comm"))
    assert box.dropped == 2
    assert box.take(1, Key(0, 1, 3, 0, 0), SIG_A) == b"p2p"
    assert box.take(1, Key(0, 0, 4, 0, 0), SIG_A) == b"next"
    assert box.take(1, Key(1, 0, 3, 0, 0), SIG_A) == b"other comm"


def test_late_mismatched_signature_for_retired_seq_is_ignored():
    box = Mailbox()
    box.retire(0, 3)
    put(box, data(2, Key(0, 0, 3, 0, 0), sig=SIG_B))
    put(box, data(1, Key(0, 0, 4, 0, 0), b"next"))
    assert box.take(1, Key(0, 0, 4, 0, 0), SIG_A) == b"next"


def test_retire_forgets_signatures_and_aborts_of_that_seq():
    box = Mailbox()
    put(box, data(2, Key(0, 0, 3, 0, 0), sig=SIG_B))
    put(box, abort(2, 0, 3, code=1))
    box.retire(0, 3)
    # nothing of collective 3 is left to raise (or to deliver)
    assert box.take(1, Key(0, 0, 3, 0, 0), SIG_A) is None


def test_late_abort_for_retired_seq_poisons_next_collective_once():
    box = Mailbox()
    box.retire(0, 3)                      # this rank finished #3 without noticing a failure
    put(box, abort(2, 0, 3, code=3, reason=b"rank 1 died", lost=1))
    put(box, data(1, Key(0, 0, 4, 0, 0), b"next"))
    put(box, data(1, Key(0, 1, 4, 0, 0), b"p2p"))
    put(box, data(1, Key(1, 0, 4, 0, 0), b"other comm"))
    # point-to-point and other communicators are not affected
    assert box.take(1, Key(0, 1, 4, 0, 0), SIG_A) == b"p2p"
    assert box.take(1, Key(1, 0, 4, 0, 0), SIG_A) == b"other comm"
    with pytest.raises(AbortNotice) as info:
        box.take(1, Key(0, 0, 4, 0, 0), SIG_A)
    assert info.value.seq == 3
    exc = error_for(info.value, 4)
    assert isinstance(exc, PeerLost) and exc.rank == 1
    assert str(exc) == "collective #3 on this communicator failed on rank 2: rank 1 died"
    assert exc.remote is False  # this rank must abort its own collective in turn
    # raised once: the collective after that proceeds
    assert box.take(1, Key(0, 0, 4, 0, 0), SIG_A) == b"next"


def test_late_abort_for_collective_that_failed_here_is_ignored():
    box = Mailbox()
    box.retire(0, 3, failed=True)
    put(box, abort(2, 0, 3, code=2))
    put(box, data(1, Key(0, 0, 4, 0, 0), b"next"))
    assert box.take(1, Key(0, 0, 4, 0, 0), SIG_A) == b"next"


def test_late_abort_for_an_older_collective_after_a_later_one_failed_here_is_ignored():
    """Collective 3 failed on rank 2 while this rank only sent; this rank then failed 4
    (told by a faster peer) before rank 2's abort of 3 arrived. Poisoning 5 as well would
    fail it on every rank a second time (seen under load in test_mismatch_raises_on_every_rank)."""
    box = Mailbox()
    box.retire(0, 3)
    box.retire(0, 4, failed=True)
    put(box, abort(2, 0, 3, code=1))
    put(box, data(1, Key(0, 0, 5, 0, 0), b"next"))
    assert box.take(1, Key(0, 0, 5, 0, 0), SIG_A) == b"next"


def test_news_of_an_older_collective_is_dropped_when_a_later_one_fails_here_first():
    """Collective 3 ended here; rank 2's abort of it arrived, but collective 4 failed here for
    its own reason before any wait raised the news: 5 must not fail a second time."""
    box = Mailbox()
    box.retire(0, 3)
    put(box, abort(2, 0, 3, code=3))
    box.retire(0, 4, failed=True)
    put(box, data(1, Key(0, 0, 5, 0, 0), b"next"))
    assert box.take(1, Key(0, 0, 5, 0, 0), SIG_A) == b"next"


def test_the_first_notice_is_kept():
    box = Mailbox()
    put(box, abort(1, 0, 6, code=2, reason=b"first"))
    put(box, abort(2, 0, 6, code=3, reason=b"second"))
    box.retire(0, 5)
    with pytest.raises(AbortNotice) as info:
        box.take(1, Key(0, 0, 6, 0, 0), SIG_A)
    assert info.value.reason == "first"
    box.retire(0, 6)
    box.retire(0, 7)
    put(box, abort(1, 0, 7, code=2, reason=b"late first"))
    put(box, abort(2, 0, 6, code=3, reason=b"late second"))
    with pytest.raises(AbortNotice) as info:
        box.take(1, Key(0, 0, 8, 0, 0), SIG_A)
    assert info.value.reason == "late first"


def test_retire_is_monotonic():
    box = Mailbox()
    box.retire(0, 5)
    box.retire(0, 2)  # retiring an older seq does not un-retire 3..5
    put(box, data(1, Key(0, 0, 4, 0, 0), b"late"))
    assert box.take(1, Key(0, 0, 4, 0, 0), SIG_A) is None
    assert box.dropped == 1


# -- the same paths through the in-process transport -----------------------------------------

def test_transport_abort_reaches_waiting_peer():
    hub = LocalHub(3)
    t0, t1, t2 = (Session(hub.transport(r)) for r in range(3))
    t2.abort([0, 1, 2], 0, 6, PeerLost("rank 1 went away", rank=1))
    assert all(ABORT_SIG.unpack(raw_sig) == (3, 1, 0) for raw_sig in (
        hub.queues[0].queue[0][0][40:], hub.queues[1].queue[0][0][40:]))
    assert [(src, dst, kind) for src, dst, _, _, kind in hub.log] == [
        (2, 0, Kind.ABORT), (2, 1, Kind.ABORT)]
    start = time.monotonic()
    with pytest.raises(AbortNotice) as info:
        t0.recv(1, Key(0, 0, 6, 0, 0), SIG_A, time.monotonic() + 5, "test")
    assert time.monotonic() - start < 2
    notice = info.value
    assert (notice.src, notice.seq, notice.kind, notice.rank) == (2, 6, PeerLost, 1)
    assert notice.reason == "rank 1 went away"


def test_transport_abort_reason_is_truncated():
    hub = LocalHub(2)
    t0, t1 = Session(hub.transport(0)), Session(hub.transport(1))
    t1.abort([0], 0, 0, CommError("x" * 10_000))
    assert hub.log[0][3] == 4096
    with pytest.raises(CommError):
        t0.recv(1, Key(0, 0, 0, 0, 0), SIG_A, time.monotonic() + 5, "test")


def test_transport_recv_times_out_naming_the_peer():
    hub = LocalHub(2)
    t0 = Session(hub.transport(0))
    start = time.monotonic()
    with pytest.raises(CommTimeout, match=r"rank 1.*step 4, segment 2"):
        t0.recv(1, Key(0, 0, 0, 4, 2), SIG_A, time.monotonic() + 0.3, "test")
    assert 0.3 <= time.monotonic() - start < 2


def test_transport_delivers_copy_of_payload():
    hub = LocalHub(2)
    t0, t1 = Session(hub.transport(0)), Session(hub.transport(1))
    x = np.arange(4, dtype=np.uint8)
    t1.send(0, Key(0, 0, 0, 0, 0), SIG_A, x)
    x[:] = 9  # the sender reuses its buffer: the message must not change
    got = t0.recv(1, Key(0, 0, 0, 0, 0), SIG_A, time.monotonic() + 5, "test")
    assert bytes(got) == bytes([0, 1, 2, 3])
    assert hub.log == [(1, 0, Key(0, 0, 0, 0, 0), 4, Kind.DATA)]


def test_transport_poll_never_waits():
    hub = LocalHub(2)
    t0, t1 = Session(hub.transport(0)), Session(hub.transport(1))
    key = Key(0, 1, 0, 3, 0)
    start = time.monotonic()
    assert t0.poll(1, key, SIG_A, time.monotonic() + 5, "test") is None
    assert time.monotonic() - start < 0.05
    t1.send(0, key, SIG_A, b"hi")
    t0.pump(1.0)
    assert bytes(t0.poll(1, key, SIG_A, time.monotonic() + 5, "test")) == b"hi"
    with pytest.raises(CommTimeout, match="rank 1"):
        t0.poll(1, key, SIG_A, time.monotonic() - 1, "test")


def test_collective_data_too_far_ahead_is_refused_and_named():
    box = Mailbox(collective_window=2)
    put(box, data(1, Key(0, 0, 0, 0, 0), b"ok"))      # the collective running here
    put(box, data(1, Key(0, 0, 1, 0, 0), b"ok"))      # one ahead of the running #0: the limit
    put(box, data(1, Key(0, 0, 2, 0, 0), b"no"))      # #2 while nothing retired: refused
    assert box.dropped == 1
    assert box.take(1, Key(0, 0, 0, 0, 0), SIG_A) == b"ok"  # the peer is not cut off
    with pytest.raises(CommError, match="rank 1 ignored its flow-control credits: it sent data for collective #2"):
        box.take(1, Key(0, 0, 2, 0, 0), SIG_A)
    box.retire(0, 2, failed=True)                     # that collective alone failed
    put(box, data(1, Key(0, 0, 3, 0, 0), b"ok"))
    put(box, data(1, Key(0, 0, 4, 0, 0), b"ok"))      # retired #2: #4 is one ahead of #3
    assert box.take(1, Key(0, 0, 4, 0, 0), SIG_A) == b"ok"


def test_point_to_point_past_the_window_is_refused():
    box = Mailbox(window=8)
    put(box, data(1, Key(0, 1, 0, 0, 0), b"12345"))
    put(box, data(1, Key(0, 1, 1, 0, 0), b"678"))     # 8 bytes: still inside
    assert box.take(1, Key(0, 1, 0, 0, 0), SIG_A) == b"12345"
    put(box, data(1, Key(0, 1, 0, 7, 0), b"abcdefgh"))  # another tag has its own window
    put(box, data(1, Key(0, 1, 2, 0, 0), b"abcdef"))  # 3 + 6 > 8: refused
    assert box.dropped == 1
    with pytest.raises(CommError, match="flow-control window"):
        box.take(1, Key(0, 1, 1, 0, 0), SIG_A)
    assert box.take(1, Key(0, 1, 0, 7, 0), SIG_A) == b"abcdefgh"
