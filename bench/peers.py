"""ringcomm all-reduce side by side with torch.distributed (Gloo), Open MPI and the
shared-memory floor, in one run.

    python bench/peers.py [--world-sizes 2,4] [--sizes 4K,256K,4M,64M] [--rounds 3]
                          [--iters 10] [--warmup 1] [--algorithms ring,auto]
                          [--peers gloo,openmpi,floor] [--timeout 300] [--out bench/out] [--verbose]

The driver (this script, one process) starts, for each world size N, one job per library
and keeps them all alive: ringcomm under ``python -m ringcomm.launch --nproc N``
(bench/peer_ringcomm.py), N torch.distributed Gloo processes with torchrun's environment
and ``init_method=tcp://127.0.0.1:PORT`` (bench/peer_torch.py), and ``mpirun -n N
--oversubscribe python bench/peer_mpi.py`` (mpi4py over Open MPI), and N processes of
bench/peer_floor.py (numpy over one shared mapping and spinning flags: the floor any
shared-memory all-reduce in Python pays at least). Every rank waits for
commands on a socket (bench/control.py), so only one library runs at a time. In round k
the libraries take turns, for each size, in an order rotated by k; each turn is ``--warmup``
untimed and ``--iters`` timed float32 SUM all-reduces, every result checked. ringcomm runs
once per algorithm in ``--algorithms`` (default: ``ring``, the schedule the targets in RESULTS.md name,
and ``auto``, the default a user gets).

Metrics (nccl-tests): time = median over all rounds' timed calls of the slowest rank's
time; algbw = size / time; busbw = algbw * 2(N-1)/N; #wrong = wrong result elements over
all calls and ranks. ``vs gloo`` / ``vs openmpi`` = ringcomm time / peer time (< 1: ringcomm
is faster); busbw ratios are their inverses. A peer that cannot run (torch or mpi4py not
importable, no mpirun, a job that fails) is reported as missing or failed, never filled in.

Prints one table per N and the targets: at 4 MiB and 64 MiB ringcomm ring busbw
>= 1.5x Gloo's and >= 0.8x Open MPI's; at 4 KiB ringcomm time <= 0.5x Gloo's. Writes
``peers.json`` and ``peers.csv`` to ``--out`` and each job's output to ``--out``/logs/.
"""
import argparse
import importlib.util
import os
import shutil
import socket
import sys
import time

import numpy as np

import benchlib as bl
from ringcomm.launch.config import free_port
from ringcomm.units import human
import control
import peer_floor

HERE = os.path.dirname(os.path.abspath(__file__))
PEERS = ("gloo", "openmpi", "floor")
SCRIPTS = {"ringcomm": "peer_ringcomm.py", "gloo": "peer_torch.py", "openmpi": "peer_mpi.py",
           "floor": "peer_floor.py"}
TARGETS = [  # (size, peer, metric, bound): ringcomm/peer ratio of metric must satisfy bound
    (4 << 20, "gloo", "busbw", 1.5), (4 << 20, "openmpi", "busbw", 0.8),
    (64 << 20, "gloo", "busbw", 1.5), (64 << 20, "openmpi", "busbw", 0.8),
    (4 << 10, "gloo", "time", 0.5)]
