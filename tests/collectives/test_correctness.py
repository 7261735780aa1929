"""Every collective x op x dtype x algorithm x length on N = 1..4 real ranks, against numpy
on the stacked inputs of all ranks, and bitwise equality of all-reduce results across ranks."""
import numpy as np
import pytest

pytestmark = pytest.mark.timeout(120)

WORLD_SIZES = [1, 2, 3, 4]
ALGORITHMS = ["ring", "ps", "auto"]
DTYPES = [np.float16, np.float32, np.float64, np.int32, np.int64]
OPS = ["sum", "avg", "max", "min", "prod"]
BIG = 1_000_003  # ~1M elements, prime: uneven chunks and many segments
TOLERANCE = {np.float16: 2e-2, np.float32: 1e-5, np.float64: 1e-12}


def lengths(n):
    return sorted({0, 1, max(n - 1, 0), 97})


def make_input(rank, count, dtype, op):
    """Rank ``rank``'s input; the test process rebuilds every rank's copy to stack them."""
    rng = np.random.default_rng([rank, count, np.dtype(dtype).num, OPS.index(op) if op else 0])
    floating = np.issubdtype(dtype, np.floating)
    if op == "prod":
        values = rng.uniform(0.5, 1.5, count) if floating else rng.integers(1, 3, count)
    else:
        values = rng.standard_normal(count) if floating else rng.integers(-1000, 1000, count)
    return values.astype(dtype)


def cases(n, with_ops=True):
    ops = OPS if with_ops else [None]
    small = [(dt, op, c) for dt in DTYPES for op in ops for c in lengths(n)
             if not (op == "avg" and not np.issubdtype(dt, np.floating))]
    return small + [(np.float32, "sum" if with_ops else None, BIG)]


def numpy_reduce(arrays, op, dtype):
    wide = np.stack(arrays).astype(np.float64 if np.issubdtype(dtype, np.floating) else np.int64)
    result = {"sum": wide.sum(0), "avg": wide.mean(0), "max": wide.max(0), "min": wide.min(0),
              "prod": wide.prod(0)}[op]
    return result


def assert_close(got, want, dtype, context):
    if np.issubdtype(dtype, np.floating):
        tol = TOLERANCE[dtype]
        scale = max(1.0, float(np.abs(want).max())) if want.size else 1.0
        ok = np.allclose(got.astype(np.float64), want, rtol=tol, atol=tol * scale)
    else:
        ok = np.array_equal(got.astype(np.int64), want)
    if not ok:
        bad = np.flatnonzero(~np.isclose(got.astype(np.float64), want, rtol=1e-3))[:5]
        raise AssertionError(f"{context}: first bad indices {bad}: got {got[bad]}, want {want[bad]}")


# -- functions run on every rank (module level: they travel to the ranks by reference) ----
def run_all_reduce(comm, algorithm, todo):
    out = []
    for dtype, op, count in todo:
        x = make_input(comm.rank, count, dtype, op)
        assert comm.all_reduce(x, op=op, algorithm=algorithm) is x
        out.append(x)
    return out


def run_reduce_scatter(comm, algorithm, todo):
    out = []
    for dtype, op, count in todo:
        x = make_input(comm.rank, count * comm.world_size, dtype, op)
        before = x.copy()
        res = np.empty(count, dtype)
        comm.reduce_scatter(res, x, op=op, algorithm=algorithm)
        assert np.array_equal(x, before), "reduce_scatter modified its input"
        out.append(res)
    return out


def run_all_gather(comm, algorithm, todo):
    out = []
    for dtype, _, count in todo:
        res = np.empty(count * comm.world_size, dtype)
        comm.all_gather(res, make_input(comm.rank, count, dtype, None), algorithm=algorithm)
        out.append(res)
    return out


def _every_root(comm, todo, call):
    """``call(x, root, op)`` on this rank's input, for every case and every root."""
    out = []
    for dtype, op, count in todo:
        for root in range(comm.world_size):
            x = make_input(comm.rank, count, dtype, op)
            call(x, root, op)
            out.append(x)
    return out


def run_broadcast(comm, algorithm, todo):
    return _every_root(comm, todo, lambda x, root, _: comm.broadcast(x, root=root, algorithm=algorithm))


def run_reduce(comm, algorithm, todo):
    return _every_root(comm, todo, lambda x, root, op: comm.reduce(x, root=root, op=op, algorithm=algorithm))


# -- the tests ----------------------------------------------------------------------------
@pytest.mark.parametrize("n", WORLD_SIZES)
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_all_reduce(pools, n, algorithm):
    todo = cases(n)
    results = pools(n).run(run_all_reduce, algorithm, todo)
    for i, (dtype, op, count) in enumerate(todo):
        want = numpy_reduce([make_input(r, count, dtype, op) for r in range(n)], op, dtype)
        for r in range(n):
            assert results[r][i].dtype == dtype and results[r][i].shape == (count,)
            assert results[r][i].tobytes() == results[0][i].tobytes(), \
                f"rank {r} differs bitwise from rank 0 ({dtype.__name__} {op} {count})"
        assert_close(results[0][i], want, dtype, f"all_reduce {algorithm} {dtype.__name__} {op} n={count}")


