"""Ring vs parameter server where the network, not the CPU, is the limit (emulated cluster).

    sudo python bench/cluster.py [--world-sizes 2,3,4,6,8] [--size 8M] [--rate 1gbit]
                                 [--iters 5] [--warmup 1] [--timeout 120] [--out bench/out]
    sudo python bench/cluster.py --cleanup     # remove namespaces left by a killed run

Builds a private cluster out of Linux network namespaces: a namespace ``rcbench-P-br``
holding a bridge, and per rank i a namespace ``rcbench-P-r<i>`` (P: this process id) whose
only interface is one end of a veth pair (10.77.0.<10+i>/24); the other end is a port of
the bridge. Each rank's link is rate-limited in both directions with ``tc`` (tbf on the
rank's end for its upload, on the bridge port for its download), so every rank has its
own full-duplex link of ``--rate`` B into a non-blocking switch. Nothing is added to the
host's own namespace; the addresses exist only inside these namespaces; everything made is
removed at the end, also on Ctrl-C, SIGTERM or an exception. Needs root, ``ip`` and ``tc``
(Debian iproute2); says so and exits 2 where namespaces cannot be made.

For each N the ranks run ringcomm over TCP (RINGCOMM_TRANSPORT=tcp, RINGCOMM_IFADDR = the
rank's address, MASTER_ADDR = rank 0's), started directly with RANK / WORLD_SIZE /
LOCAL_RANK / LOCAL_WORLD_SIZE / MASTER_ADDR / MASTER_PORT / RINGCOMM_SECRET, and time
float32 SUM all-reduces of S bytes with ``ring`` and ``ps`` (median over iterations of the
slowest rank; results checked). Predicted, with B = rate x payload share of a frame
(1448 / 1514 for TCP with timestamps at MTU 1500), measured once with a plain TCP stream:

  ring  every link carries 2(N-1)S/N each way, all links at once:  t = 2(N-1)S / (N B)
  ps    rank 0's link carries (N-1)S in, then (N-1)S out (ringcomm's PS finishes the
        reduction before it sends; the two phases do not overlap):  t = 2(N-1)S / B

so PS time grows ~linearly with N while the ring's stays nearly flat (-> 2S/B).
Writes ``cluster.json`` to ``--out``; bench/plots.py draws it.
"""
import argparse
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import numpy as np

import benchlib as bl
from ringcomm.units import human, parse_size

SUBNET, FIRST_HOST, PORT = "10.77.0", 10, 29611
PREFIX = "rcbench-"
PAYLOAD_SHARE = 1448 / 1514  # TCP payload per Ethernet frame (MTU 1500, timestamps on)
STARTED = []  # every process this run started (see spawn)


def sh(*argv, check=True):
    """Run ip/tc; raise with its stderr if it fails."""
    proc = subprocess.run(argv, check=False, capture_output=True, text=True, timeout=30)
    if check and proc.returncode:
        raise RuntimeError(f"{' '.join(argv)}: {proc.stderr.strip() or proc.returncode}")
    return proc


class Cluster:
    """The namespaces, veth pairs, bridge and qdiscs of one run; ``close`` removes them."""

    def __init__(self, n, rate):
        self.tag, self.n, self.rate, self.spaces = f"{PREFIX}{os.getpid()}-", n, rate, []
        self.bridge = self.tag + "br"

    def ns(self, i):
        return f"{self.tag}r{i}"

    def addr(self, i):
        return f"{SUBNET}.{FIRST_HOST + i}"

    def build(self):
        self._netns(self.bridge)
        sh("ip", "-n", self.bridge, "link", "add", "br0", "type", "bridge")
        sh("ip", "-n", self.bridge, "link", "set", "br0", "up")
        for i in range(self.n):
            ns, port, nic = self.ns(i), f"p{i}", f"v{i}"
            self._netns(ns)
            sh("ip", "link", "add", nic, "netns", ns, "type", "veth", "peer", "name", port,
               "netns", self.bridge)
            sh("ip", "-n", self.bridge, "link", "set", port, "master", "br0", "up")
            sh("ip", "-n", ns, "addr", "add", f"{self.addr(i)}/24", "dev", nic)
            sh("ip", "-n", ns, "link", "set", nic, "up")
            sh("ip", "-n", ns, "link", "set", "lo", "up")
            for space, dev in ((ns, nic), (self.bridge, port)):  # upload, download
                sh("tc", "-n", space, "qdisc", "add", "dev", dev, "root", "tbf", "rate", self.rate,
                   "burst", "256kb", "latency", "100ms")

    def _netns(self, name):
        sh("ip", "netns", "add", name)
        self.spaces.append(name)
        sh("ip", "-n", name, "link", "set", "lo", "up")

    def close(self):
        for name in reversed(self.spaces):  # deleting a namespace deletes its veth ends
            sh("ip", "netns", "delete", name, check=False)
        self.spaces = []


def stale_namespaces():
    names = sh("ip", "netns", "list").stdout.split("\n")
    return [line.split()[0] for line in names if line.startswith(PREFIX)]


