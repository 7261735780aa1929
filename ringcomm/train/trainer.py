"""The training loop: one loop for every model, data-parallel strategy and layout.

It composes the parts, each in its room: the model's layers on this rank
(:mod:`.models.stage`), the layout (:mod:`.parallel.mesh`), the data-parallel strategy over
the data group (:mod:`.parallel.strategy`, :mod:`.parallel.zero`), the step with its
pipeline schedule (:mod:`.parallel.step`), checkpoints (:mod:`.checkpoint`) and the report
(:mod:`.accounting.report`).

>>> document, strategy = train(comm, TrainConfig(model="gpt", cp=2, tp=2, steps=10))
"""
import dataclasses
import os
import statistics
import time

import numpy as np

from ..arrays import to_host
from ..errors import PeerLost
from . import corpus, data as datasets, elastic as elastic_training
from .accounting import report
from .accounting.memory import ZERO_STAGES, MemoryRegistry
from .accounting.peak import PeakWatch, allocated_by
from .accounting.trace import Tracer
from .checkpoint import files as checkpoint_files, state as checkpoint_state
from .checkpoint.layout import Placement
from .config import uneven_batches, validate
from .models import stage as stages
from .models.gpt import held_out_loss
from .models.mlp import predict
from .parallel import mesh as meshes
from .parallel.regions import all_reduce_arrays
from .parallel.step import StepRunner
from .parallel.strategy import ParameterServer, Replicated, Single, StrategyContext
from .parallel.zero import Zero

STRATEGY_CLASSES = {"single": Single, "dp": ParameterServer, "ddp": Replicated,
                    **{name: Zero for name in ZERO_STAGES}}


def make_strategy(ctx):
    """The strategy ``ctx.cfg.strategy`` names, built from ``ctx`` (a :class:`StrategyContext`)."""
    return STRATEGY_CLASSES[ctx.cfg.strategy](ctx)


def load_data(cfg):
    """The MLP's feature vectors, or the GPT's sequences (see :mod:`.corpus`)."""
    if cfg.model == "gpt":
        if cfg.data:
            return corpus.load_npz(cfg.data, cfg.seq_len, cfg.vocab)
        if cfg.vocab < 256:
            raise ValueError(f"the default corpus is bytes: it needs --vocab >= 256, got {cfg.vocab}")
        return corpus.stdlib_corpus(cfg.seq_len)
    # a file's labels are checked against the classes as it is read (naming the first bad row)
    dataset = datasets.load_npz(cfg.data, cfg.layers[-1]) if cfg.data else \
        datasets.synthetic(cfg.layers[0], cfg.layers[-1], cfg.samples, cfg.seed)
    if dataset.x.shape[1] != cfg.layers[0]:
        raise ValueError(f"the data has {dataset.x.shape[1]} features but --layers starts with {cfg.layers[0]}")
    return dataset


def array_module_for(comm):
    """Where model state lives: cupy on a GPU worker, numpy otherwise."""
    if comm.device == "gpu":
        import cupy
        return cupy
    return np


