"""The ceiling under ringcomm: how fast ZeroMQ alone moves segments between two processes
here, next to a plain memory copy, so the collective numbers can be read against them.

    python bench/transport.py [--segments 128K,512K,2M] [--total 64M] [--repeats 5]

For each segment size a child process PULLs and reduces (``np.add``, as the ring does) what
the parent PUSHes zero-copy over ``ipc://``; the rate is bytes over the time until ZeroMQ
has sent the last segment, median of the repeats. A ring all-reduce on N ranks moves
2(N−1)/N of the buffer through such a link in each direction at once, so at N=2 a 4 MiB
all-reduce cannot beat ≈ 2 × 2 MiB / (this rate), plus the reductions.

The same for a shared-memory lane (:mod:`ringcomm.transport.shm`, what ranks of one host
use): the parent copies each segment into a slot and sends a notice over ZeroMQ, the child
reduces out of the slot; the rate counts until the child has reduced the last segment. And
one-way latencies (half a ping-pong, median): of a small ZeroMQ message (every ring step pays
it today), of a message through the shared-memory channel
(:mod:`ringcomm.transport.channel`), and the floor under both: two processes spinning on a
counter in shared memory, each writing it when it sees the other's value. Beside that floor,
in the same run: ringcomm's public ``send``/``recv`` and Open MPI's ``Send``/``Recv`` (when
mpirun and mpi4py are here) ping-ponging 8 B, 4 KiB and 64 KiB (``bench/pingpong.py``).
"""
import argparse
import importlib.util
import json
import mmap
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np
import zmq

from ringcomm.units import parse_size
from ringcomm.transport.channel import Channel
from ringcomm.transport.spin import default_spin
from ringcomm.transport.shm import SHM_DIR, InLanes, OutLane, lane_path, new_token

SLOTS = 4


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


def _pair(path, bind):
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PAIR)
    (sock.bind if bind else sock.connect)(f"ipc://{path}")
    return ctx, sock


def _close(ctx, sock):
    """Deliver what is queued before the child's ``os._exit``, which would drop it."""
    sock.close(linger=5000)
    ctx.term()


