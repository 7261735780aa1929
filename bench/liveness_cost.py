"""What the collective credit window and process liveness add to one small all-reduce,
counted and timed rather than read off the wall clock.

    python bench/liveness_cost.py [--nproc 4] [--size 4K] [--calls 2000] [--algorithms ring,auto]

Four ranks on two cores make a 4 KiB call's wall time a matter of who is scheduled when, so
an A/B of whole calls cannot resolve a cost of a few per cent there. This bench instead
counts, on every rank of a real job under ``python -m ringcomm.launch``, how often one call
runs each piece those features put on the path, and times each piece alone on that rank's
live transport (``timeit``, best of 5; the other ranks wait meanwhile):

- ``check_peers``: the liveness look every wait takes as it goes round (goodbyes, the
  /proc clock, peers gone since when);
- the full poll (``zmq_poll`` with timeout 0) against the same poll without the pidfds and
  the wake pipe: the difference is what liveness adds to each full poll;
- ``await_room``: the credit check before each send of collective data (timed with room);
- ``on_retire``: the receiver's look for WANTs to answer as each collective ends;
- credit messages (WANT and GRANT) counted per call; each costs one control message, whose
  price is timed as posting a GRANT that changes nothing at the peer, and each one
  received as its unpacking and filing (``credit received``).

Per rank and algorithm: pieces, runs per call, µs each, µs per call, and their sum against
the median call time measured in the same job: the counted pieces' share of the call. Not
counted: the revocation flag tests (one attribute read each), the link's record of which
peers had room, and the bell rings and channel reads of the credit messages.
"""
import argparse
import json
import math
import os
import subprocess
import sys
import time

import numpy as np
from benchlib import best_seconds

from ringcomm.units import parse_size


def best_us(fn, number):
    return best_seconds(fn, number) * 1e6


class Counter:
    """Wraps ``obj.name`` (an instance attribute) to count its calls."""

    def __init__(self, obj, name):
        self.n, inner = 0, getattr(obj, name)

        def counted(*args, **kwargs):
            self.n += 1
            return inner(*args, **kwargs)
        setattr(obj, name, counted)
        self.restore = lambda: setattr(obj, name, inner)


