"""How steady training steps are: ringcomm's DDP trainer against PyTorch DDP over Gloo on
the same MLP, batch and world size, jobs alternated in one run.

    python bench/step_spread.py [--nproc 2] [--layers 256,1024,1024,1024,10] [--steps 80]
                                [--batch-size 512] [--precision fp32] [--repeats 2]

Each job trains ``--steps`` steps (Adam, global batch ``--batch-size`` split over the ranks);
the first 5 steps of each are warm-up and dropped. Per library: the median, p75 and p90 of
rank 0's step times over all its jobs, and p75/median, the spread the table compares.
ringcomm runs ``python -m ringcomm.launch --nproc N -m ringcomm.train --strategy ddp``
(its metrics JSON holds every step's time); PyTorch runs N processes of this script's
``--torch-worker`` mode, ``DistributedDataParallel`` with its default buckets over Gloo on
127.0.0.1.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

from torch_backend import timed_steps

from ringcomm.launch.config import free_port

WARMUP = 5


def torch_worker(args):
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, n = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    widths = [int(w) for w in args.layers.split(",")]
    layers = []
    for i, (a, b) in enumerate(zip(widths, widths[1:], strict=False)):
        layers.append(torch.nn.Linear(a, b))
        if i < len(widths) - 2:
            layers.append(torch.nn.ReLU())
    model = DistributedDataParallel(torch.nn.Sequential(*layers))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    local = args.batch_size // n
    generator = torch.Generator().manual_seed(rank)
    x = torch.randn(local, widths[0], generator=generator)
    y = torch.randint(0, widths[-1], (local,), generator=generator)
    times, _ = timed_steps(model, optimizer, x, y, args.steps)
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump({"step_times_s": times}, f)
    dist.destroy_process_group()



def run_torch(args, out):
    port = free_port("127.0.0.1")
    procs = []
    for rank in range(args.nproc):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(args.nproc),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo",
                   OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, __file__, "--torch-worker", "--out", out,
                                       "--layers", args.layers, "--steps", str(args.steps),
                                       "--batch-size", str(args.batch_size)], env=env))
    codes = [p.wait(timeout=600) for p in procs]
    if any(codes):
        raise SystemExit(f"a PyTorch DDP rank failed (exit codes {codes})")


def run_ringcomm(args, out):
    subprocess.run([sys.executable, "-m", "ringcomm.launch", "--nproc", str(args.nproc), "-m",
                    "ringcomm.train", "--strategy", "ddp", "--layers", args.layers, "--steps",
                    str(args.steps), "--batch-size", str(args.batch_size), "--precision",
                    args.precision, "--metrics-json", out, "--log-every", str(args.steps)],
                   check=True, stdout=subprocess.DEVNULL, timeout=600)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--layers", default="256,1024,1024,1024,10")
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--batch-size", type=int, default=512)
    p.add_argument("--precision", default="fp32", choices=("fp32", "fp16"),
                   help="ringcomm's precision (PyTorch runs fp32)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--torch-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.torch_worker:
        return torch_worker(args)
    runs = {"ringcomm ddp": run_ringcomm, "torch ddp (gloo)": run_torch}
    times = {name: [] for name in runs}
    with tempfile.TemporaryDirectory() as tmp:
        for k in range(args.repeats):
            order = list(runs) if k % 2 == 0 else list(runs)[::-1]
            for name in order:
                out = os.path.join(tmp, f"steps-{k}-{len(times[name])}-{name.split()[0]}.json")
                runs[name](args, out)  # a fresh path: a job that wrote nothing cannot pass
                with open(out) as f:
                    times[name] += json.load(f)["step_times_s"][WARMUP:]
    print(f"# DDP step time, N = {args.nproc}, layers {args.layers}, batch {args.batch_size}, "
          f"{args.repeats} jobs each alternated, {args.steps - WARMUP} steps per job after warm-up")
    print(f"# {'library':<18} {'median ms':>9} {'p75 ms':>7} {'p90 ms':>7} {'max ms':>7} {'p75/median':>10}")
    for name, samples in times.items():
        t = np.array(samples) * 1e3
        med, p75, p90 = np.median(t), np.percentile(t, 75), np.percentile(t, 90)
        print(f"  {name:<18} {med:>9.1f} {p75:>7.1f} {p90:>7.1f} {t.max():>7.1f} {p75 / med:>10.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
