"""``python -m ringcomm.train``: train the MLP with one data-parallel strategy.

    python -m ringcomm.launch --nproc N -m ringcomm.train --strategy S [--offload]
        [--precision fp32|fp16] [--steps N] [--batch-size B] [--layers 64,256,256,10]
        [--lr] [--seed] [--optimizer adam|sgd] [--data FILE.npz] [--bucket-mb]
        [--no-overlap] [--clip-grad-norm] [--trace DIR] [--metrics-json FILE] [--save FILE.npz]

Strategies: ``single`` (one process, the reference), ``dp`` (parameter server), ``ddp``,
``zero1``, ``zero2``, ``zero3``; ``--offload`` keeps optimizer state on the host (ZeRO only).
Rank 0 prints progress (step, loss, samples/s) and, at the end, every rank's model-state
memory and bytes sent per step against the formulas. ``--main-job`` is the project's
demonstration run (ZeRO-2, fp16, about a minute on 2 cores), which is what
``python -m ringcomm.launch --nproc 4`` runs with no script.
"""
import argparse
import statistics
import sys
import time
from dataclasses import dataclass

import numpy as np

from ..memory import MemoryRegistry
from . import data as datasets
from . import report
from .model import init_params, param_specs, predict
from .strategy import ParameterServer, Replicated, Single
from .trace import Tracer
from .zero import Zero

STRATEGIES = ("single", "dp", "ddp", "zero1", "zero2", "zero3")
MAIN_JOB = dict(strategy="zero2", precision="fp16", steps=400, batch_size=512, layers="64,512,512,512,10",
                lr=2e-3, samples=32768)


@dataclass
class TrainConfig:
    strategy: str = "ddp"
    offload: bool = False
    precision: str = "fp32"
    steps: int = 100
    batch_size: int = 256
    layers: tuple = (64, 256, 256, 10)
    lr: float = 1e-3
    seed: int = 0
    optimizer: str = "adam"
    weight_decay: float = 0.0
    data: str = None
    samples: int = 8192
    bucket_mb: float = 25.0
    overlap: bool = True
    clip_grad_norm: float = None
    trace: str = None
    metrics_json: str = None
    save: str = None
    log_every: int = 0


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m ringcomm.train", description=__doc__.split("\n")[0])
    p.add_argument("--strategy", choices=STRATEGIES, default="ddp")
    p.add_argument("--offload", action="store_true", help="optimizer state and step in host memory (ZeRO)")
    p.add_argument("--precision", choices=("fp32", "fp16"), default="fp32")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--batch-size", type=int, default=256, help="the global batch (all ranks together)")
    p.add_argument("--layers", default="64,256,256,10", help="layer widths, input first")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--optimizer", choices=("adam", "sgd"), default="adam")
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--data", help="an .npz with arrays x and y (optional x_test, y_test)")
    p.add_argument("--samples", type=int, default=8192, help="size of the synthetic training set")
    p.add_argument("--bucket-mb", type=float, default=25.0, help="gradient bucket size (first bucket ≤ 1 MiB)")
    p.add_argument("--no-overlap", dest="overlap", action="store_false",
                   help="communicate gradients after backward instead of during it")
    p.add_argument("--clip-grad-norm", type=float, default=None, help="clip by the global gradient norm")
    p.add_argument("--trace", metavar="DIR", help="write a Chrome trace per rank into DIR")
    p.add_argument("--metrics-json", metavar="FILE", help="rank 0 writes the run's metrics here")
    p.add_argument("--save", metavar="FILE.npz", help="rank 0 saves the fp32 parameters W0, b0, ...")
    p.add_argument("--log-every", type=int, default=0, help="progress every N steps (default: ~10 lines)")
    p.add_argument("--main-job", action="store_true", help="the demonstration run: " + ", ".join(
        f"{k.replace('_', '-')}={v}" for k, v in MAIN_JOB.items()))
    args = p.parse_args(argv)
    if args.main_job:
        given = {a.split("=")[0].lstrip("-").replace("-", "_") for a in (argv or sys.argv[1:]) if a.startswith("--")}
        for key, value in MAIN_JOB.items():
            if key not in given:
                setattr(args, key, value)
    try:
        layers = tuple(int(w) for w in str(args.layers).split(","))
    except ValueError:
        p.error(f"--layers must be comma-separated integers, got {args.layers!r}")
    if len(layers) < 2 or min(layers) < 1:
        p.error("--layers needs at least an input and an output width, all positive")
    if args.steps < 0 or args.batch_size < 1 or args.lr <= 0:
        p.error("--steps must be >= 0, --batch-size >= 1 and --lr > 0")
    if args.offload and not args.strategy.startswith("zero"):
        p.error("--offload needs --strategy zero1, zero2 or zero3")
    fields = {k: v for k, v in vars(args).items() if k != "main_job"}
    fields["layers"] = layers
    return TrainConfig(**fields)


