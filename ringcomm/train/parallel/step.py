"""One training step on one rank, for every layout: micro-batches through this rank's
pipeline stage in schedule order, gradients handed to the strategy, then the update.

**Pipeline.** The stage's layers (:mod:`ringcomm.train.models.stage`) run on the rank's
batch cut into M **micro-batches**; activations travel forward and their gradients backward
between neighbouring stages with send/recv on the pp group. Schedules:

- ``gpipe``: all M forwards, then all M backwards; M micro-batches' activations alive.
- ``1f1b``: stage p runs min(P−p−1, M) warm-up forwards, then alternates one forward and
  one backward, then drains; at most P−p micro-batches' activations alive on stage p.

Either way a stage is idle for (P−1) of the M+P−1 time slots: the **bubble** fraction
(P−1)/(M+P−1). The measured idle fraction is the time a stage spends blocked waiting for
its neighbours, over the step. Without pipeline parallelism (P = 1, M = 1) this is plain
forward then backward.

**Gradients.** Each layer's backward yields one contribution per parameter it uses; the
strategy accumulates them (``first`` overwrites) and hears ``grad_done`` after the last one of
the step, which is when DDP and ZeRO start a bucket's communication. A **tied** parameter
(one held by two stages) is accumulated here instead, summed over the tied group after the
schedule and then handed over.

**Activation recomputation** (``recompute``): a layer keeps only its input and runs its
forward again just before its backward.

>>> runner = StepRunner(stage_model, strategy, mesh, cfg, tracer)
>>> loss, skipped = runner.step(x, y, denominator)      # this rank's tokens or rows
"""
import time
from collections import Counter

import numpy as np

from ..accounting.activations import held_bytes


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


class StepRunner:
    def __init__(self, model, strategy, mesh, cfg, tracer):
        self.model, self.strategy, self.mesh, self.cfg, self.trace = model, strategy, mesh, cfg, tracer
        self.members = model.layer_members()
        self.dtype = strategy.dtype
        self.xp = strategy.xp
        self.micro = cfg.micro_batches
        self.ops = schedule(cfg.schedule, mesh.p, mesh.pp, self.micro)
        uses = Counter(p for members in self.members for p in members)
        self.contributions = {p: n * self.micro for p, n in uses.items()}
        where = {g: i for i, g in enumerate(model.local)}
        self.tied = sorted(where[g] for g in model.tied)
        self.idle = 0.0           # seconds blocked on the pipeline neighbours, last step
        self.step_time = 0.0
        self.saved_peak = 0       # the most activation bytes held between forward and backward
        self.events = []          # (op, micro-batch, start, end) of the last step

    # -- the step -----------------------------------------------------------------------------
    def step(self, x, y, denominator):
        """Forward and backward of every micro-batch, then the update. Returns ``(loss,
        skipped)``, the global loss agreed by every rank."""
        start = time.perf_counter()
        self.idle, self.events = 0.0, []
        xs, ys = np.array_split(x, self.micro), np.array_split(y, self.micro)
        if self.micro > 1:  # each micro-batch its own array (freed once done), where it is used
            xs = [a.copy() for a in xs] if self.mesh.first_stage else xs
            ys = [a.copy() for a in ys] if self.mesh.last_stage else ys
        self._left = dict(self.contributions)
        self._tied_grads = {}
        self._saved, self._dout, self._shapes = {}, {}, {}
        share = 0.0
        for op, i in self.ops:
            t0 = time.perf_counter()
            if op == "F":
                share += self._forward(i, xs[i], ys[i], denominator)
            else:
                self._backward(i)
            self.events.append((op, i, t0, time.perf_counter()))
        self._sync_tied()
        with self.trace.span("finish backward"):
            self.strategy.finish_backward()
        self.step_time = time.perf_counter() - start
        if not self._reports_loss():
            share = 0.0
        with self.trace.span("optimizer step"):
            return self.strategy.update(share)

    def _reports_loss(self):
        """Whether this rank's loss share is part of the global sum (each row once)."""
        return self.mesh.last_stage and (self.mesh.t == 0 or self.model.loss_rows_split)

    def _label(self, phase, k, i):
        """``forward L3`` (``forward L3 mb1`` with micro-batches): L counts the model's layers."""
        return f"{phase} L{self.model.offset + k}" + (f" mb{i}" if self.micro > 1 else "")

    # -- pipeline neighbours ------------------------------------------------------------------
    def _recv(self, shape, src, tag):
        buf = self.xp.empty(shape, self.dtype)
        t0 = time.perf_counter()
        self.mesh.group("pp").recv(buf, src, tag=tag)
        self.idle += time.perf_counter() - t0
        return buf

    def _send(self, h, dst, tag):
        self.mesh.group("pp").send(self.xp.ascontiguousarray(h, dtype=self.dtype), dst, tag=tag)

    # -- forward and backward of one micro-batch ------------------------------------------------
    def _forward(self, i, x, y, denominator):
        mesh, layers = self.mesh, self.model.layers
        h = x if mesh.first_stage else self._recv(self.model.boundary_shape(len(x)), mesh.p - 1, 2 * i)
        saved = []
        for k, layer in enumerate(layers):
            params = self.strategy.layer_params(k, "forward")
            with self.trace.span(self._label("forward", k, i)):
                out, cache = layer.forward(params, h)
            self.strategy.release_layer(k, "forward")
            saved.append(h if self.cfg.recompute else cache)
            h = out
        self._saved[i] = saved
        self.saved_peak = max(self.saved_peak, held_bytes(self._saved, self._dout))
        if not mesh.last_stage:
            self._shapes[i] = h.shape
            self._send(h, mesh.p + 1, 2 * i)
            return 0.0
        share, dlogits = self.model.loss(h, self.xp.asarray(y), denominator)
        dlogits *= self.strategy.scaler.scale
        self._dout[i] = dlogits
        self.saved_peak = max(self.saved_peak, held_bytes(self._saved, self._dout))
        return share

    def _backward(self, i):
        mesh, layers = self.mesh, self.model.layers
        d = self._dout.pop(i) if mesh.last_stage else self._recv(self._shapes.pop(i), mesh.p + 1, 2 * i + 1)
        saved = self._saved.pop(i)
        for k in reversed(range(len(layers))):
            layer = layers[k]
            params = self.strategy.layer_params(k, "backward")
            with self.trace.span(self._label("backward", k, i)):
                cache = layer.forward(params, saved[k])[1] if self.cfg.recompute else saved[k]
                grads, d = layer.backward(params, cache, d)
            saved[k] = None  # this layer's activations are garbage from here on
            self.strategy.release_layer(k, "backward")
            for p, g in zip(self.members[k], grads, strict=True):
                self._grad(p, g)
        if not mesh.first_stage:
            self._send(d, mesh.p - 1, 2 * i + 1)

    def _grad(self, p, g):
        first = self._left[p] == self.contributions[p]
        self._left[p] -= 1
        if p in self.tied:
            self._tied_grads[p] = g.astype(np.float32) if first else self._tied_grads[p] + g
            return
        self.strategy.accumulate(p, g, first)
        if self._left[p] == 0:
            self.strategy.grad_done(p)

    def _sync_tied(self):
        """Sum the tied parameters' gradients over the stages that hold them."""
        group = self.mesh.group("tied")
        for p in self.tied:
            g = self.xp.ascontiguousarray(self._tied_grads.pop(p), dtype=np.float32)
            if group is not None:
                group.all_reduce(g)
            self.strategy.accumulate(p, g, first=True)
            self.strategy.grad_done(p)
