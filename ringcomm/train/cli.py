"""``python -m ringcomm.train``: train the MLP with one data-parallel strategy.

    python -m ringcomm.launch --nproc N -m ringcomm.train --strategy S [--offload]
        [--precision fp32|fp16] [--steps N] [--batch-size B] [--layers 64,256,256,10]
        [--lr] [--seed] [--optimizer adam|sgd] [--data FILE.npz] [--bucket-mb]
        [--no-overlap] [--clip-grad-norm] [--trace DIR] [--metrics-json FILE] [--save FILE.npz]
        [--checkpoint-dir D] [--checkpoint-every K] [--resume]

Strategies: ``single`` (one process, the reference), ``dp`` (parameter server), ``ddp``,
``zero1``, ``zero2``, ``zero3``; ``--offload`` keeps optimizer state on the host (ZeRO only).
Rank 0 prints progress (step, loss, samples/s) and, at the end, every rank's model-state
memory and bytes sent per step against the formulas. ``--main-job`` is the project's
demonstration run (ZeRO-2, fp16, about a minute on 2 cores), which is what
``python -m ringcomm.launch --nproc 4`` runs with no script.

Checkpoints (:mod:`ringcomm.checkpoint`): ``--checkpoint-dir D --checkpoint-every K`` saves
every rank's state into ``D/step_NNNNNN/`` every K steps and after the last one; ``--resume``
continues from the newest complete checkpoint in D (or starts fresh, saying so), on the same
or another number of ranks. With ``python -m ringcomm.launch --max-restarts K ... --resume``
a job whose worker dies restarts from its last checkpoint.
"""
import argparse
import os
import signal
import statistics
import sys
import time
from dataclasses import dataclass

import numpy as np

from .. import checkpoint
from ..device import to_host
from ..memory import MemoryRegistry
from . import data as datasets
from . import report
from .model import init_params, param_specs, predict
from .strategy import ParameterServer, Replicated, Single
from .trace import Tracer
from .zero import Zero

STRATEGIES = ("single", "dp", "ddp", "zero1", "zero2", "zero3")
MAIN_JOB = dict(strategy="zero2", precision="fp16", steps=1000, batch_size=512, layers="64,512,512,512,10",
                lr=2e-3, samples=65536)


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
    device: str = None
    dp: int = 0
    pp: int = 1
    tp: int = 1
    micro_batches: int = 1
    schedule: str = "1f1b"
    checkpoint_dir: str = None
    checkpoint_every: int = 0
    resume: bool = False


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
    p.add_argument("--device", choices=("auto", "cpu", "gpu", "emulated"), default=None,
                   help="each worker's device (default: RINGCOMM_DEVICE, else auto)")
    p.add_argument("--dp", type=int, default=0, help="data-parallel size (default: world / (pp·tp))")
    p.add_argument("--pp", type=int, default=1, help="pipeline stages (model parallelism)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (model parallelism)")
    p.add_argument("--micro-batches", type=int, default=1, help="micro-batches per step (pipeline)")
    p.add_argument("--schedule", choices=("gpipe", "1f1b"), default="1f1b", help="pipeline schedule")
    p.add_argument("--checkpoint-dir", metavar="D", help="save checkpoints into D/step_NNNNNN/")
    p.add_argument("--checkpoint-every", metavar="K", type=int, default=0,
                   help="save a checkpoint every K steps (and after the last step; 0: only then)")
    p.add_argument("--resume", action="store_true",
                   help="continue from the newest complete checkpoint in --checkpoint-dir (none: start fresh)")
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
    if (args.resume or args.checkpoint_every) and not args.checkpoint_dir:
        p.error("--resume and --checkpoint-every need --checkpoint-dir")
    if args.checkpoint_every < 0:
        p.error("--checkpoint-every must be >= 0")
    if args.checkpoint_dir and (args.pp > 1 or args.tp > 1):
        p.error("--checkpoint-dir is not supported with --pp/--tp yet")
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


# Test hook (fault injection), inert unless the environment variable is set: in the first
# attempt of a launcher job (TORCHELASTIC_RESTART_COUNT == "0"), rank 1 SIGKILLs itself right
# after step k, so that tests can check --max-restarts + --resume end where an uninterrupted
# run ends.
TEST_KILL_AT_STEP_ENV = "RINGCOMM_TEST_KILL_AT_STEP"


def _test_kill_at_step(rank):
    if rank != 1 or os.environ.get("TORCHELASTIC_RESTART_COUNT") != "0":
        return None
    value = os.environ.get(TEST_KILL_AT_STEP_ENV)
    return int(value) if value else None


def resume(meta, strategy, cfg, out):
    """Load the newest complete checkpoint for ``--resume``; the step to start from and the
    losses so far."""
    if not (cfg.resume and cfg.checkpoint_dir):
        return 0, []
    resumed = checkpoint.restore(meta, strategy, cfg, cfg.checkpoint_dir)
    if meta.rank == 0:
        if resumed is None:
            out(f"ringcomm.train: no complete checkpoint in {cfg.checkpoint_dir}: starting from step 0")
        else:
            m = resumed.manifest
            how = (f", resharded from {m['strategy']} on {m['world_size']} rank(s)" if resumed.resharded else "")
            out(f"ringcomm.train: resuming from {resumed.path} (step {resumed.step}{how})")
            for warning in checkpoint.check_compatible(m, cfg):
                out(f"ringcomm.train: warning: {warning} when the checkpoint was saved")
    if resumed is None:
        return 0, []
    if resumed.step > cfg.steps:
        raise checkpoint.CheckpointError(f"{resumed.path} is at step {resumed.step}, past --steps {cfg.steps}")
    return resumed.step, resumed.losses