CSV_COLUMNS = ["world_size", "library", "algorithm", "status", "size_bytes", "count", "type",
               "redop", "root", "calls", "time_us", "time_us_min", "time_us_max", "algbw",
               "busbw", "wrong", "vs_gloo", "vs_openmpi", "vs_floor"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world-sizes", default="2,4")
    p.add_argument("--sizes", default="4K,256K,4M,64M")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--algorithms", default="ring,auto", help="ringcomm algorithms to run")
    p.add_argument("--peers", default=",".join(PEERS))
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per call block")
    p.add_argument("--out", default=os.path.join(HERE, "out"))
    p.add_argument("--verbose", action="store_true", help="print every call block's times")
    a = p.parse_args(argv)
    a.world_sizes = [int(n) for n in a.world_sizes.split(",") if n]
    a.sizes = [s - s % 4 for s in bl.parse_sizes(a.sizes)]
    a.algorithms = [x for x in a.algorithms.split(",") if x]
    a.peers = [x for x in a.peers.split(",") if x]
    if set(a.peers) - set(PEERS) or min(a.world_sizes) < 2 or a.rounds < 1 or a.iters < 1:
        p.error(f"peers must be among {PEERS}; world sizes >= 2; rounds, iters >= 1")
    return a


def missing_reason(library):
    """Why ``library`` cannot run here, or None."""
    if library == "gloo" and importlib.util.find_spec("torch") is None:
        return "torch is not importable (pip install torch==2.13.0)"
    if library == "openmpi":
        if shutil.which("mpirun") is None:
            return "mpirun not found on PATH (apt-get install openmpi-bin libopenmpi-dev)"
        if importlib.util.find_spec("mpi4py") is None:
            return "mpi4py is not importable (pip install mpi4py)"
    return None


def start(library, n, address, logs):
    """Start ``library``'s job of n ranks; they connect back to ``address``."""
    job = control.Job(library, n, os.path.join(logs, f"peers_{library}_n{n}.log"))
    open(job.log_path, "w").close()
    script = os.path.join(HERE, SCRIPTS[library])
    if library == "ringcomm":
        job.start([sys.executable, "-m", "ringcomm.launch", "--nproc", str(n), script,
                   "--control", address])
    elif library == "floor":
        job.mapping = f"/dev/shm/ringcomm-bench-floor-{os.getpid()}-n{n}"
        fd = os.open(job.mapping, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, peer_floor.mapping_bytes(n))
        finally:
            os.close(fd)
        for rank in range(n):
            env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(n), OMP_NUM_THREADS="1")
            job.start([sys.executable, "-u", script, "--control", address, "--mapping", job.mapping], env=env)
    elif library == "gloo":
        port = free_port("127.0.0.1")
        for rank in range(n):
            env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(n),
                       LOCAL_WORLD_SIZE=str(n), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                       GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
            job.start([sys.executable, "-u", script, "--control", address], env=env)
    else:
        root = ["--allow-run-as-root"] if os.geteuid() == 0 else []
        job.start(["mpirun", "-n", str(n), "--oversubscribe", *root, "--mca", "btl_tcp_if_include",
                   "lo", "--mca", "oob_tcp_if_include", "lo", sys.executable, "-u", script,
                   "--control", address], env=dict(os.environ, OMP_NUM_THREADS="1"))
    return job



