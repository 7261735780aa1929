"""Two ringcomm source trees side by side: the same all-reduce benchmark on each, alternated.

    python bench/ab.py --before /tmp/rc_before [--after .] [--world-sizes 2,4]
                       [--sizes 4K,1M,64M] [--rounds 3] [--iters 10] [--out bench/out]

For a change's cost: in round k, for each world size N, both trees run
``bench/collectives.py`` (all_reduce, ``--algorithms``, float32 sum) under their own
``python -m ringcomm.launch --nproc N``, one after the other in an order rotated by k, so
machine noise hits both alike. The tree is chosen by ``PYTHONPATH`` (its ``ringcomm`` is
imported before any installed one; each run's JSON records which source it imported).

Per (N, size, algorithm): each tree's time is the median over rounds of that round's median
call time (nccl-tests' time: the slowest rank's); ``after/before`` < 1 means the change is
faster; ``spread`` is the ratio's min..max over rounds, the noise to judge it against. Every
result is checked (``#wrong``). Writes ``ab.json`` to ``--out``.
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
    p.add_argument("--algorithms", default="auto")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--out", default=os.path.join(HERE, "out"))
    return p.parse_args(argv)


def run_tree(tree, n, args, scratch):
    """One collectives.py run of ``tree`` at world size ``n``: {(size, algorithm): (time_us,
    wrong)}."""
    name = f"ab_{os.getpid()}"
    cmd = [sys.executable, "-m", "ringcomm.launch", "--nproc", str(n), "--no-prefix",
           os.path.join(tree, "bench", "collectives.py"), "--collectives", "all_reduce",
           "--algorithms", args.algorithms, "--sizes", args.sizes, "--iters", str(args.iters),
           "--warmup", "2", "--out", scratch, "--name", name]
    env = dict(os.environ, PYTHONPATH=os.path.abspath(tree))
    done = subprocess.run(cmd, env=env, cwd=tree, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise SystemExit(f"{tree} at N={n} failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    with open(os.path.join(scratch, name + ".json")) as f:
        result = json.load(f)
    source = result.get("ringcomm", {})
    return source, {(row["size_bytes"], row["algorithm"]): (row["time_us"], row["wrong"])
                    for row in result["rows"]}


def main(argv=None):
    args = parse_args(argv)
    trees = {"before": args.before, "after": args.after}
    times = {}  # (label, n, size, algorithm) -> [time_us per round]
    wrong = 0
    with tempfile.TemporaryDirectory() as scratch:
        for k in range(args.rounds):
            for n in [int(v) for v in args.world_sizes.split(",")]:
                order = list(trees) if k % 2 == 0 else list(reversed(trees))
                for label in order:
                    source, cells = run_tree(trees[label], n, args, scratch)
                    for (size, algorithm), (t, bad) in cells.items():
                        times.setdefault((label, n, size, algorithm), []).append(t)
                        wrong += bad
                    print(f"# round {k} N={n} {label}: {source}", flush=True)
    rows = []
    print(f"\n{'N':>3} {'size':>10} {'algorithm':>9} {'before us':>11} {'after us':>11} "
          f"{'after/before':>12} {'spread':>13}")
    for (label, n, size, algorithm), before in sorted(times.items()):
        if label != "before":
            continue
        after = times[("after", n, size, algorithm)]
        ratios = [a / b for a, b in zip(after, before)]
        row = dict(world_size=n, size_bytes=size, algorithm=algorithm,
                   before_us=statistics.median(before), after_us=statistics.median(after),
                   ratio=statistics.median(after) / statistics.median(before),
                   spread=(min(ratios), max(ratios)), rounds=args.rounds)
        rows.append(row)
        print(f"{n:>3} {size:>10} {algorithm:>9} {row['before_us']:>11.1f} {row['after_us']:>11.1f} "
              f"{row['ratio']:>12.3f} {row['spread'][0]:>6.2f}..{row['spread'][1]:<6.2f}")
    print(f"# #wrong: {wrong}")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "ab.json"), "w") as f:
        json.dump({"before": args.before, "after": args.after, "rows": rows, "wrong": wrong}, f, indent=1)
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