class Job:
    """Everything one rank builds before the first step."""

    def __init__(self, comm, cfg, fresh=True):
        """``fresh=False``: the job again over a world shrunk by a loss (``--elastic``)."""
        # every check that can fail on its own comes before the first byte is sent
        self.cfg = cfg = validate(cfg, comm.world_size)
        self.rank = comm.rank
        self.replaced = self.check_checkpoint_dir() if fresh else []
        self.dataset = load_data(cfg)
        self.order = datasets.BatchOrder(len(self.dataset.x), cfg.batch_size, cfg.dp, cfg.seed,
                                         uneven=uneven_batches(cfg))
        self.mesh = meshes.build(comm, cfg.dp, cfg.cp, cfg.pp, cfg.tp, tied=cfg.model == "gpt")
        self.meta = comm.new_group(list(range(comm.world_size)))  # control traffic, not counted
        self.xp = array_module_for(comm)
        self.dtype = np.dtype(np.float16 if cfg.precision == "fp16" else np.float32)
        self.stage = stages.build(cfg, self.mesh, self.dtype)
        self.counted = stages.counted(self.stage, self.mesh)
        self.registry, self.tracer = MemoryRegistry(self.xp), Tracer(comm.rank, bool(cfg.trace))
        ctx = StrategyContext(
            group=self.mesh.group("data"), meta=self.meta, side=self.mesh.group("side"),
            specs=[(s.name, s.local_shape) for s in self.stage.local_specs()],
            layer_members=self.stage.layer_members(), params=self.stage.init_local(stages.full_init(cfg)),
            cfg=cfg, registry=self.registry, tracer=self.tracer, counted=self.counted, alone=self.stage.copies(),
            zero_stage=ZERO_STAGES.get(cfg.strategy, 0), layer_offset=self.stage.offset)
        self.strategy, self.state_traced = allocated_by(make_strategy, ctx)
        if self.xp is not np:
            self.state_traced = -1  # device memory: not what tracemalloc sees
        self.strategy.placement = self.placement()
        self.watch = PeakWatch(enabled=self.xp is np, every=cfg.memory_watch == "every")
        self.runner = StepRunner(self.stage, self.strategy, self.mesh, cfg, self.tracer)
        self.denominator = cfg.batch_size * self.stage.seq_len

    def check_checkpoint_dir(self):
        """The checkpoints a fresh run would replace: refused unless ``--overwrite``."""
        cfg = self.cfg
        if not cfg.checkpoint_dir or cfg.resume:
            return []
        existing = [e for e in checkpoint_files.scan(cfg.checkpoint_dir, check=False) if e.reason != "no manifest"]
        if existing and not cfg.overwrite:
            names = ", ".join(os.path.basename(e.path) for e in existing)
            raise checkpoint_files.CheckpointError(
                f"--checkpoint-dir {cfg.checkpoint_dir} already holds checkpoints ({names}): --resume to "
                f"continue from them, or --overwrite to replace them")
        return existing

    def placement(self):
        """Where this rank's parameters sit in the whole model, for checkpoints."""
        mesh = self.mesh
        return Placement({"dp": mesh.dp, "cp": mesh.cp, "pp": mesh.pp, "tp": mesh.tp},
                         [mesh.d, mesh.c, mesh.p, mesh.t], mesh.data_rank,
                         [[s.name, list(s.shape)] for s in stages.full_specs(self.cfg)],
                         [[s.name, s.axis, None if s.index is None else s.index.tolist()]
                          for s in self.stage.local_specs()])

    def batch(self, step):
        rows = self.order.local_rows(step, self.mesh.d)
        x, y = self.stage.batch(self.dataset.x[rows], self.dataset.y[rows])
        if self.cfg.model == "mlp":
            return self.xp.asarray(x, dtype=self.dtype), self.xp.asarray(y)
        return self.xp.asarray(x), self.xp.asarray(y)

    def full_params(self):
        """The whole model's fp32 parameters in model order, the same on every rank."""
        local = [to_host(p) for p in self.strategy.full_params()]
        if not self.cfg.model_parallel:
            return local
        specs = self.stage.specs
        full = [np.zeros(s.shape, np.float32) for s in specs]
        if self.mesh.data_rank == 0:  # tp pieces are disjoint; replicated and tied copies count once
            for g, piece, counted in zip(self.stage.local, local, self.counted, strict=True):
                if counted:
                    specs[g].place(full[g], piece)
        return all_reduce_arrays(self.meta, full)  # each piece placed by exactly one rank: exact sums


def resume(job, out):
    """Load the newest complete checkpoint for ``--resume``; the step to start from and the
    losses so far."""
    cfg, meta, strategy = job.cfg, job.meta, job.strategy
    if not (cfg.resume and cfg.checkpoint_dir):
        return 0, []
    resumed = checkpoint_state.restore(meta, strategy, cfg, cfg.checkpoint_dir)
    if meta.rank == 0:
        if resumed is None:
            out(f"ringcomm.train: no complete checkpoint in {cfg.checkpoint_dir}: starting from step 0")
        else:
            m = resumed.manifest
            how = (f", resharded from {m['strategy']} on {m['world_size']} rank(s)" if resumed.resharded else "")
            out(f"ringcomm.train: resuming from {resumed.path} (step {resumed.step}{how})")
            for warning in checkpoint_state.check_compatible(m, cfg):
                out(f"ringcomm.train: warning: {warning} when the checkpoint was saved")
            for note in resumed.notes:
                out(f"ringcomm.train: warning: {note}")
    if resumed is None:
        return 0, []
    if resumed.step > cfg.steps:
        raise checkpoint_files.CheckpointError(f"{resumed.path} is at step {resumed.step}, past --steps {cfg.steps}")
    return resumed.step, resumed.losses


