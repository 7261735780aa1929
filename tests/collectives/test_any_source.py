"""Receives from any source: each takes one whole message from one peer and names it; named
receives before, behind and after them still pair right; timeouts, mismatches and peers
that close end in a clear error."""
import textwrap
import time

import numpy as np
import pytest

from harness import spawn_job
from ringcomm import CollectiveMismatch, CommTimeout
from ringcomm.receives import Receives, Ticket
from ringcomm.transport.frame import Header, Key, Kind
from ringcomm.transport.mailbox import Mailbox

pytestmark = pytest.mark.timeout(90)
N = 4
K = 3  # messages each rank sends rank 0 in the scrambled phase


def message(src, i, size=5):
    return np.random.default_rng(1000 * src + i).standard_normal(size)


def test_numbers_bind_in_posting_order_and_a_cancelled_receive_takes_none():
    """In-process: any, named(1), any, named(2) on one tag; the first binds to rank 1, the
    second is cancelled, so rank 2's named receive takes its #0, and a later one binds at once."""
    box = Receives()
    first, named1, second, named2 = Ticket(None, 5), Ticket(1, 5), Ticket(None, 5), Ticket(2, 5)
    assert [box.post(t) for t in (first, named1, second, named2)] == [None] * 4
    assert not box.bind_any(second, lambda number: 2)  # not its turn yet
    assert box.bind_any(first, lambda number: 1 if number(1) == 0 else None)
    assert (first.src, first.seq, named1.seq, second.seq, named2.seq) == (1, 0, 1, None, None)
    box.cancel(second)
    assert (second.seq, named2.src, named2.seq) == (None, 2, 0)
    assert box.post(Ticket(1, 5)) == 2 and box.post(Ticket(1, 6)) == 0


def test_the_mailbox_names_the_message_that_arrived_first():
    box, sig = Mailbox(), bytes(16)
    for src, seq in ((2, 0), (1, 4)):
        box.put(Header(Kind.DATA, src, Key(0, 1, seq, 7, 0), 3, sig), b"abc")
    candidates = [(1, Key(0, 1, 4, 7, 0)), (2, Key(0, 1, 0, 7, 0)), (3, Key(0, 1, 0, 7, 0))]
    assert box.first_arrived(candidates) == 1
    assert box.take(2, Key(0, 1, 0, 7, 0), sig) == b"abc"
    assert box.first_arrived(candidates) == 0
    assert box.first_arrived(candidates[2:]) is None


def scrambled_then_named(comm):
    """Ranks 1..3 send K messages each with one tag, at scrambled times; rank 0 takes them all
    from any source, then one more from each rank by name, in reverse rank order."""
    n, r = comm.world_size, comm.rank
    if r != 0:
        for delay, i in zip(np.random.default_rng(r).uniform(0, 0.05, K), range(K), strict=True):
            time.sleep(delay)
            comm.send(message(r, i), 0, tag=11)
        comm.barrier()  # else an any-source receive may take the message meant for a named one
        comm.send(message(r, K), 0, tag=11)
        return None
    got = []
    for _ in range(K * (n - 1)):
        x = np.empty(5)
        src = comm.recv(x, None, tag=11)
        got.append((src, x.copy()))
    comm.barrier()
    named = {}
    for src in reversed(range(1, n)):
        x = np.empty(5)
        assert comm.recv(x, src, tag=11) is x  # a named receive still returns its array
        named[src] = x
    return got, named


def test_any_source_takes_every_message_once_then_named_receives_pair(pools):
    got, named = pools(N).run(scrambled_then_named)[0]
    assert sorted(src for src, _ in got) == sorted(list(range(1, N)) * K)
    seen = {src: 0 for src in range(1, N)}
    for src, x in got:  # each peer's messages in the order it sent them
        np.testing.assert_array_equal(x, message(src, seen[src]))
        seen[src] += 1
    for src, x in named.items():
        np.testing.assert_array_equal(x, message(src, K))


def posting_order(comm):
    """Rank 0 posts any, named(1), any; rank 1 sends a then b, rank 2 sends c later: the
    first any-source receive takes a, the named one b (rank 1's next), the last c."""
    r = comm.rank
    bufs = [np.empty(5) for _ in range(3)]
    if r == 0:
        first = comm.recv(bufs[0], None, tag=12, async_op=True)
        named = comm.recv(bufs[1], 1, tag=12, async_op=True)
        last = comm.recv(bufs[2], None, tag=12, async_op=True)
        comm.barrier()
        sources = [first.wait(), named.wait() is bufs[1], last.wait()]
        return sources, [b.tolist() for b in bufs]
    comm.barrier()
    if r == 1:
        comm.send(message(1, 0), 0, tag=12)
        comm.send(message(1, 1), 0, tag=12)
        comm.send(np.empty(0), 2, tag=13)  # c goes only after a and b
    elif r == 2:
        comm.recv(np.empty(0), 1, tag=13)
        time.sleep(0.2)
        comm.send(message(2, 0), 0, tag=12)
    return None


def test_receives_on_a_tag_bind_in_posting_order(pools):
    sources, bufs = pools(N).run(posting_order)[0]
    assert sources == [1, True, 2]
    for buf, (src, i) in zip(bufs, [(1, 0), (1, 1), (2, 0)], strict=True):
        np.testing.assert_array_equal(buf, message(src, i))


