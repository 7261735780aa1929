"""ringcomm collective benchmark in the nccl-tests conventions, plus a traffic table.

Run on every rank, under the launcher::

    python -m ringcomm.launch --nproc 4 bench/collectives.py \\
        [--sizes 1K:256M:x4] [--collectives all_reduce,reduce_scatter,all_gather,broadcast,reduce]
        [--dtypes float32] [--algorithms ring,ps,auto] [--op sum] [--root 0]
        [--iters 10] [--warmup 2] [--budget 5] [--traffic-size 4M] [--out bench/out]
        [--name collectives_n{n}]

For every collective, dtype and size: ``--warmup`` untimed calls per algorithm, then up to
``--iters`` timed calls per algorithm (fewer, but at least 3, when the warm-up says they
would take more than ``--budget`` seconds; every rank agrees on the count), the algorithms
taking turns call by call so that machine noise hits them alike. Every call is preceded by
a barrier and its result is checked against the closed form (see benchlib).

Columns (nccl-tests): size (B, the whole n-rank buffer), count (elements of the operation's
parameter: one rank's part for reduce_scatter and all_gather), type, redop (``none`` where
there is no reduction), root (-1 where there is none), and per algorithm: time = median
over timed calls of the slowest rank's time (us), algbw = size / time, busbw = algbw *
factor with factor 2(n-1)/n all_reduce, (n-1)/n reduce_scatter and all_gather, 1 broadcast
and reduce; #wrong = wrong result elements over every call and rank. ``n/a``: the algorithm
does not exist for that collective or world size (``rd``: all_reduce, power-of-two n).

Traffic table: one all_reduce of S = ``--traffic-size`` bytes per algorithm; ``stats()``
bytes against the formulas, per rank:
  ring  sent = received = 2(n-1)S/n (chunks differ by <= 1 element), total 2(n-1)S;
  ps    rank 0 sends and receives (n-1)S, every other rank S;
  rd    log2(n) S each way on every rank.

Rank 0 prints the tables and writes ``--name`` + ``.json`` and ``.csv`` (default
``collectives_n{N}``) to ``--out``; bench/plots.py reads every such JSON file there.
"""
import argparse
import math
import os
import sys
import time

import numpy as np

import benchlib as bl
from ringcomm.units import human, parse_size
import ringcomm

MIN_ITERS = 3
CSV_COLUMNS = ["collective", "algorithm", "world_size", "size_bytes", "count", "type", "redop",
               "root", "iters", "warmup", "time_us", "time_us_min", "time_us_max", "algbw",
               "busbw", "wrong"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="1K:256M:x4", help="from:to:xfactor or a comma list")
    p.add_argument("--collectives", default=",".join(bl.COLLECTIVES))
    p.add_argument("--dtypes", default="float32")
    p.add_argument("--algorithms", default="ring,ps,auto")
    p.add_argument("--op", default="sum", choices=bl.OPS)
    p.add_argument("--root", type=int, default=0, help="root of broadcast and reduce")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--budget", type=float, default=5.0, help="seconds of timed calls per cell")
    p.add_argument("--traffic-size", default="4M", help="all_reduce size of the traffic table")
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "out"))
    p.add_argument("--name", default="collectives_n{n}", help="output file name, {n} = world size")
    a = p.parse_args(argv)
    a.sizes, a.traffic_size = bl.parse_sizes(a.sizes), parse_size(a.traffic_size)
    a.collectives = [c for c in a.collectives.split(",") if c]
    a.algorithms = [x for x in a.algorithms.split(",") if x]
    a.dtypes = [np.dtype(d) for d in a.dtypes.split(",") if d]
    unknown = set(a.collectives) - set(bl.COLLECTIVES)
    if unknown or a.iters < 1 or a.warmup < 0:
        p.error(f"unknown collectives {sorted(unknown)}" if unknown else "need --iters >= 1, --warmup >= 0")
    return a


def applicable(collective, algorithm, n):
    if algorithm == "rd":
        return collective == "all_reduce" and n & (n - 1) == 0
    return algorithm in ("ring", "ps", "auto")


