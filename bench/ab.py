"""Two ringcomm source trees side by side: bench/peers.py on each, alternated run by run.

    python bench/ab.py --before /tmp/rc_before [--after .] [--world-sizes 2,4]
                       [--sizes 4K,1M,64M] [--algorithms ring,auto] [--runs 3] [--out bench/out]

For a change's cost: in run k both trees run ``bench/peers.py`` (ringcomm against Gloo in
the same job, float32 sum all-reduces, every result checked), one after the other in an
order rotated by k, so machine noise hits both alike. The tree is chosen by ``PYTHONPATH``
(its ``ringcomm`` is imported before any installed one; each run's JSON records which source
it imported, and this prints it).

Per (N, size, algorithm): each tree's time is the median over its runs of the run's time
(peers.py's: the median call of the slowest rank); ``after/before`` < 1 means the change is
faster; ``spread`` is that ratio's min..max over the runs, the noise to judge it by; ``/ Gloo``
is the median of each run's ringcomm time over Gloo's time in that same run. Writes
``ab.json`` to ``--out``.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--before", required=True, help="source tree of the baseline")
    p.add_argument("--after", default=os.path.dirname(HERE), help="source tree of the change")
    p.add_argument("--world-sizes", default="2,4")
    p.add_argument("--sizes", default="4K,1M,64M")
    p.add_argument("--algorithms", default="ring,auto")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--rounds", type=int, default=2, help="peers.py --rounds of each run")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--out", default=os.path.join(HERE, "out"))
    return p.parse_args(argv)


def run_tree(tree, args, scratch):
    """One bench/peers.py run of ``tree``: its source, and {(n, size, algorithm): (time_us,
    wrong, time over Gloo's)} for ringcomm's rows."""
    out = os.path.join(scratch, "peers")
    cmd = [sys.executable, os.path.join(tree, "bench", "peers.py"), "--world-sizes", args.world_sizes,
           "--sizes", args.sizes, "--algorithms", args.algorithms, "--peers", "gloo",
           "--rounds", str(args.rounds), "--iters", str(args.iters), "--out", out]
    env = dict(os.environ, PYTHONPATH=os.path.abspath(tree))
    done = subprocess.run(cmd, env=env, cwd=tree, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"{tree} failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    with open(os.path.join(out, "peers.json")) as f:
        result = json.load(f)
    return result.get("ringcomm", {}), {
        (row["world_size"], row["size_bytes"], row["algorithm"]): (row["time_us"], row["wrong"], row.get("vs_gloo"))
        for row in result["rows"] if row["library"] == "ringcomm" and row.get("time_us") is not None}


def main(argv=None):
    args = parse_args(argv)
    trees = {"before": args.before, "after": args.after}
    times, gloo = {}, {}  # (label, n, size, algorithm) -> {run: µs}, [per run]
    wrong = 0
    with tempfile.TemporaryDirectory() as scratch:
        for k in range(args.runs):
            for label in (list(trees) if k % 2 == 0 else list(reversed(trees))):
                source, cells = run_tree(trees[label], args, scratch)
                for (n, size, algorithm), (t, bad, vs_gloo) in cells.items():
                    times.setdefault((label, n, size, algorithm), {})[k] = t
                    gloo.setdefault((label, n, size, algorithm), []).append(vs_gloo)
                    wrong += bad
                print(f"# run {k} {label}: {source}", flush=True)
    rows = []
    print(f"\n{'N':>3} {'algorithm':>9} {'size':>10} {'before us':>11} {'after us':>11} "
          f"{'after/before':>12} {'spread':>13} {'before/Gloo':>11} {'after/Gloo':>10}")
    for (label, n, size, algorithm), before in sorted(times.items(), key=lambda kv: kv[0][1:]):
        after = times.get(("after", n, size, algorithm))
        if label != "before" or not after:
            continue
        # a run that lost this cell on one side has no ratio; the rest pair run by run
        ratios = [after[k] / before[k] for k in sorted(before.keys() & after.keys())]
        before, after = list(before.values()), list(after.values())
        vs = {side: statistics.median(v for v in gloo[(side, n, size, algorithm)] if v is not None)
              for side in trees}
        row = dict(world_size=n, size_bytes=size, algorithm=algorithm,
                   before_us=statistics.median(before), after_us=statistics.median(after),
                   ratio=statistics.median(after) / statistics.median(before),
                   spread=(min(ratios), max(ratios)) if ratios else None, runs=args.runs,
                   before_vs_gloo=vs["before"], after_vs_gloo=vs["after"])
        rows.append(row)
        print(f"{n:>3} {algorithm:>9} {size:>10} {row['before_us']:>11.1f} {row['after_us']:>11.1f} "
              f"{row['ratio']:>12.3f} {row['spread'][0]:>6.2f}..{row['spread'][1]:<6.2f} "
              f"{vs['before']:>11.2f} {vs['after']:>10.2f}")
    print(f"# #wrong: {wrong}")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "ab.json"), "w") as f:
        json.dump({"before": args.before, "after": args.after, "config": vars(args), "rows": rows,
                   "wrong": wrong}, f, indent=1)
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