@pytest.mark.parametrize("n", WORLD_SIZES)
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_reduce_scatter(pools, n, algorithm):
    todo = [(dt, op, c if c != BIG else BIG // n) for dt, op, c in cases(n)]
    results = pools(n).run(run_reduce_scatter, algorithm, todo)
    for i, (dtype, op, count) in enumerate(todo):
        full = numpy_reduce([make_input(r, count * n, dtype, op) for r in range(n)], op, dtype)
        for r in range(n):
            assert_close(results[r][i], full[r * count:(r + 1) * count], dtype,
                         f"reduce_scatter {algorithm} {dtype.__name__} {op} rank {r} n={count}")


@pytest.mark.parametrize("n", WORLD_SIZES)
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_all_gather(pools, n, algorithm):
    todo = cases(n, with_ops=False)
    results = pools(n).run(run_all_gather, algorithm, todo)
    for i, (dtype, _, count) in enumerate(todo):
        want = np.concatenate([make_input(r, count, dtype, None) for r in range(n)])
        for r in range(n):
            assert np.array_equal(results[r][i], want), f"all_gather {algorithm} rank {r} n={count}"


@pytest.mark.parametrize("n", WORLD_SIZES)
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_broadcast(pools, n, algorithm):
    todo = cases(n, with_ops=False)
    results = pools(n).run(run_broadcast, algorithm, todo)
    k = 0
    for dtype, _, count in todo:
        for root in range(n):
            want = make_input(root, count, dtype, None)
            for r in range(n):
                assert np.array_equal(results[r][k], want), f"broadcast {algorithm} root {root} rank {r}"
            k += 1


@pytest.mark.parametrize("n", WORLD_SIZES)
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_reduce(pools, n, algorithm):
    todo = cases(n)
    results = pools(n).run(run_reduce, algorithm, todo)
    k = 0
    for dtype, op, count in todo:
        inputs = [make_input(r, count, dtype, op) for r in range(n)]
        want = numpy_reduce(inputs, op, dtype)
        for root in range(n):
            for r in range(n):
                if r == root:
                    assert_close(results[r][k], want, dtype, f"reduce {algorithm} {op} root {root}")
                else:
                    assert np.array_equal(results[r][k], inputs[r]), f"reduce changed x on rank {r}"
            k += 1


def run_shapes(comm):
    """Multi-dimensional and 0-d arrays reduce element-wise, keeping their shape."""
    a = np.full((3, 4, 5), comm.rank, np.float64)
    s = np.array(comm.rank + 1, np.int64)
    comm.all_reduce(a)
    comm.all_reduce(s, op="max")
    return a, s


@pytest.mark.parametrize("n", [2, 3])
def test_any_shape(pools, n):
    for a, s in pools(n).run(run_shapes):
        assert a.shape == (3, 4, 5) and np.all(a == sum(range(n)))
        assert s.shape == () and s == n


def run_recursive_doubling(comm, count):
    x = make_input(comm.rank, count, np.float32, "sum")
    comm.all_reduce(x, algorithm="rd")
    return x


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("count", [0, 5, 300_001])
def test_recursive_doubling(pools, n, count):
    results = pools(n).run(run_recursive_doubling, count)
    want = numpy_reduce([make_input(r, count, np.float32, "sum") for r in range(n)], "sum", np.float32)
    for r in range(n):
        assert results[r].tobytes() == results[0].tobytes()
    assert_close(results[0], want, np.float32, "rd")


def run_in_place(comm, algorithm):
    """NCCL's in-place forms: reduce_scatter into this rank's slice of x, all_gather from it."""
    r, n, m = comm.rank, comm.world_size, 1001
    x = make_input(r, m * n, np.float32, "sum")
    keep = x.copy()
    comm.reduce_scatter(x[r * m:(r + 1) * m], x, algorithm=algorithm)
    others = np.delete(np.arange(m * n), np.arange(r * m, (r + 1) * m))
    untouched = bool(np.array_equal(x[others], keep[others]))
    comm.all_gather(x, x[r * m:(r + 1) * m], algorithm=algorithm)
    return x, untouched


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("algorithm", ["ring", "ps"])
def test_in_place_reduce_scatter_then_all_gather(pools, n, algorithm):
    """Reduce-scatter in place, then all-gather in place, is an all-reduce (ZeRO's pattern)."""
    want = numpy_reduce([make_input(r, 1001 * n, np.float32, "sum") for r in range(n)], "sum", np.float32)
    for x, untouched in pools(n).run(run_in_place, algorithm):
        assert untouched, "in-place reduce_scatter wrote outside this rank's slice"
        assert_close(x, want, np.float32, f"in-place {algorithm}")