def write_outputs(cfg, rank, document, params, tracer):
    """``--metrics-json`` and ``--save`` (rank 0), ``--trace`` (every rank)."""
    if rank == 0:
        if cfg.metrics_json:
            report.write_json(cfg.metrics_json, document)
        if cfg.save:
            np.savez(cfg.save, **{name: p for (name, _), p in zip(param_specs(cfg.layers), params)})
    if cfg.trace:
        tracer.write(cfg.trace)


def train_model_parallel_run(comm, cfg, out):
    """``--dp/--pp/--tp`` runs (see :mod:`.pipeline`); returns ``(document, None)``."""
    from .pipeline import train_model_parallel
    if cfg.strategy not in ("ddp", "single", "zero1", "zero2") or cfg.offload:
        raise ValueError("--pp/--tp compose with data parallelism as ddp, zero1 or zero2 (no offload)")
    if cfg.dp == 0:
        cfg.dp = comm.world_size // (cfg.pp * cfg.tp)
    tracer = Tracer(comm.rank, bool(cfg.trace))
    document, params = train_model_parallel(comm, cfg, load_data(cfg), datasets.BatchOrder, out, tracer)
    write_outputs(cfg, comm.rank, document, params, tracer)
    return document, None


def array_module_for(comm):
    """Where model state lives: cupy on a GPU worker, numpy otherwise."""
    if comm.device == "gpu":
        import cupy
        return cupy
    return np


def train(comm, cfg, out=print):
    """Run ``cfg`` on this rank; returns ``(metrics document, strategy)``.

    The document is the same on every rank (``per_rank`` gathered everywhere); the strategy
    holds this rank's final model state. With ``cfg.resume`` the run continues from the
    newest complete checkpoint, and the document's losses include those before it."""
    rank, n = comm.rank, comm.world_size
    if cfg.pp > 1 or cfg.tp > 1 or cfg.dp not in (0, n):
        if cfg.checkpoint_dir:
            raise ValueError("--checkpoint-dir is not supported with --pp/--tp yet")
        return train_model_parallel_run(comm, cfg, out)
    if cfg.strategy == "single" and n != 1:
        raise ValueError("--strategy single is the one-process reference; launch it with --nproc 1")
    if cfg.resume and not cfg.checkpoint_dir:
        raise ValueError("--resume needs --checkpoint-dir")
    meta = comm.new_group(list(range(n)))  # losses, flags, reports: kept out of the traffic counts
    dataset = load_data(cfg)
    order = datasets.BatchOrder(len(dataset.x), cfg.batch_size, n, cfg.seed)
    registry, tracer = MemoryRegistry(array_module_for(comm)), Tracer(rank, bool(cfg.trace))
    strategy = make_strategy(cfg, comm, meta, init_params(cfg.layers, cfg.seed), registry, tracer)
    if rank == 0:
        out(f"ringcomm.train: {cfg.strategy}{' + offload' if cfg.offload else ''}, {cfg.precision}, "
            f"{n} rank(s), {strategy.layout.num_params} parameters in layers {list(cfg.layers)}, "
            f"global batch {cfg.batch_size}, {cfg.steps} steps, {len(strategy.layout.units)} "
            f"communication unit(s)")
    first, losses = resume(meta, strategy, cfg, out)
    comm.reset_stats()
    times = []
    every = cfg.log_every or max(1, cfg.steps // 10)
    save_every = cfg.checkpoint_every if cfg.checkpoint_dir else 0
    kill_at = _test_kill_at_step(rank)
    start = time.perf_counter()
    for step in range(first, cfg.steps):
        rows = order.local_rows(step, rank)
        t0 = time.perf_counter()
        losses.append(strategy.step(dataset.x[rows], dataset.y[rows], cfg.batch_size))
        times.append(time.perf_counter() - t0)
        if rank == 0 and ((step + 1) % every == 0 or step + 1 == cfg.steps):
            rate = cfg.batch_size * (step + 1 - first) / (time.perf_counter() - start)
            scale = f"  loss scale {strategy.scaler.scale:g}" if strategy.mixed else ""
            out(f"step {step + 1:>5}/{cfg.steps}  loss {losses[-1]:.4f}  {rate:8.0f} samples/s{scale}")
        if cfg.checkpoint_dir and ((save_every and (step + 1) % save_every == 0) or step + 1 == cfg.steps):
            path = checkpoint.save(meta, strategy, cfg, step + 1, losses, cfg.checkpoint_dir)
            if rank == 0 and step + 1 == cfg.steps:
                out(f"checkpoint {path}")
        if step + 1 == kill_at:  # test hook, see _test_kill_at_step
            os.kill(os.getpid(), signal.SIGKILL)
    params = [to_host(p) for p in strategy.full_params()]
    accuracy = float((predict(params, dataset.x_test) == dataset.y_test).mean())
    step_time = statistics.median(times) if times else 0.0
    per_rank = report.gather_per_rank(meta, strategy, registry, comm.stats(), len(times), step_time)
    document = report.metrics(strategy, cfg, losses, accuracy, params, per_rank)
    document["resumed_from_step"] = first or None  # None: a run from step 0
    if rank == 0:
        out(f"final loss {document['final_loss']}, accuracy {accuracy:.3f} on {len(dataset.y_test)} "
            f"held-out samples (chance {1 / cfg.layers[-1]:.3f}); median step {step_time * 1e3:.1f} ms")
        out(report.table(strategy, per_rank))
    write_outputs(cfg, rank, document, params, tracer)
    return document, strategy  # meta stays open: strategy.full_params() may still use it


def main(argv=None):
    cfg = parse_args(argv)
    import ringcomm
    comm = ringcomm.init(device=cfg.device)
    try:
        train(comm, cfg)
    finally:
        comm.close()
    return 0
