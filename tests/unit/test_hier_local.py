"""The hierarchical schedules on the in-process transport with ranks placed on "hosts":
results against numpy for even, interleaved and uneven layouts, bitwise agreement between
ranks, and the bytes that cross hosts against the formulas (hier against the flat ring)."""
import numpy as np
import pytest

from ringcomm.algorithms import hier, ring
from ringcomm.algorithms.choice import auto_algorithm, hier_all_reduce_bytes
from ringcomm.ops import parse_op
from ringcomm.topology import Topology

from test_algorithms_local import FEWER_DTYPE_OPS, assert_matches, dtype_ops_ids, lengths, op_sig, \
    reference, run_ok, stacked

pytestmark = pytest.mark.timeout(60)

LAYOUTS = {
    "2x2": [0, 0, 1, 1],
    "2x3": [0, 0, 0, 1, 1, 1],
    "3x2": [0, 0, 1, 1, 2, 2],
    "interleaved": [0, 1, 0, 1],          # group ranks alternate between the hosts
    "mixed": [0, 1, 1, 0],
    "uneven": [0, 0, 0, 1],
    "uneven3": [0, 1, 1, 2, 2, 2],
    "one-host": [0, 0, 0],
    "one-per-host": [0, 1, 2],
}


def run_hier(hosts, body, dtype, collective, op=None, root=0, count=0, **kw):
    sig = op_sig(collective, dtype, op, "hier", root, count)
    return run_ok(len(hosts), body, dtype=dtype, sig=sig, hosts=hosts, **kw)


def inter_sent(run):
    return [s.bytes_sent_inter_host for s in run.stats]


# -- topology ----------------------------------------------------------------------------------

def test_topology_numbers_hosts_by_their_lowest_rank():
    t = Topology.of(["b", "a", "b", "a"], rank=1)
    assert t.hosts == (0, 1, 0, 1)
    assert t.host_ranks == ((0, 2), (1, 3))
    assert t.per_host == 2 and t.layered and t.num_hosts == 2
    assert [t.local_rank(r) for r in range(4)] == [0, 0, 1, 1]
    assert t.rail(0) == (0, 1) and t.rail(1) == (2, 3)
    assert t.remote == (True, False, True, False)
    assert Topology.of(["x"] * 3, 0).remote is None and not Topology.of(["x"] * 3, 0).layered
    assert not Topology.of(["a", "b"], 0).layered                 # one rank per host
    assert Topology.of(["a", "a", "b"], 0).per_host is None       # uneven


def test_auto_picks_hier_only_where_hosts_are_layered():
    two_by_two, flat = Topology.of([0, 0, 1, 1], 0), Topology.of([0, 1, 2, 3], 0)
    uneven = Topology.of([0, 0, 0, 1], 0)
    big = 4 << 20
    assert auto_algorithm("all_reduce", 4, big, topology=two_by_two) == "hier"
    assert auto_algorithm("all_reduce", 4, 4096, topology=two_by_two) == "rd"  # latency wins
    assert auto_algorithm("all_reduce", 4, big, topology=flat) == "ring"
    assert auto_algorithm("all_reduce", 4, big, topology=uneven) == "hier"
    for collective in ("reduce_scatter", "all_gather"):
        assert auto_algorithm(collective, 4, 64, topology=two_by_two) == "hier"
        assert auto_algorithm(collective, 4, big, topology=uneven) == "ring"
        assert auto_algorithm(collective, 4, big, topology=flat) == "ring"
    for collective in ("broadcast", "reduce"):
        assert auto_algorithm(collective, 4, big, topology=two_by_two) == "hier"
        assert auto_algorithm(collective, 4, 1024, topology=two_by_two) == "ps"
    assert auto_algorithm("all_reduce", 4, big) == "ring"  # no topology: one host


# -- all-reduce --------------------------------------------------------------------------------


def all_reduce_of(xs, op):
    """A run_hier body: rank r all-reduces a copy of ``xs[r]`` with ``op`` and returns it."""
    def body(r, link):
        x = xs[r].copy()
        hier.all_reduce(link, x, op)
        return x
    return body

@pytest.mark.parametrize("dtype, opname", FEWER_DTYPE_OPS + [(np.float32, "avg")],
                         ids=dtype_ops_ids(FEWER_DTYPE_OPS + [(np.float32, "avg")]))
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_all_reduce_matches_numpy_and_agrees_bitwise(layout, dtype, opname):
    hosts = LAYOUTS[layout]
    n = len(hosts)
    op = parse_op(opname, dtype)
    for count in lengths(n):
        xs = stacked(n, count, dtype, opname)

        run = run_hier(hosts, all_reduce_of(xs, op), dtype, "all_reduce", op, count=count)
        assert_matches(run.results[0], reference(opname, xs))
        for r in range(1, n):
            assert run.results[r].tobytes() == run.results[0].tobytes(), (count, r)


