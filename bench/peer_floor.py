"""The shared-memory floor of bench/peers.py: an all-reduce with nothing but one shared
mapping, numpy and spinning flags, one process per rank.

    RANK=r WORLD_SIZE=n python bench/peer_floor.py --control 127.0.0.1:PORT --mapping /dev/shm/F

No messages, no headers, no checks, no library: what any Python process that all-reduces
through shared memory on this host pays at least, for the copies and the synchronisation.
The driver makes the mapping (``mapping_bytes(n)``, zeroed); rank r owns one 64-byte flag
line and one *slot* of ``SLOT_BYTES``, and the ranks share one result area. A buffer goes
through in *pieces* of at most one slot:

1. every rank copies its piece into its slot;            barrier
2. rank r reduces its chunk of the piece over all slots, in rank order, into the result
   area (a reduce-scatter, each byte read once);          barrier
3. every rank copies the whole result piece out;         barrier (the slots are free again)

A barrier is a store of this rank's epoch into its flag line, then a wait until every
rank's line holds it (x86-64 keeps each rank's stores in order, so the data written before
a flag is visible once the flag is). The waiter spins, or yields its core between looks
when ranks outnumber cores. Three barriers per piece are about six flag latencies; the
copies move 3S + S/n bytes per rank.
"""
import argparse
import mmap
import os
import time

import numpy as np

import control

SLOT_BYTES = 8 << 20  # the largest piece; larger buffers go through in pieces
LINE = 64
BARRIER_TIMEOUT_S = 60.0


def mapping_bytes(n):
    """Size of the mapping for n ranks: flag lines, n slots, the result area."""
    return LINE * n + (n + 1) * SLOT_BYTES


class Floor:
    def __init__(self, path, rank, n):
        fd = os.open(path, os.O_RDWR)
        try:
            self._map = mmap.mmap(fd, mapping_bytes(n))
        finally:
            os.close(fd)
        self.rank, self.n = rank, n
        self._flags = np.frombuffer(self._map, np.uint64, n * LINE // 8).reshape(n, LINE // 8)[:, 0]
        data = np.frombuffer(self._map, np.uint8, (n + 1) * SLOT_BYTES, LINE * n)
        self._slots = data[:n * SLOT_BYTES].reshape(n, SLOT_BYTES)
        self._result = data[n * SLOT_BYTES:]
        self._epoch = 0
        self._yield = n > len(os.sched_getaffinity(0))

    def barrier(self):
        self._epoch += 1
        epoch, flags = self._epoch, self._flags
        flags[self.rank] = epoch
        deadline = time.monotonic() + BARRIER_TIMEOUT_S
        looks = 0
        while flags.min() < epoch:
            if self._yield:
                os.sched_yield()
            looks += 1
            if looks % 1024 == 0 and time.monotonic() > deadline:
                raise TimeoutError(f"rank {self.rank}: a peer never reached barrier {epoch}")

    def all_reduce(self, x, _algorithm=None):
        """In place on a flat float32 array: the sum over ranks."""
        n, rank = self.n, self.rank
        slots = self._slots.view(np.float32)
        result = self._result.view(np.float32)
        piece = SLOT_BYTES // 4
        for start in range(0, max(x.size, 1), piece):
            p = min(piece, x.size - start)
            slots[rank, :p] = x[start:start + p]
            self.barrier()
            lo, hi = rank * p // n, (rank + 1) * p // n
            np.copyto(result[lo:hi], slots[0, lo:hi])
            for r in range(1, n):
                np.add(result[lo:hi], slots[r, lo:hi], out=result[lo:hi])
            self.barrier()
            x[start:start + p] = result[:p]
            self.barrier()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--control", required=True, help="the driver's HOST:PORT")
    parser.add_argument("--mapping", required=True, help="the shared file the driver made")
    args = parser.parse_args()
    rank, n = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    floor = Floor(args.mapping, rank, n)
    control.serve(args.control, "floor", rank, n, floor.barrier, floor.all_reduce,
                  version=f"numpy {np.__version__} over one shared mapping")


if __name__ == "__main__":
    main()
