"""PyTorch's own DDP and FSDP2 on the "ringcomm" backend against the same training on Gloo,
jobs alternated in one run.

    python bench/torch_backend.py [--nproc 2,4] [--modes ddp,fsdp2] [--layers 512,1024,1024,512,10]
                                  [--steps 40] [--batch-size 256] [--rounds 3]

Every job is ``python -m ringcomm.launch --nproc N bench/torch_backend.py --worker ...``:
one script, ``init_process_group(BACKEND)``, an MLP of ``--layers`` widths (the default has
2.1M parameters), Adam, global batch ``--batch-size`` split over the ranks, ``--steps``
steps of which the first 5 are warm-up. DDP uses its default buckets; FSDP2 shards every
linear layer and the whole model (``fully_shard``). A step is rank 0's wall time from
zero_grad to the optimizer step; the table gives each library's median over all its jobs
and ringcomm / Gloo, and for DDP the floor: the same DDP step with a comm hook that sends
nothing (what no library can beat). Each ``--batch-size`` (global) gives its own rows: a
large batch is compute-bound, a small one communication-bound. Results: bench/results/torch_backend.json and torch_backend.png.
"""
import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import benchlib

HERE = os.path.dirname(os.path.abspath(__file__))
WARMUP = 5
LIBRARIES = ("ringcomm", "gloo")


def timed_steps(model, optimizer, x, y, steps):
    """Each step's wall time (zero_grad to the optimizer step), and the last loss."""
    import torch
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        times.append(time.perf_counter() - start)
    return times, loss


def worker(args):
    import torch
    import torch.distributed as dist
    if args.backend == "ringcomm":
        import ringcomm.torch  # noqa: F401 - registers the backend
    torch.set_num_threads(1)
    dist.init_process_group(args.backend)
    rank, n = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    widths = [int(w) for w in args.layers.split(",")]
    layers = []
    for i, (a, b) in enumerate(zip(widths, widths[1:], strict=False)):
        layers += [torch.nn.Linear(a, b)] + ([torch.nn.ReLU()] if i < len(widths) - 2 else [])
    model = torch.nn.Sequential(*layers)
    if args.mode in ("ddp", "floor"):
        model = torch.nn.parallel.DistributedDataParallel(model)
        if args.mode == "floor":  # DDP's machinery without the communication: the step's floor
            def no_communication(_, bucket):
                future = torch.futures.Future()
                future.set_result(bucket.buffer())
                return future
            model.register_comm_hook(None, no_communication)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh("cpu", (n,))
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(rank)
    local = int(args.batch_size) // n
    x = torch.randn(local, widths[0], generator=generator)
    y = torch.randint(0, widths[-1], (local,), generator=generator)
    times, loss = timed_steps(model, optimizer, x, y, args.steps)
    if rank == 0:
        params = sum(p.numel() for p in model.parameters())  # FSDP2: DTensors count globally
        with open(args.out, "w") as f:
            json.dump({"times_s": times[WARMUP:], "loss": loss.item(), "parameters": params}, f)
    dist.destroy_process_group()


def run_job(args, backend, mode, n, batch):
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    cmd = [sys.executable, "-m", "ringcomm.launch", "--nproc", str(n), os.path.abspath(__file__), "--worker",
           "--backend", backend, "--mode", mode, "--layers", args.layers, "--steps", str(args.steps),
           "--batch-size", str(batch), "--out", out]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    if done.returncode:
        raise SystemExit(f"{backend} {mode} N={n} failed:\n{done.stderr[-2000:]}")
    with open(out) as f:
        result = json.load(f)
    os.unlink(out)
    return result


def measure(args, batch, n, mode):
    """One table row: the libraries' jobs (and, for DDP, the floor: a DDP step whose comm hook
    sends nothing, under Gloo) alternated over ``args.rounds`` rounds."""
    arms = [*LIBRARIES, *(["floor"] if mode == "ddp" else [])]
    times = {arm: [] for arm in arms}
    results = {}
    for i in range(args.rounds):
        for arm in arms[i % len(arms):] + arms[:i % len(arms)]:
            backend, job_mode = ("gloo", "floor") if arm == "floor" else (arm, mode)
            results[arm] = run_job(args, backend, job_mode, n, batch)
            times[arm] += results[arm]["times_s"]
    row = {"mode": mode, "n": n, "batch_size": batch, "parameters": results["gloo"]["parameters"],
           "steps_per_job": args.steps - WARMUP, "rounds": args.rounds,
           "floor_ms": 1e3 * statistics.median(times["floor"]) if "floor" in times else None}
    for lib in LIBRARIES:
        row[lib] = {"median_ms": 1e3 * statistics.median(times[lib]),
                    "p75_ms": 1e3 * statistics.quantiles(times[lib], n=4)[2], "last_loss": results[lib]["loss"]}
    row["ratio"] = row["ringcomm"]["median_ms"] / row["gloo"]["median_ms"]
    return row


def plot(rows, path):
    plt = benchlib.pyplot()
    if plt is None:
        return
    labels = [f"{r['mode']} N={r['n']}\nbatch {r['batch_size']}" for r in rows]
    fig, ax = plt.subplots(figsize=(1.4 * len(rows) + 2, 4))
    for i, lib in enumerate(LIBRARIES):
        ax.bar([j + 0.4 * i for j in range(len(rows))], [r[lib]["median_ms"] for r in rows], 0.4, label=lib)
    ax.set_xticks([j + 0.2 for j in range(len(rows))], labels)
    ax.set_ylabel("median step time (ms)")
    ax.set_title("PyTorch DDP and FSDP2 on ringcomm vs Gloo (CPU)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--backend", default="ringcomm", help=argparse.SUPPRESS)
    p.add_argument("--mode", default="ddp", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--nproc", default="2,4")
    p.add_argument("--modes", default="ddp,fsdp2")
    p.add_argument("--layers", default="512,1024,1024,512,10")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--batch-size", default="256,32", help="global batch sizes, one table row each")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--results", default=os.path.join(HERE, "results"))
    args = p.parse_args(argv)
    if args.worker:
        return worker(args)
    rows = []
    print(f"{'mode':>6} {'N':>2} {'batch':>5} {'params':>9} {'floor ms':>9} {'ringcomm ms':>12} {'gloo ms':>9} "
          f"{'ratio':>6}  loss (ringcomm, gloo)")
    for batch, n, mode in itertools.product([int(b) for b in args.batch_size.split(",")],
                                            [int(v) for v in args.nproc.split(",")], args.modes.split(",")):
        row = measure(args, batch, n, mode)
        rows.append(row)
        floor_ms = f"{row['floor_ms']:.2f}" if row["floor_ms"] else "-"
        print(f"{mode:>6} {n:>2} {batch:>5} {row['parameters']:>9} {floor_ms:>9} "
              f"{row['ringcomm']['median_ms']:>12.2f} {row['gloo']['median_ms']:>9.2f} {row['ratio']:>6.2f}  "
              f"{row['ringcomm']['last_loss']:.4g}, {row['gloo']['last_loss']:.4g}", flush=True)
    os.makedirs(args.results, exist_ok=True)
    with open(os.path.join(args.results, "torch_backend.json"), "w") as f:
        json.dump({"args": {k: v for k, v in vars(args).items() if k not in ("worker", "out")}, "rows": rows},
                  f, indent=1)
    plot(rows, os.path.join(args.results, "torch_backend.png"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
