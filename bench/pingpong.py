"""One-way point-to-point latency through a library's public send/recv: half the median
round trip of a ping-pong between ranks 0 and 1.

    python -m ringcomm.launch --nproc 2 bench/pingpong.py [--sizes 8,4K,64K] [--rounds 2000]
    mpirun -np 2 python bench/pingpong.py --library mpi

Rank 0 sends, rank 1 receives into its buffer and sends it back. Rank 0 prints one JSON line,
``{"library": ..., "one_way_s": {"4096": seconds, ...}}``, which ``bench/transport.py`` reads
and sets beside the shared-memory flag floor measured in the same run. Every echo is checked
against what was sent (outside the timed part), so a fast wrong answer is not counted.
"""
import argparse
import json
import statistics
import time

import numpy as np

from ringcomm.units import parse_size


def ringcomm_pair():
    import ringcomm
    comm = ringcomm.init()
    return comm.rank, comm.send, comm.recv, comm.close


def mpi_pair():
    from mpi4py import MPI
    world = MPI.COMM_WORLD
    return world.Get_rank(), (lambda x, dst: world.Send(x, dst)), \
        (lambda x, src: world.Recv(x, src)), (lambda: None)


def pingpong(rank, send, recv, nbytes, rounds):
    """Half of each round trip, s (rank 0); rank 1 echoes and returns []."""
    payload = np.arange(nbytes, dtype=np.uint8)
    back = np.empty_like(payload)
    times = []
    for i in range(rounds + 20):  # 20 warm-up rounds
        if rank == 0:
            back[:1] = ~payload[:1]  # a round that delivers nothing cannot pass the check
            start = time.perf_counter()
            send(payload, 1)
            recv(back, 1)
            times.append((time.perf_counter() - start) / 2)
            if not np.array_equal(back, payload):
                raise SystemExit(f"pingpong: echo {i} of {nbytes} B differs from what was sent")
        else:
            recv(back, 0)
            send(back, 0)
    return times[20:]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--library", choices=("ringcomm", "mpi"), default="ringcomm")
    p.add_argument("--sizes", default="8,4K,64K")
    p.add_argument("--rounds", type=int, default=2000)
    args = p.parse_args(argv)
    rank, send, recv, close = (ringcomm_pair if args.library == "ringcomm" else mpi_pair)()
    result = {}
    for nbytes in (parse_size(s) for s in args.sizes.split(",")):
        times = pingpong(rank, send, recv, nbytes, args.rounds)
        if rank == 0:
            result[str(nbytes)] = statistics.median(times)
    if rank == 0:
        print(json.dumps({"library": args.library, "one_way_s": result}), flush=True)
    close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