def bench_world(n, args, logs):
    """All libraries at world size n: {arm: {size: [per-call seconds]}}, wrong counts, status."""
    arms = [("ringcomm", a) for a in args.algorithms] + [(p, None) for p in args.peers]
    listener = socket.create_server(("127.0.0.1", 0))
    address = f"127.0.0.1:{listener.getsockname()[1]}"
    jobs, status = {}, {}
    times = {arm: {s: [] for s in args.sizes} for arm in arms}
    rounds = {arm: {s: [] for s in args.sizes} for arm in arms}
    wrong = {arm: {s: 0 for s in args.sizes} for arm in arms}
    try:
        for library in ["ringcomm"] + args.peers:
            reason = missing_reason(library)
            if reason:
                status[library] = {"status": "missing", "reason": reason}
                print(f"# N={n}: {library} is missing: {reason}", flush=True)
                continue
            started = time.perf_counter()
            job = jobs[library] = start(library, n, address, logs)
            ok = job.accept(listener)
            status[library] = {"status": "ok" if ok else "failed", "version": job.version,
                               "reason": job.error}
            print(f"# N={n}: {library} {job.version + ' ' if job.version else ''}"
                  f"{'ready' if ok else 'FAILED: ' + str(job.error)} "
                  f"({time.perf_counter() - started:.1f} s)", flush=True)
        for k in range(args.rounds):
            for size in args.sizes:
                live = [arm for arm in arms if arm[0] in jobs and not jobs[arm[0]].error]
                for arm in live[k % len(live):] + live[:k % len(live)] if live else []:
                    command = {"cmd": "run", "size": size, "warmup": args.warmup,
                               "iters": args.iters, "algorithm": arm[1]}
                    replies = jobs[arm[0]].run(command, args.timeout)
                    if replies is None:
                        if status[arm[0]]["status"] != "failed":
                            print(f"# N={n}: {arm[0]} FAILED: {jobs[arm[0]].error}", flush=True)
                        status[arm[0]].update(status="failed", reason=jobs[arm[0]].error)
                        continue
                    per_call = np.max([r["times"] for r in replies], axis=0)  # slowest rank
                    times[arm][size] += per_call.tolist()
                    rounds[arm][size].append(float(np.median(per_call)) * 1e6)
                    wrong[arm][size] += sum(r["wrong"] for r in replies)
                    if args.verbose:
                        ms = np.round(per_call * 1e3).astype(int).tolist()
                        print(f"#   {arm} {size}: block {max(r['block_s'] for r in replies):.2f} s, "
                              f"per call {ms} ms", flush=True)
            print(f"# N={n}: round {k + 1} of {args.rounds} done", flush=True)
    finally:
        for job in jobs.values():
            job.stop()
            if getattr(job, "mapping", None):
                try:
                    os.unlink(job.mapping)
                except OSError as exc:  # reported, and the other jobs are still stopped
                    print(f"# could not remove {job.mapping}: {exc}", flush=True)
        listener.close()
    return arms, times, rounds, wrong, status


def table_rows(n, arms, times, rounds, wrong, status):
    rows = []
    for size in sorted(next(iter(times.values()))):
        by_arm = {}
        for library, algo in arms:
            state = status.get(library, {})
            row = {"world_size": n, "library": library, "algorithm": algo or "-",
                   "size_bytes": size, "count": size // 4, "type": "float32", "redop": "sum",
                   "root": -1, "status": state.get("status", "missing"), "reason": state.get("reason")}
            samples = times[(library, algo)][size]
            if samples:
                row.update(bl.summarize(samples), calls=len(samples), wrong=wrong[(library, algo)][size],
                           round_medians_us=rounds[(library, algo)][size])
                row["algbw"], row["busbw"] = bl.metrics("all_reduce", n, size, row["time_us"] / 1e6)
            by_arm[(library, algo)] = row
            rows.append(row)
        for (library, _algo), row in by_arm.items():
            if library == "ringcomm" and "time_us" in row:
                for peer in PEERS:
                    other = by_arm.get((peer, None), {})
                    if "time_us" in other:
                        row[f"vs_{peer}"] = row["time_us"] / other["time_us"]
    return rows


def print_world(n, rows, args):
    print(f"\n# all_reduce float32 sum, N = {n} ranks: ringcomm vs torch.distributed Gloo vs "
          f"Open MPI vs the shared-memory floor; {args.rounds} rounds x {args.iters} timed calls, "
          f"libraries alternated")
    print(f"# time = median of the slowest rank's per-call time; busbw = algbw * {2 * (n - 1) / n:.3g}"
          f"; vs X = ringcomm time / X time (< 1: ringcomm faster)")
    head = bl.header_prefix()
    extra = (f"  {'library':<15}", f"  {'':<15}")
    ratio = (f" {'vs gloo':>8} {'vs openmpi':>10} {'vs floor':>8} {'spread':>7}",
             f" {'(time)':>8} {'(time)':>10} {'(time)':>8} {'':>7}")
    for i in range(2):
        print(head[i] + extra[i] + "  " + bl.metric_header()[i] + ratio[i])
    last = None
    for row in rows:
        prefix = bl.row_prefix(row["size_bytes"], row["count"], row["type"], row["redop"], row["root"])
        prefix = prefix if row["size_bytes"] != last else " " * len(prefix)
        last = row["size_bytes"]
        name = row["library"] + (f"/{row['algorithm']}" if row["library"] == "ringcomm" else "")
        if "time_us" not in row:
            print(f" {prefix}  {name:<15}  {row['status'].upper()}: {row['reason']}")
            continue
        spread = max(row["round_medians_us"]) / min(row["round_medians_us"])
        ratios = "".join(f" {row[k]:>{w}.3f}" if k in row else f" {'':>{w}}"
                         for k, w in (("vs_gloo", 8), ("vs_openmpi", 10), ("vs_floor", 8)))
        print(f" {prefix}  {name:<15}  {bl.metric_cells(row)}{ratios} {spread:>6.2f}x")