def lane_rate(segment, total, repeats):
    """GB/s through a lane of ``SLOTS`` slots, the receiver reducing every segment."""
    path = os.path.join(tempfile.gettempdir(), f"ringcomm-bench-lane-{os.getpid()}.sock")
    lane = OutLane(lane_path(SHM_DIR, new_token(), 0, 1), SLOTS, segment)
    count = total // segment
    pid = os.fork()
    if pid == 0:
        ctx, sock = _pair(path, bind=False)
        lanes = InLanes(SLOTS, segment)
        lanes.open(0, lane.path)
        acc = np.zeros(segment // 4, np.float32)
        for _ in range(repeats):
            for _ in range(count):
                view = lanes.take(0, sock.recv(), segment)
                np.add(acc, np.frombuffer(view, np.float32), out=acc)
                del view  # acknowledges the slot
            sock.send(b"done")
        _close(ctx, sock)
        os._exit(0)
    ctx, sock = _pair(path, bind=True)
    data = np.ones(total, np.uint8)
    rates = []
    for _ in range(repeats):
        start = time.perf_counter()
        for i in range(count):
            while (notice := lane.put(data[i * segment:(i + 1) * segment])) is None:
                time.sleep(0)  # every slot still being reduced: wait for an ack
            sock.send(notice)
        sock.recv()
        rates.append(total / (time.perf_counter() - start) / 1e9)
    os.waitpid(pid, 0)
    ctx.destroy(0)
    lane.close()
    os.unlink(path)
    return statistics.median(rates)


def hop_latency(rounds=2000):
    """One-way time of an 8-byte ZeroMQ message over ipc (median of half round trips), s."""
    path = os.path.join(tempfile.gettempdir(), f"ringcomm-bench-hop-{os.getpid()}.sock")
    pid = os.fork()
    if pid == 0:
        ctx, sock = _pair(path, bind=False)
        for _ in range(rounds + 1):
            sock.send(sock.recv())
        _close(ctx, sock)
        os._exit(0)
    ctx, sock = _pair(path, bind=True)
    sock.send(b"x" * 8)
    sock.recv()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        sock.send(b"x" * 8)
        sock.recv()
        times.append((time.perf_counter() - start) / 2)
    os.waitpid(pid, 0)
    ctx.destroy(0)
    os.unlink(path)
    return statistics.median(times)


def flag_floor(rounds=20000):
    """One-way time of a spin on a shared-memory counter between two processes, s: the
    latency floor of any same-host handoff written in Python."""
    mapping = mmap.mmap(-1, 128)
    flag = np.frombuffer(mapping, np.uint64, 1)
    pid = os.fork()
    if pid == 0:
        for i in range(1, 2 * rounds + 2, 2):
            while flag[0] != i:
                pass
            flag[0] = i + 1
        os._exit(0)
    times = []
    for i in range(1, 2 * rounds + 2, 2):
        start = time.perf_counter()
        flag[0] = i
        while flag[0] != i + 1:
            pass
        times.append((time.perf_counter() - start) / 2)
    os.waitpid(pid, 0)
    return statistics.median(times[1:])


def channel_latency(nbytes, rounds=5000):
    """One-way time of an ``nbytes`` message through a pair of channels (a ping-pong), s."""
    spin = default_spin(2)
    there, there_rx = Channel.pair(1 << 20, spin)
    back, back_rx = Channel.pair(1 << 20, spin)
    pid = os.fork()
    if pid == 0:
        for _ in range(rounds + 1):
            back.send(there_rx.recv())
            there_rx.release()
        os._exit(0)
    payload = np.ones(nbytes, np.uint8)
    times = []
    for _ in range(rounds + 1):
        start = time.perf_counter()
        there.send(payload)
        back_rx.recv()
        back_rx.release()
        times.append((time.perf_counter() - start) / 2)
    os.waitpid(pid, 0)
    return statistics.median(times[1:])


def public_latency(library, sizes="8,4K,64K"):
    """``{bytes: one-way s}`` of ``library``'s public send/recv (bench/pingpong.py), or the
    reason it could not run (a string)."""
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "pingpong.py")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if library == "ringcomm":
        cmd = [sys.executable, "-m", "ringcomm.launch", "--nproc", "2", script]
    elif shutil.which("mpirun") is None or importlib.util.find_spec("mpi4py") is None:
        return "mpirun or mpi4py missing"
    else:
        root = ["--allow-run-as-root"] if os.geteuid() == 0 else []
        cmd = ["mpirun", "-n", "2", *root, sys.executable, script, "--library", "mpi"]
    done = subprocess.run([*cmd, "--sizes", sizes], capture_output=True, text=True, env=env, timeout=300)
    lines = [line for line in done.stdout.splitlines() if '"one_way_s"' in line]
    if done.returncode or not lines:
        return f"failed (rc {done.returncode}): {done.stderr.strip()[-300:]}"
    return {int(k): v for k, v in json.loads(lines[-1].split("]: ", 1)[-1])["one_way_s"].items()}


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
    p.add_argument("--segments", default="128K,512K,1M,4M")
    p.add_argument("--total", default="64M")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    total = parse_size(args.total)
    print(f"memory copy, 4 MiB: {copy_rate(4 << 20, 20):.1f} GB/s; 64 MiB: {copy_rate(64 << 20, 5):.1f} GB/s")
    floor = flag_floor()
    print(f"shared-memory flag one-way latency (the floor): {floor * 1e6:.2f} µs")
    for size in (8, 4 << 10, 64 << 10):
        t = channel_latency(size)
        print(f"shared-memory channel one-way latency, {size:>6} B: {t * 1e6:.2f} µs ({t / floor:.1f}x the floor)")
    for library in ("ringcomm", "openmpi"):
        times = public_latency(library)
        if isinstance(times, str):
            print(f"{library} send/recv: not measured, {times}")
            continue
        for size, t in times.items():
            print(f"{library} send/recv one-way latency, {size:>6} B: {t * 1e6:.2f} µs ({t / floor:.1f}x the floor)")
    for seg in (parse_size(s) for s in args.segments.split(",")):
        print(f"shared-memory lane, {SLOTS} slots of {seg >> 10:>5} KiB, receiver reducing: "
              f"{lane_rate(seg, total, args.repeats):.2f} GB/s")
    # before any zero-copy send: a child forked after pyzmq's garbage-collector thread
    # started can hang in ZeroMQ
    print(f"ZeroMQ ipc one-way latency of an 8-byte message: {hop_latency() * 1e6:.0f} µs")
    for seg in (parse_size(s) for s in args.segments.split(",")):
        print(f"ZeroMQ ipc, {seg >> 10:>5} KiB segments, receiver reducing: "
              f"{zmq_rate(seg, total, args.repeats):.2f} GB/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
