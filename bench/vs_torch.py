"""ringcomm's training step against PyTorch's on the same job, side by side in one run.

    python bench/vs_torch.py [--rows gpt-1,mlp-2-ddp,...] [--rounds 3] [--steps 12] [--warmup 3]
                             [--out bench/out]

A **job** is one side (ringcomm's trainer, or a PyTorch model written from the same contract in
:mod:`torch_models`) on N processes under ``python -m ringcomm.launch``; a **row** compares two
jobs: ratio = the first job's step time / the second's (below 1: the first is faster). Both
sides start from ringcomm's initial parameters and read the same batches in the same order
(ringcomm.train's data and batch order), fp32, Adam with the config's learning rate, one
thread per process; PyTorch's data parallelism is DDP or FSDP2 on Gloo. Each round runs
every job once, in an order rotated per round so that machine noise falls on both sides; a
job's step time is the median of its steps after ``--warmup``, then the median over rounds;
its CPU time per step (the process's, every thread) the same way. On a machine shared with
other jobs the CPU ratio is the steadier one: it leaves out the time a process waits for a
core, which falls on the two sides unequally however the jobs are alternated.
Each row also checks that the two sides' losses agree over the first steps (the largest
relative difference is reported), and gives each side's peak RSS (the largest of its ranks).

Writes ``vs_torch.json``, ``vs_torch.md`` (the table) and ``vs_torch.png`` into ``--out``.
"""
import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import benchlib