def evaluate_targets(rows, args):
    results = []
    for n in args.world_sizes:
        for algo in args.algorithms:
            for size, peer, metric, bound in TARGETS:
                ours = next((r for r in rows if r["world_size"] == n and r["library"] == "ringcomm"
                             and r["algorithm"] == algo and r["size_bytes"] == size), None)
                if ours is None:
                    continue  # that size was not measured in this run
                ratio = ours.get(f"vs_{peer}")
                if ratio is not None and metric == "busbw":
                    ratio = 1 / ratio
                met = None if ratio is None else (ratio >= bound if metric == "busbw" else ratio <= bound)
                results.append({"world_size": n, "algorithm": algo, "size_bytes": size, "peer": peer,
                                "metric": metric, "ratio": ratio, "bound": bound, "met": met})
    print("\n# targets: ratio = ringcomm / peer (busbw: >= bound, time: <= bound)")
    print(f"#{'N':>2} {'ringcomm':>9} {'size':>8} {'peer':>8} {'metric':>6} {'ratio':>7} {'target':>8}  met")
    for t in results:
        sign = ">=" if t["metric"] == "busbw" else "<="
        got = f"{t['ratio']:.3f}" if t["ratio"] is not None else "-"
        met = {True: "yes", False: "NO", None: "n/a (peer missing, failed or not run)"}[t["met"]]
        print(f" {t['world_size']:>2} {t['algorithm']:>9} {human(t['size_bytes']):>8} {t['peer']:>8} "
              f"{t['metric']:>6} {got:>7} {sign}{t['bound']:>6}  {met}")
    return results


def main(argv=None):
    args = parse_args(argv)
    logs = os.path.join(args.out, "logs")
    os.makedirs(logs, exist_ok=True)
    started = time.perf_counter()
    rows, libraries, loads = [], {}, {}
    for n in args.world_sizes:
        load = os.getloadavg()[0]
        arms, times, rounds, wrong, status = bench_world(n, args, logs)
        loads[n] = [round(load, 2), round(os.getloadavg()[0], 2)]
        libraries[n] = status
        world_rows = table_rows(n, arms, times, rounds, wrong, status)
        print_world(n, world_rows, args)
        rows += world_rows
        sys.stdout.flush()
    targets = evaluate_targets(rows, args)
    path = os.path.join(args.out, "peers.json")
    bl.write_json(path, {"benchmark": "peers", "ringcomm": bl.ringcomm_source(),
                         "argv": sys.argv, "machine": bl.machine(),
                         "config": {k: v for k, v in vars(args).items() if k != "out"},
                         "libraries": libraries, "loadavg_1min_before_after": loads,
                         "rows": rows, "targets": targets,
                         "elapsed_s": time.perf_counter() - started})
    bl.write_csv(os.path.join(args.out, "peers.csv"), rows, CSV_COLUMNS)
    bad = sum(r.get("wrong", 0) for r in rows)
    print(f"\n# wrote {path} and peers.csv ({time.perf_counter() - started:.0f} s); "
          f"{'all results correct' if not bad else f'{bad} WRONG result elements'}")
    failed = [f"{lib} N={n}" for n, st in libraries.items() for lib, s in st.items() if s["status"] == "failed"]
    if failed:
        print(f"# failed: {', '.join(failed)} (see {logs})")
    return 1 if bad or failed else 0  # a missing peer is reported above, not an error


if __name__ == "__main__":
    sys.exit(main())
