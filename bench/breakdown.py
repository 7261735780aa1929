"""Where the microseconds of one small all-reduce go.

    python bench/breakdown.py [--size 4K] [--calls 3000]

Two parts, one run:

1. **End to end**: two ranks under ``python -m ringcomm.launch --nproc 2`` run ``--calls``
   all-reduces of ``--size`` bytes of float32 (``auto``: recursive doubling, one exchange
   through the shared-memory channels), each rank timing its own calls; the median of rank
   0's. Next to it, the one-way latency of a bare shared-memory flag between two processes
   (bench/transport.py's floor) and of one channel message.
2. **The pieces**: each step of that path timed alone in this process on the real objects
   (``timeit``, best of 5): argument checks, signature, thread guard, the call and link
   objects, header pack and unpack, the mailbox, the channel, the reduction. Each is
   multiplied by how often one call runs it (the path in ``Communicator._collective`` →
   ``Call.run`` → ``rd.all_reduce``; counted with cProfile on the real loop).

The table lists piece, runs per call, µs each and µs per call, then their sum against the
end-to-end time: the rest is the glue between the pieces (Python calls and lookups the
pieces do not include) and the wait for the peer.
"""
import argparse
import os
import re
import subprocess
import sys
import threading
import time

import numpy as np
from benchlib import best_seconds

from ringcomm import checks, ops, signature
from ringcomm.algorithms import schedule
from ringcomm.algorithms.choice import auto_algorithm
from ringcomm.algorithms.chunks import segments
from ringcomm.collective import Call
from ringcomm.link import Link, Stats
from ringcomm.threads import ThreadGuard
from ringcomm.transport import frame
from ringcomm.transport.channel import Channel
from ringcomm.transport.fence import fence
from ringcomm.transport.frame import Key, Kind, Space
from ringcomm.transport.mailbox import Mailbox
from ringcomm.units import parse_size

HERE = os.path.dirname(os.path.abspath(__file__))


