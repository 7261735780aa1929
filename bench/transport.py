"""The ceiling under ringcomm: how fast ZeroMQ alone moves segments between two processes
here, next to a plain memory copy, so the collective numbers can be read against them.

    python bench/transport.py [--segments 128K,512K,2M] [--total 64M] [--repeats 5]

For each segment size a child process PULLs and reduces (``np.add``, as the ring does) what
the parent PUSHes zero-copy over ``ipc://``; the rate is bytes over the time until ZeroMQ
has sent the last segment, median of the repeats. A ring all-reduce on N ranks moves
2(N−1)/N of the buffer through such a link in each direction at once, so at N=2 a 4 MiB
all-reduce cannot beat ≈ 2 × 2 MiB / (this rate), plus the reductions.
"""
import argparse
import os
import statistics
import tempfile
import time

import numpy as np
import zmq

from benchlib import parse_size


def zmq_rate(segment, total, repeats):
    path = os.path.join(tempfile.gettempdir(), f"ringcomm-bench-{os.getpid()}.sock")
    pid = os.fork()
    if pid == 0:
        ctx = zmq.Context()
        pull = ctx.socket(zmq.PULL)
        pull.bind(f"ipc://{path}")
        acc = np.zeros(segment // 4, np.float32)
        for _ in range(repeats * (total // segment)):
            frame = pull.recv(copy=False)
            np.add(acc, np.frombuffer(frame.buffer, np.float32), out=acc)
        os._exit(0)
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.SNDHWM, 0)
    push.connect(f"ipc://{path}")
    data = np.ones(total, np.uint8)
    time.sleep(0.3)
    rates = []
    for _ in range(repeats):
        start = time.perf_counter()
        tracker = None
        for i in range(total // segment):
            tracker = push.send(data[i * segment:(i + 1) * segment], copy=False, track=True)
        tracker.wait()
        rates.append(total / (time.perf_counter() - start) / 1e9)
    os.waitpid(pid, 0)
    ctx.destroy(0)
    if os.path.exists(path):
        os.unlink(path)
    return statistics.median(rates)


def copy_rate(nbytes, repeats):
    a, b = np.ones(nbytes, np.uint8), np.empty(nbytes, np.uint8)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        np.copyto(b, a)
        times.append(time.perf_counter() - start)
    return nbytes / statistics.median(times) / 1e9


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--segments", default="128K,512K,2M")
    p.add_argument("--total", default="64M")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    total = parse_size(args.total)
    print(f"memory copy, 4 MiB: {copy_rate(4 << 20, 20):.1f} GB/s; 64 MiB: {copy_rate(64 << 20, 5):.1f} GB/s")
    for seg in (parse_size(s) for s in args.segments.split(",")):
        print(f"ZeroMQ ipc, {seg >> 10:>5} KiB segments, receiver reducing: "
              f"{zmq_rate(seg, total, args.repeats):.2f} GB/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
