"""Where the time of one ring all-reduce goes, per call: copying segments into shared-memory
slots, waiting for the peer's notices, reducing out of the slots, and the rest (the
all-gather's copies out, Python, bookkeeping). Also a one-way hop inside ringcomm: from
one rank's send call to the message sitting in the peer's mailbox.

    python -m ringcomm.launch --nproc 2 bench/steps.py [--sizes 4K,4M] [--iters 200]

It wraps a few internal functions with timers, so its absolute times are a little above the
plain benchmark's; the split is what it is for. Rank 0 prints; CLOCK_MONOTONIC is shared by
the processes of a host, so send and arrival times of different ranks compare directly.
"""
import argparse
import collections
import time

import numpy as np

import ringcomm
from ringcomm.units import human, parse_size
from ringcomm.algorithms import ring
from ringcomm import session
from ringcomm.transport import mailbox, shm

TIMES = collections.defaultdict(list)
SENT, ARRIVED = [], []


def timed(name, fn):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            TIMES[name].append(time.perf_counter() - start)
    return wrapper


def stamped(stamps, fn):
    def wrapper(*args, **kwargs):
        stamps.append(time.perf_counter())
        return fn(*args, **kwargs)
    return wrapper


def instrument():
    shm.OutLane.put = timed("copy into slots", shm.OutLane.put)
    session.Session.recv = timed("wait for the peer", session.Session.recv)
    ring.reduce_into = timed("reduce out of slots", ring.reduce_into)
    session.Session.send = stamped(SENT, session.Session.send)  # every data message, by any route
    mailbox.Mailbox.put = stamped(ARRIVED, mailbox.Mailbox.put)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default="4K,4M")
    p.add_argument("--iters", type=int, default=200)
    args = p.parse_args()
    instrument()
    comm = ringcomm.init()
    for size in (parse_size(s) for s in args.sizes.split(",")):
        x = np.ones(size // 4, np.float32)
        for _ in range(20):
            comm.all_reduce(x, algorithm="ring")
        comm.barrier()
        for stamps in (TIMES, SENT, ARRIVED):
            stamps.clear()
        total = []
        for _ in range(args.iters):
            start = time.perf_counter()
            comm.all_reduce(x, algorithm="ring")
            total.append(time.perf_counter() - start)
        timings, arrived = {k: list(v) for k, v in TIMES.items()}, list(ARRIVED)
        mine = np.array(SENT, np.float64)  # before the all-gather below adds its own
        everyone = np.empty(comm.world_size * len(mine), np.float64)
        comm.all_gather(everyone, mine)  # every rank made the same number of sends
        if comm.rank == 0:
            # in the ring rank 0 hears only from rank n-1, and in the order it sent
            left = everyone[(comm.world_size - 1) * len(mine):]
            hop = np.array(arrived[:len(left)]) - left
            med = 1e6 * np.median(total)
            print(f"all_reduce {human(size)} float32 ring, N={comm.world_size}: median {med:.0f} µs per call")
            accounted = 0.0
            for name, values in timings.items():
                per_call = 1e6 * np.median(np.array(values).reshape(args.iters, -1).sum(1))
                accounted += per_call
                print(f"  {name:22s} {per_call:7.0f} µs  ({len(values) // args.iters} per call)")
            print(f"  {'the rest':22s} {med - accounted:7.0f} µs")
            print(f"  one-way hop (send call -> peer's mailbox): median {1e6 * np.median(hop):.0f} µs", flush=True)
    comm.close()


if __name__ == "__main__":
    main()