@pytest.mark.parametrize("layout", ["2x2", "2x3", "3x2", "interleaved"])
def test_all_reduce_bytes_across_hosts_follow_the_formula(layout):
    """hier: every rank sends 2(H−1)S/(HL) across hosts and 2(L−1)S/L inside its host; the
    flat ring over the same ranks sends 2(N−1)S/N across from each rank at a host boundary."""
    hosts = LAYOUTS[layout]
    top = Topology.of(hosts, 0)
    n, H, L = len(hosts), top.num_hosts, top.per_host
    count = n * H * 16  # every chunk of every phase the same size
    S = count * 4
    xs = stacked(n, count, np.float32, "sum")
    inside, across = hier_all_reduce_bytes(H, L, S)

    def run_with(fn, algorithm):
        def body(r, link):
            x = xs[r].copy()
            fn(link, x, parse_op("sum", np.float32))
            return x
        return run_ok(n, body, sig=op_sig("all_reduce", np.float32, "sum", algorithm, 0, count),
                      hosts=hosts, segment_bytes=1 << 20)

    h = run_with(hier.all_reduce, "hier")
    assert inter_sent(h) == [across] * n
    assert [s.bytes_sent - s.bytes_sent_inter_host for s in h.stats] == [inside] * n
    assert [s.bytes_received_inter_host for s in h.stats] == [across] * n
    flat = run_with(ring.all_reduce, "ring")
    boundary = [r for r in range(n) if hosts[(r + 1) % n] != hosts[r]]
    assert inter_sent(flat) == [2 * (n - 1) * S / n if r in boundary else 0 for r in range(n)]
    assert max(inter_sent(flat)) / across == pytest.approx(L * (n - 1) * H / (n * (H - 1)))


def test_uneven_hosts_cross_through_their_leaders():
    hosts = LAYOUTS["uneven3"]  # hosts {0}, {1, 2}, {3, 4, 5}
    n, count = len(hosts), 60
    xs = stacked(n, count, np.float64, "sum")

    run = run_hier(hosts, all_reduce_of(xs, parse_op("sum", np.float64)), np.float64, "all_reduce", "sum", count=count)
    S = count * 8
    assert inter_sent(run) == [2 * 2 / 3 * S, 2 * 2 / 3 * S, 0, 2 * 2 / 3 * S, 0, 0]


# -- reduce-scatter and all-gather ----------------------------------------------------------------

@pytest.mark.parametrize("dtype, opname", [(np.float32, "sum"), (np.float64, "avg"), (np.int32, "max")])
@pytest.mark.parametrize("layout", ["2x2", "2x3", "3x2", "interleaved", "uneven", "one-host"])
def test_reduce_scatter_matches_numpy(layout, dtype, opname):
    hosts = LAYOUTS[layout]
    n = len(hosts)
    op = parse_op(opname, dtype)
    for m in (0, 1, 5, 16):
        xs = stacked(n, n * m, dtype, opname)

        def body(r, link, xs=xs, m=m):
            x = xs[r].copy()
            out = np.zeros(m, dtype)
            hier.reduce_scatter(link, out, x, op)
            assert np.array_equal(x, xs[r])  # x is not modified
            return out

        run = run_hier(hosts, body, dtype, "reduce_scatter", op, count=n * m)
        want = reference(opname, xs)
        for r in range(n):
            assert_matches(run.results[r], want[r * m:(r + 1) * m])
        top = Topology.of(hosts, 0)
        if top.layered and top.per_host:
            assert inter_sent(run) == [(top.num_hosts - 1) * m * xs.itemsize] * n


@pytest.mark.parametrize("layout", ["2x2", "2x3", "3x2", "interleaved", "uneven", "one-per-host"])
def test_all_gather_matches_numpy(layout):
    hosts = LAYOUTS[layout]
    n = len(hosts)
    for m in (0, 1, 7, 16):
        xs = stacked(n, m, np.float32, "sum")

        def body(r, link, m=m, xs=xs):
            out = np.zeros(n * m, np.float32)
            hier.all_gather(link, out, xs[r].copy())
            return out

        run = run_hier(hosts, body, np.float32, "all_gather", count=m)
        for r in range(n):
            assert np.array_equal(run.results[r], xs.reshape(-1))
        top = Topology.of(hosts, 0)
        if top.layered and top.per_host:
            assert inter_sent(run) == [(top.num_hosts - 1) * m * 4] * n


