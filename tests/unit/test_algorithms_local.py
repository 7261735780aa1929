"""The algorithms layer (ring, parameter server, recursive doubling) on the in-process
transport: results against numpy, the shape of each schedule from ``hub.log``, bitwise
agreement between ranks, and what a mismatch or a silent peer does."""
import math
import threading
import time

import numpy as np
import pytest

from ringcomm import signature
from ringcomm.algorithms import ps, rd, ring
from ringcomm.algorithms.chunks import chunk_bounds, segment_table, segments
from ringcomm.collective import error_for
from ringcomm.errors import CollectiveMismatch, CommTimeout, SignatureMismatch
from ringcomm.link import Link, Stats
from ringcomm.ops import parse_op
from ringcomm.transport.frame import Kind
from ringcomm.topology import Topology
from ringcomm.session import Session
from ringcomm.transport.local import LocalHub
from ringcomm.transport.mailbox import AbortNotice

pytestmark = pytest.mark.timeout(30)

SEG = 64          # bytes per segment: 16 float32 / 8 float64, so chunks have several segments
JOIN_S = 20.0     # a rank still running after this long is a hang


# -- running one function per rank ------------------------------------------------------------------

class Ranks:
    """The outcome of one run: the hub (with its log), per-rank results, errors and stats."""

    def __init__(self, hub, results, errors, stats, elapsed):
        self.hub, self.results, self.errors = hub, results, errors
        self.stats, self.elapsed = stats, elapsed

    def raise_errors(self):
        for rank, exc in enumerate(self.errors):
            if exc is not None:
                exc.add_note(f"(raised on rank {rank} of {len(self.errors)})")
                raise exc
        return self

    def data(self, src=None):
        """DATA messages in the log, as (src, dst, key, nbytes), optionally from ``src`` only."""
        return [(s, d, k, nb) for s, d, k, nb, kind in self.hub.log
                if kind == Kind.DATA and (src is None or s == src)]


def run_ranks(n, body, *, dtype=np.float32, sig=None, sigs=None, timeout=10.0, timeouts=None,
              segment_bytes=SEG, comm_id=0, seq=0, hosts=None):
    """Run ``body(rank, link)`` for every rank in its own thread, on one shared LocalHub
    (``hosts[r]``: rank r's host; the links then carry that topology)."""
    hub = LocalHub(n, hosts)
    transports = [Session(hub.transport(r)) for r in range(n)]
    if sigs is None:
        sigs = [sig if sig is not None else signature.pack("all_reduce", dtype, "sum", "ring", 0, 0)] * n
    timeouts = timeouts or [timeout] * n
    stats = [Stats() for _ in range(n)]
    results, errors = [None] * n, [None] * n
    start = time.monotonic()

    def target(r):
        link = Link(transports[r], ranks=list(range(n)), rank=r, comm_id=comm_id, space=0,
                    seq=seq, sig=sigs[r], dtype=dtype, segment_bytes=segment_bytes,
                    deadline=time.monotonic() + timeouts[r], what="test", stats=stats[r],
                    topology=None if hosts is None else Topology.of(hosts, r))
        try:
            results[r] = body(r, link)
        except BaseException as exc:  # noqa: BLE001 - handed back to the test
            errors[r] = exc

    threads = [threading.Thread(target=target, args=(r,), name=f"rank-{r}", daemon=True)
               for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(0.0, start + JOIN_S - time.monotonic()))
    hung = [t.name for t in threads if t.is_alive()]
    if hung:
        pytest.fail(f"ranks still running after {JOIN_S}s: {hung}")
    return Ranks(hub, results, errors, stats, time.monotonic() - start)


def run_ok(n, body, **kwargs):
    return run_ranks(n, body, **kwargs).raise_errors()


# -- inputs and references --------------------------------------------------------------------------

UFUNC = {"sum": np.add, "avg": np.add, "max": np.maximum, "min": np.minimum, "prod": np.multiply}
DTYPE_OPS = [(np.float32, "sum"), (np.float32, "max"), (np.float32, "prod"), (np.float32, "avg"),
             (np.float32, "min"),
             (np.float64, "sum"), (np.float64, "max"), (np.float64, "prod"), (np.float64, "avg"),
             (np.int32, "sum"), (np.int32, "max"), (np.int32, "prod"), (np.int32, "min")]