def evaluate(job, params):
    """Held-out accuracy (MLP) or held-out loss in bits per character (GPT), computed by rank
    0 on the fp32 model and shared."""
    value = np.zeros(1)
    if job.rank == 0:
        if job.cfg.model == "mlp":
            value[0] = float((predict(params, job.dataset.x_test) == job.dataset.y_test).mean())
        else:
            loss = held_out_loss(stages.gpt_shape(job.cfg), params, job.dataset.x_test, job.dataset.y_test)
            value[0] = corpus.bits(loss)
    job.meta.broadcast(value, root=0)
    return float(value[0])


def train(comm, cfg, out=print):
    """Run ``cfg`` on this rank; returns ``(metrics document, strategy)``.

    The document is the same on every rank (``per_rank`` gathered everywhere) but for
    ``step_times_s`` and ``step_cpu_s``, this rank's own step times (wall clock, and the CPU
    time of its process: every thread's, the communication thread's included); the strategy
    holds this rank's final model state. With ``cfg.resume`` the run continues from the
    newest complete checkpoint, and the document's losses include those before it."""
    job = Job(comm, cfg)
    mesh = job.mesh
    if job.rank == 0:
        out(report.banner(job))
        for entry in job.replaced:  # --overwrite: every rank has checked the directory by now
            checkpoint_files.remove_checkpoint(entry.path)
            out(f"ringcomm.train: --overwrite: removed {entry.path}")
    first, losses = resume(job, out)
    groups = report.dimension_groups(mesh)
    for group in groups.values():
        group.reset_stats()
    elastic = _elastic(comm, job, out)
    job, times, idle, counted, cpu = _run_steps(job, first, losses, out, elastic)
    if job.mesh is not mesh:  # rebuilt after a loss: the byte counts are the new groups'
        groups = report.dimension_groups(job.mesh)
    cfg, runner = job.cfg, job.runner
    params = job.full_params()
    quality = evaluate(job, params)
    step_time = statistics.median(times) if times else 0.0
    idle_fraction = sum(idle) / sum(times) if times and sum(times) else 0.0
    per_rank = report.gather_per_rank(job, groups, counted, step_time, idle_fraction)
    document = report.metrics(job, losses, quality, params, per_rank)
    document["resumed_from_step"] = first or None  # None: a run from step 0
    document["recoveries"] = [] if elastic is None else [
        {"step": step, "lost": lost, "seconds": seconds, "step_taken": taken}
        for step, lost, seconds, taken in elastic.recoveries]
    document["step_times_s"] = times  # this rank's, in order: how steady the steps are
    document["step_cpu_s"] = cpu  # beside other jobs, a steadier measure of the work
    if job.rank == 0:
        out(report.summary(job, document, step_time))
        out(report.table(job, per_rank))
    _write_outputs(job, document, params, runner)
    return document, job.strategy  # meta stays open: strategy.full_params() may still use it


def _elastic(comm, job, out):
    """``--elastic``: this rank's :class:`~.elastic.Elastic`, its commit point set on the
    strategy; None without it, or (said at start) where the layout cannot recover in memory."""
    if not job.cfg.elastic:
        return None
    reason = elastic_training.unsupported(job.cfg)
    if reason is not None:
        if job.rank == 0:
            out(f"ringcomm.train: --elastic: {reason}: a lost rank ends this job, and --resume "
                f"continues it from its last checkpoint")
        return None
    if job.rank == 0 and os.environ.get("RINGCOMM_ERROR_FILE") and os.environ.get("RINGCOMM_ON_FAILURE") != "continue":
        out("ringcomm.train: warning: --elastic under ringcomm.launch without --on-failure continue: the "
            "launcher stops every worker as soon as one is lost")
    elastic = elastic_training.Elastic(comm, out)
    job.strategy.commit = elastic.commit
    return elastic


