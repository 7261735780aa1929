"""Shared by the checkpoint tests: a small training configuration and the functions the
ranks of a ``pools(n)`` job run (module level, so the pool can send them by name)."""
import functools
import json
import os
import subprocess
import sys
import time

import numpy as np

import ringcomm
from ringcomm.train.checkpoint import files, state
from ringcomm.train.parallel import strategy as strategy_module
from ringcomm.train.config import TrainConfig
from ringcomm.train.trainer import train
from ringcomm.train.optim import LossScaler

# small enough for 2 cores; bucket_mb makes 2 buckets, so units, padding and shards matter
BASE = dict(layers=(16, 32, 24, 5), batch_size=48, samples=480, steps=8, lr=5e-3, seed=3,
            bucket_mb=0.001, log_every=100)
# fp16 runs use a loss scaler that starts high and grows fast, so that within 8 steps it
# overflows, skips steps, halves and doubles: its whole state must survive a checkpoint
BUSY_SCALER = dict(initial=2.0 ** 19, window=2)

# (strategy, offload, world size)
STRATEGIES = [("single", False, 1), ("dp", False, 2), ("ddp", False, 2), ("zero1", False, 2),
              ("zero2", False, 2), ("zero3", False, 2), ("zero1", True, 2), ("zero2", True, 2),
              ("zero3", True, 2)]


def subprocess_env(**extra):
    """The environment for ``python -m ringcomm...`` subprocesses: this checkout importable
    wherever the tests run from, installed or not."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(ringcomm.__file__)))
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    return dict(os.environ, PYTHONPATH=path, **extra)


def restart_args(ckpt, metrics):
    """``python -m ringcomm.train`` arguments of the restart tests: BASE in zero2 fp16,
    checkpoints every 2 steps into ``ckpt``, resuming from them, metrics to ``metrics``."""
    return ["--strategy", "zero2", "--precision", "fp16", "--layers", ",".join(map(str, BASE["layers"])),
            "--batch-size", BASE["batch_size"], "--samples", BASE["samples"], "--steps", BASE["steps"],
            "--lr", BASE["lr"], "--seed", BASE["seed"], "--bucket-mb", BASE["bucket_mb"],
            "--checkpoint-dir", ckpt, "--checkpoint-every", 2, "--resume", "--metrics-json", metrics]


def config(**overrides):
    return TrainConfig(**{**BASE, **overrides})


def run_train(comm, overrides, busy_scaler=True):
    """Train on this rank; the parts of the metrics document the tests compare."""
    cfg = config(**overrides)
    original = strategy_module.LossScaler
    if cfg.precision == "fp16" and busy_scaler:
        strategy_module.LossScaler = functools.partial(LossScaler, **BUSY_SCALER)
    try:
        doc, _ = train(comm, cfg, out=lambda *a, **k: None)
    finally:
        strategy_module.LossScaler = original
    return {k: doc[k] for k in ("param_sha256", "losses", "skipped_steps", "loss_scale",
                                "resumed_from_step", "steps")}


def run_resume_and_save(comm, overrides, out_dir):
    """Resume (running no step when ``steps`` is the checkpoint's step), then save this
    world's checkpoint of the loaded state into ``out_dir``."""
    cfg = config(**overrides)
    doc, strategy = train(comm, cfg, out=lambda *a, **k: None)
    meta = comm.new_group(list(range(comm.world_size)))
    try:
        state.save(meta, strategy, cfg, cfg.steps, doc["losses"], out_dir)
    finally:
        meta.close()
    return doc["param_sha256"]


def load_params(path):
    with np.load(path, allow_pickle=False) as f:
        return {k: f[k] for k in f.files}


def cli(*args, timeout=60):
    """``python -m ringcomm.checkpoint ARGS``: (returncode, stdout, stderr)."""
    proc = subprocess.run([sys.executable, "-m", "ringcomm.checkpoint", *map(str, args)],
                          capture_output=True, text=True, timeout=timeout, env=subprocess_env())
    return proc.returncode, proc.stdout, proc.stderr


def manifest(path):
    with open(os.path.join(path, files.MANIFEST)) as f:
        return json.load(f)


def steps_on_disk(root):
    return sorted(e.step for e in files.scan(root))


def run_train_crashing(comm, overrides, crash_step, victim):
    """Train, but die (``os._exit``) in the middle of writing the checkpoint of
    ``crash_step``: ``victim="rank file"``: rank 1 writes half of its file to the temporary
    name and dies (rank 0's file is already durable); ``victim="manifest"``: every rank file
    is durable and rank 0 dies half-way through the manifest."""
    real = state.write_durable  # as saving calls it

    def crashing(path, data):
        in_step = os.path.basename(os.path.dirname(path)) == f"step_{crash_step:06d}"
        mine = (victim == "rank file" and comm.rank == 1 and path.endswith(".npz")) or \
               (victim == "manifest" and path.endswith(files.MANIFEST))
        if in_step and mine:
            if victim == "rank file":  # the scenario: rank 0's file is durable first
                other = os.path.join(os.path.dirname(path), "rank0.npz")
                deadline = time.monotonic() + 20
                while not os.path.exists(other) and time.monotonic() < deadline:
                    time.sleep(0.01)
            with open(f"{path}.tmp-{os.getpid()}", "wb") as f:
                f.write(data[:len(data) // 2])
            os._exit(17)
        return real(path, data)

    state.write_durable = crashing
    try:
        return run_train(comm, overrides)
    finally:
        state.write_durable = real
