"""np.memmap and a numpy subclass that is only its bytes, as inputs and outputs of real
collectives, alone and beside plain arrays, against numpy on every rank's inputs."""
import os

import numpy as np
import pytest

pytestmark = pytest.mark.timeout(60)

KINDS = ["plain", "memmap", "tagged"]
COUNT = 5  # elements per block


class Tagged(np.ndarray):
    """A subclass that only carries an attribute, as many libraries' arrays do."""

    def __array_finalize__(self, obj):
        self.tag = getattr(obj, "tag", "tagged")


def make(kind, values, folder, name):
    """``values`` as a fresh array of ``kind`` (a memmap lives in a file of ``folder``)."""
    if kind == "plain":
        return values.copy()
    if kind == "memmap":
        a = np.memmap(os.path.join(folder, name), values.dtype, "w+", shape=values.shape)
        a[...] = values
        return a
    return values.copy().view(Tagged)


def rank_input(rank, count):
    return np.arange(count, dtype=np.float32) + 100 * rank


# -- run on every rank ---------------------------------------------------------------------
def run_every_pair(comm, folder):
    """Each collective with ``out`` and ``x`` of every pair of kinds: {(verb, kinds): (the
    call returned the caller's object, the result as a plain array)}."""
    folder = os.path.join(folder, f"rank{comm.rank}")
    os.makedirs(folder, exist_ok=True)
    n, r, c = comm.world_size, comm.rank, COUNT
    results = {}

    def one(verb, out_kind, x_kind, out_values, x_values, call):
        key = f"{verb}-{out_kind}-{x_kind}"
        out = None if out_values is None else make(out_kind, out_values, folder, key + ".out")
        x = None if x_values is None else make(x_kind, x_values, folder, key + ".x")
        got = call(out, x)
        results[verb, out_kind, x_kind] = (got is out, None if out is None else np.array(out))

    for ok in KINDS:
        for xk in KINDS:
            one("all_gather", ok, xk, np.zeros(n * c, np.float32), rank_input(r, c), comm.all_gather)
            one("reduce_scatter", ok, xk, np.zeros(c, np.float32), rank_input(r, n * c), comm.reduce_scatter)
            one("all_to_all", ok, xk, np.zeros(n * c, np.float32), rank_input(r, n * c), comm.all_to_all)
            one("gather", ok, xk, np.zeros(n * c, np.float32) if r == 0 else None, rank_input(r, c),
                lambda out, x: comm.gather(out, x, root=0))
            one("scatter", ok, xk, np.zeros(c, np.float32), rank_input(r, n * c) if r == 0 else None,
                lambda out, x: comm.scatter(out, x, root=0))
    for kind in KINDS:
        one("all_reduce", kind, kind, rank_input(r, c), None, lambda out, _: comm.all_reduce(out))
        one("broadcast", kind, kind, rank_input(r, c), None, lambda out, _: comm.broadcast(out, root=0))
    return results


def run_in_place_memmap(comm, folder):
    """NCCL's in-place all-gather on a memmap: ``x`` is this rank's slice of ``out``; the
    result reaches the file."""
    path = os.path.join(folder, f"in-place-rank{comm.rank}")
    n, r, c = comm.world_size, comm.rank, COUNT
    out = np.memmap(path, np.float32, "w+", shape=(n * c,))
    out[r * c:(r + 1) * c] = rank_input(r, c)
    comm.all_gather(out, out[r * c:(r + 1) * c])
    out.flush()
    return np.fromfile(path, np.float32)


# -- the test process ----------------------------------------------------------------------
def expected(verb, n, r):
    c = COUNT
    if verb == "all_gather" or (verb == "gather" and r == 0):
        return np.concatenate([rank_input(s, c) for s in range(n)])
    if verb == "gather":
        return None
    if verb == "reduce_scatter":
        return sum(rank_input(s, n * c) for s in range(n))[r * c:(r + 1) * c]
    if verb == "all_to_all":
        return np.concatenate([rank_input(s, n * c)[r * c:(r + 1) * c] for s in range(n)])
    if verb == "scatter":
        return rank_input(0, n * c)[r * c:(r + 1) * c]
    if verb == "all_reduce":
        return sum(rank_input(s, c) for s in range(n))
    return rank_input(0, c)  # broadcast from rank 0


@pytest.mark.parametrize("n", [2, 3])
def test_memmap_and_subclass_beside_plain_arrays(pools, n, tmp_path):
    for r, results in enumerate(pools(n).run(run_every_pair, str(tmp_path))):
        assert len(results) == 5 * len(KINDS) ** 2 + 2 * len(KINDS)
        for (verb, out_kind, x_kind), (same, got) in results.items():
            want = expected(verb, n, r)
            context = f"rank {r}: {verb}(out={out_kind}, x={x_kind})"
            assert same, f"{context} did not return out"
            if want is None:
                assert got is None, context
            else:
                np.testing.assert_array_equal(got, want, err_msg=context)


def test_in_place_all_gather_on_a_memmap(pools, tmp_path):
    want = np.concatenate([rank_input(s, COUNT) for s in range(2)])
    for got in pools(2).run(run_in_place_memmap, str(tmp_path)):
        np.testing.assert_array_equal(got, want)
