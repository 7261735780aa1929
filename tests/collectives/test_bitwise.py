"""Bitwise reduce ops (band, bor, bxor) on every integer dtype and bool, and the arithmetic
ops on bool, through every algorithm on N = 2..4 real ranks, against numpy's reduction of
the stacked inputs; a float array with a bitwise op is refused before anything is sent, and
ranks that disagree on the op get CollectiveMismatch."""
import numpy as np
import pytest

from ringcomm.errors import CollectiveMismatch

pytestmark = pytest.mark.timeout(120)

INTEGERS = ["int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"]
BITWISE = {"band": np.bitwise_and, "bor": np.bitwise_or, "bxor": np.bitwise_xor}
ON_BOOL = {**BITWISE, "sum": np.logical_or, "max": np.logical_or, "prod": np.logical_and,
           "min": np.logical_and}
COUNTS = [0, 1, 7, 1000]


def make_input(rank, count, dtype):
    """Rank ``rank``'s input: every bit pattern of the dtype is possible."""
    rng = np.random.default_rng([rank, count, np.dtype(dtype).num])
    return rng.integers(0, 256, count * np.dtype(dtype).itemsize, dtype=np.uint8).view(dtype) \
        if dtype != "bool" else rng.integers(0, 2, count).astype(bool)


def cases():
    return ([(dt, op, c) for dt in INTEGERS for op in BITWISE for c in COUNTS]
            + [("bool", op, c) for op in ON_BOOL for c in COUNTS])


def expected(n, dtype, op, count):
    table = ON_BOOL if dtype == "bool" else BITWISE
    return table[op].reduce(np.stack([make_input(r, count, dtype) for r in range(n)]), axis=0)


def run_all_reduce(comm, algorithm, todo):
    out = []
    for dtype, op, count in todo:
        x = make_input(comm.rank, count, dtype)
        comm.all_reduce(x, op=op, algorithm=algorithm)
        out.append(x)
    return out


def run_reduce_scatter_and_reduce(comm, algorithm, todo):
    out = []
    for dtype, op, count in todo:
        x = make_input(comm.rank, count * comm.world_size, dtype)
        part = np.empty(count, dtype)
        comm.reduce_scatter(part, x, op=op, algorithm=algorithm)
        comm.reduce(x, root=comm.world_size - 1, op=op, algorithm=algorithm)
        out.append((part, x))
    return out


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("algorithm", ["ring", "ps", "rd"])
def test_all_reduce_bitwise_and_bool(pools, n, algorithm):
    todo = cases()
    results = pools(n).run(run_all_reduce, algorithm, todo)
    for i, (dtype, op, count) in enumerate(todo):
        want = expected(n, dtype, op, count)
        for rank in range(n):
            got = results[rank][i]
            assert got.dtype == np.dtype(dtype)
            assert np.array_equal(got, want), f"{algorithm} {op} {dtype} count {count} rank {rank}"


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("algorithm", ["ring", "ps"])
def test_reduce_scatter_and_reduce_bitwise(pools, n, algorithm):
    todo = [(dt, op, c) for dt in ("int32", "uint8", "bool") for op in BITWISE for c in (1, 33)]
    results = pools(n).run(run_reduce_scatter_and_reduce, algorithm, todo)
    for i, (dtype, op, count) in enumerate(todo):
        want = expected(n, dtype, op, count * n)
        for rank in range(n):
            part, whole = results[rank][i]
            assert np.array_equal(part, want[rank * count:(rank + 1) * count]), (algorithm, op, dtype)
            if rank == n - 1:
                assert np.array_equal(whole, want), (algorithm, op, dtype)
            else:  # reduce leaves x alone elsewhere
                assert np.array_equal(whole, make_input(rank, count * n, dtype))


def refused_before_sending(comm):
    sent = comm.stats()["messages_sent"]
    try:
        comm.all_reduce(np.ones(4, np.float32), op="bxor")
    except TypeError as exc:
        return str(exc), comm.stats()["messages_sent"] - sent
    return None, None


def disagreeing_ops(comm):
    x = np.arange(8, dtype=np.int64)
    try:
        comm.all_reduce(x, op="band" if comm.rank == 0 else "bor", algorithm="ring")
    except CollectiveMismatch as exc:
        return str(exc)
    return None


def test_a_float_array_with_a_bitwise_op_is_refused_before_anything_is_sent(pools):
    for message, sent in pools(2).run(refused_before_sending):
        assert message is not None and "integer or bool" in message
        assert sent == 0


def test_ranks_that_disagree_on_the_op_get_a_mismatch(pools):
    for message in pools(2).run(disagreeing_ops):
        assert message is not None and "band" in message and "bor" in message
