"""gather, scatter and all_to_all (equal and uneven blocks) on N = 2..4 real ranks, against
numpy on every rank's input; their payload bytes in stats() against the formulas; ranks that
disagree on sizes or splits get CollectiveMismatch, and bad arguments raise before sending."""
import numpy as np
import pytest

from harness import refusals
from ringcomm.errors import CollectiveMismatch

pytestmark = pytest.mark.timeout(120)

DTYPES = ["float32", "float16", "int64", "uint8", "bool"]
COUNTS = [0, 1, 5, 40_000]  # 40 000 float32: more than one lane segment of 64 KiB


def make(rank, count, dtype, salt=0):
    rng = np.random.default_rng([rank, count, np.dtype(dtype).num, salt])
    if dtype == "bool":
        return rng.integers(0, 2, count).astype(bool)
    return (rng.integers(-100, 100, count) if np.dtype(dtype).kind == "i" else
            rng.integers(0, 200, count)).astype(dtype)


def splits_for(n, salt):
    """A consistent uneven split table: rank r sends table[r][s] elements to rank s."""
    rng = np.random.default_rng(salt)
    return rng.integers(0, 6, (n, n)).tolist()


def run_gather_scatter(comm, todo):
    n, r = comm.world_size, comm.rank
    got = []
    for dtype, count, root in todo:
        x = make(r, count, dtype)
        out = np.empty(n * count, dtype) if r == root else None
        assert comm.gather(out, x, root=root) is out
        whole = make(root, n * count, dtype, salt=1) if r == root else None
        mine = np.empty(count, dtype)
        assert comm.scatter(mine, whole, root=root) is mine
        got.append((out, mine))
    return got


def run_all_to_all(comm, todo):
    n, r = comm.world_size, comm.rank
    got = []
    for dtype, count, table in todo:
        if table is None:
            x, out = make(r, n * count, dtype), np.empty(n * count, dtype)
            comm.all_to_all(out, x)
        else:
            ins, outs = table[r], [table[s][r] for s in range(n)]
            x, out = make(r, sum(ins), dtype), np.empty(sum(outs), dtype)
            comm.all_to_all(out, x, out_splits=outs, in_splits=ins)
        got.append(out)
    return got


@pytest.mark.parametrize("n", [2, 3, 4])
def test_gather_and_scatter_match_numpy(pools, n):
    todo = [(dt, c, root) for dt in DTYPES for c in COUNTS[:3] for root in range(n)]
    todo += [("float32", COUNTS[3], n - 1)]
    results = pools(n).run(run_gather_scatter, todo)
    for i, (dtype, count, root) in enumerate(todo):
        want = np.concatenate([make(r, count, dtype) for r in range(n)])
        whole = make(root, n * count, dtype, salt=1)
        for rank in range(n):
            out, mine = results[rank][i]
            if rank == root:
                assert np.array_equal(out, want), (dtype, count, root)
            else:
                assert out is None
            assert np.array_equal(mine, whole[rank * count:(rank + 1) * count]), (dtype, count, root, rank)


@pytest.mark.parametrize("n", [2, 3, 4])
def test_all_to_all_equal_and_uneven_match_numpy(pools, n):
    todo = [(dt, c, None) for dt in DTYPES for c in COUNTS[:3]] + [("float32", 10_000, None)]
    todo += [(dt, 0, splits_for(n, salt)) for dt in ("float64", "int32", "bool") for salt in range(3)]
    todo += [("float32", 0, [[20_000 * (r + s + 1) for s in range(n)] for r in range(n)])]
    results = pools(n).run(run_all_to_all, todo)
    for i, (dtype, count, table) in enumerate(todo):
        if table is None:
            table = [[count] * n for _ in range(n)]
            sent = [make(r, n * count, dtype) for r in range(n)]
        else:
            sent = [make(r, sum(table[r]), dtype) for r in range(n)]
        for dst in range(n):
            want = np.concatenate([sent[src][sum(table[src][:dst]):sum(table[src][:dst + 1])]
                                   for src in range(n)])
            assert np.array_equal(results[dst][i], want), (dtype, count, table, dst)


def traffic(comm):
    n, r, m = comm.world_size, comm.rank, 1000
    counts = {}
    for name, call in (
            ("gather", lambda: comm.gather(np.empty(n * m, np.float32) if r == 0 else None,
                                           np.ones(m, np.float32), root=0)),
            ("scatter", lambda: comm.scatter(np.empty(m, np.float32),
                                             np.ones(n * m, np.float32) if r == 0 else None, root=0)),
            ("all_to_all", lambda: comm.all_to_all(np.empty(n * m, np.float32), np.ones(n * m, np.float32)))):
        comm.reset_stats()
        call()
        stats = comm.stats()
        counts[name] = (stats["bytes_sent"], stats["bytes_received"])
    return counts


