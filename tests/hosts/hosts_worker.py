"""One rank of a job on an emulated cluster of H hosts × L ranks (tests/hosts): every
hierarchical collective against numpy, the bytes that cross hosts against the formulas, and
what ``auto`` picks. Prints one ``ok <what>`` line per check from rank 0; any failure raises
(the launcher then fails the job)."""
import json
import sys

import numpy as np

import ringcomm
from ringcomm.algorithms.choice import hier_all_reduce_bytes


def inter_sent(comm, fn):
    comm.barrier()
    comm.reset_stats()
    fn()
    stats = comm.stats()
    mine = np.array([stats["bytes_sent_inter_host"], stats["bytes_sent_intra_host"]], np.float64)
    every = np.zeros(2 * comm.world_size)
    comm.all_gather(every, mine)
    return every[0::2], every[1::2]


def main():
    H, L = int(sys.argv[1]), int(sys.argv[2])
    comm = ringcomm.init()
    n, r = comm.world_size, comm.rank
    said = []
    assert comm.topology.hosts == tuple(g // L for g in range(n)), comm.topology
    said.append("topology " + json.dumps(comm.topology.hosts))

    count = n * H * 4096  # float32, over 64 KiB (auto: hier); every chunk of every phase equal
    S = count * 4
    base = np.arange(count, dtype=np.float32) % 1000
    want = base * sum(g + 1 for g in range(n))
    for algorithm in ("hier", "ring", "auto"):
        x = base * (r + 1)
        across, inside = inter_sent(comm, lambda x=x, algorithm=algorithm: comm.all_reduce(x, algorithm=algorithm))
        assert np.array_equal(x, want), algorithm
        if algorithm == "ring":
            boundary = 2 * (n - 1) * S / n
            assert list(across) == [boundary if g % L == L - 1 else 0 for g in range(n)], across
        else:  # auto: hier above 64 KiB across hosts
            h_inside, h_across = hier_all_reduce_bytes(H, L, S)
            assert list(across) == [h_across] * n and list(inside) == [h_inside] * n, (across, inside)
        said.append(f"all_reduce {algorithm}: across hosts per rank {sorted(set(across))}")

    m = 3000
    xs = np.arange(n * m, dtype=np.float64) * (r + 1)
    out = np.zeros(m)
    across, _ = inter_sent(comm, lambda: comm.reduce_scatter(out, xs, algorithm="hier"))
    total = np.arange(n * m, dtype=np.float64) * sum(g + 1 for g in range(n))
    assert np.array_equal(out, total[r * m:(r + 1) * m])
    assert list(across) == [(H - 1) * m * 8] * n, across
    said.append("reduce_scatter hier")

    gathered = np.zeros(n * m)
    across, _ = inter_sent(comm, lambda: comm.all_gather(gathered, np.full(m, r, np.float64), algorithm="hier"))
    assert np.array_equal(gathered, np.repeat(np.arange(n, dtype=np.float64), m))
    assert list(across) == [(H - 1) * m * 8] * n, across
    said.append("all_gather hier")

    for root in range(n):
        b = np.full(70_000, r, np.float32)
        across, _ = inter_sent(comm, lambda b=b, root=root: comm.broadcast(b, root=root, algorithm="auto"))
        assert np.all(b == root) and across.sum() == (H - 1) * b.nbytes, (root, across)
        red = np.full(70_000, r + 1, np.float32)
        across, _ = inter_sent(comm, lambda red=red, root=root: comm.reduce(red, root=root, algorithm="hier"))
        assert np.all(red == (n * (n + 1) // 2 if r == root else r + 1))
        assert across.sum() == (H - 1) * red.nbytes, (root, across)
    said.append("broadcast and reduce from every root: each host boundary crossed once")
    if r == 0:
        print("\n".join(f"ok {line}" for line in said), flush=True)
    comm.close()


if __name__ == "__main__":
    main()
