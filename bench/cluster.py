"""Ring, hierarchical and parameter-server all-reduce where the network is the limit (emulated cluster).

    sudo python bench/cluster.py [--hosts 2,4] [--ranks-per-host 1,2] [--size 64M]
                                 [--rate 1gbit] [--delay 100us] [--iters 3] [--training]
    sudo python bench/cluster.py --cleanup     # remove namespaces left by a killed run

For each H in ``--hosts`` and L in ``--ranks-per-host`` it builds an emulated cluster of H
hosts with L ranks each (bench/netns.py: a network namespace per host, a ``tc``-shaped link
of ``--rate`` per rank, each way, into one switch; ``--delay`` one way on each link), starts
one ``python -m ringcomm.launch`` per host, and times float32 SUM all-reduces of S bytes
with ``ring``, ``hier`` and ``ps`` (median over iterations of the slowest rank; every result
checked). Predicted with B = the bandwidth of one plain TCP stream measured over the shaped
links, N = HL ranks:

  ring  every step of the ring crosses a host boundary somewhere, S/N per step on a link,
        2(N−1) steps:                                    t = 2(N−1)S / (N B)
  hier  inside each host (a reduce-scatter and an all-gather through shared memory: t_host,
        measured as a ring all-reduce of S among one host's ranks), then a ring of H along
        each rail, every rank on its own link:           t = t_host + 2(H−1)S / (H L B)
  ps    rank 0's link carries (N−L)S in (the ranks of the other hosts), then (N−L)S out
        (ringcomm's PS finishes the reduction before it sends):  t = 2(N−L)S / B

With L = 1, ``hier`` is the ring. Next to each time: the bytes the busiest rank sent across
hosts per call (``stats()``), against the formulas (ring: 2(N−1)S/N from a rank at a host
boundary; hier: 2(H−1)S/(HL) from every rank; ps: (N−L)S from rank 0), and what the
busiest link carried per call by the kernel's own count (payload, headers and the job's
start-up; each algorithm runs as a job of its own).

Connections between hosts are encrypted (CURVE), as ringcomm does by default across hosts;
``--encryption off`` measures without, ``both`` each way (its cost).

``--training``: on each cluster also a DDP and a ZeRO-2 step (``python -m ringcomm.train``,
the model of bench/cluster_training.py; the trainer runs ``hier`` where hosts hold several
ranks), rank 0's median step time. Writes ``cluster.json`` to ``--out``; bench/plots.py
draws it.
"""
import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import numpy as np

import benchlib as bl
import netns
from cluster_training import PORT, train
from ringcomm.algorithms.choice import all_reduce_bytes, hier_all_reduce_bytes
from ringcomm.units import human, parse_size

PAYLOAD_SHARE = 1448 / 1514  # TCP payload per Ethernet frame (MTU 1500, timestamps on)
ALGORITHMS = ("ring", "hier", "ps")
ENCRYPTION = {"on": (True,), "off": (False,), "both": (True, False)}


def calibrate(cluster, nbytes=32 << 20):
    """Bytes per second of one plain TCP stream from a rank of the last host to rank 0."""
    me, where = os.path.abspath(__file__), f"{cluster.addr(0)}:{PORT + 1}"
    sink = netns.spawn(cluster, 0, [sys.executable, me, "--tcp-sink", where, "--size", str(nbytes)])
    source = netns.spawn(cluster, cluster.n - 1, [sys.executable, me, "--tcp-source", where, "--size", str(nbytes)])
    out, _ = sink.communicate(timeout=120)
    source.communicate(timeout=10)
    if sink.returncode or source.returncode:
        raise RuntimeError(f"calibration stream failed: {out[-500:]}")
    return float(out.split()[-1])


def tcp_sink(where, nbytes):
    """Accept one connection, receive nbytes, print bytes/s from the first byte to the last."""
    host, port = where.rsplit(":", 1)
    with socket.create_server((host, int(port))) as server:
        server.settimeout(60)
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
            with socket.create_connection((host, int(port)), timeout=60) as conn:
                conn.sendall(bytes(nbytes))
                return
        except ConnectionRefusedError:
            time.sleep(0.05)
    raise SystemExit(f"could not connect to {where}")


def run_all_reduces(cluster, args, algo, encrypt, result_path):
    """Rank 0's JSON results of the all-reduce worker running ``algo`` on ``cluster``, its
    connections encrypted or not."""
    argv = [os.path.abspath(__file__), "--worker", "--size", str(args.size), "--iters", str(args.iters),
            "--warmup", str(args.warmup), "--result", result_path, "--algorithms", algo]
    netns.run(cluster, argv, PORT, args.timeout + 30, RINGCOMM_TIMEOUT=str(args.timeout),
              RINGCOMM_ENCRYPT="1" if encrypt else "0")
    with open(result_path) as f:
        return json.load(f)


