"""What every data-parallel strategy shares: the optimizer step, mixed precision, loss
scaling and clipping, and the replicated strategies ``single``, ``ddp`` and ``dp``.

A strategy decides where each piece of model state lives and what crosses the wire inside
the **data group** (the ranks that hold the same parameters and see different data: N of
them, ``group``), through hooks the step (:mod:`.step`) calls:

- ``layer_params(i, phase)`` / ``release_layer(i, phase)``: the parameters of layer i for
  forward or backward (ZeRO-3 gathers them here and frees them after use);
- ``accumulate(p, grad, first)``: backward produced a contribution to parameter p's
  gradient (several with micro-batches or a parameter used by two layers);
  ``grad_done(p)``: that was the last one this step (DDP starts a bucket's all-reduce as soon
  as its last gradient is done);
- ``finish_backward()``: wait for gradient communication;
- ``update(loss_share)``: the optimizer step on the state this rank owns, with the
  overflow decision, the global gradient norm and the loss agreed by every rank of the job
  (one all-reduce over ``meta``; with ``--elastic`` then the commit point, see
  :mod:`ringcomm.train.elastic`), then sharing the result.

Every strategy's step leaves the model in exactly the state the single-process reference
would reach, up to floating-point summation order.
"""
from dataclasses import dataclass

import numpy as np

from ... import kernels
from ...algorithms.choice import bandwidth_algorithm
from ...arrays import array_module, cast_into, copy_into, to_host
from ..accounting import memory, traffic
from ..optim import LossScaler, clip_coefficient, make_optimizer
from .flat import Countdown, Layout


@dataclass
class StrategyContext:
    """Everything a strategy is built from (the trainer fills it in by keyword)."""

    group: object            # the data group: where gradients are summed and ZeRO shards
    meta: object             # every rank of the job, for control traffic the byte counts leave out
    side: object             # the data group again, for control traffic likewise
    specs: list              # ``(name, shape)`` of this rank's parameters in model order
    layer_members: list      # per layer, the indices of its parameters
    params: list             # their fp32 values (copied into the strategy's buffers by setup)
    cfg: object              # the TrainConfig
    registry: object         # the MemoryRegistry every model-state buffer comes from
    tracer: object           # the Tracer collectives are recorded in
    counted: object = None   # per parameter, whether this rank's copy counts in the global
    #                          gradient norm (models.stage.counted); None: every one
    alone: tuple = ()        # parameters that get a unit of their own (see flat.Layout)
    zero_stage: int = 0      # ZeRO's stage, 1 to 3; 0 for the other strategies
    layer_offset: int = 0    # model-order index of layer 0 here (pipeline stages), for trace names


