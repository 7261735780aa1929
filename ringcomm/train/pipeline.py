"""Model parallelism in the trainer: pipeline stages of tensor-parallel layers, with data
parallelism outermost (``--dp D --pp P --tp T``, D·P·T = world size).

**Pipeline.** Consecutive layers are placed on P stages (``split`` of the layer list). The
replica's batch is cut into M **micro-batches**; activations travel forward and their
gradients backward between neighbouring stages with send/recv on the pp group. Schedules:

- ``gpipe``: all M forwards, then all M backwards; M micro-batches' activations alive.
- ``1f1b``: stage p runs min(P−p−1, M) warm-up forwards, then alternates one forward and
  one backward, then drains; at most P micro-batches' activations alive per stage.

Either way a stage is idle for (P−1) of the M+P−1 time slots: the **bubble** fraction
(P−1)/(M+P−1). The measured idle fraction is the time a stage spends blocked waiting for
its neighbours, over the step.

**Data parallelism** on top: after the pipeline, each rank's local gradients are summed over
its dp group (ring all-reduce), and every rank steps Adam/SGD on its own layer pieces; with
``--strategy zero1``/``zero2`` the gradients are reduce-scattered instead, each dp rank
keeps optimizer state for and updates only its 1/D shard of the stage's parameters, and the
updated shards are all-gathered (ZeRO over the data dimension, on top of TP and PP).
"""
import time

import numpy as np

from ..algorithms.chunks import split
from .model import init_params, softmax_cross_entropy
from .optim import make_optimizer
from .tensor import TPLayer


def schedule(kind, p, pp, m):
    """The order of ("F", i) / ("B", i) operations stage ``p`` of ``pp`` runs for ``m``
    micro-batches."""
    if kind == "gpipe":
        return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
    if kind != "1f1b":
        raise ValueError(f"unknown schedule {kind!r}; expected gpipe or 1f1b")
    warm = min(pp - p - 1, m)
    ops = [("F", i) for i in range(warm)]
    f, b = warm, 0
    while f < m:
        ops += [("F", f), ("B", b)]
        f, b = f + 1, b + 1
    ops += [("B", i) for i in range(b, m)]
    return ops