# -- broadcast and reduce ---------------------------------------------------------------------------

@pytest.mark.parametrize("layout", ["2x2", "3x2", "interleaved", "uneven3", "one-per-host"])
@pytest.mark.parametrize("count", [0, 3, 100, 40_000])  # 40 000 float32: the chain inside hosts
def test_broadcast_crosses_each_host_boundary_once(layout, count):
    hosts = LAYOUTS[layout]
    n = len(hosts)
    H = Topology.of(hosts, 0).num_hosts
    for root in range(n):
        xs = stacked(n, count, np.float32, "sum")

        def body(r, link, xs=xs, root=root):
            x = xs[r].copy()
            hier.broadcast(link, x, root)
            return x

        run = run_hier(hosts, body, np.float32, "broadcast", root=root, count=count,
                       segment_bytes=1 << 16)
        for r in range(n):
            assert np.array_equal(run.results[r], xs[root])
        assert sum(inter_sent(run)) == (H - 1) * count * 4


@pytest.mark.parametrize("dtype, opname", [(np.float64, "sum"), (np.float32, "avg"), (np.int32, "prod")])
@pytest.mark.parametrize("layout", ["2x2", "interleaved", "uneven3"])
def test_reduce_reaches_the_root_only(layout, dtype, opname):
    hosts = LAYOUTS[layout]
    n, count = len(hosts), 33
    op = parse_op(opname, dtype)
    H = Topology.of(hosts, 0).num_hosts
    for root in range(n):
        xs = stacked(n, count, dtype, opname)

        def body(r, link, xs=xs, root=root):
            x = xs[r].copy()
            hier.reduce(link, x, root, op)
            return x

        run = run_hier(hosts, body, dtype, "reduce", op, root=root, count=count)
        assert_matches(run.results[root], reference(opname, xs))
        for r in range(n):
            if r != root:
                assert np.array_equal(run.results[r], xs[r])  # left unchanged
        assert sum(inter_sent(run)) == (H - 1) * count * xs.itemsize


@pytest.mark.parametrize("layout", ["2x2", "mixed", "3x2", "uneven"])
def test_reduce_scatter_and_all_gather_in_place_as_zero_calls_them(layout):
    """ZeRO's shard is a view of the flat buffer: reduce-scatter into ``x``'s own slice,
    all-gather from ``out``'s own slice."""
    hosts = LAYOUTS[layout]
    n, m = len(hosts), 37
    xs = stacked(n, n * m, np.float64, "sum")

    def body(r, link):
        flat = xs[r].copy()
        hier.reduce_scatter(link, flat[r * m:(r + 1) * m], flat, parse_op("sum", np.float64))
        mine = flat[r * m:(r + 1) * m].copy()
        hier.all_gather(link, flat, flat[r * m:(r + 1) * m])
        return mine, flat

    run = run_hier(hosts, body, np.float64, "reduce_scatter", "sum", count=n * m)
    want = reference("sum", xs)
    for r in range(n):
        assert_matches(run.results[r][0], want[r * m:(r + 1) * m])
        assert np.array_equal(run.results[r][1], np.concatenate([run.results[g][0] for g in range(n)]))


@pytest.mark.parametrize("layout", ["uneven3", "mixed"])
def test_large_buffers_take_the_chain_inside_hosts(layout):
    """Over 64 KiB (where reduce inside a host takes the chain rather than the fan-out) and
    with 4 KiB segments (every chunk cut into several), uneven hosts still get exact results."""
    hosts = LAYOUTS[layout]
    n, count = len(hosts), 20011
    xs = stacked(n, count, np.float64, "sum")

    run = run_hier(hosts, all_reduce_of(xs, parse_op("sum", np.float64)), np.float64, "all_reduce", "sum",
                   count=count, segment_bytes=4096)
    for r in range(n):
        assert_matches(run.results[r], reference("sum", xs))
        assert run.results[r].tobytes() == run.results[0].tobytes()
    for root in (0, n - 1):
        def reduce_body(r, link, root=root):
            y = xs[r].copy()
            hier.reduce(link, y, root, parse_op("sum", np.float64))
            return y

        run = run_hier(hosts, reduce_body, np.float64, "reduce", "sum", root=root, count=count, segment_bytes=4096)
        assert_matches(run.results[root], reference("sum", xs))
        assert all(np.array_equal(run.results[r], xs[r]) for r in range(n) if r != root)