class Case:
    """One (collective, dtype, size) on this rank: buffers, the call, and its check."""

    def __init__(self, comm, collective, dtype, size, op, root):
        n, r = comm.world_size, comm.rank
        self.comm, self.collective, self.op, self.root = comm, collective, op, root
        per_rank = collective in ("reduce_scatter", "all_gather")
        self.count = size // (n * dtype.itemsize) if per_rank else size // dtype.itemsize
        total = self.count * n if per_rank else self.count
        self.size = total * dtype.itemsize
        m = self.count
        if collective == "all_reduce":
            self.base, self.want = bl.input_for(r, total, dtype), bl.reduced(n, total, dtype, op)
        elif collective == "reduce_scatter":
            self.x = bl.input_for(r, total, dtype)
            self.out, self.want = np.empty(m, dtype), bl.reduced(n, m, dtype, op, offset=r * m)
        elif collective == "all_gather":
            self.x, self.out = bl.input_for(r, m, dtype), np.empty(total, dtype)
            self.want = np.concatenate([bl.input_for(q, m, dtype) for q in range(n)])
        elif collective == "broadcast":
            self.base, self.want = bl.input_for(r, total, dtype), bl.input_for(root, total, dtype)
        else:  # reduce: the result on the root, every other rank's x unchanged
            self.base = bl.input_for(r, total, dtype)
            self.want = bl.reduced(n, total, dtype, op) if r == root else self.base
        if hasattr(self, "base"):
            self.x = self.base.copy()

    def reset(self):
        if hasattr(self, "base"):
            np.copyto(self.x, self.base)
        else:
            self.out.fill(0)  # a stale result must not pass the check

    def call(self, algorithm):
        c, comm = self.collective, self.comm
        if c == "all_reduce":
            comm.all_reduce(self.x, self.op, algorithm)
        elif c == "reduce_scatter":
            comm.reduce_scatter(self.out, self.x, self.op, algorithm)
        elif c == "all_gather":
            comm.all_gather(self.out, self.x, algorithm)
        elif c == "broadcast":
            comm.broadcast(self.x, self.root, algorithm)
        else:
            comm.reduce(self.x, self.root, self.op, algorithm)

    def wrong(self):
        return bl.count_wrong(self.x if hasattr(self, "base") else self.out, self.want)


def timed_call(comm, case, algorithm):
    """One checked call after a barrier: (seconds on this rank, wrong elements)."""
    case.reset()
    comm.barrier()
    start = time.perf_counter()
    case.call(algorithm)
    elapsed = time.perf_counter() - start
    return elapsed, case.wrong()


