"""What every data-parallel strategy shares: the step (forward, backward, update), mixed
precision, loss scaling, clipping, and the replicated strategies ``single`` and ``ddp``.

A strategy decides where each piece of model state lives and what crosses the wire, through
a few hooks called by :meth:`Strategy.step`:

- ``layer_params(i, phase)`` / ``release_layer(i, phase)``: the parameters of layer i for
  forward or backward (ZeRO-3 gathers them here and frees them after use);
- ``grad_ready(p, grad)``: backward produced parameter p's gradient (DDP starts a bucket's
  all-reduce as soon as its last gradient arrives);
- ``finish_backward()``: wait for gradient communication;
- ``owned_grad32()``, ``master_pieces()``, ``write_back()``, ``publish(skipped)``: the
  optimizer step on the state this rank owns, then sharing the result.

Every strategy's step leaves the model in exactly the state the single-process reference
would reach, up to floating-point summation order.
"""
import numpy as np

from ..device import copy_into, to_host

from ..memory import predicted
from .layout import Layout
from .model import linear_backward, linear_forward, param_specs, softmax_cross_entropy
from .optim import LossScaler, clip_coefficient, make_optimizer


class Strategy:
    name = "base"
    per_layer_units = False

    def __init__(self, comm, meta, layers, params, cfg, registry, tracer):
        self.comm, self.meta = comm, meta
        self.rank, self.n = comm.rank, comm.world_size
        self.cfg, self.reg, self.trace = cfg, registry, tracer
        self.xp = registry.xp  # numpy, or cupy when training on a GPU
        self.layers = layers
        self.nlayers = len(layers) - 1
        self.dtype = np.dtype(np.float16 if cfg.precision == "fp16" else np.float32)
        self.mixed = cfg.precision == "fp16"
        self.layout = Layout(param_specs(layers), self.n, int(cfg.bucket_mb * 2 ** 20),
                             self.dtype.itemsize, per_layer=self.per_layer_units)
        self.scaler = LossScaler(enabled=self.mixed)
        self.optimizer_category = "optimizer_host" if cfg.offload else "optimizer"
        self.setup(params)

    # -- the step ---------------------------------------------------------------------------
    def step(self, x, y, global_batch):
        """One training step on this rank's rows; returns the global mean loss."""
        h = self.xp.asarray(x, dtype=self.dtype)  # the batch moves to the device here
        y = self.xp.asarray(y)
        acts = [h]
        for i in range(self.nlayers):
            W, b = self.layer_params(i, "forward")
            with self.trace.span(f"forward L{i}"):
                h = linear_forward(h, W, b, relu=i < self.nlayers - 1)
            self.release_layer(i, "forward")
            acts.append(h)
        loss_share, d = softmax_cross_entropy(acts[-1], y, global_batch)
        d *= self.scaler.scale
        for i in reversed(range(self.nlayers)):
            W, b = self.layer_params(i, "backward")
            with self.trace.span(f"backward L{i}"):
                dW, db, d = linear_backward(acts[i], W, acts[i + 1], d, relu=i < self.nlayers - 1,
                                            need_dh=i > 0)
            self.release_layer(i, "backward")
            self.grad_ready(2 * i + 1, db)
            self.grad_ready(2 * i, dW)
        self.finish_backward()
        with self.trace.span("optimizer step"):
            skipped = self._update()
        self.publish(skipped)
        loss = np.array([loss_share])
        self.meta.all_reduce(loss)
        return float(loss[0])

    def _update(self):
        grad = self.owned_grad32()
        if grad is not None and self.cfg.offload:
            grad = to_host(grad)  # offload: the optimizer step runs on the host
        flags = np.zeros(2)
        if grad is not None:
            if self.mixed:
                grad /= self.scaler.scale
            flags[0] = 0.0 if np.isfinite(grad).all() else 1.0
            if self.cfg.clip_grad_norm and not flags[0]:
                flags[1] = float(np.dot(grad.astype(np.float64), grad))
        overflow, sq_norm = self.combine_flags(flags)
        skipped = self.scaler.update(overflow > 0)
        if not skipped and grad is not None:
            if self.cfg.clip_grad_norm:
                grad *= clip_coefficient(sq_norm, self.cfg.clip_grad_norm)
            self.optimizer.begin_step()
            for master, lo, hi in self.master_pieces():
                self.optimizer.update(master, grad[lo:hi], lo)
            self.write_back()
        return skipped

    def combine_flags(self, flags):
        """(overflow, squared global gradient norm) agreed by every rank."""
        return flags[0], flags[1]

    # -- helpers for subclasses -------------------------------------------------------------
    def make_optimizer(self, size):
        def alloc(name, count):
            return self.reg.alloc(self.optimizer_category, name, count, np.float32)
        self.optimizer = make_optimizer(self.cfg.optimizer, size, self.cfg.lr, self.cfg.weight_decay, alloc)

    def k_bytes(self):
        """Optimizer bytes per parameter: the fp32 master copy (mixed precision) + state."""
        return (4 if self.mixed else 0) + self.optimizer.state_bytes

    def predicted_bytes(self, rank):
        size = self.dtype.itemsize
        return predicted(self.name, self.layout.num_params, self.n, size, size, self.k_bytes(),
                         rank=rank, offload=self.cfg.offload)

    def predicted_sent_per_step(self, rank):
        """Payload bytes this rank sends per step, by the formulas."""
        phi, n, e = self.layout.num_params, self.n, self.dtype.itemsize
        return 2 * (n - 1) / n * phi * e

    # -- hooks --------------------------------------------------------------------------------
    def setup(self, params):
        raise NotImplementedError

    def layer_params(self, i, phase):
        raise NotImplementedError

    def release_layer(self, i, phase):
        pass

    def grad_ready(self, p, grad):
        raise NotImplementedError

    def finish_backward(self):
        pass

    def publish(self, skipped):
        pass

    def full_params(self):
        """Model-order fp32 parameters (called on every rank; may communicate)."""
        raise NotImplementedError

    # -- checkpoints (see :mod:`ringcomm.checkpoint`) -------------------------------------
    # ``checkpoint_kind`` says what ``state()["master"]`` holds on each rank: ``"full"`` the
    # whole padded flat buffer, ``"shard"`` this rank's shard buffer, ``"server"`` the whole
    # flat buffer everywhere but the optimizer state (m, v) on rank 0 only.
    checkpoint_kind = "full"

    def state(self):
        """This rank's model state for checkpoints: name -> array (``master`` in fp32, then
        the optimizer's ``m``, ``v``, ``t``)."""
        raise NotImplementedError

    def load_state(self, state):
        """Undo :meth:`state`: put a saved (or resharded) state of this rank back in place.
        Called on every rank at once (it may communicate); the loss scaler is separate."""
        raise NotImplementedError