def measure(comm, size, calls, algorithm):
    import zmq
    t = comm._engine.session
    x = np.ones(size // 4, np.float32)
    for _ in range(200):
        np.copyto(x, 1)
        comm.all_reduce(x, algorithm=algorithm)
    counters = {"check_peers": Counter(t.wire, "check_peers"), "await_room": Counter(t, "await_room")}
    if t.credit is not None:
        counters["credit messages"] = Counter(t.credit, "_send")
        received = [Counter(t.credit, "on_want"), Counter(t.credit, "on_grant")]
        counters["on_retire"] = Counter(t.credit, "on_retire")
    polls = [0]
    real_poll = zmq.zmq_poll

    def counted_poll(*args, **kwargs):
        polls[0] += 1
        return real_poll(*args, **kwargs)
    zmq.zmq_poll = counted_poll
    times = []
    try:
        for _ in range(calls):
            np.copyto(x, 1)
            start = time.perf_counter()
            comm.all_reduce(x, algorithm=algorithm)
            times.append(time.perf_counter() - start)
            if x[0] != comm.world_size:
                raise SystemExit(f"rank {comm.rank}: wrong result {x[0]}")
    finally:
        zmq.zmq_poll = real_poll
        for c in [*counters.values(), *(received if t.credit is not None else [])]:
            c.restore()
    per_call = {name: c.n / calls for name, c in counters.items()}
    if t.credit is not None:
        per_call["credit received"] = sum(c.n for c in received) / calls
    per_call["full poll"] = polls[0] / calls
    unit = {}
    for r in range(comm.world_size):  # one rank at a time times its pieces; the rest wait
        comm.barrier()
        if r == comm.rank:
            with comm._engine._busy:  # the transport is this thread's alone meanwhile
                unit = unit_costs(t, (comm.rank + 1) % comm.world_size, real_poll)
    comm.barrier()
    return {"rank": comm.rank, "algorithm": algorithm, "median_us": float(np.median(times)) * 1e6,
            "per_call": per_call, "unit_us": unit}


def unit_costs(t, peer, poll):
    """µs each piece takes alone on session ``t`` and its wire (``peer``: the one its checks
    name)."""
    w = t.wire
    unit = {"check_peers": best_us(lambda: w.check_peers("bench", peer), 20000),
            "await_room": best_us(lambda: t.await_room(peer, 0, 0, math.inf, "bench"), 50000),
            "on_retire": best_us(lambda: t.credit.on_retire(0), 50000)}
    liveness = set(w.connections.watch.fds) | {w._wake_in}
    bare = [item for item in w._poll_all if item[0] not in liveness]
    full, without = best_us(lambda: poll(w._poll_all, 0), 5000), best_us(lambda: poll(bare, 0), 5000)
    unit["full poll"] = max(0.0, full - without)
    unit["_poll_fds"] = (len(w._poll_all), len(bare))
    unit["credit messages"], unit["credit received"] = control_message_us(t, peer)
    return unit


def control_message_us(t, peer):
    """µs to send one credit message to ``peer`` (a GRANT of none finished on the world,
    which it files and forgets: a grant never lowers what was granted) and to handle one
    received (unpacked and filed; the channel read itself is not included)."""
    from ringcomm.transport import frame
    from ringcomm.transport.frame import Key, Kind
    header = frame.pack(Kind.GRANT, t.rank, Key(0, frame.COLLECTIVE, 0, 0, 0), 0, bytes(16))
    incoming = frame.pack(Kind.GRANT, peer, Key(0, frame.COLLECTIVE, 0, 0, 0), 0, bytes(16))
    return (best_us(lambda: t.wire.post(peer, header, b""), 200),
            best_us(lambda: t._control(frame.unpack(incoming, 0, t.world_size, t.rank)), 20000))


def worker(size, calls, algorithms, out):
    import ringcomm
    comm = ringcomm.init()
    rows = [measure(comm, size, calls, a) for a in algorithms]
    with open(os.path.join(out, f"rank{comm.rank}.json"), "w") as f:
        json.dump(rows, f)
    comm.close()


def table(rows):
    lines = []
    for row in rows:
        total = 0.0
        lines.append(f"rank {row['rank']} {row['algorithm']}: median call {row['median_us']:.1f} µs")
        for name, n in row["per_call"].items():
            each = row["unit_us"].get(name, 0.0)
            total += n * each
            lines.append(f"  {name:<16} {n:8.2f} per call × {each:7.2f} µs = {n * each:7.2f} µs")
        lines.append(f"  {'added':<16} {total:7.2f} µs per call = {100 * total / row['median_us']:.1f} % "
                     f"of the call (poll fds {row['unit_us']['_poll_fds'][0]}, "
                     f"{row['unit_us']['_poll_fds'][1]} without liveness)")
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--size", type=parse_size, default=parse_size("4K"))
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--algorithms", default="ring,auto")
    p.add_argument("--worker", metavar="OUT")
    args = p.parse_args()
    algorithms = args.algorithms.split(",")
    if args.worker:
        return worker(args.size, args.calls, algorithms, args.worker)
    import tempfile
    with tempfile.TemporaryDirectory() as out:
        subprocess.run([sys.executable, "-m", "ringcomm.launch", "--nproc", str(args.nproc), __file__,
                        "--worker", out, "--size", str(args.size), "--calls", str(args.calls),
                        "--algorithms", args.algorithms], check=True, timeout=600)
        rows = []
        for r in range(args.nproc):
            with open(os.path.join(out, f"rank{r}.json")) as f:
                rows += json.load(f)
    print(f"all_reduce float32 {args.size} B, N = {args.nproc}, {args.calls} calls per algorithm")
    print(table(sorted(rows, key=lambda row: (row["algorithm"], row["rank"]))))


if __name__ == "__main__":
    main()