def timed(comm, x, base, want, algo, args):
    """Per-call times (s) of ``args.iters`` all-reduces of ``x`` after ``args.warmup``, and
    how many elements came out wrong."""
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
    return times, wrong


def worker(args):
    """One rank: time each algorithm's all-reduce of args.size bytes; rank 0 writes the result.
    With ``hier``, first the same all-reduce among this host's ranks alone (t_host)."""
    import ringcomm

    comm = ringcomm.init()
    n, r, count = comm.world_size, comm.rank, args.size // 4
    top = comm.topology
    base, want = bl.input_for(r, count, np.float32), bl.reduced(n, count, np.float32)
    x, out = base.copy(), {"world_size": n, "size_bytes": count * 4, "hosts": top.num_hosts,
                           "ranks_per_host": top.per_host}
    for algo in args.algorithms.split(","):
        if algo == "hier" and top.per_host > 1:
            hosts = [comm.new_group(list(members)) for members in top.host_ranks]
            host = hosts[top.hosts[r]]
            local = host.rank
            host_times, _ = timed(host, x, bl.input_for(local, count, np.float32),
                                  bl.reduced(host.world_size, count, np.float32), "ring", args)
            comm.all_reduce(host_times, op="max")
            out["host_all_reduce_us"] = float(np.median(host_times)) * 1e6
        times, wrong = timed(comm, x, base, want, algo, args)
        stats = comm.stats()
        comm.all_reduce(times, op="max")
        mine = np.array([stats["bytes_sent_inter_host"], stats["bytes_sent"]], np.float64)
        every = np.zeros(2 * n)
        comm.all_gather(every, mine)
        total = np.array([wrong], np.int64)
        comm.all_reduce(total, op="sum")
        out[algo] = dict(bl.summarize(times), wrong=int(total[0]), rank0_inter_host_sent=every[0],
                         max_inter_host_sent=float(every[0::2].max()), rank0_bytes_sent=every[1])
    if r == 0:
        with open(args.result, "w") as f:
            json.dump(out, f)
    comm.close()


def predicted(algo, H, L, S, bandwidth):
    """Seconds, and the bytes the busiest rank sends across hosts (see the module docstring)."""
    n = H * L
    if algo == "ps":
        return 2 * (n - L) * S / bandwidth, (n - L) * S
    sent = hier_all_reduce_bytes(H, L, S)[1] if algo == "hier" else all_reduce_bytes(n, S, "ring")
    return sent / bandwidth, sent