class Replicated(Strategy):
    """Every rank holds full parameters, gradients and optimizer state (``single``, ``ddp``).

    DDP: gradients live in one flat buffer in reverse parameter order, cut into buckets;
    the moment backward has written a bucket's last gradient, that bucket's ring all-reduce
    starts asynchronously while backward continues (``--no-overlap``: all buckets after
    backward, in order). Every rank then runs the same optimizer on the same averaged
    gradient, so parameters stay bitwise identical.
    """

    name = "ddp"

    def setup(self, params):
        lay = self.layout
        self.flat_params = self.reg.alloc("params", "params", lay.total, self.dtype)
        copy_into(self.flat_params, lay.pack(params, self.dtype))
        self.params = lay.views(self.flat_params)
        self.flat_grads = self.reg.alloc("grads", "grads", lay.total, self.dtype)
        self.grads = lay.views(self.flat_grads)
        owner = self.steps_optimizer()
        if owner and self.mixed:
            self.master = self.reg.alloc(self.optimizer_category, "master", lay.total, np.float32)
            copy_into(self.master, lay.pack(params, np.float32))
        else:
            self.master = self.flat_params
        self.make_optimizer(lay.total if owner else 0)
        self._pending = []
        self._remaining = {}

    def steps_optimizer(self):
        """Whether this rank keeps optimizer state and steps it (every rank, here)."""
        return True

    def layer_params(self, i, phase):
        return self.params[2 * i], self.params[2 * i + 1]

    def grad_ready(self, p, grad):
        self.grads[p][...] = grad
        unit = self.layout.unit_of_param[p]
        if not self._remaining:
            self._remaining = {u.index: len(u.params) for u in self.layout.units}
        self._remaining[unit.index] -= 1
        if self._remaining[unit.index] == 0 and self.cfg.overlap and self.n > 1:
            work = self.comm.all_reduce(self.flat_grads[unit.start:unit.stop], algorithm="ring", async_op=True)
            self._pending.append((unit, work))

    def finish_backward(self):
        self._remaining = {}
        if self.n == 1:
            return
        if not self.cfg.overlap:
            for unit in self.layout.units:
                work = self.comm.all_reduce(self.flat_grads[unit.start:unit.stop], algorithm="ring",
                                            async_op=True)
                self._pending.append((unit, work))
        for unit, work in self._pending:
            work.wait()
            self.trace.comm(f"all_reduce bucket {unit.index}", work, bytes=unit.padded * self.dtype.itemsize)
        self._pending = []

    def owned_grad32(self):
        return self.flat_grads.astype(np.float32)

    def master_pieces(self):
        return [(self.master, 0, self.layout.total)]

    def write_back(self):
        if self.mixed:
            copy_into(self.flat_params, self.master)

    def full_params(self):
        source = self.master if self.mixed else self.flat_params
        return [v.astype(np.float32) for v in self.layout.views(source)]

    def state(self):
        return {"master": self.master.astype(np.float32), **self.optimizer.state()}

    def load_state(self, state):
        # fp32: master is the parameter buffer itself; fp16 (and dp ranks other than 0, whose
        # "master" is their fp16 copy): the parameters are the master cast, as write_back does
        copy_into(self.master, state["master"])
        if self.mixed:
            copy_into(self.flat_params, self.master)
        self.optimizer.load_state(state)


