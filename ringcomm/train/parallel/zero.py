"""ZeRO stages 1, 2 and 3 (optimizer state, + gradients, + parameters partitioned), with
optional optimizer offload.

Rank r owns the r-th slice of every unit (see :mod:`.flat`) and keeps optimizer state
(fp32 master, m, v) for that shard only. Which other state is sharded follows one rule,
as in llm.c: a category is sharded when ``stage >= shard_at_stage`` — optimizer state at 1,
gradients at 2, parameters at 3.

- **Backward**: a unit's gradients are *reduce-scattered* as soon as backward has produced
  them all (asynchronously, overlapping the rest of backward): each rank receives the summed
  gradient of its own slice. Stage 1 does it in place in its full gradient buffer; stage 2+
  writes gradients into a short-lived unit buffer and frees it once the reduce-scatter is
  done.
- **Step**: Adam on the fp32 shard; the result is cast to the parameter dtype.
- **Stages 1–2**: the updated shards are *all-gathered* in place, so every rank again holds
  all parameters. Traffic 2Φ per step, as DDP.
- **Stage 3**: parameters stay sharded. Before a layer's forward, and again before its
  backward, its parameters are all-gathered into a temporary buffer, freed right after use;
  the next layer's gather is issued before the current layer computes (prefetch).
  Traffic 3Φ per step.
- **Offload**: the optimizer state (and the step) live in host memory (category
  ``optimizer_host``); only gradients go down and parameters come back. From a GPU, as in
  ZeRO-Offload, both crossings overlap other work on a **copy stream** of their own, through
  the **host shard** (pinned, the parameter dtype, one shard long): a unit's reduced
  gradient slice starts down as soon as its reduce-scatter finishes, while backward goes
  on; after the host's Adam step on one unit's slice, that slice (cast to the parameter
  dtype) starts up while the host updates the next unit.
- **A copy of the ring predecessor's shard** (``--elastic``): :mod:`.shard_copy`.
"""
import numpy as np

from ...arrays import cast_into, copy_into, to_host
from ..accounting import traffic
from .flat import Countdown
from .shard_copy import ShardCopy
from .strategy import Strategy

SHARD_AT_STAGE = {"optimizer": 1, "grads": 2, "params": 3}
MAX_UNITS_IN_FLIGHT = 2  # stage 2+: reduce-scatters whose unit buffers may be alive at once


