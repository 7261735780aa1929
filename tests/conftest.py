import pytest

from harness import RankPool


class _Pools:
    """One live pool per world size, replaced when a test breaks it."""

    def __init__(self):
        self._pools = {}

    def __call__(self, world_size):
        pool = self._pools.get(world_size)
        if pool is None or pool.broken:
            pool = self._pools[world_size] = RankPool(world_size)
        return pool

    def close(self):
        for pool in self._pools.values():
            if not pool.broken:
                pool.close()


@pytest.fixture(scope="session")
def pools():
    """``pools(n).run(fn, *args)`` runs ``fn(comm, *args)`` on n ranks of a live job."""
    p = _Pools()
    yield p
    p.close()


@pytest.fixture(scope="session")
def token_file(tmp_path_factory):
    """``token_file(n)``: an .npz of the first n real 16-byte sequences of the standard
    library's source (GPT tests: full-batch training on real text)."""
    import numpy as np

    from ringcomm.train.corpus import stdlib_corpus

    def make(sequences, seq_len=16):
        corpus = stdlib_corpus(seq_len, max_bytes=1 << 16)
        path = tmp_path_factory.mktemp("tokens") / f"t{sequences}x{seq_len}.npz"
        np.savez(path, x=corpus.x[:sequences], y=corpus.y[:sequences])
        return str(path)
    return make