class Single(Replicated):
    """The single-process reference: DDP's code path with no communication."""

    name = "single"


class ParameterServer(Replicated):
    """``dp``: gradients are reduced at rank 0, which alone keeps optimizer state and steps,
    then broadcasts the new parameters. Rank 0 receives and sends (N−1)Φ per step; every
    other rank sends and receives Φ."""

    name = "dp"
    checkpoint_kind = "server"

    def steps_optimizer(self):
        return self.rank == 0

    def grad_ready(self, p, grad):
        self.grads[p][...] = grad

    def finish_backward(self):
        if self.n > 1:
            work = self.comm.reduce(self.flat_grads, root=0, algorithm="ps", async_op=True)
            work.wait()
            self.trace.comm("reduce grads at rank 0", work)

    def owned_grad32(self):
        return self.flat_grads.astype(np.float32) if self.rank == 0 else None

    def combine_flags(self, flags):
        self.meta.broadcast(flags, root=0)
        return flags[0], flags[1]

    def publish(self, skipped):
        if self.n > 1 and not skipped:
            work = self.comm.broadcast(self.flat_params, root=0, algorithm="ps", async_op=True)
            work.wait()
            self.trace.comm("broadcast params from rank 0", work)

    def full_params(self):
        full = self.master if (self.mixed and self.rank == 0) else self.flat_params.astype(np.float32)
        if self.mixed:  # only rank 0 has the fp32 master: share it
            full = full if self.rank == 0 else np.empty(self.layout.total, np.float32)
            self.meta.broadcast(full, root=0)
        return [v.astype(np.float32) for v in self.layout.views(full)]

    def predicted_sent_per_step(self, rank):
        phi, n, e = self.layout.num_params, self.n, self.dtype.itemsize
        return (n - 1) * phi * e if rank == 0 else phi * e