FEWER_DTYPE_OPS = [(np.float32, "sum"), (np.float64, "avg"), (np.int32, "max"),
                   (np.int32, "prod"), (np.float32, "min")]


def dtype_ops_ids(cases):
    return [f"{np.dtype(d).name}-{op}" for d, op in cases]


def lengths(n):
    """Empty, one element, fewer than n, a prime, and sizes not divisible by n."""
    return sorted({0, 1, max(n - 1, 0), 7, 2 * n + 1, 61, 100})


def stacked(n, count, dtype, op, seed=0):
    rng = np.random.default_rng(seed * 1000 + n * 100 + count)
    if np.issubdtype(dtype, np.floating):
        data = rng.uniform(0.5, 1.5, (n, count)) if op == "prod" else rng.uniform(-10, 10, (n, count))
    else:
        data = rng.integers(-3, 4, (n, count)) if op == "prod" else rng.integers(-1000, 1000, (n, count))
    return data.astype(dtype)


def reference(op, xs):
    """``op`` over the rows of ``xs`` in rank order, in the rows' dtype."""
    acc = xs[0].copy()
    for row in xs[1:]:
        UFUNC[op](acc, row, out=acc)
    if op == "avg":
        np.true_divide(acc, len(xs), out=acc)
    return acc


def assert_matches(got, want):
    assert got.dtype == want.dtype and got.shape == want.shape
    if np.issubdtype(want.dtype, np.floating):
        tol = 1e-5 if want.dtype == np.float32 else 1e-12
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol * 10)
    else:
        np.testing.assert_array_equal(got, want)


def op_sig(collective, dtype, op, algorithm, root=0, count=0):
    return signature.pack(collective, dtype, op, algorithm, root, count)


# -- correctness: all-reduce --------------------------------------------------------------------------

ALL_REDUCE = {
    "ring": lambda link, x, op: ring.all_reduce(link, x, op),
    "ps": lambda link, x, op: ps.all_reduce(link, x, op),
    "rd": lambda link, x, op: rd.all_reduce(link, x, op),
}


def check_all_reduce(algorithm, n, dtype, opname, count):
    xs = stacked(n, count, dtype, opname)
    op = parse_op(opname, dtype)

    def body(r, link):
        x = xs[r].copy()
        ALL_REDUCE[algorithm](link, x, op)
        return x

    run = run_ok(n, body, dtype=dtype, sig=op_sig("all_reduce", dtype, op, algorithm, 0, count))
    want = reference(opname, xs)
    for r in range(n):
        assert_matches(run.results[r], want)
    return run


@pytest.mark.parametrize("dtype, opname", DTYPE_OPS, ids=dtype_ops_ids(DTYPE_OPS))
@pytest.mark.parametrize("n", [1, 2, 3, 4, 5])
def test_ring_all_reduce(n, dtype, opname):
    for count in lengths(n):
        check_all_reduce("ring", n, dtype, opname, count)


@pytest.mark.parametrize("dtype, opname", DTYPE_OPS, ids=dtype_ops_ids(DTYPE_OPS))
@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_ps_all_reduce(n, dtype, opname):
    for count in lengths(n):
        check_all_reduce("ps", n, dtype, opname, count)


@pytest.mark.parametrize("dtype, opname", DTYPE_OPS, ids=dtype_ops_ids(DTYPE_OPS))
@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 6, 8])
def test_rd_all_reduce(n, dtype, opname):
    for count in lengths(n):
        check_all_reduce("rd", n, dtype, opname, count)


@pytest.mark.parametrize("root", [1, 2])
def test_ps_all_reduce_other_root(root):
    xs = stacked(3, 29, np.float64, "sum")
    op = parse_op("sum", np.float64)

    def body(r, link):
        x = xs[r].copy()
        ps.all_reduce(link, x, op, root=root)
        return x

    run = run_ok(3, body, dtype=np.float64)
    for r in range(3):
        assert_matches(run.results[r], reference("sum", xs))
    assert {s for s, d, k, nb in run.data() if k.step == 0} == {0, 1, 2} - {root}
    assert {s for s, d, k, nb in run.data() if k.step == 1} == {root}