def worker(size, calls):
    """Under the launcher: time ``calls`` all-reduces; rank 0 prints the median."""
    import ringcomm
    comm = ringcomm.init()
    x = np.ones(size // 4, np.float32)
    for _ in range(300):
        np.copyto(x, 1)
        comm.all_reduce(x)
    times = []
    for _ in range(calls):
        np.copyto(x, 1)
        start = time.perf_counter()
        comm.all_reduce(x)
        times.append(time.perf_counter() - start)
        if x[0] != comm.world_size:
            raise SystemExit(f"wrong result {x[0]}")
    if comm.rank == 0:
        print(f"median_us={np.median(times) * 1e6:.2f}", flush=True)
    comm.close()


def end_to_end(size, calls):
    out = subprocess.run([sys.executable, "-m", "ringcomm.launch", "--nproc", "2", __file__,
                          "--worker", "--size", str(size), "--calls", str(calls)],
                         capture_output=True, text=True, timeout=300, check=True).stdout
    return float(re.search(r"median_us=([\d.]+)", out).group(1))


def pieces(size):
    """[(piece, runs per call, seconds each)] for one all-reduce of ``size`` bytes, N = 2."""
    x = np.ones(size // 4, np.float32)
    incoming = np.ones(size // 4, np.float32)
    guard = ThreadGuard("world", revoke=print)  # never called: one thread
    sig = signature.pack("all_reduce", x.dtype, ops.ReduceOp.SUM, "rd", 0, x.size)
    key = Key(1, 0, 1, 1, 0)
    header = frame.pack(Kind.DATA, 1, key, x.nbytes, sig)
    parsed = frame.unpack(header, x.nbytes, 2, 0)
    payload = x.tobytes()
    mailbox = Mailbox(1 << 20, 2)
    tx, rx = Channel.pair(1 << 20)
    lock = threading.Lock()

    class Transport:
        def started(self, comm_id, seq):
            pass

    transport = Transport()

    def guarded():  # the steady state: the one thread that uses the communicator
        guard.leave(guard.enter("all_reduce"))

    def link():
        Link(transport, ranks=(0, 1), rank=0, comm_id=1, space=Space.COLLECTIVE, seq=5, sig=sig, dtype=x.dtype,
             segment_bytes=1 << 20, deadline=time.monotonic() + 60, what="w", stats=Stats())

    def channel_round_trip():  # one message in and out: the sender's copy and the receiver's
        tx.try_send(header, x)
        rx.take()

    def mailbox_round_trip():
        mailbox.put(parsed, payload)
        mailbox.take(1, key, sig)

    steps = [
        ("check_array (type, dtype, layout)", 1, lambda: checks.check_array(x, "x")),
        ("parse_op (cached)", 1, lambda: ops.parse_op("sum", x.dtype)),
        ("auto choice + schedule lookup", 1, lambda: (auto_algorithm("all_reduce", 2, size, True),
                                                      schedule("rd", "all_reduce"))),
        ("signature (cached pack)", 1, lambda: signature.pack("all_reduce", x.dtype, ops.ReduceOp.SUM,
                                                               "rd", 0, x.size)),
        ("thread guard enter + leave", 1, guarded),
        ("engine lock + call name", 1, lambda: (lock.acquire(), f"all_reduce #{7} on world", lock.release())),
        ("Call object", 1, lambda: Call(comm=None, body=None, space=Space.COLLECTIVE, seq=5, sig=sig,
                                           dtype=x.dtype, what="w", device=None, result=None)),
        ("Link object", 1, link),
        ("segments", 1, lambda: segments(x.size, 4, 1 << 20)),
        ("Key (send and receive)", 2, lambda: frame.new_key((1, Space.COLLECTIVE, 5, 1, 0))),
        ("header pack", 1, lambda: frame.pack(Kind.DATA, 1, key, x.nbytes, sig)),
        ("channel: copy in, fence, copy out", 1, channel_round_trip),
        ("fence alone (inside the above)", 0, fence),
        ("header unpack and checks", 1, lambda: frame.unpack(header, x.nbytes, 2, 0)),
        ("mailbox put + take", 1, mailbox_round_trip),
        ("mailbox take that misses", 1, lambda: mailbox.take(1, key, sig)),
        ("frombuffer of the payload", 1, lambda: np.frombuffer(payload, np.float32, x.size)),
        ("reduction (np.add)", 1, lambda: np.add(x, incoming, out=x)),
        ("mailbox retire", 1, lambda: mailbox.retire(1, 0)),
        ("clock reads (deadline, pumps)", 5, time.monotonic),
    ]
    timed = []
    for name, runs, fn in steps:
        number = 20000
        timed.append((name, runs, best_seconds(fn, number)))
    return timed


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", type=parse_size, default=4 << 10)
    p.add_argument("--calls", type=int, default=3000)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return worker(args.size, args.calls)
    import transport as bench_transport
    total = end_to_end(args.size, args.calls)
    floor = bench_transport.flag_floor()
    channel = bench_transport.channel_latency(args.size)
    rows = pieces(args.size)
    print(f"# one all_reduce of {args.size} B float32, 2 ranks on this host (auto: recursive doubling)")
    print(f"# end to end, median of {args.calls} calls: {total:.1f} µs; one-way shared-memory flag "
          f"{floor * 1e6:.2f} µs; one channel message one way {channel * 1e6:.1f} µs")
    print(f"# {'piece':<38} {'runs':>4} {'µs each':>8} {'µs/call':>8}")
    summed = 0.0
    for name, runs, each in rows:
        summed += runs * each
        print(f"  {name:<38} {runs:>4} {each * 1e6:>8.2f} {runs * each * 1e6:>8.2f}")
    print(f"  {'sum of the pieces':<38} {'':>4} {'':>8} {summed * 1e6:>8.2f}")
    print(f"  {'the rest: glue between them, the wait':<38} {'':>4} {'':>8} {total - summed * 1e6:>8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
