"""How long a job stands still when a rank is lost: from the kill to the first all-reduce
completed over the survivors.

    python bench/shrink.py [--nproc 4] [--trials 10] [--size 1M] [--train]

Each trial is one job under ``python -m ringcomm.launch --nproc N --on-failure continue``:
every rank runs all-reduces of ``--size`` bytes back to back; after a random 0.3–0.8 s one
rank (a random one, rank 0 included) writes the time and SIGKILLs itself. Each survivor
catches the :class:`~ringcomm.errors.PeerLost`, calls ``comm.shrink()`` and times, on the
host's monotonic clock (one clock for every process), the kill to its first all-reduce
completed over the N−1 left, split into the wait until the loss was raised (detection: the
process watch, then the grace a goodbye gets) and the shrink itself (revocation, agreement,
the new communicator and its confirming agreement). The table gives median and worst over the
survivors of every trial.

``--train`` measures the elastic trainer instead (``python -m ringcomm.train --elastic``,
the MLP, ``--strategy``): the victim kills itself as a step begins; the time from the kill to the
moment each survivor begins the step after it (the lost step redone over N−1 ranks: the
detection, the agreement that the step is not taken, the shrink, the job rebuilt, the step).
"""
import argparse
import os
import statistics
import subprocess
import sys
import tempfile

from ringcomm.units import parse_size

WORKER = """
import os, random, signal, sys, time, numpy as np, ringcomm
comm = ringcomm.init()
size, seed, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
rng = random.Random(seed)
victim, at = rng.randrange(comm.world_size), rng.uniform(0.3, 0.8)
x = np.ones(size // 4, np.float32)
comm.barrier()
start = time.monotonic()
while True:
    if comm.rank == victim and time.monotonic() - start > at:
        with open(os.path.join(out, "killed"), "w") as f:
            f.write(repr(time.monotonic()))
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        comm.all_reduce(x)
    except ringcomm.PeerLost:
        raised = time.monotonic()
        comm = comm.shrink()
        comm.all_reduce(x)
        done = time.monotonic()
        with open(os.path.join(out, f"rank{comm.ranks[comm.rank]}"), "w") as f:
            f.write(f"{raised!r} {done!r} {comm.world_size}")
        break
comm.close()
"""


# --train: the elastic trainer (ddp, the MLP) under the launcher; the victim kills itself
# as step KILL_STEP begins, each survivor writes when it begins each step after that
TRAIN_WORKER = """
import os, random, signal, sys, time
from ringcomm.train import cli, trainer
seed, out, kill_step = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
me, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
victim = random.Random(seed).randrange(world)
batch, begun = trainer.Job.batch, {}


def timed_batch(self, step):
    if step == kill_step and me == victim:
        with open(os.path.join(out, "killed"), "w") as f:
            f.write(repr(time.monotonic()))
        os.kill(os.getpid(), signal.SIGKILL)
    begun.setdefault(step, time.monotonic())
    return batch(self, step)


trainer.Job.batch = timed_batch
try:
    cli.main(sys.argv[4:])
finally:
    with open(os.path.join(out, f"rank{me}"), "w") as f:
        f.write(repr(begun.get(kill_step + 1)))
"""
TRAIN_ARGS = ["--elastic", "--layers", "64,256,256,10", "--batch-size", "256", "--samples", "8192", "--steps", "30"]
KILL_STEP = 20


def train_trial(nproc, seed, strategy):
    """``[seconds from the kill to the step after the redone one]``, one per survivor."""
    with tempfile.TemporaryDirectory() as out:
        script = os.path.join(out, "worker.py")
        with open(script, "w") as f:
            f.write(TRAIN_WORKER)
        done = subprocess.run([sys.executable, "-m", "ringcomm.launch", "--nproc", str(nproc), "--on-failure",
                               "continue", "--timeout", "30", script, str(seed), out, str(KILL_STEP), *TRAIN_ARGS,
                               "--strategy", strategy],
                              capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            raise SystemExit(f"trial {seed} failed:\n{done.stderr[-3000:]}")
        with open(os.path.join(out, "killed")) as f:
            killed = float(f.read())
        rows = []
        for name in sorted(os.listdir(out)):
            if name.startswith("rank"):
                with open(os.path.join(out, name)) as f:
                    rows.append(float(f.read()) - killed)
        assert len(rows) == nproc - 1, rows
        return rows


def trial(nproc, size, seed):
    """``[(detect, shrink, total)]`` seconds, one per survivor."""
    with tempfile.TemporaryDirectory() as out:
        script = os.path.join(out, "worker.py")
        with open(script, "w") as f:
            f.write(WORKER)
        done = subprocess.run([sys.executable, "-m", "ringcomm.launch", "--nproc", str(nproc), "--on-failure",
                               "continue", "--timeout", "30", script, str(size), str(seed), out],
                              capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise SystemExit(f"trial {seed} failed:\n{done.stderr[-3000:]}")
        with open(os.path.join(out, "killed")) as f:
            killed = float(f.read())
        rows = []
        for name in sorted(os.listdir(out)):
            if name.startswith("rank"):
                with open(os.path.join(out, name)) as f:
                    raised, finished, left = f.read().split()
                assert int(left) == nproc - 1, (name, left)
                rows.append((float(raised) - killed, float(finished) - float(raised), float(finished) - killed))
        assert len(rows) == nproc - 1, rows
        return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--size", type=parse_size, default=1 << 20)
    parser.add_argument("--train", action="store_true", help="the elastic trainer instead of all-reduces")
    parser.add_argument("--strategy", default="ddp", choices=("ddp", "zero1", "zero2", "zero3"),
                        help="--train: the trainer's strategy")
    args = parser.parse_args()
    if args.train:
        times = []
        for seed in range(args.trials):
            times += train_trial(args.nproc, seed, args.strategy)
            print(f"trial {seed + 1}/{args.trials}: worst {max(times[-(args.nproc - 1):]):.3f} s", file=sys.stderr,
                  flush=True)
        print(f"# python -m ringcomm.train {' '.join(TRAIN_ARGS)} --strategy {args.strategy}, "
              f"N = {args.nproc} -> {args.nproc - 1}, "
              f"a random rank killed as step {KILL_STEP + 1} begins, {args.trials} trials")
        print(f"  kill -> the step after the redone one begins: median {statistics.median(times):.3f} s, "
              f"worst {max(times):.3f} s")
        return
    rows = []
    for seed in range(args.trials):
        rows += trial(args.nproc, args.size, seed)
        print(f"trial {seed + 1}/{args.trials}: worst {max(r[2] for r in rows[-(args.nproc - 1):]):.3f} s",
              file=sys.stderr, flush=True)
    print(f"# N = {args.nproc} -> {args.nproc - 1}, all-reduce of {args.size} B, {args.trials} trials, "
          f"{len(rows)} survivors")
    print(f"# {'part':>34}  {'median (s)':>10}  {'worst (s)':>10}")
    for i, name in enumerate(("kill -> PeerLost raised", "shrink + first all-reduce", "kill -> first all-reduce")):
        values = [r[i] for r in rows]
        print(f"  {name:>34}  {statistics.median(values):10.3f}  {max(values):10.3f}")


if __name__ == "__main__":
    main()