class Stage:
    """The layers of one pipeline stage, each split over the tp group; runs one step."""

    def __init__(self, cfg, mesh, comm):
        self.cfg, self.mesh, self.comm = cfg, mesh, comm
        layers = cfg.layers
        nlayers = len(layers) - 1
        if mesh.pp > nlayers:
            raise ValueError(f"--pp {mesh.pp} exceeds the {nlayers} layers")
        lo, hi = split(0, nlayers, mesh.pp)[mesh.p]
        self.first, self.last = lo == 0, hi == nlayers
        self.layers = [TPLayer(i, layers[i], layers[i + 1], mesh.tp, mesh.t, i == nlayers - 1)
                       for i in range(lo, hi)]
        full = init_params(layers, cfg.seed)
        self.params = [layer.shard(full[2 * i], full[2 * i + 1]) for layer, i in zip(self.layers, range(lo, hi))]
        size = sum(W.size + b.size for W, b in self.params)
        # ZeRO-1/2 over the data dimension: each dp rank keeps optimizer state for 1/D of
        # this stage's (tp-local) parameters; the flat buffer is padded to a multiple of D
        self.zero = cfg.strategy in ("zero1", "zero2") and mesh.dp > 1
        self.padded = -(-size // mesh.dp) * mesh.dp if self.zero else size
        self.shard = self.padded // mesh.dp if self.zero else size
        self.optimizer = make_optimizer(cfg.optimizer, self.shard, cfg.lr, cfg.weight_decay, None)
        self.nlayers = nlayers
        self.idle = 0.0
        self.act_bytes = self.peak_act_bytes = 0
        self.events = []  # (op, micro-batch, start, end) for the trace

    # -- one step ---------------------------------------------------------------------------
    def step(self, x_rows, y_rows, global_batch):
        """Forward/backward over the micro-batches in schedule order, then the update."""
        m = self.cfg.micro_batches
        if len(x_rows) % m:
            raise ValueError(f"the per-replica batch {len(x_rows)} does not divide into {m} micro-batches")
        xs, ys = np.split(x_rows, m), np.split(y_rows, m)
        grads = [[np.zeros_like(W), np.zeros_like(b)] for W, b in self.params]
        saved, loss = {}, 0.0
        start = time.perf_counter()
        for op, i in schedule(self.cfg.schedule, self.mesh.p, self.mesh.pp, m):
            t0 = time.perf_counter()
            if op == "F":
                saved[i], share = self._forward(i, xs[i], ys[i], global_batch)
                loss += share
                self._track(saved[i], +1)
            else:
                self._backward(i, saved[i], grads)
                self._track(saved.pop(i), -1)
            self.events.append((op, i, t0, time.perf_counter()))
        self.step_time = time.perf_counter() - start
        self._sync_and_update(grads)
        return loss

    def _recv(self, shape, src, tag):
        buf = np.empty(shape, np.float32)
        t0 = time.perf_counter()
        self.mesh.pp_group.recv(buf, src, tag=tag)
        self.idle += time.perf_counter() - t0
        return buf

    def _forward(self, i, x, y, global_batch):
        rows = len(x)
        if self.first:
            h = x.astype(np.float32)
        else:
            width = self.layers[0].in_local
            h = self._recv((rows, width), self.mesh.p - 1, 2 * i)
        acts = [h]
        for layer, (W, b) in zip(self.layers, self.params):
            h = layer.forward(h, W, b, self.mesh.tp_group, relu=not layer.last)
            acts.append(h)
        share, dlogits = 0.0, None
        if self.last:
            share, dlogits = softmax_cross_entropy(h, y, global_batch)
        else:
            self.mesh.pp_group.send(np.ascontiguousarray(h), self.mesh.p + 1, tag=2 * i)
        return (acts, dlogits), share

    def _backward(self, i, saved, grads):
        acts, d = saved
        if not self.last:
            d = self._recv(acts[-1].shape, self.mesh.p + 1, 2 * i + 1)
        for k in reversed(range(len(self.layers))):
            layer, (W, _) = self.layers[k], self.params[k]
            need_dh = not (self.first and k == 0)
            dW, db, d = layer.backward(acts[k], W, acts[k + 1], d, self.mesh.tp_group,
                                       relu=not layer.last, need_dh=need_dh)
            grads[k][0] += dW
            grads[k][1] += db
        if not self.first:
            self.mesh.pp_group.send(np.ascontiguousarray(d), self.mesh.p - 1, tag=2 * i + 1)

    def _track(self, saved, sign):
        nbytes = sum(a.nbytes for a in saved[0]) + (saved[1].nbytes if saved[1] is not None else 0)
        self.act_bytes += sign * nbytes
        self.peak_act_bytes = max(self.peak_act_bytes, self.act_bytes)

    def _sync_and_update(self, grads):
        """Sum gradients over the dp group and step. Plain DP: all-reduce, every rank steps
        everything. ZeRO-1/2: reduce-scatter, each rank steps its shard, all-gather."""
        if self.cfg.clip_grad_norm:
            raise ValueError("--clip-grad-norm is not supported with --tp/--pp yet")
        size = sum(g.size for pair in grads for g in pair)
        flat = np.zeros(self.padded, np.float32)
        flat[:size] = np.concatenate([g.reshape(-1) for pair in grads for g in pair])
        master = np.zeros(self.padded, np.float32)
        master[:size] = np.concatenate([p.reshape(-1) for pair in self.params for p in pair])
        self.optimizer.begin_step()
        if self.zero:
            lo, hi = self.mesh.d * self.shard, (self.mesh.d + 1) * self.shard
            self.mesh.dp_group.reduce_scatter(flat[lo:hi], flat, algorithm="ring")
            self.optimizer.update(master[lo:hi], flat[lo:hi])
            self.mesh.dp_group.all_gather(master, master[lo:hi], algorithm="ring")
        else:
            if self.mesh.dp > 1:
                self.mesh.dp_group.all_reduce(flat, algorithm="ring")
            self.optimizer.update(master, flat)
        offset = 0
        for W, b in self.params:
            for p in (W, b):
                p[...] = master[offset:offset + p.size].reshape(p.shape)
                offset += p.size

    # -- results ----------------------------------------------------------------------------
    def full_params(self, meta):
        """Every layer's full W and b (model order), summed into place from all ranks."""
        layers = self.cfg.layers
        full = init_params(layers, self.cfg.seed)
        flat = [np.zeros_like(p) for p in full]
        if self.mesh.d == 0:
            for layer, (W, b) in zip(self.layers, self.params):
                flat[2 * layer.index][layer.rows, layer.cols] = W
                if layer.owns_bias():
                    flat[2 * layer.index + 1][layer.cols] = b
        joined = np.concatenate([f.reshape(-1) for f in flat])
        meta.all_reduce(joined)
        out, offset = [], 0
        for f in flat:
            out.append(joined[offset:offset + f.size].reshape(f.shape))
            offset += f.size
        return out

    def predicted_tp_bytes(self, rows_per_step):
        m = self.cfg.micro_batches
        local = self.mesh.tp_group.local if self.mesh.tp > 1 else False
        return m * sum(layer.comm_bytes(rows_per_step // m, 4, first=layer.index == 0, local=local)
                       for layer in self.layers)

    def bubble_formula(self):
        p, m = self.mesh.pp, self.cfg.micro_batches
        return (p - 1) / (m + p - 1)


def train_model_parallel(comm, cfg, dataset, order_cls, out=print, tracer=None):
    """Train with ``--dp/--pp/--tp``; returns the metrics document (same on every rank)."""
    from . import mesh as meshes
    from .report import param_sha256
    from .model import predict
    if cfg.precision != "fp32":
        raise ValueError("--tp/--pp run in fp32 only")
    mesh = meshes.build(comm, cfg.dp, cfg.pp, cfg.tp)
    meta = comm.new_group(list(range(comm.world_size)))
    stage = Stage(cfg, mesh, comm)
    order = order_cls(len(dataset.x), cfg.batch_size, mesh.dp, cfg.seed)
    if comm.rank == 0:
        out(f"ringcomm.train: {mesh.name}, {cfg.schedule} with {cfg.micro_batches} micro-batches, "
            f"{len(cfg.layers) - 1} layers over {mesh.pp} stage(s), global batch {cfg.batch_size}, {cfg.steps} steps")
    for group in (mesh.tp_group, mesh.pp_group, mesh.dp_group):
        group.reset_stats()
    losses, times, every = [], [], cfg.log_every or max(1, cfg.steps // 10)
    for step in range(cfg.steps):
        rows = order.local_rows(step, mesh.d)
        t0 = time.perf_counter()
        share = stage.step(dataset.x[rows], dataset.y[rows], cfg.batch_size)
        times.append(time.perf_counter() - t0)
        loss = np.array([share if stage.last and mesh.t == 0 else 0.0])
        meta.all_reduce(loss)
        losses.append(float(loss[0]))
        if comm.rank == 0 and ((step + 1) % every == 0 or step + 1 == cfg.steps):
            out(f"step {step + 1:>5}/{cfg.steps}  loss {losses[-1]:.4f}")
    params = stage.full_params(meta)
    accuracy = float((predict(params, dataset.x_test) == dataset.y_test).mean())
    busy_time = sum(times)
    stats = {k: g.stats() for k, g in (("tp", mesh.tp_group), ("pp", mesh.pp_group), ("dp", mesh.dp_group))}
    steps = max(len(losses), 1)
    mine = np.array([comm.rank, mesh.d, mesh.p, mesh.t, stage.idle / busy_time if busy_time else 0.0,
                     stage.bubble_formula(), stage.peak_act_bytes, stats["tp"]["bytes_sent"] / steps,
                     stage.predicted_tp_bytes(cfg.batch_size // mesh.dp), stats["pp"]["bytes_sent"] / steps,
                     stats["dp"]["bytes_sent"] / steps, float(np.median(times)) if times else 0.0])
    everyone = np.empty(len(mine) * comm.world_size)
    meta.all_gather(everyone, mine)
    names = ["rank", "d", "p", "t", "bubble_fraction", "bubble_formula", "peak_activation_bytes",
             "tp_bytes_sent_per_step", "tp_bytes_predicted_per_step", "pp_bytes_sent_per_step",
             "dp_bytes_sent_per_step", "step_time_s"]
    per_rank = [{k: (int(v) if k in ("rank", "d", "p", "t", "peak_activation_bytes") else float(v))
                 for k, v in zip(names, row)} for row in everyone.reshape(comm.world_size, -1)]
    document = {"strategy": "model_parallel", "layout": {"dp": mesh.dp, "pp": mesh.pp, "tp": mesh.tp},
                "schedule": cfg.schedule, "micro_batches": cfg.micro_batches, "world_size": comm.world_size,
                "precision": cfg.precision, "steps": len(losses), "losses": losses,
                "final_loss": losses[-1] if losses else None, "accuracy": accuracy,
                "num_params": sum(p.size for p in params), "param_sha256": param_sha256(params),
                "per_rank": per_rank}
    if comm.rank == 0:
        out(f"final loss {document['final_loss']}, accuracy {accuracy:.3f}")
        out(f"{'rank':>4} {'d':>2} {'p':>2} {'t':>2} {'idle':>6} {'(P-1)/(M+P-1)':>14} {'peak act KiB':>13}"
            f" {'tp KiB/step':>12} {'tp formula':>11} {'pp KiB/step':>12} {'dp KiB/step':>12}")
        for r in per_rank:
            out(f"{r['rank']:>4} {r['d']:>2} {r['p']:>2} {r['t']:>2} {r['bubble_fraction']:>6.2f} "
                f"{r['bubble_formula']:>14.2f} {r['peak_activation_bytes'] / 1024:>13.1f} "
                f"{r['tp_bytes_sent_per_step'] / 1024:>12.1f} {r['tp_bytes_predicted_per_step'] / 1024:>11.1f} "
                f"{r['pp_bytes_sent_per_step'] / 1024:>12.1f} {r['dp_bytes_sent_per_step'] / 1024:>12.1f}")
    if tracer is not None and tracer.enabled:
        for op, i, t0, t1 in stage.events:
            tracer._add(f"{op}{i} stage {mesh.p}", 0, t0, t1, {"micro_batch": i})
    meta.close()
    return document, params