@pytest.mark.parametrize("n", [3, 5, 6, 7])
def test_rd_folds_extra_ranks(n):
    """Beyond the largest power of two p, rank r ≥ p folds into r − p (step 0), the p core
    ranks double (steps 1..log2 p), then hand the result back (step log2 p + 1)."""
    p = 1 << (n.bit_length() - 1)
    rounds = p.bit_length() - 1
    op = parse_op("sum", np.float32)
    def body(r, link):
        x = np.full(7, r + 1.0, np.float32)
        rd.all_reduce(link, x, op)
        return x

    run = run_ok(n, body)
    for r in range(n):
        assert np.all(run.results[r] == n * (n + 1) / 2)
        assert run.results[r].tobytes() == run.results[0].tobytes()
        sent = run.data(src=r)
        if r >= p:
            assert [(d, k.step) for _, d, k, _ in sent] == [(r - p, 0)]
        else:
            steps = sorted((k.step, d) for _, d, k, _ in sent)
            want = [(i + 1, r ^ (1 << i)) for i in range(rounds)] + ([(rounds + 1, r + p)] if r + p < n else [])
            assert steps == sorted(want)


def _over_ring_and_ps(argnames, argvalues, ids=None):
    """A decorator: the test for n = 1..5, each of ``argvalues``, ring and ps."""
    def decorate(test):
        test = pytest.mark.parametrize("n", [1, 2, 3, 4, 5])(test)
        test = pytest.mark.parametrize(argnames, argvalues, ids=ids)(test)
        return pytest.mark.parametrize("algorithm", ["ring", "ps"])(test)
    return decorate


over_reductions = _over_ring_and_ps("dtype, opname", FEWER_DTYPE_OPS, dtype_ops_ids(FEWER_DTYPE_OPS))
over_copies = _over_ring_and_ps("dtype", [np.float32, np.float64, np.int32])


# -- correctness: reduce-scatter, all-gather, broadcast, reduce ----------------------------------------

@over_reductions
def test_reduce_scatter(n, dtype, opname, algorithm):
    op = parse_op(opname, dtype)
    for m in lengths(n):
        xs = stacked(n, n * m, dtype, opname)

        def body(r, link, xs=xs, m=m):
            x, out = xs[r].copy(), np.full(m, 77, dtype)
            if algorithm == "ring":
                ring.reduce_scatter(link, out, x, op)
            else:
                ps.reduce_scatter(link, out, x, op)
            np.testing.assert_array_equal(x, xs[r])  # the input is left alone
            return out

        run = run_ok(n, body, dtype=dtype)
        want = reference(opname, xs)
        for r in range(n):
            assert_matches(run.results[r], want[r * m:(r + 1) * m])


@over_copies
def test_all_gather(n, dtype, algorithm):
    for m in lengths(n):
        xs = stacked(n, m, dtype, "sum")

        def body(r, link, xs=xs, m=m):
            x, out = xs[r].copy(), np.full(n * m, 77, dtype)
            if algorithm == "ring":
                ring.all_gather(link, out, x)
            else:
                ps.all_gather(link, out, x)
            np.testing.assert_array_equal(x, xs[r])
            return out

        run = run_ok(n, body, dtype=dtype)
        for r in range(n):
            np.testing.assert_array_equal(run.results[r], xs.reshape(-1), strict=True)


@over_copies
def test_broadcast_from_every_root(n, dtype, algorithm):
    for root in range(n):
        for count in (0, 1, max(n - 1, 0), 61):
            xs = stacked(n, count, dtype, "sum", seed=root)

            def body(r, link, xs=xs, root=root):
                x = xs[r].copy()
                if algorithm == "ring":
                    ring.broadcast(link, x, root)
                else:
                    ps.broadcast(link, x, root)
                return x

            run = run_ok(n, body, dtype=dtype)
            for r in range(n):
                np.testing.assert_array_equal(run.results[r], xs[root], strict=True)


@over_reductions
def test_reduce_to_every_root(n, dtype, opname, algorithm):
    op = parse_op(opname, dtype)
    for root in range(n):
        for count in (0, 1, max(n - 1, 0), 61):
            xs = stacked(n, count, dtype, opname, seed=root)

            def body(r, link, xs=xs, root=root):
                x = xs[r].copy()
                if algorithm == "ring":
                    ring.reduce(link, x, root, op)
                else:
                    ps.reduce(link, x, root, op)
                return x

            run = run_ok(n, body, dtype=dtype)
            assert_matches(run.results[root], reference(opname, xs))
            for r in range(n):
                if r != root:  # everyone else keeps its input
                    np.testing.assert_array_equal(run.results[r], xs[r], strict=True)