def measure(args, H, L, tmp, rows, training):
    cluster = netns.Cluster(H, L, args.rate, args.delay)
    try:
        cluster.build()
        bandwidth = calibrate(cluster)
        ring_time = {}
        for encrypt, algo in [(e, a) for e in ENCRYPTION[args.encryption] for a in args.algorithms.split(",")]:
            before = cluster.link_bytes()
            res = run_all_reduces(cluster, args, algo, encrypt, os.path.join(tmp, f"h{H}l{L}{algo}{encrypt}.json"))
            calls = args.iters + args.warmup
            link_sent = max(a[0] - b[0] for a, b in zip(cluster.link_bytes(), before, strict=True)) / calls
            S, cell = res["size_bytes"], res[algo]
            pred, sent_formula = predicted(algo, H, L, S, bandwidth)
            pred += res.get("host_all_reduce_us", 0.0) / 1e6
            if algo == "ring":
                ring_time[encrypt] = cell["time_us"]
            row = dict(cell, hosts=H, ranks_per_host=L, world_size=H * L, algorithm=algo, size_bytes=S, encrypted=encrypt,
                       predicted_us=pred * 1e6, host_all_reduce_us=res.get("host_all_reduce_us"),
                       inter_host_formula=sent_formula, busiest_link_bytes_per_call=link_sent,
                       rate=args.rate, delay=args.delay, link_bytes_per_s=bandwidth)
            rows.append(row)
            ring = ring_time.get(encrypt)
            vs_ring = f"{ring / cell['time_us']:>8.2f}" if ring and algo != "ring" else f"{'':>8}"
            print(f" {H:>2} {L:>2} {H * L:>3} {algo:>5} {'on' if encrypt else 'off':>4} {cell['time_us'] / 1e3:>10.1f} {pred * 1e3:>10.1f} "
                  f"{cell['time_us'] / 1e6 / pred:>9.2f} {vs_ring} {cell['max_inter_host_sent'] / 2**20:>10.2f} "
                  f"{sent_formula / 2**20:>10.2f} {link_sent / 2**20:>10.2f} {cell['wrong']:>6}", flush=True)
        print(f"#      one TCP stream over these links: {bandwidth / 1e6:.1f} MB/s", flush=True)
        if args.training:
            for strategy in ("ddp", "zero2"):
                rank0 = train(cluster, args.steps, ["--strategy", strategy], args.timeout * 4)["per_rank"][0]
                step, sent = rank0["step_time_s"], rank0["bytes_sent_per_step"]
                training.append(dict(hosts=H, ranks_per_host=L, strategy=strategy, step_time_s=step,
                                     bytes_sent_per_step=sent, rate=args.rate))
                print(f"#      {strategy:>5} training step {step * 1e3:8.1f} ms, rank 0 sent "
                      f"{sent / 2**20:.1f} MiB/step", flush=True)
    finally:
        netns.kill_started()
        cluster.close()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hosts", default="2,4", help="host counts H, comma-separated")
    p.add_argument("--ranks-per-host", default="1,2", help="ranks per host L, comma-separated")
    p.add_argument("--size", type=parse_size, default=64 << 20)
    p.add_argument("--rate", default="1gbit", help="tc rate of every rank's link, each way")
    p.add_argument("--delay", default=None, help="netem delay of every link, one way (e.g. 100us)")
    p.add_argument("--algorithms", default=",".join(ALGORITHMS))
    p.add_argument("--encryption", choices=sorted(ENCRYPTION), default="on",
                   help="CURVE between hosts: on (ringcomm's default there), off, or both to measure its cost")
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--training", action="store_true", help="also a DDP and a ZeRO-2 step per cluster")
    p.add_argument("--steps", type=int, default=8, help="training steps per job (--training)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per cluster's all-reduces")
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
        for name in netns.stale_namespaces():
            netns.sh("ip", "netns", "delete", name, check=False)
            print(f"removed namespace {name}")
        return 0
    problem = netns.preflight()
    if problem:
        print(f"bench/cluster.py: cannot emulate a cluster here: {problem}", file=sys.stderr)
        return 2
    grid = [(H, L) for L in sorted({int(v) for v in args.ranks_per_host.split(",")})
            for H in sorted({int(v) for v in args.hosts.split(",")})]
    if any(H < 2 or L < 1 or H * L > 64 for H, L in grid):
        p.error("hosts must be at least 2, ranks per host at least 1, and H×L at most 64")

    def stop(signum, _frame):
        raise KeyboardInterrupt(f"signal {signum}")
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, stop)
    rows, training = [], []
    tmp = tempfile.mkdtemp(prefix="rcbench-")
    os.chmod(tmp, 0o777)
    print(f"# emulated clusters: H hosts x L ranks, {args.rate} per rank link each way"
          + (f", {args.delay} one-way delay" if args.delay else "")
          + f"; all_reduce float32 sum of S = {human(args.size)}; time = median of {args.iters} calls, "
          f"slowest rank; predicted with B = one TCP stream over the same links")
    print(f"#{'H':>2} {'L':>2} {'N':>3} {'algo':>5} {'enc':>4} {'time(ms)':>10} {'predicted':>10} {'meas/pred':>9} "
          f"{'ring/this':>8} {'xhost MiB':>10} {'formula':>10} {'link MiB':>10} {'#wrong':>6}")
    try:
        failed = False
        for H, L in grid:
            try:
                measure(args, H, L, tmp, rows, training)
            except (RuntimeError, subprocess.TimeoutExpired) as exc:
                print(f"bench/cluster.py: H={H} L={L} failed: {exc}; keeping the rows measured before it",
                      file=sys.stderr)
                failed = True
                break
        path = os.path.join(args.out, "cluster.json")
        bl.write_json(path, {"benchmark": "cluster", "ringcomm": bl.ringcomm_source(), "argv": sys.argv,
                             "machine": bl.machine(), "rate": args.rate, "delay": args.delay,
                             "model_bytes_per_s": bl.parse_rate(args.rate) / 8 * PAYLOAD_SHARE,
                             "rows": rows, "training": training})
        print(f"# wrote {path}")
        return 2 if failed else 1 if any(row["wrong"] for row in rows) else 0
    except KeyboardInterrupt as exc:
        print(f"bench/cluster.py: interrupted ({exc or 'Ctrl-C'}); cleaning up", file=sys.stderr)
        return 130
    finally:
        netns.kill_started()
        shutil.rmtree(tmp, ignore_errors=True)
        left = netns.stale_namespaces()
        if left:
            print(f"bench/cluster.py: namespaces left behind: {left} (--cleanup removes them)", file=sys.stderr)


if __name__ == "__main__":
    raise SystemExit(main())