HERE = os.path.dirname(os.path.abspath(__file__))
ONE_THREAD = {k: "1" for k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")}
GPT = ("--model", "gpt", "--n-layer", "4", "--d-model", "256", "--n-head", "4", "--seq-len", "128",
       "--vocab", "256", "--batch-size", "16")  # 3.26 M parameters, 2048 tokens a step
MLP = ("--model", "mlp", "--layers", "1024,4096,4096,1024", "--samples", "2048")  # 25.2 M


@dataclass(frozen=True)
class Job:
    side: str    # "ringcomm" or "torch"
    n: int       # processes
    wrap: str    # ringcomm: its --strategy; torch: "single", "ddp" or "fsdp2"
    flags: tuple  # ringcomm.train's flags: the model and its batch

    @property
    def name(self):
        split = "".join(f" {f[2:]}{v}" for f, v in zip(self.flags, self.flags[1:], strict=False) if f in ("--tp", "--cp"))
        return f"{self.side} {self.wrap}{split} N={self.n} {self.flags[1]} {self.batch}"

    @property
    def batch(self):
        return f"batch {self.flags[self.flags.index('--batch-size') + 1]}" if "--batch-size" in self.flags else ""


def _rows():
    rows = {}
    for n, wrap in ((1, "single"), (2, "ddp")):
        ours = "single" if n == 1 else "ddp"
        rows[f"gpt-{n}"] = (Job("ringcomm", n, ours, GPT), Job("torch", n, wrap, GPT))
    rows["gpt-2-zero2"] = (Job("ringcomm", 2, "zero2", GPT), Job("torch", 2, "ddp", GPT))
    rows["gpt-2-fsdp2"] = (Job("ringcomm", 2, "zero3", GPT), Job("torch", 2, "fsdp2", GPT))
    for extra in (("--tp", "2"), ("--cp", "2")):
        rows[f"gpt-2-{extra[0][2:]}2"] = (Job("ringcomm", 2, "ddp", GPT + extra), Job("ringcomm", 2, "ddp", GPT))
    for batch in ("256", "128", "64"):
        flags = MLP + ("--batch-size", batch)
        rows[f"mlp-1-b{batch}"] = (Job("ringcomm", 1, "single", flags), Job("torch", 1, "single", flags))
    flags = MLP + ("--batch-size", "256")
    for n in (2, 4):
        for ours in ("ddp", "zero2"):
            rows[f"mlp-{n}-{ours}"] = (Job("ringcomm", n, ours, flags), Job("torch", n, "ddp", flags))
    return rows


ROWS = _rows()


def peak_rss_mib():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def ringcomm_worker(flags):
    import ringcomm
    from ringcomm.train.config import parse_args
    from ringcomm.train.trainer import train
    cfg = parse_args(list(flags))
    comm = ringcomm.init()
    try:
        document, _ = train(comm, cfg, out=lambda line: None)
    finally:
        comm.close()
    return comm.rank, document["step_times_s"], document["step_cpu_s"], document["losses"]


def torch_worker(wrap, flags):
    import numpy as np
    import torch
    import torch.distributed as dist
    import torch_models
    from ringcomm.train import data as datasets
    from ringcomm.train.models.stage import full_init
    from ringcomm.train.config import parse_args, validate
    from ringcomm.train.trainer import load_data
    torch.set_num_threads(1)
    n, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    cfg = validate(parse_args(list(flags)), n)
    if n > 1:
        dist.init_process_group("gloo")
    model = torch_models.build(cfg, full_init(cfg))
    if wrap == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
    elif wrap == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh("cpu", (n,))
        for unit in torch_models.shard_units(model):
            fully_shard(unit, mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    dataset = load_data(cfg)
    order = datasets.BatchOrder(len(dataset.x), cfg.batch_size, n, cfg.seed)
    times, cpu, losses = [], [], []
    for step in range(cfg.steps):
        rows = order.local_rows(step, rank)
        x = dataset.x[rows].astype(np.int64 if cfg.model == "gpt" else np.float32)
        x, y = torch.from_numpy(x), torch.from_numpy(dataset.y[rows].astype(np.int64))
        t0, c0 = time.perf_counter(), time.process_time()
        opt.zero_grad()
        loss = model(x, y)
        loss.backward()
        if cfg.clip_grad_norm:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip_grad_norm)
        opt.step()
        losses.append(loss.item())
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    if n > 1:  # each rank's loss is the mean over its share of the batch: the job's is their mean
        every = torch.tensor(losses, dtype=torch.float64)
        dist.all_reduce(every)
        losses = (every / n).tolist()
        dist.destroy_process_group()
    return rank, times, cpu, losses


def worker_main(ns):
    sys.path.insert(0, HERE)
    if ns.worker == "ringcomm":
        rank, times, cpu, losses = ringcomm_worker(ns.flags)
    else:
        rank, times, cpu, losses = torch_worker(ns.wrap, ns.flags)
    with open(f"{ns.result}.{rank}", "w") as f:
        json.dump({"times": times, "cpu": cpu, "losses": losses, "rss_mib": peak_rss_mib()}, f)


def run_job(job, steps, warmup):
    """One run of ``job``: its median step after warm-up (rank 0's), losses, peak RSS."""
    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "r")
        flags = [*job.flags, "--steps", str(steps)]
        if job.side == "ringcomm":
            flags += ["--strategy", job.wrap]
        cmd = [sys.executable, "-m", "ringcomm.launch", "--nproc", str(job.n), "--no-prefix", os.path.abspath(__file__),
               "--worker", job.side, "--wrap", job.wrap, "--result", result, "--", *flags]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=1200, env={**os.environ, **ONE_THREAD})
        if done.returncode:
            raise SystemExit(f"{job.name} failed ({done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
        ranks = []
        for r in range(job.n):
            with open(f"{result}.{r}") as f:
                ranks.append(json.load(f))
    return {"step_s": statistics.median(ranks[0]["times"][warmup:]),
            "cpu_s": statistics.median(ranks[0]["cpu"][warmup:]), "losses": ranks[0]["losses"],
            "rss_mib": max(r["rss_mib"] for r in ranks)}


def agreement(a, b, steps=5):
    """The largest relative difference of two loss curves over their first ``steps``."""
    pairs = list(zip(a, b, strict=False))[:steps]
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in pairs) if pairs else None