class Strategy:
    name = "base"
    per_layer_units = False
    # --elastic: called before the update changes anything; raises if the step is not to be
    # taken, else returns the ranks found lost (see ringcomm.train.elastic)
    commit = None

    def __init__(self, ctx):
        """``ctx``: a :class:`StrategyContext`; the strategy keeps what it needs of it, not
        the context (nor the initial parameters, once ``setup`` has copied them)."""
        group, cfg, registry = ctx.group, ctx.cfg, ctx.registry
        self.comm, self.meta, self.side = group, ctx.meta, ctx.side
        self.rank, self.n = group.rank, group.world_size
        # gradients and shards: the ring, or inside hosts first where the group spans several
        self.algorithm = bandwidth_algorithm(group.topology)
        self.cfg, self.reg, self.trace = cfg, registry, ctx.tracer
        self.xp = registry.xp  # numpy, or cupy when training on a GPU
        self.members = ctx.layer_members
        self.nlayers = len(self.members)
        self.layer_offset = ctx.layer_offset
        self.dtype = np.dtype(np.float16 if cfg.precision == "fp16" else np.float32)
        self.mixed = cfg.precision == "fp16"
        self.layout = Layout(ctx.specs, self.n, int(cfg.bucket_mb * 2 ** 20), self.dtype.itemsize,
                             layer_members=self.members if self.per_layer_units else None, alone=ctx.alone)
        self.counted = np.ones(len(ctx.specs), bool) if ctx.counted is None else np.asarray(ctx.counted, bool)
        self.scaler = LossScaler(enabled=self.mixed)
        self.optimizer_category = "optimizer_host" if cfg.offload else "optimizer"
        self.setup(ctx.params)

    # -- the update -----------------------------------------------------------------------------
    def update(self, loss_share):
        """The optimizer step after :meth:`finish_backward`; returns ``(loss, skipped)``: the
        sum of every rank's ``loss_share`` and whether the step was skipped (fp16 overflow
        anywhere in the job)."""
        pieces = self.step_grad()
        flags = np.zeros(3)
        grad = copied = None
        if pieces is not None:
            grad = self._checked_fp32(pieces, flags, loss_share)
            copied = self.exchange_grad(grad)
        else:  # nothing on the device to decide: the share alone comes over
            flags[2] = float(loss_share)
        self.meta.all_reduce(flags)  # overflow anywhere, squared norm of every piece once, loss
        self.agreed_loss = float(flags[2])  # (a loss raised after the commit point still knows it)
        lost = ()
        if self.commit is not None:  # --elastic: nothing changes unless every survivor agrees
            lost = self.commit()
        skipped = self.scaler.update(flags[0] > 0)
        if not skipped and grad is not None:
            coefficient = clip_coefficient(flags[1], self.cfg.clip_grad_norm) if self.cfg.clip_grad_norm else None
            if coefficient is not None:
                kernels.scale(grad, coefficient)
            self.optimizer.begin_step()
            for master, lo, hi in self.master_pieces():
                self.optimizer.update(master, grad[lo:hi], lo)
            self.write_back()
            if copied is not None:
                self.update_copy(copied, coefficient)
        if not lost:  # (a rank known lost would hold up the sharing: the rebuild redoes it)
            self.publish(skipped)
        return float(flags[2]), skipped

    def exchange_grad(self, grad):
        """ZeRO with ``--elastic``: send this rank's fp32 gradient to the rank that keeps a
        copy of its state, and return the one of the rank whose copy this one keeps (see
        :mod:`.zero`); None elsewhere."""
        return None

    def update_copy(self, grad, coefficient):
        """Step the copy :meth:`exchange_grad` serves with its ``grad``, clipped alike."""

    def step_grad(self):
        """The gradient the optimizer step takes, as :meth:`owned_grad` gives it (ZeRO's
        offload brings it to the host first)."""
        return self.owned_grad()

    def _checked_fp32(self, pieces, flags, loss_share):
        """A fresh fp32 copy of the gradient made of ``pieces`` (clipping scales it in
        place), with ``flags[0]`` set when it holds inf/NaN, ``flags[1]`` to this rank's
        share of the squared norm when clipping (0 after an overflow) and ``flags[2]`` to
        ``loss_share``: fp16 is cast, unscaled and checked in one pass (one kernel on a GPU).
        Each piece is copied straight into its place in the fp32 result, with no
        concatenation first. The flag, the norm and the loss (a device scalar on a GPU) stay
        where the gradient is until one copy brings them to the host for the step's one
        decision (on a GPU: one wait per step)."""
        xp = array_module(pieces[0])
        found = xp.zeros(1, np.int32)
        grad = xp.empty(sum(piece.size for piece in pieces), np.float32)
        lo = 0
        for piece in pieces:
            place, lo = grad[lo:lo + piece.size], lo + piece.size
            if self.mixed:
                kernels.unscale(piece.reshape(-1), place, self.scaler.scale, found=found)
            else:
                place[...] = piece.reshape(-1)
        if not self.mixed:
            kernels.found_nonfinite(grad, found=found)
        decision = xp.zeros(3, np.float64)
        decision[0] = found[0]
        # a host gradient (offloaded) takes the device share's value; a device one, the share
        decision[2] = float(loss_share) if xp is np else loss_share
        if self.cfg.clip_grad_norm:  # an overflowed gradient's norm is taken, then dropped
            with np.errstate(invalid="ignore", over="ignore"):
                decision[1] = xp.where(found[0] == 0, self._squared_norm(grad, on_device=True), 0.0)
        flags[:] = to_host(decision)
        return grad

    def _squared_norm(self, grad, on_device=False):
        """This rank's share of the squared global gradient norm: every piece counted once."""
        xp = array_module(grad)
        if getattr(self, "_weight", None) is None or array_module(self._weight) is not xp:
            self._weight = xp.asarray(self.owned_weight())
        return kernels.sq_norm(grad * self._weight, on_device=on_device)  # a weight is 0 or 1: exact

    def owned_weight(self):
        """1 where an element of :meth:`owned_grad` counts in the global norm, else 0."""
        lay = self.layout
        mask = lay.pack([np.full(shape, float(c), np.float32) for (_, shape), c in zip(lay.specs, self.counted, strict=True)],
                        np.float32)
        return self._own(mask)

    def _own(self, flat):
        """The part of a full flat buffer whose gradient this rank owns."""
        return flat if self.rank == 0 else np.zeros_like(flat)

    # -- helpers for subclasses -------------------------------------------------------------
    def make_optimizer(self, size):
        def alloc(name, count):
            return self.reg.alloc(self.optimizer_category, name, count, np.float32)
        self.optimizer = make_optimizer(self.cfg.optimizer, size, self.cfg.lr, self.cfg.weight_decay, alloc)

    def keeps_master(self):
        """Whether a separate fp32 master copy exists (mixed precision)."""
        return self.mixed

    def k_bytes(self):
        """Optimizer bytes per parameter: the fp32 master copy (when there is one) + state."""
        return memory.optimizer_bytes(self.keeps_master(), self.optimizer.state_bytes)

    def has_host_shard(self):
        """Whether a host shard sits beside offloaded optimizer state (ZeRO from a GPU)."""
        return False

    def predicted_bytes(self, rank):
        """Model-state bytes per category on ``rank``, by the formulas."""
        size = self.dtype.itemsize
        return memory.strategy_bytes(self.name, self.layout.num_params, self.n, size, self.k_bytes(), rank=rank,
                                     offload=self.cfg.offload, host_shard=self.has_host_shard())

    def predicted_sent_per_step(self, rank):
        """Payload bytes this rank sends per step, by the formulas."""
        return traffic.all_reduce_sent(self.layout.num_params, self.n, self.dtype.itemsize)

    # -- hooks --------------------------------------------------------------------------------
    def setup(self, params):
        raise NotImplementedError

    def layer_params(self, i, phase):
        raise NotImplementedError

    def release_layer(self, i, phase):
        pass

    def accumulate(self, p, grad, first):
        raise NotImplementedError

    def grad_done(self, p):
        pass

    def finish_backward(self):
        pass

    def publish(self, skipped):
        pass

    def full_params(self):
        """Model-order fp32 parameters (called on every rank; may communicate)."""
        raise NotImplementedError

    # -- checkpoints (see :mod:`ringcomm.train.checkpoint`) --------------------------
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
        self._pending = []  # (unit, work) all-reduces in flight
        self._countdown = Countdown(lay)

    def steps_optimizer(self):
        """Whether this rank keeps optimizer state and steps it (every rank, here)."""
        return True

    def layer_params(self, i, phase):
        return [self.params[p] for p in self.members[i]]

    def accumulate(self, p, grad, first):
        if first:
            self.grads[p][...] = grad
        else:
            self.grads[p][...] += grad

    def grad_done(self, p):
        unit = self._countdown.done(p)
        if unit is not None and self.cfg.overlap and self.n > 1:
            work = self.comm.all_reduce(self.flat_grads[unit.start:unit.stop], algorithm=self.algorithm, async_op=True)
            self._pending.append((unit, work))

    def finish_backward(self):
        self._countdown.reset()
        if self.n == 1:
            return
        if not self.cfg.overlap:
            for unit in self.layout.units:
                work = self.comm.all_reduce(self.flat_grads[unit.start:unit.stop], algorithm=self.algorithm,
                                            async_op=True)
                self._pending.append((unit, work))
        for unit, work in self._pending:
            work.wait()
            self.trace.comm(f"all_reduce bucket {unit.index}", work, bytes=unit.padded * self.dtype.itemsize)
        self._pending = []

    def owned_grad(self):
        """The reduced gradient of what this rank's optimizer steps, in the working dtype:
        flat pieces (views) in the order :meth:`master_pieces` updates them, concatenated
        that is the optimizer's flat gradient; ``None`` on a rank that steps nothing."""
        return [self.flat_grads]

    def master_pieces(self):
        return [(self.master, 0, self.layout.total)]

    def write_back(self):
        if self.mixed:
            cast_into(self.flat_params, self.master)

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

    def grad_done(self, p):
        pass

    def finish_backward(self):
        if self.n > 1:
            work = self.comm.reduce(self.flat_grads, root=0, algorithm="ps", async_op=True)
            work.wait()
            self.trace.comm("reduce grads at rank 0", work)

    def owned_grad(self):
        return [self.flat_grads] if self.rank == 0 else None

    def publish(self, skipped):
        if self.n > 1 and not skipped:
            work = self.comm.broadcast(self.flat_params, root=0, algorithm="ps", async_op=True)
            work.wait()
            self.trace.comm("broadcast params from rank 0", work)

    def full_params(self):
        full = self.master if (self.mixed and self.rank == 0) else self.flat_params.astype(np.float32)
        if self.mixed:  # only rank 0 has the fp32 master: share it
            full = full if self.rank == 0 else np.empty(self.layout.total, np.float32)
            self.side.broadcast(full, root=0)
        return [v.astype(np.float32) for v in self.layout.views(full)]

    def predicted_sent_per_step(self, rank):
        return traffic.server_sent(self.layout.num_params, self.n, self.dtype.itemsize, rank)