def preflight():
    """None if this process can build the cluster, else why not."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, veth and tc)"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"{' and '.join(missing)} not found: apt-get install iproute2"
    probe = f"{PREFIX}{os.getpid()}-probe"
    result = sh("ip", "netns", "add", probe, check=False)
    if result.returncode:
        return f"network namespaces are not permitted here: {result.stderr.strip()}"
    sh("ip", "netns", "delete", probe, check=False)
    return None


def spawn(cluster, i, argv, env=None):
    """Start ``argv`` inside rank i's namespace, in its own process group."""
    proc = subprocess.Popen(["ip", "netns", "exec", cluster.ns(i), *argv], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    STARTED.append(proc)
    return proc


def kill_started():
    """SIGKILL every process group this run started that is still running."""
    for proc in STARTED:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
    STARTED.clear()


def calibrate(cluster, nbytes=32 << 20):
    """Bytes per second of one plain TCP stream from rank 1 to rank 0 over the shaped links."""
    me, where = os.path.abspath(__file__), f"{cluster.addr(0)}:{PORT + 1}"
    sink = spawn(cluster, 0, [sys.executable, me, "--tcp-sink", where, "--size", str(nbytes)])
    source = spawn(cluster, 1, [sys.executable, me, "--tcp-source", where, "--size", str(nbytes)])
    out, _ = sink.communicate(timeout=60)
    source.communicate(timeout=10)
    if sink.returncode or source.returncode:
        raise RuntimeError(f"calibration stream failed: {out[-500:]}")
    return float(out.split()[-1])


def tcp_sink(where, nbytes):
    """Accept one connection, receive nbytes, print bytes/s from the first byte to the last."""
    host, port = where.rsplit(":", 1)
    with socket.create_server((host, int(port))) as server:
        server.settimeout(30)
        conn, _ = server.accept()
        got, first = 0, None
        while got < nbytes:
            data = conn.recv(1 << 20)
            if not data:
                raise SystemExit(f"stream ended after {got} bytes")
            first = first or time.perf_counter()
            got += len(data)
        print(got / (time.perf_counter() - first))


def tcp_source(where, nbytes):
    host, port = where.rsplit(":", 1)
    for _ in range(200):  # the sink may not listen yet
        try:
            with socket.create_connection((host, int(port)), timeout=30) as conn:
                conn.sendall(bytes(nbytes))
                return
        except ConnectionRefusedError:
            time.sleep(0.05)
    raise SystemExit(f"could not connect to {where}")


def run_world(cluster, n, args, result_path):
    """Start n ranks in their namespaces; return rank 0's JSON results."""
    secret, procs = secrets.token_hex(16), []
    try:  # the ranks leave when done; on any failure kill_started() stops the rest
        for i in range(n):
            env = dict(os.environ, RANK=str(i), WORLD_SIZE=str(n), LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                       MASTER_ADDR=cluster.addr(0), MASTER_PORT=str(PORT), RINGCOMM_SECRET=secret,
                       RINGCOMM_TRANSPORT="tcp", RINGCOMM_IFADDR=cluster.addr(i),
                       RINGCOMM_TIMEOUT=str(args.timeout), OMP_NUM_THREADS="1")
            procs.append(spawn(cluster, i, [sys.executable, "-u", os.path.abspath(__file__), "--worker",
                                            "--size", str(args.size), "--iters", str(args.iters),
                                            "--warmup", str(args.warmup), "--result", result_path], env))
        deadline, outputs = time.monotonic() + args.timeout, []
        for proc in procs:
            outputs.append(proc.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
        failed = [(i, p.returncode, out) for i, (p, out) in enumerate(zip(procs, outputs)) if p.returncode]
        if failed:
            said = "\n".join(f"--- rank {i} (exit {rc}):\n{out[-1500:]}" for i, rc, out in failed)
            raise RuntimeError(f"N={n}: ranks {[f[0] for f in failed]} failed\n{said}")
        with open(result_path) as f:
            return json.load(f)
    finally:
        kill_started()


def worker(args):
    """One rank: time ring and PS all-reduce of args.size bytes; rank 0 writes the result."""
    import ringcomm

    comm = ringcomm.init()
    n, r, count = comm.world_size, comm.rank, args.size // 4
    base, want = bl.input_for(r, count, np.float32), bl.reduced(comm.world_size, count, np.float32)
    x, out = base.copy(), {"world_size": n, "size_bytes": count * 4}
    for algo in ("ring", "ps"):
        times, wrong = np.empty(args.iters), 0
        for i in range(-args.warmup, args.iters):
            np.copyto(x, base)
            comm.barrier()
            comm.reset_stats()
            start = time.perf_counter()
            comm.all_reduce(x, "sum", algo)
            if i >= 0:
                times[i] = time.perf_counter() - start
            wrong += bl.count_wrong(x, want)
        sent = comm.stats()["bytes_sent"]
        comm.all_reduce(times, op="max")
        total = np.array([wrong, sent], np.int64)
        comm.all_reduce(total, op="sum")
        out[algo] = dict(bl.summarize(times), wrong=int(total[0]), rank0_bytes_sent=sent,
                         total_bytes_sent=int(total[1]))
    if r == 0:
        with open(args.result, "w") as f:
            json.dump(out, f)
    comm.close()


def predicted(algo, n, size, bandwidth):
    return 2 * (n - 1) * size / (n * bandwidth) if algo == "ring" else 2 * (n - 1) * size / bandwidth


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world-sizes", default="2,3,4,6,8")
    p.add_argument("--size", type=parse_size, default=8 << 20)
    p.add_argument("--rate", default="1gbit", help="tc rate of every rank's link, each way")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--timeout", type=float, default=120.0, help="seconds per world size")
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "out"))
    p.add_argument("--cleanup", action="store_true", help="remove rcbench-* namespaces and exit")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--tcp-sink", help=argparse.SUPPRESS)
    p.add_argument("--tcp-source", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return worker(args)
    if args.tcp_sink or args.tcp_source:
        return tcp_sink(args.tcp_sink, args.size) if args.tcp_sink else tcp_source(args.tcp_source, args.size)
    if args.cleanup:
        for name in stale_namespaces():
            sh("ip", "netns", "delete", name, check=False)
            print(f"removed namespace {name}")
        return 0
    problem = preflight()
    if problem:
        print(f"bench/cluster.py: cannot emulate a cluster here: {problem}", file=sys.stderr)
        return 2
    sizes = sorted({int(n) for n in args.world_sizes.split(",")})
    if sizes[0] < 2 or sizes[-1] > 200:
        p.error("world sizes must be in [2, 200]")

    def stop(signum, _frame):
        raise KeyboardInterrupt(f"signal {signum}")
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, stop)
    cluster, rows = Cluster(sizes[-1], args.rate), []
    tmp = tempfile.mkdtemp(prefix="rcbench-")
    try:
        try:
            cluster.build()
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            print(f"bench/cluster.py: cannot emulate a cluster here: {exc}", file=sys.stderr)
            return 2
        bandwidth = calibrate(cluster)
        model = bl.parse_rate(args.rate) / 8 * PAYLOAD_SHARE
        print(f"# emulated cluster: {sizes[-1]} namespaces on a bridge, {args.rate} per rank link each "
              f"way; one TCP stream measured {bandwidth / 1e6:.1f} MB/s (model {model / 1e6:.1f} MB/s)")
        print(f"# all_reduce float32 sum of S = {human(args.size)}; time = median of {args.iters} "
              f"calls, slowest rank; predicted with B = {bandwidth / 1e6:.1f} MB/s measured")
        print(f"#{'N':>3} {'algorithm':>9} {'time(ms)':>10} {'predicted':>10} {'meas/pred':>9} "
              f"{'busbw':>7} {'rank0 sent':>11} {'formula':>11} {'#wrong':>6} {'ps/ring':>8}")
        for n in sizes:
            res = run_world(cluster, n, args, os.path.join(tmp, f"n{n}.json"))
            S = res["size_bytes"]
            for algo in ("ring", "ps"):
                cell = res[algo]
                pred = predicted(algo, n, S, bandwidth)
                sent_formula = 2 * (n - 1) * S / n if algo == "ring" else (n - 1) * S
                row = dict(cell, world_size=n, algorithm=algo, size_bytes=S, predicted_us=pred * 1e6,
                           rank0_sent_formula=sent_formula, rate=args.rate, link_bytes_per_s=bandwidth,
                           busbw=bl.metrics("all_reduce", n, S, cell["time_us"] / 1e6)[1])
                rows.append(row)
                ratio = res["ps"]["time_us"] / res["ring"]["time_us"] if algo == "ps" else None
                print(f" {n:>3} {algo:>9} {cell['time_us'] / 1e3:>10.1f} {pred * 1e3:>10.1f} "
                      f"{cell['time_us'] / 1e6 / pred:>9.2f} {bl.fmt_bw(row['busbw']):>7} "
                      f"{cell['rank0_bytes_sent']:>11} {sent_formula:>11.0f} {cell['wrong']:>6} "
                      + (f"{ratio:>8.2f}" if ratio else ""), flush=True)
        path = os.path.join(args.out, "cluster.json")
        bl.write_json(path, {"benchmark": "cluster", "ringcomm": bl.ringcomm_source(),
                             "argv": sys.argv, "machine": bl.machine(),
                             "rate": args.rate, "link_bytes_per_s": bandwidth, "model_bytes_per_s": model,
                             "rows": rows})
        print(f"# wrote {path}")
        return 1 if any(row["wrong"] for row in rows) else 0
    except KeyboardInterrupt as exc:
        print(f"bench/cluster.py: interrupted ({exc or 'Ctrl-C'}); cleaning up", file=sys.stderr)
        return 130
    finally:
        kill_started()
        cluster.close()
        shutil.rmtree(tmp, ignore_errors=True)
        left = [s for s in stale_namespaces() if s.startswith(cluster.tag)]
        if left:
            print(f"bench/cluster.py: could not remove {left}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