# -- structure of the schedules, from hub.log ----------------------------------------------------------

def bytes_by(messages, field):
    totals = {}
    for src, dst, key, nbytes in messages:
        k = {"src": src, "dst": dst, "step": key.step}[field]
        totals[k] = totals.get(k, 0) + nbytes
    return totals


def check_stats(run):
    """Each rank's Link counted exactly the payload bytes and messages the log shows."""
    for r, st in enumerate(run.stats):
        sent = run.data(src=r)
        received = [m for m in run.data() if m[1] == r]
        assert st.bytes_sent == sum(m[3] for m in sent)
        assert st.messages_sent == len(sent)
        assert st.bytes_received == sum(m[3] for m in received)
        assert st.messages_received == len(received)


@pytest.mark.parametrize("n, count, dtype", [(2, 37, np.float32), (3, 37, np.float32),
                                             (4, 37, np.float32), (5, 101, np.float64),
                                             (4, 3, np.float32), (3, 0, np.int32)])
def test_ring_all_reduce_structure(n, count, dtype):
    itemsize = np.dtype(dtype).itemsize
    S = count * itemsize
    table = segment_table(count, n, itemsize, SEG)
    nseg = len(table[0])
    chunk_bytes = [(hi - lo) * itemsize for lo, hi in chunk_bounds(count, n)]
    xs = stacked(n, count, dtype, "sum")
    op = parse_op("sum", dtype)

    def body(r, link):
        x = xs[r].copy()
        ring.all_reduce(link, x, op)

    run = run_ok(n, body, dtype=dtype, comm_id=5, seq=9)
    assert all(kind == Kind.DATA for *_, kind in run.hub.log)
    assert all((k.comm_id, k.space, k.seq) == (5, 0, 9) for _, _, k, _ in run.data())
    for r in range(n):
        sent = run.data(src=r)
        assert {dst for _, dst, _, _ in sent} == {(r + 1) % n}
        assert len(sent) == 2 * (n - 1) * nseg
        assert sorted((k.step, k.segment) for _, _, k, _ in sent) == [
            (s, j) for s in range(2 * (n - 1)) for j in range(nseg)]
        # in step s rank r sends chunk (r - s) mod n, segment by segment
        for _, _, key, nbytes in sent:
            sl = table[(r - key.step) % n][key.segment]
            assert nbytes == (sl.stop - sl.start) * itemsize
            assert nbytes <= SEG
        per_step = bytes_by(sent, "step")
        assert per_step == {s: chunk_bytes[(r - s) % n] for s in range(2 * (n - 1))}
        assert max(per_step.values()) <= -(-S // n) + itemsize
    assert sum(nb for *_, nb in run.data()) == 2 * (n - 1) * S
    check_stats(run)


@pytest.mark.parametrize("collective", ["reduce_scatter", "all_gather"])
@pytest.mark.parametrize("n, m", [(2, 9), (3, 13), (5, 7), (4, 0)])
def test_ring_reduce_scatter_all_gather_structure(collective, n, m):
    S = n * m * 4
    nseg = len(segment_table(n * m, n, 4, SEG)[0])
    op = parse_op("sum", np.float32)

    def body(r, link):
        if collective == "reduce_scatter":
            ring.reduce_scatter(link, np.empty(m, np.float32), np.ones(n * m, np.float32), op)
        else:
            ring.all_gather(link, np.empty(n * m, np.float32), np.ones(m, np.float32))

    run = run_ok(n, body)
    for r in range(n):
        sent = run.data(src=r)
        assert {dst for _, dst, _, _ in sent} == {(r + 1) % n}
        assert len(sent) == (n - 1) * nseg
        assert bytes_by(sent, "step") == {s: m * 4 for s in range(n - 1)}
    assert sum(nb for *_, nb in run.data()) == (n - 1) * S
    check_stats(run)


@pytest.mark.parametrize("n, count", [(2, 40), (3, 40), (5, 17), (4, 0)])
def test_ps_all_reduce_structure(n, count):
    S = count * 4
    nseg = len(segments(count, 4, SEG))
    op = parse_op("sum", np.float32)
    run = run_ok(n, lambda r, link: ps.all_reduce(link, np.ones(count, np.float32), op))
    for r in range(1, n):
        sent = run.data(src=r)
        assert {dst for _, dst, _, _ in sent} == {0}
        assert {k.step for _, _, k, _ in sent} == {0}
        assert len(sent) == nseg
        assert sum(nb for *_, nb in sent) == S
    root_sent = run.data(src=0)
    assert {k.step for _, _, k, _ in root_sent} == ({1} if n > 1 else set())
    assert bytes_by(root_sent, "dst") == {peer: S for peer in range(1, n)}
    assert sum(nb for *_, nb in root_sent) == (n - 1) * S
    check_stats(run)


def test_ps_reduce_scatter_structure():
    n, m = 4, 11
    op = parse_op("sum", np.float32)
    run = run_ok(n, lambda r, link: ps.reduce_scatter(
        link, np.empty(m, np.float32), np.ones(n * m, np.float32), op))
    for r in range(1, n):
        assert bytes_by(run.data(src=r), "dst") == {0: n * m * 4}
    assert bytes_by(run.data(src=0), "dst") == {peer: m * 4 for peer in range(1, n)}


@pytest.mark.parametrize("n", [2, 3, 5])
@pytest.mark.parametrize("root_of", [lambda n: 0, lambda n: n - 1, lambda n: n // 2],
                         ids=["first", "last", "middle"])
def test_ring_broadcast_structure(n, root_of):
    root, count = root_of(n), 45
    S = count * 4
    nseg = len(segments(count, 4, SEG))
    run = run_ok(n, lambda r, link: ring.broadcast(link, np.ones(count, np.float32), root))
    last = (root - 1) % n
    for r in range(n):
        sent = run.data(src=r)
        if r == last:
            assert sent == []
        else:
            assert {dst for _, dst, _, _ in sent} == {(r + 1) % n}
            assert len(sent) == nseg
            assert sum(nb for *_, nb in sent) == S
    assert sum(nb for *_, nb in run.data()) == (n - 1) * S


@pytest.mark.parametrize("n", [2, 3, 5])
@pytest.mark.parametrize("root", [0, 1])
def test_ring_reduce_structure(n, root):
    count = 45
    op = parse_op("max", np.float32)
    run = run_ok(n, lambda r, link: ring.reduce(link, np.ones(count, np.float32), root, op))
    for r in range(n):
        sent = run.data(src=r)
        if r == root:
            assert sent == []
        else:
            assert bytes_by(sent, "dst") == {(r + 1) % n: count * 4}


@pytest.mark.parametrize("n, count", [(2, 30), (4, 30), (8, 5), (4, 0)])
def test_rd_all_reduce_structure(n, count):
    S = count * 4
    rounds = int(math.log2(n))
    nseg = len(segments(count, 4, SEG))
    op = parse_op("sum", np.float32)
    run = run_ok(n, lambda r, link: rd.all_reduce(link, np.ones(count, np.float32), op))
    for r in range(n):
        sent = run.data(src=r)
        assert len(sent) == rounds * nseg
        assert {k.step for _, _, k, _ in sent} == set(range(1, rounds + 1))
        for _, dst, key, _ in sent:
            assert dst == r ^ (1 << (key.step - 1))
        assert bytes_by(sent, "step") == {k: S for k in range(1, rounds + 1)}
    check_stats(run)


# -- every rank holds the same bits ------------------------------------------------------------------

@pytest.mark.parametrize("opname", ["sum", "avg", "prod"])
@pytest.mark.parametrize("algorithm, n", [("ring", 3), ("ring", 5), ("ps", 3), ("ps", 5),
                                          ("rd", 4), ("rd", 8), ("rd", 3), ("rd", 6)])
def test_all_reduce_bitwise_identical_across_ranks(algorithm, n, opname):
    rng = np.random.default_rng(42 + n)
    xs = (rng.uniform(0.9, 1.1, (n, 1001)) if opname == "prod"
          else rng.standard_normal((n, 1001)) * 10 ** rng.uniform(-3, 3, (n, 1001)))
    xs = xs.astype(np.float32)
    op = parse_op(opname, np.float32)

    def body(r, link):
        x = xs[r].copy()
        ALL_REDUCE[algorithm](link, x, op)
        return x.tobytes()

    run = run_ok(n, body, segment_bytes=256)
    assert len(set(run.results)) == 1, "ranks disagree on the result bits"


# -- mismatches and silent peers -------------------------------------------------------------------------

def test_signature_mismatch_raises_instead_of_hanging():
    n, count = 2, 20
    sigs = [op_sig("all_reduce", np.float32, "sum", "ring", 0, count),
            op_sig("all_reduce", np.float32, "max", "ring", 0, count)]
    xs = stacked(n, count, np.float32, "sum")
    op = parse_op("sum", np.float32)
    run = run_ranks(n, lambda r, link: ring.all_reduce(link, xs[r].copy(), op), sigs=sigs,
                    timeout=10.0)
    assert run.elapsed < 5, "a mismatch must be reported at once, not at the deadline"
    for r, exc in enumerate(run.errors):
        assert isinstance(exc, SignatureMismatch), exc
        assert (exc.src, exc.theirs, exc.ours) == (1 - r, sigs[1 - r], sigs[r])


def test_signature_mismatch_from_other_peer_while_waiting():
    # the PS root waits for rank 1 (which never sends) and learns of rank 2's different call
    n, count = 3, 20
    good = op_sig("all_reduce", np.float32, "sum", "ps", 0, count)
    bad = op_sig("reduce", np.float32, "sum", "ps", 0, count)
    op = parse_op("sum", np.float32)

    def body(r, link):
        if r == 0:
            return ps.all_reduce(link, np.ones(count, np.float32), op)
        if r == 2:  # only its step-0 contribution, then it leaves
            for j, sl in enumerate(segments(count, 4, SEG)):
                link.send(0, 0, j, np.ones(count, np.float32)[sl])
        return None

    run = run_ranks(n, body, sigs=[good, good, bad], timeout=10.0)
    exc = run.errors[0]
    assert isinstance(exc, SignatureMismatch), exc
    assert (exc.src, exc.theirs, exc.ours) == (2, bad, good)
    assert run.elapsed < 5


def test_length_mismatch_with_same_signature_is_collective_mismatch():
    sig = op_sig("all_reduce", np.float32, "sum", "ring", 0, 10)
    op = parse_op("sum", np.float32)
    run = run_ranks(2, lambda r, link: ring.all_reduce(link, np.ones(10 + 2 * r, np.float32), op),
                    sig=sig, timeout=10.0)
    for exc in run.errors:
        assert isinstance(exc, CollectiveMismatch) and not isinstance(exc, SignatureMismatch), exc
        assert "bytes" in str(exc)
    assert run.elapsed < 5


def test_silent_peer_times_out_after_deadline():
    op = parse_op("sum", np.float32)

    def body(r, link):
        if r == 0:
            ring.all_reduce(link, np.ones(20, np.float32), op)

    run = run_ranks(2, body, timeouts=[0.5, 10.0])
    exc = run.errors[0]
    assert isinstance(exc, CommTimeout), exc
    assert not exc.remote
    assert "test" in str(exc) and "rank 1" in str(exc)
    assert 0.5 <= run.elapsed < 3
    assert run.errors[1] is None


def test_remote_abort_interrupts_a_running_collective():
    n = 3
    op = parse_op("sum", np.float32)

    def body(r, link):
        if r == 2:
            link.session.abort([0, 1, 2], link.comm_id, link.seq, CommTimeout("rank 2 gave up"))
            return None
        ring.all_reduce(link, np.ones(50, np.float32), op)

    run = run_ranks(n, body, timeout=10.0)
    for r in (0, 1):  # the wait ends with the notice; ringcomm.collective words it for the caller
        exc = run.errors[r]
        assert isinstance(exc, AbortNotice) and exc.kind is CommTimeout, exc
        assert exc.reason == "rank 2 gave up" and exc.src == 2
    assert run.elapsed < 5


def test_poisoned_rank_fails_its_next_collective_even_if_it_only_sends():
    """The communicator checks for poison before every collective, so even a next collective
    in which this rank only sends (a ring broadcast root) fails; it fails exactly once."""
    hub = LocalHub(2)
    t0, t1 = Session(hub.transport(0)), Session(hub.transport(1))
    t0.retire(0, 0)  # rank 0 finished collective #0 (it only sent)
    t1.abort([0, 1], 0, 0, CommTimeout("rank 1 timed out in #0"))
    t0.pump(1.0)     # the late abort is now in rank 0's mailbox
    with pytest.raises(AbortNotice) as info:
        t0.raise_news(0)
    exc = error_for(info.value, 1)
    assert isinstance(exc, CommTimeout) and not exc.remote
    assert str(exc) == "collective #0 on this communicator failed on rank 1: rank 1 timed out in #0"
    t0.raise_news(0)  # once only