def test_payload_bytes_match_the_formulas(pools):
    n, m = 4, 4000  # 1000 float32 per block
    for rank, counts in enumerate(pools(n).run(traffic)):
        root = rank == 0
        assert counts["gather"] == ((0, (n - 1) * m) if root else (m, 0))
        assert counts["scatter"] == (((n - 1) * m, 0) if root else (0, m))
        assert counts["all_to_all"] == ((n - 1) * m, (n - 1) * m)


def disagreements(comm):
    r = comm.rank
    errors = {}
    try:  # rank 0 sends 2 elements to rank 1, which expects 3
        ins = [1, 2] if r == 0 else [1, 1]
        outs = [1, 1] if r == 0 else [3, 1]
        comm.all_to_all(np.empty(sum(outs), np.float32), np.ones(sum(ins), np.float32),
                        out_splits=outs, in_splits=ins)
    except CollectiveMismatch as exc:
        errors["splits"] = str(exc)
    try:  # the ranks gather blocks of different sizes
        x = np.ones(3 + r, np.float32)
        comm.gather(np.empty(2 * x.size, np.float32) if r == 0 else None, x, root=0)
    except CollectiveMismatch as exc:
        errors["sizes"] = str(exc)
    return errors


def test_ranks_that_disagree_get_a_mismatch_on_every_rank(pools):
    for errors in pools(2).run(disagreements):
        assert "expects 3" in errors["splits"]
        assert "gather" in errors["sizes"]


def misuse(comm):
    n, r = comm.world_size, comm.rank
    sent = comm.stats()["messages_sent"]
    calls = {
        "gather out too small": lambda: comm.gather(np.empty(n, np.float32), np.ones(2, np.float32), root=r),
        "scatter x too small": lambda: comm.scatter(np.empty(2, np.float32), np.ones(n, np.float32), root=r),
        "gather dtypes": lambda: comm.gather(np.empty(2 * n, np.float64), np.ones(2, np.float32), root=r),
        "bad root": lambda: comm.scatter(np.empty(2, np.float32), None, root=n),
        "splits length": lambda: comm.all_to_all(np.empty(3), np.ones(3), in_splits=[3]),
        "splits sum": lambda: comm.all_to_all(np.empty(4), np.ones(4), in_splits=[1] * n, out_splits=[2] * n),
        "negative split": lambda: comm.all_to_all(np.empty(0), np.ones(0), in_splits=[-1, 1] + [0] * (n - 2)),
        "indivisible": lambda: comm.all_to_all(np.empty(n + 1), np.ones(n + 1)),
        "overlap": lambda: comm.all_to_all(*(lambda b: (b[:n], b[1:n + 1]))(np.ones(n + 1))),
    }
    raised = refusals(calls)
    return raised, comm.stats()["messages_sent"] - sent


def test_bad_arguments_raise_before_anything_is_sent(pools):
    for raised, sent in pools(3).run(misuse):
        assert all(raised.values()), [k for k, v in raised.items() if v is None]
        assert sent == 0


def root_disagreement(comm):
    try:
        x = np.ones(2, np.float32)
        comm.gather(np.empty(2 * comm.world_size, np.float32), x, root=comm.rank)
    except CollectiveMismatch as exc:
        return str(exc)
    return None


def test_ranks_that_disagree_on_the_root_are_told_which_roots(pools):
    for message in pools(2).run(root_disagreement):
        assert message is not None and "root=0" in message and "root=1" in message


def uneven_with_a_wrong_algorithm(comm):
    n = comm.world_size
    sent = comm.stats()["messages_sent"]
    errors = []
    for algorithm in ("ps", "tree"):
        try:
            comm.all_to_all(np.empty(n), np.ones(n), out_splits=[1] * n, in_splits=[1] * n, algorithm=algorithm)
        except ValueError as exc:
            errors.append(str(exc))
    return errors, comm.stats()["messages_sent"] - sent


def test_an_uneven_all_to_all_refuses_a_wrong_algorithm_before_the_splits_travel(pools):
    for errors, sent in pools(3).run(uneven_with_a_wrong_algorithm):
        assert len(errors) == 2 and "runs with: auto, ring" in errors[0] and "unknown algorithm" in errors[1]
        assert sent == 0