def make_strategy(cfg, comm, meta, params, registry, tracer):
    if cfg.strategy.startswith("zero"):
        return Zero(int(cfg.strategy[-1]), comm, meta, cfg.layers, params, cfg, registry, tracer)
    cls = {"single": Single, "dp": ParameterServer, "ddp": Replicated}[cfg.strategy]
    return cls(comm, meta, cfg.layers, params, cfg, registry, tracer)


def load_data(cfg):
    if cfg.data:
        dataset = datasets.load_npz(cfg.data)
    else:
        dataset = datasets.synthetic(cfg.layers[0], cfg.layers[-1], cfg.samples, cfg.seed)
    if dataset.x.shape[1] != cfg.layers[0]:
        raise ValueError(f"the data has {dataset.x.shape[1]} features but --layers starts with {cfg.layers[0]}")
    if dataset.num_classes > cfg.layers[-1]:
        raise ValueError(f"the data has {dataset.num_classes} classes but --layers ends with {cfg.layers[-1]}")
    return dataset


def train(comm, cfg, out=print):
    """Run ``cfg`` on this rank; returns ``(metrics document, strategy)``.

    The document is the same on every rank (``per_rank`` gathered everywhere); the strategy
    holds this rank's final model state."""
    rank, n = comm.rank, comm.world_size
    if cfg.strategy == "single" and n != 1:
        raise ValueError("--strategy single is the one-process reference; launch it with --nproc 1")
    meta = comm.new_group(list(range(n)))  # losses, flags, reports: kept out of the traffic counts
    dataset = load_data(cfg)
    order = datasets.BatchOrder(len(dataset.x), cfg.batch_size, n, cfg.seed)
    registry, tracer = MemoryRegistry(), Tracer(rank, bool(cfg.trace))
    strategy = make_strategy(cfg, comm, meta, init_params(cfg.layers, cfg.seed), registry, tracer)
    if rank == 0:
        out(f"ringcomm.train: {cfg.strategy}{' + offload' if cfg.offload else ''}, {cfg.precision}, "
            f"{n} rank(s), {strategy.layout.num_params} parameters in layers {list(cfg.layers)}, "
            f"global batch {cfg.batch_size}, {cfg.steps} steps, {len(strategy.layout.units)} "
            f"communication unit(s)")
    comm.reset_stats()
    losses, times = [], []
    every = cfg.log_every or max(1, cfg.steps // 10)
    start = time.perf_counter()
    for step in range(cfg.steps):
        rows = order.local_rows(step, rank)
        t0 = time.perf_counter()
        losses.append(strategy.step(dataset.x[rows], dataset.y[rows], cfg.batch_size))
        times.append(time.perf_counter() - t0)
        if rank == 0 and ((step + 1) % every == 0 or step + 1 == cfg.steps):
            rate = cfg.batch_size * (step + 1) / (time.perf_counter() - start)
            scale = f"  loss scale {strategy.scaler.scale:g}" if strategy.mixed else ""
            out(f"step {step + 1:>5}/{cfg.steps}  loss {losses[-1]:.4f}  {rate:8.0f} samples/s{scale}")
    params = strategy.full_params()
    accuracy = float((predict(params, dataset.x_test) == dataset.y_test).mean())
    step_time = statistics.median(times) if times else 0.0
    per_rank = report.gather_per_rank(meta, strategy, registry, comm.stats(), len(losses), step_time)
    document = report.metrics(strategy, cfg, losses, accuracy, params, per_rank)
    if rank == 0:
        out(f"final loss {document['final_loss']}, accuracy {accuracy:.3f} on {len(dataset.y_test)} "
            f"held-out samples (chance {1 / cfg.layers[-1]:.3f}); median step {step_time * 1e3:.1f} ms")
        out(report.table(strategy, per_rank))
        if cfg.metrics_json:
            report.write_json(cfg.metrics_json, document)
        if cfg.save:
            np.savez(cfg.save, **{name: p for (name, _), p in zip(param_specs(cfg.layers), params)})
    if cfg.trace:
        tracer.write(cfg.trace)
    meta.close()
    return document, strategy


def main(argv=None):
    cfg = parse_args(argv)
    import ringcomm
    comm = ringcomm.init()
    try:
        train(comm, cfg)
    finally:
        comm.close()
    return 0