def measure(rows, rounds, steps, warmup):
    jobs = list(dict.fromkeys(job for pair in rows.values() for job in pair))
    seen = {job: [] for job in jobs}
    for r in range(rounds):
        order = jobs[r % len(jobs):] + jobs[:r % len(jobs)]
        for i, job in enumerate(order):
            print(f"round {r + 1}/{rounds}, job {i + 1}/{len(order)}: {job.name}", flush=True)
            seen[job].append(run_job(job, steps, warmup))
    out = {}
    for job, runs in seen.items():
        out[job] = {"step_s": statistics.median(run["step_s"] for run in runs),
                    "cpu_s": statistics.median(run["cpu_s"] for run in runs),
                    "rounds_s": [run["step_s"] for run in runs], "losses": runs[0]["losses"],
                    "rss_mib": max(run["rss_mib"] for run in runs)}
    return out


def table(rows, results):
    lines = ["| row | first job | second job | first (ms) | second (ms) | ratio | CPU ms first / second | CPU ratio "
             "| loss rel. diff | RSS MiB first / second |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    doc = []
    for name, (a, b) in rows.items():
        ra, rb = results[a], results[b]
        ratio, cpu_ratio = ra["step_s"] / rb["step_s"], ra["cpu_s"] / rb["cpu_s"]
        diff = agreement(ra["losses"], rb["losses"])
        lines.append(f"| {name} | {a.name} | {b.name} | {1e3 * ra['step_s']:.1f} | {1e3 * rb['step_s']:.1f} | "
                     f"**{ratio:.2f}** | {1e3 * ra['cpu_s']:.1f} / {1e3 * rb['cpu_s']:.1f} | {cpu_ratio:.2f} | "
                     f"{diff:.1e} | {ra['rss_mib']:.0f} / {rb['rss_mib']:.0f} |")
        doc.append({"row": name, "first": a.name, "second": b.name, "first_s": ra["step_s"], "second_s": rb["step_s"],
                    "first_rounds_s": ra["rounds_s"], "second_rounds_s": rb["rounds_s"], "ratio": ratio,
                    "first_cpu_s": ra["cpu_s"], "second_cpu_s": rb["cpu_s"], "cpu_ratio": cpu_ratio,
                    "loss_rel_diff": diff, "first_rss_mib": ra["rss_mib"], "second_rss_mib": rb["rss_mib"]})
    return "\n".join(lines), doc


def plot(doc, path):
    plt = benchlib.pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(8, 0.4 * len(doc) + 1.5))
    ax.barh([d["row"] for d in doc], [d["ratio"] for d in doc], color="tab:blue")
    ax.axvline(1.0, color="black", linewidth=1)
    ax.invert_yaxis()
    ax.set_xlabel("step time ratio, first job / second (below 1: first faster)")
    ax.set_title("ringcomm vs PyTorch: training step, same job, same run")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, of: {', '.join(ROWS)}")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--out", default=os.path.join(HERE, "out"))
    parser.add_argument("--worker", choices=("ringcomm", "torch"), help=argparse.SUPPRESS)
    parser.add_argument("--wrap", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    parser.add_argument("flags", nargs="*", help=argparse.SUPPRESS)
    ns = parser.parse_args(argv)
    if ns.worker:
        return worker_main(ns)
    unknown = [r for r in ns.rows.split(",") if r not in ROWS]
    if unknown or ns.steps <= ns.warmup or ns.rounds < 1:
        parser.error(f"unknown rows {unknown}" if unknown else "--steps must exceed --warmup; --rounds >= 1")
    rows = {r: ROWS[r] for r in ns.rows.split(",")}
    results = measure(rows, ns.rounds, ns.steps, ns.warmup)
    text, doc = table(rows, results)
    print(text)
    os.makedirs(ns.out, exist_ok=True)
    with open(os.path.join(ns.out, "vs_torch.md"), "w") as f:
        f.write(text + "\n")
    with open(os.path.join(ns.out, "vs_torch.json"), "w") as f:
        json.dump({"rounds": ns.rounds, "steps": ns.steps, "warmup": ns.warmup, "rows": doc}, f, indent=1)
    plot(doc, os.path.join(ns.out, "vs_torch.png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