def _run_steps(job, first, losses, out, elastic=None):
    """Steps ``first`` to ``cfg.steps``, each loss appended to ``losses``, with progress
    lines and checkpoints; with ``elastic``, past lost ranks. Returns the job (rebuilt after
    a loss), this rank's step times and idle times (s), the steps its groups' byte counts
    cover, and the process's CPU time per step (s)."""
    cfg = job.cfg
    times, idle, cpu = [], [], []
    every = cfg.log_every or max(1, cfg.steps // 10)
    save_every = cfg.checkpoint_every if cfg.checkpoint_dir else 0
    start, step, counted = time.perf_counter(), first, 0
    while step < cfg.steps:
        x, y = job.batch(step)
        watch = job.watch
        watched = watch.watches(step - first)
        t0, c0 = time.perf_counter(), time.process_time()
        if watched:
            watch.begin()
        try:
            if elastic is None:
                (loss, _), after, waited = job.runner.step(x, y, job.denominator), job, job.runner.idle
            else:
                after, loss, waited = _elastic_step(job, elastic, step, x, y)
        finally:
            if watched:
                watch.end()
        if loss is None:  # taken nowhere: again, over the survivors
            job, counted = after, 0
            continue
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
        idle.append(waited)
        losses.append(loss)
        counted += 1
        if after is not job:  # taken, and a rank lost on the way: go on over the survivors
            job, counted = after, 0
        if job.rank == 0 and ((step + 1) % every == 0 or step + 1 == cfg.steps):
            out(report.progress(job, step, losses[-1], (step + 1 - first) / (time.perf_counter() - start)))
        if cfg.checkpoint_dir and ((save_every and (step + 1) % save_every == 0) or step + 1 == cfg.steps):
            path = checkpoint_state.save(job.meta, job.strategy, job.cfg, step + 1, losses, cfg.checkpoint_dir)
            if job.rank == 0 and step + 1 == cfg.steps:
                out(f"checkpoint {path}")
        step += 1
    return job, times, idle, counted, cpu


def _elastic_step(job, elastic, step, x, y):
    """Step ``step`` with ``--elastic``: ``(job, loss, idle)``, the job rebuilt over the
    survivors when a rank was lost, and the loss None when the step was taken nowhere (it
    is to be run again over them)."""
    elastic.outcome = None
    rebuild = lambda world: _rebuilt(world, job.cfg)  # noqa: E731 - the one place it is made
    try:
        (loss, _), lost_after_commit = job.runner.step(x, y, job.denominator), False
    except (PeerLost, elastic_training.StepNotTaken):
        if elastic.outcome is None:
            elastic.failed()  # failed before its commit point: it votes against the step
        if not elastic.outcome[0]:
            return elastic.recover(job, rebuild, step, taken=False), None, 0.0
        # taken everywhere, then a loss (ZeRO-1/2's gather of the updated shards): the step
        # stands. Survivors whose gather completed go on and fail the next step before its
        # commit point; this rank votes against that step now, as they will, and all rebuild
        loss, lost_after_commit = job.strategy.agreed_loss, True
    waited = job.runner.idle
    if lost_after_commit:
        elastic.failed()
        return elastic.recover(job, rebuild, step + 1, taken=False), loss, waited
    if elastic.lost:
        return elastic.recover(job, rebuild, step, taken=True), loss, waited
    return job, loss, waited


def _rebuilt(world, cfg):
    """The job over ``world``, a world shrunk by a loss (its layout found again for it)."""
    return Job(world, dataclasses.replace(cfg, dp=0), fresh=False)


def _write_outputs(job, document, params, runner):
    """What the flags ask for: the metrics JSON and the parameters (rank 0), the trace."""
    cfg = job.cfg
    if job.rank == 0:
        if cfg.metrics_json:
            report.write_json(cfg.metrics_json, document)
        if cfg.save:
            np.savez(cfg.save, **{s.name: p for s, p in zip(job.stage.specs, params, strict=True)})
    if cfg.trace:
        for op, i, t0, t1 in runner.events:
            job.tracer._add(f"{op}{i} stage {job.mesh.p}", 0, t0, t1, {"micro_batch": i})
        job.tracer.write(cfg.trace)