def large_messages(comm):
    """Three senders at once, three messages each of three segments or more, three receives
    from any source posted at a time: each gets one sender's next message whole (credits go
    back to it, so its later messages come in)."""
    n, r = comm.world_size, comm.rank
    size = 2 * comm.segment_bytes // 4 + 1000  # float32 elements: 3 segments

    def data(src, i):
        return np.random.default_rng(10 * src + i).standard_normal(size).astype(np.float32)
    if r != 0:
        for i in range(3):
            comm.send(data(r, i), 0, tag=21)
        return None
    taken = {src: 0 for src in range(1, n)}
    for _ in range(3):
        bufs = [np.empty(size, np.float32) for _ in range(n - 1)]
        works = [comm.recv(b, None, tag=21, async_op=True) for b in bufs]
        for work, buf in zip(works, bufs, strict=True):
            src = work.wait()
            assert np.array_equal(buf, data(src, taken[src])), (src, taken[src])
            taken[src] += 1
    return taken


def test_a_multi_segment_message_is_taken_whole_from_one_peer(pools):
    assert pools(N).run(large_messages)[0] == {src: 3 for src in range(1, N)}


def timeout_then_named(comm):
    """An any-source receive with nothing sent times out naming the ranks it waited for; it
    takes no message number: a named receive posted behind it binds once it fails and gets
    rank 1's first message on that tag."""
    group = comm.new_group(list(range(comm.world_size)))  # a timeout of its own
    if comm.rank != 0:
        group.barrier()
        if comm.rank == 1:
            group.send(message(1, 0), 0, tag=31)
        return None
    group.timeout = 1.0
    waiting = group.recv(np.empty(5), None, tag=31, async_op=True)
    while waiting.started is None:  # its deadline is set as it starts
        time.sleep(0.01)
    time.sleep(0.05)
    group.timeout = 20.0
    x = np.empty(5)
    named = group.recv(x, 1, tag=31, async_op=True)
    start = time.monotonic()
    try:
        waiting.wait()
        error = None
    except CommTimeout as exc:
        error = str(exc)
    waited = time.monotonic() - start
    group.barrier()
    named.wait()
    return error, waited, x.tolist()


def test_an_any_source_receive_times_out_and_frees_its_tag(pools):
    error, waited, x = pools(N).run(timeout_then_named)[0]
    assert error is not None and "any of ranks [1, 2, 3]" in error, error
    assert waited < 5
    np.testing.assert_array_equal(x, message(1, 0))


def mismatch(comm):
    """Rank 2 sends float64 where rank 0 receives float32 from any source: a mismatch naming
    rank 2; it used up rank 2's message #0 only, so what follows pairs right."""
    r = comm.rank
    if r == 2:
        comm.send(np.ones(4, np.float64), 0, tag=41)
        comm.barrier()
        comm.send(np.full(4, 2.0, np.float32), 0, tag=41)
    elif r == 1:
        comm.barrier()
        comm.send(np.full(4, 1.0, np.float32), 0, tag=41)
    elif r == 0:
        try:
            comm.recv(np.empty(4, np.float32), None, tag=41)
            error = None
        except CollectiveMismatch as exc:
            error = str(exc)
        comm.barrier()
        x, y = np.empty(4, np.float32), np.empty(4, np.float32)
        named = comm.recv(x, 1, tag=41)
        return error, named.tolist(), comm.recv(y, None, tag=41), y.tolist()
    else:
        comm.barrier()
    return None


def test_a_mismatch_names_the_sender_of_the_message_taken(pools):
    error, named, src, y = pools(N).run(mismatch)[0]
    assert error is not None and "rank 2 called point_to_point(count=4, dtype=float64)" in error, error
    assert "dtype=float32" in error
    assert named == [1.0] * 4 and (src, y) == (2, [2.0] * 4)


def subgroup_ranks(comm):
    """On the group [0, 3, 1], the source is a group rank: global 3 is 1, global 1 is 2."""
    group = comm.new_group([0, 3, 1])
    if group is None:
        return None
    if group.rank == 0:
        x = np.empty(2)
        first = group.recv(x, None, tag=51)
        group.barrier()
        return first, group.recv(x, None, tag=51)
    if group.rank == 1:
        group.send(np.ones(2), 0, tag=51)
        group.barrier()
    else:
        group.barrier()
        group.send(np.ones(2), 0, tag=51)
    return None


def test_the_source_is_a_group_rank(pools):
    assert pools(N).run(subgroup_ranks)[0] == (1, 2)


PEERS_CLOSE = textwrap.dedent("""
    import time, numpy as np, ringcomm
    comm = ringcomm.init()
    if comm.rank == 1:                  # sends one message, then closes
        comm.send(np.full(3, 1.0), 0, tag=7)
    elif comm.rank == 2:                # later, the same
        time.sleep(1.0)
        comm.send(np.full(3, 2.0), 0, tag=7)
    else:
        time.sleep(0.5)                 # rank 1's goodbye is in: its message is still taken
        for _ in range(3):
            x = np.zeros(3)
            try:
                print("from", comm.recv(x, ringcomm.ANY_SOURCE, tag=7), x[0], flush=True)
            except ringcomm.PeerLost as exc:
                print("lost:", exc, flush=True)
    comm.close()
""")


def test_peers_that_close_drop_out_until_none_is_left():
    results = spawn_job(PEERS_CLOSE, 3, timeout=60)
    code, out, err = results[0]
    assert code == 0, err
    lines = out.splitlines()
    assert lines[:2] == ["from 1 1.0", "from 2 2.0"], out + err
    assert lines[2].startswith("lost:") and "every rank it may come from ([1, 2]) has closed" in lines[2], out
