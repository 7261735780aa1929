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