class Zero(Strategy):
    def __init__(self, ctx):
        """``ctx``: a :class:`.strategy.StrategyContext` whose ``zero_stage`` is 1, 2 or 3."""
        if ctx.zero_stage not in (1, 2, 3):
            raise ValueError(f"ZeRO has stages 1, 2 and 3, not {ctx.zero_stage!r}")
        self.stage = ctx.zero_stage
        self.name = f"zero{self.stage}"
        self.per_layer_units = self.stage >= SHARD_AT_STAGE["params"]
        super().__init__(ctx)

    def sharded(self, category):
        return self.stage >= SHARD_AT_STAGE[category]

    # -- state ----------------------------------------------------------------------------
    def setup(self, params):
        lay, r = self.layout, self.rank
        of = lay.unit_of_param  # each layer's units, once: looked up on every layer's path
        self._units_of_layer = [sorted({of[p].index: of[p] for p in members}.values(), key=lambda u: u.index)
                                for members in self.members]
        full = lay.pack(params, self.dtype)
        if self.sharded("params"):
            self.param_shard = self.reg.alloc("params", "param shard", lay.shard_total, self.dtype)
            copy_into(self.param_shard, lay.own_shard(full, r))
            self._gathered = {}  # unit index -> (buffer, work)
        else:
            self.flat_params = self.reg.alloc("params", "params", lay.total, self.dtype)
            copy_into(self.flat_params, full)
            self.params = lay.views(self.flat_params)
        if self.sharded("grads"):
            self.grad_shard = self.reg.alloc("grads", "grad shard", lay.shard_total, self.dtype)
            self._unit_grads = {}  # unit index -> buffer, while its gradients are being produced
        else:
            self.flat_grads = self.reg.alloc("grads", "grads", lay.total, self.dtype)
            self.grads = lay.views(self.flat_grads)
        if self.keeps_master():
            self.master = self.reg.alloc(self.optimizer_category, "master shard", lay.shard_total, np.float32)
            copy_into(self.master, lay.own_shard(lay.pack(params, np.float32), r))
        if self._offloaded_from_device():
            self.host_shard = self.reg.alloc(self.optimizer_category, "host shard", lay.shard_total, self.dtype)
            self._copies = self.xp.cuda.Stream(non_blocking=True)  # the copy stream
        self.make_optimizer(lay.shard_total)
        self._countdown = Countdown(lay)
        self._pending = []  # (unit, work) reduce-scatters in flight
        self.mirrored = self.cfg.elastic and not self.cfg.model_parallel and self.n > 1
        # --elastic: the ring predecessor's shard of optimizer state, kept equal to its own
        self.copy = ShardCopy(self, params) if self.mirrored else None
        self.pred = None if self.copy is None else self.copy.pred

    # -- parameters -----------------------------------------------------------------------
    def layer_params(self, i, phase):
        if not self.sharded("params"):
            return [self.params[p] for p in self.members[i]]
        units = self._layer_units(i)
        for unit in units:
            self._gather(unit)
        nxt = i + 1 if phase == "forward" else i - 1
        if 0 <= nxt < self.nlayers:  # prefetch: the next layer's gathers run during this one
            for unit in self._layer_units(nxt):
                self._gather(unit)
        views = {}
        for unit in units:
            buffer, work = self._gathered[unit.index]
            if work is not None:
                work.wait()
                self.trace.comm(f"all_gather L{self.layer_offset + i} ({phase})", work, unit=unit.index,
                                bytes=unit.padded * self.dtype.itemsize)
                self._gathered[unit.index] = (buffer, None)
            views.update(self.layout.unit_views(unit, buffer))
        return [views[p] for p in self.members[i]]

    def _layer_units(self, i):
        """The units layer i's parameters live in, in unit order."""
        return self._units_of_layer[i]

    def _gather(self, unit):
        if unit.index in self._gathered:
            return
        # the all-gather writes every element: no zeroing pass first
        buffer = self.reg.alloc("params", f"gathered unit {unit.index}", unit.padded, self.dtype, zeroed=False)
        mine = buffer[self.rank * unit.shard_size:(self.rank + 1) * unit.shard_size]
        mine[...] = self.layout.shard_view(self.param_shard, unit)
        work = self.comm.all_gather(buffer, mine, algorithm=self.algorithm, async_op=True)
        self._gathered[unit.index] = (buffer, work)

    def release_layer(self, i, phase):
        """Free layer i's gathered units, except those the next layer (already prefetched)
        needs too."""
        if not self.sharded("params"):
            return
        nxt = i + 1 if phase == "forward" else i - 1
        keep = {u.index for u in self._layer_units(nxt)} if 0 <= nxt < self.nlayers else set()
        for unit in self._layer_units(i):
            if unit.index not in keep and unit.index in self._gathered:
                buffer, work = self._gathered.pop(unit.index)
                if work is not None:
                    work.wait()
                self.reg.free(f"gathered unit {unit.index}")

    # -- gradients --------------------------------------------------------------------------
    def accumulate(self, p, grad, first):
        unit = self.layout.unit_of_param[p]
        if self.sharded("grads"):
            if unit.index not in self._unit_grads:
                # bound the unit buffers alive at once, so the gradient memory stays near
                # the shard plus a couple of units however slow the network is
                while len(self._pending) >= MAX_UNITS_IN_FLIGHT:
                    self._pending[0][1].wait()
                    self._free_finished()
                self._unit_grads[unit.index] = self.reg.alloc("grads", f"unit grads {unit.index}",
                                                              unit.padded, self.dtype)
            view = self.layout.unit_views(unit, self._unit_grads[unit.index])[p]
        else:
            view = self.grads[p]
        if first:
            view[...] = grad
        else:
            view[...] += grad

    def grad_done(self, p):
        unit = self._countdown.done(p)
        if unit is not None and self.cfg.overlap:
            self._reduce_scatter(unit)
        self._free_finished()

    def _reduce_scatter(self, unit):
        # stage 1 in place: this rank's slice of the unit receives the sum
        source = self._unit_grads[unit.index] if self.sharded("grads") else self.flat_grads[unit.start:unit.stop]
        work = self.comm.reduce_scatter(self._own_grads(unit), source, algorithm=self.algorithm, async_op=True)
        self._pending.append((unit, work))

    def _free_finished(self, wait=False):
        """Record finished reduce-scatters; stage 2+ frees their unit buffers right away;
        offloaded from a GPU, each unit's gradient slice starts down to the host."""
        still = []
        for unit, work in self._pending:
            if wait:
                work.wait()
            if work.is_completed():
                work.wait()  # raises its error, if any
                self.trace.comm(f"reduce_scatter unit {unit.index}", work, bytes=unit.padded * self.dtype.itemsize)
                if self._offloaded_from_device():
                    self._grad_down(unit, work)
                if self.sharded("grads"):
                    del self._unit_grads[unit.index]
                    self.reg.free(f"unit grads {unit.index}")
            else:
                still.append((unit, work))
        self._pending = still

    def _grad_down(self, unit, work):
        """Queue the copy of ``unit``'s reduced gradient slice into the host shard on the
        copy stream, after the reduce-scatter's device work."""
        with self._copies:
            work.wait()  # the copy stream, current here, waits for the reduce-scatter
            self._own_grads(unit).get(stream=self._copies, out=self.layout.shard_view(self.host_shard, unit),
                                      blocking=False)

    def _own_grads(self, unit):
        """This rank's slice of ``unit``'s gradients (its reduced sum after the reduce-scatter)."""
        if self.sharded("grads"):
            return self.layout.shard_view(self.grad_shard, unit)
        return self.flat_grads[slice(*unit.own_range(self.rank))]

    def _own_params(self, unit):
        """This rank's slice of ``unit``'s parameters, in the shard or in the full buffer."""
        if self.sharded("params"):
            return self.layout.shard_view(self.param_shard, unit)
        return self.flat_params[slice(*unit.own_range(self.rank))]

    def finish_backward(self):
        self._countdown.reset()
        if not self.cfg.overlap:
            for unit in self.layout.units:
                self._reduce_scatter(unit)
        self._free_finished(wait=True)

    # -- optimizer ----------------------------------------------------------------------------
    def owned_grad(self):
        """The shard (stages 2-3), or this rank's slice of each unit inside the full
        gradient buffer (stage 1: views, nothing copied)."""
        if self.sharded("grads"):
            return [self.grad_shard]
        return self.layout.own_pieces(self.flat_grads, self.rank)

    def _own(self, flat):
        return self.layout.own_shard(flat, self.rank)

    def keeps_master(self):
        """A separate fp32 master shard: in mixed precision, and when the optimizer is
        offloaded from a GPU (the update runs on the host, next to its state; the device
        parameters are written back from it)."""
        return self.mixed or self._offloaded_from_device()

    def _offloaded_from_device(self):
        return self.cfg.offload and self.xp is not np

    def step_grad(self):
        """Offloaded (the step runs on the host; fp16 crosses as fp16) from a GPU: the host
        shard, once every unit's slice, which started down when its reduce-scatter finished,
        is there (the step's decision needs all of them)."""
        if not self._offloaded_from_device():
            return self.owned_grad()
        self._copies.synchronize()
        # the parameters go up after the device work queued so far: today the last
        # reduce-scatter already follows every kernel that reads them, but a read queued
        # after backward (a hook, an evaluation) must not race the copies
        self._copies.wait_event(self.xp.cuda.get_current_stream().record(self._event()))
        return [self.host_shard]

    def _event(self):
        return self.xp.cuda.Event(disable_timing=True)  # ordering only

    def master_pieces(self):
        """Offloaded from a GPU, a unit at a time: once the host has updated a unit's piece
        and asks for the next, that piece (cast to the parameter dtype in the host shard,
        whose gradient was read) starts up on the copy stream."""
        lay = self.layout
        if self._offloaded_from_device():
            for u in lay.units:
                yield lay.shard_view(self.master, u), u.shard_start, u.shard_start + u.shard_size
                host = lay.shard_view(self.host_shard, u)
                host[...] = lay.shard_view(self.master, u)  # rounded as the cast kernel rounds
                self._own_params(u).set(host, stream=self._copies)
        elif self.keeps_master():
            yield self.master, 0, lay.shard_total
        elif self.sharded("params"):
            yield self.param_shard, 0, lay.shard_total
        else:
            for u in lay.units:
                yield self._own_params(u), u.shard_start, u.shard_start + u.shard_size

    def write_back(self):
        if self._offloaded_from_device():  # what follows on the device waits for the copies up
            self.xp.cuda.get_current_stream().wait_event(self._copies.record(self._event()))
            return
        if not self.keeps_master():
            return
        if self.sharded("params"):
            cast_into(self.param_shard, self.master)
        else:
            self.layout.scatter_shard(self.master, self.flat_params, self.rank)

    def publish(self, skipped):
        if self.sharded("params") or skipped:
            return
        works = []
        for unit in self.layout.units:
            full = self.flat_params[unit.start:unit.stop]
            mine = self._own_params(unit)
            works.append((unit, self.comm.all_gather(full, mine, algorithm=self.algorithm, async_op=True)))
        for unit, work in works:
            work.wait()
            self.trace.comm(f"all_gather params unit {unit.index}", work)

    # -- the copy of the predecessor's shard (--elastic; see .shard_copy) --------------------
    def exchange_grad(self, grad):
        return None if self.copy is None else self.copy.exchange(grad)

    def update_copy(self, grad, coefficient):
        self.copy.step(grad, coefficient)

    def copy_state(self):
        """The predecessor's state as its own :meth:`state` gives it (from the copy)."""
        return self.copy.state()

    # -- reporting --------------------------------------------------------------------------
    def full_params(self):
        lay = self.layout
        if self.keeps_master():
            shard = self.master
        elif self.sharded("params"):
            shard = self.param_shard.astype(np.float32)
        else:
            return [v.astype(np.float32) for v in lay.views(self.flat_params)]
        shard = to_host(shard)
        full = np.zeros(lay.total, np.float32)
        for unit in lay.units:
            self.side.all_gather(full[unit.start:unit.stop], np.ascontiguousarray(lay.shard_view(shard, unit)))
        return [v.copy() for v in lay.views(full)]

    def has_host_shard(self):
        return self._offloaded_from_device()

    def predicted_sent_per_step(self, rank):
        """By the formulas; ZeRO-3's counts what every layer gathers (its units, once each);
        with the copy, 4·Φ/N bytes of fp32 gradient more."""
        phi, n, e = self.layout.num_params, self.n, self.dtype.itemsize
        copy = 4 * phi / n if self.mirrored else 0
        if not self.sharded("params"):
            return traffic.all_reduce_sent(phi, n, e) + copy
        gathered = [sum(u.length for u in self._layer_units(i)) for i in range(self.nlayers)]
        return traffic.zero3_sent(phi, n, e, self.cfg.micro_batches, gathered) + copy

    def predicted_bytes(self, rank):
        """By the formulas; with the copy, its fp32 master and optimizer state per Φ/N more."""
        out = super().predicted_bytes(rank)
        if self.mirrored:
            out[self.optimizer_category] += (4 + self.optimizer.state_bytes) * self.layout.num_params / self.n
        return out

    checkpoint_kind = "shard"

    def state(self):
        out = {"master": (self.master if self.keeps_master() else
                          self.param_shard if self.sharded("params") else
                          self.layout.own_shard(self.flat_params, self.rank)).astype(np.float32)}
        return {**out, **self.optimizer.state()}

    def load_state(self, state):
        shard = np.asarray(state["master"], np.float32)
        if self.keeps_master():
            copy_into(self.master, shard)
        if self.sharded("params"):
            copy_into(self.param_shard, shard)
        else:  # stages 1-2 hold every parameter: put this shard in place, gather the others
            self.layout.scatter_shard(shard, self.flat_params, self.rank)
            for unit in self.layout.units:
                full = self.flat_params[unit.start:unit.stop]
                self.comm.all_gather(full, self._own_params(unit), algorithm=self.algorithm)
        self.optimizer.load_state(state)
        if self.copy is not None:
            self.copy.load_from_peers(state)