def measure(comm, case, algorithms, args):
    """Warm up, agree on an iteration count, then time the algorithms in turn, call by call
    (ring, ps, auto, ring, ...), so that machine noise hits them alike. Per-call time = max
    over ranks. Returns {algorithm: cell}."""
    wrong, warm = dict.fromkeys(algorithms, 0), np.zeros(len(algorithms))
    for _ in range(args.warmup):
        for k, algo in enumerate(algorithms):
            elapsed, bad = timed_call(comm, case, algo)
            warm[k], wrong[algo] = max(warm[k], elapsed), wrong[algo] + bad
    comm.all_reduce(warm, op="max")
    iters = args.iters
    if warm.sum() > 0:
        iters = int(min(args.iters, max(MIN_ITERS, args.budget // warm.sum())))
    times = np.empty((len(algorithms), iters))
    for i in range(iters):
        for k, algo in enumerate(algorithms):
            times[k, i], bad = timed_call(comm, case, algo)
            wrong[algo] += bad
    comm.all_reduce(times, op="max")
    total = np.array([wrong[a] for a in algorithms], np.int64)
    comm.all_reduce(total, op="sum")
    cells = {}
    for k, algo in enumerate(algorithms):
        cell = bl.summarize(times[k])
        cell["algbw"], cell["busbw"] = bl.metrics(case.collective, comm.world_size, case.size,
                                                  cell["time_us"] / 1e6)
        cell.update(wrong=int(total[k]), iters=iters, warmup=args.warmup)
        cells[algo] = cell
    return cells


def traffic(comm, algorithms, size):
    """One float32 all_reduce of ``size`` bytes per algorithm: stats() bytes vs formulas."""
    n, r, rows = comm.world_size, comm.rank, []
    count = size // 4
    S = count * 4
    for algo in [a for a in ("ring", "ps", "rd") if a in algorithms and applicable("all_reduce", a, n)]:
        x = bl.input_for(r, count, np.float32)
        comm.barrier()
        comm.reset_stats()
        comm.all_reduce(x, "sum", algo)
        stats = comm.stats()
        mine = np.array([stats["bytes_sent"], stats["bytes_received"],
                         bl.count_wrong(x, bl.reduced(n, count, np.float32))], np.int64)
        every = np.empty(3 * n, np.int64)
        comm.all_gather(every, mine)
        for rank, (sent, received, wrong) in enumerate(every.reshape(n, 3).tolist()):
            if algo == "ring":
                formula, slack = 2 * (n - 1) * S / n, 2 * (n - 1) * 4
            elif algo == "ps":
                formula, slack = ((n - 1) * S if rank == 0 else S), 0
            else:
                formula, slack = math.log2(n) * S, 0
            ok = abs(sent - formula) <= slack and abs(received - formula) <= slack and not wrong
            rows.append({"algorithm": algo, "rank": rank, "size_bytes": S, "bytes_sent": sent,
                         "bytes_received": received, "formula": formula, "ok": ok})
        total = {"ring": 2 * (n - 1) * S, "ps": 2 * (n - 1) * S, "rd": n * math.log2(n) * S}[algo]
        rows[-1].update(total_sent=sum(row["bytes_sent"] for row in rows[-n:]), total_formula=total)
    return rows


def print_table(collective, n, algorithms, rows, iters_note):
    print(f"\n# {collective}, {n} ranks, ringcomm {ringcomm.__version__}; "
          f"busbw factor {bl.busbw_factor(collective, n):.4g}; {iters_note}")
    head = bl.header_prefix()
    width = len(bl.metric_header()[0])
    print(f"#{'':>{len(head[0]) - 1}}" + "".join(f"  {a:^{width}}" for a in algorithms))
    for i in range(2):
        print(head[i] + "".join(f"  {bl.metric_header()[i]}" for _ in algorithms))
    for key in sorted({(r["size_bytes"], r["count"], r["type"], r["redop"], r["root"]) for r in rows}):
        cells = {r["algorithm"]: r for r in rows
                 if (r["size_bytes"], r["count"], r["type"], r["redop"], r["root"]) == key}
        print(f" {bl.row_prefix(*key)}" + "".join(f"  {bl.metric_cells(cells.get(a))}" for a in algorithms))
    for a in algorithms:
        mine = [r for r in rows if r["algorithm"] == a]
        if mine:
            print(f"# {a}: avg bus bandwidth {np.mean([r['busbw'] for r in mine]):.3f} GB/s, "
                  f"#wrong {sum(r['wrong'] for r in mine)} "
                  f"{'OK' if not any(r['wrong'] for r in mine) else 'FAILED'}")


def print_traffic(n, rows):
    if not rows:
        return
    print(f"\n# traffic: one float32 all_reduce of S = {human(rows[0]['size_bytes'])}, {n} ranks; "
          f"stats() payload bytes vs formula\n# (ring 2(n-1)S/n per rank, total 2(n-1)S; "
          f"ps rank 0 (n-1)S, others S, total 2(n-1)S; rd log2(n)S per rank; each way)")
    print(f"#{'algorithm':>9} {'rank':>5} {'bytes_sent':>12} {'bytes_recv':>12} {'formula':>12} "
          f"{'sent/formula':>12} {'ok':>4}")
    for row in rows:
        print(f" {row['algorithm']:>9} {row['rank']:>5} {row['bytes_sent']:>12} {row['bytes_received']:>12} "
              f"{row['formula']:>12.0f} {row['bytes_sent'] / row['formula']:>12.4f} "
              f"{'yes' if row['ok'] else 'NO':>4}")
        if "total_sent" in row:
            print(f" {row['algorithm']:>9} {'all':>5} {row['total_sent']:>12} {'':>12} "
                  f"{row['total_formula']:>12.0f} {row['total_sent'] / row['total_formula']:>12.4f}")


def main(argv=None):
    args = parse_args(argv)
    started = time.perf_counter()
    comm = ringcomm.init()
    n, r = comm.world_size, comm.rank
    if r == 0:
        print(f"# ringcomm bench/collectives: {n} ranks, sizes {human(args.sizes[0])}.."
              f"{human(args.sizes[-1])}, iters {args.iters} (>= {MIN_ITERS} within "
              f"{args.budget:g} s per cell), warmup {args.warmup}", flush=True)
    rows = []
    for collective in args.collectives:
        table = []
        for dtype in args.dtypes:
            for size in args.sizes:
                case = Case(comm, collective, dtype, size, args.op, args.root)
                if case.count == 0:
                    continue
                algorithms = [a for a in args.algorithms if applicable(collective, a, n)]
                has_op = collective in ("all_reduce", "reduce_scatter", "reduce")
                for algo, cell in measure(comm, case, algorithms, args).items():
                    cell.update(collective=collective, algorithm=algo, world_size=n,
                                size_bytes=case.size, count=case.count, type=dtype.name,
                                redop=args.op if has_op else "none",
                                root=args.root if collective in ("broadcast", "reduce") else -1)
                    table.append(cell)
                del case
        rows += table
        if r == 0:
            print_table(collective, n, [a for a in args.algorithms if applicable(collective, a, n)],
                        table, f"time = median of up to {args.iters} calls")
            sys.stdout.flush()
    moved = traffic(comm, args.algorithms, args.traffic_size) if n > 1 else []
    wrong = sum(row["wrong"] for row in rows) + sum(1 for row in moved if not row["ok"])
    if r == 0:
        print_traffic(n, moved)
        base = os.path.join(args.out, args.name.format(n=n))
        bl.write_json(base + ".json", {"benchmark": "collectives", "ringcomm": bl.ringcomm_source(),
                                       "world_size": n,
                                       "argv": sys.argv, "machine": bl.machine(), "rows": rows,
                                       "traffic": moved, "elapsed_s": time.perf_counter() - started})
        bl.write_csv(base + ".csv", rows, CSV_COLUMNS)
        print(f"\n# wrote {base}.json and {base}.csv ({time.perf_counter() - started:.1f} s); "
              f"{'all results correct' if not wrong else f'{wrong} WRONG'}")
    comm.close()
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
