"""A copy of the ring predecessor's shard of ZeRO's optimizer state (``--elastic``), kept equal
to it step by step, so that a lost rank's state lives on in its successor's memory (see
:mod:`ringcomm.train.elastic`).

Rank r keeps the fp32 master and the optimizer state (Adam's m and v, or nothing for SGD) of
rank r−1's shard (*the predecessor*; r+1 is *the successor*, around the data group's ring).
Each step, before the job-wide all-reduce that precedes the commit point, every rank sends
its unscaled fp32 gradient shard to its successor and receives its predecessor's
(:meth:`ShardCopy.exchange`, 4·Φ/N bytes sent per step); after the commit point, a step not
skipped steps the copy with the same optimizer, the same clipping coefficient and the same
step count as the predecessor steps its own (:meth:`ShardCopy.step`), so the copy is
bitwise the predecessor's state. Memory: (4 + the optimizer's bytes per parameter)·Φ/N per
rank (12·Φ/N with Adam: 1/N of the whole model's optimizer state and master; with fp32
ZeRO-3, 3/4 of the rank's own model state more). A rank and its successor lost together take its shard
with them: no memory holds it any more.

>>> copy = ShardCopy(zero_strategy, params)     # rank 2 of 4 keeps rank 1's shard
>>> theirs = copy.exchange(grad)                  # sends rank 2's to rank 3, gets rank 1's
>>> copy.step(theirs, coefficient=None)           # after the commit point
"""
import numpy as np

from ... import kernels
from ...arrays import copy_into
from ..optim import make_optimizer

TAG = 0x5A45  # the point-to-point tag of the copy's traffic


class ShardCopy:
    def __init__(self, strategy, params):
        """Of ``strategy``'s (a ZeRO strategy's) predecessor, from the initial ``params``."""
        lay, reg, cfg = strategy.layout, strategy.reg, strategy.cfg
        category = strategy.optimizer_category
        self.comm = strategy.comm
        self.pred, self.succ = (strategy.rank - 1) % strategy.n, (strategy.rank + 1) % strategy.n
        self.master = reg.alloc(category, "copy master shard", lay.shard_total, np.float32)
        copy_into(self.master, lay.own_shard(lay.pack(params, np.float32), self.pred))
        self.optimizer = make_optimizer(cfg.optimizer, lay.shard_total, cfg.lr, cfg.weight_decay,
                                        lambda name, count: reg.alloc(category, f"copy {name}", count, np.float32))

    def exchange(self, grad):
        """Send this rank's fp32 gradient shard ``grad`` to the successor; the predecessor's."""
        theirs = np.empty_like(grad)
        sent = self.comm.send(grad, self.succ, tag=TAG, async_op=True)
        self.comm.recv(theirs, self.pred, tag=TAG)
        sent.wait()
        return theirs

    def step(self, grad, coefficient):
        """The predecessor's optimizer step, on the copy: ``grad`` clipped by ``coefficient``
        (None: no clipping), as it clips its own."""
        if coefficient is not None:
            kernels.scale(grad, coefficient)
        self.optimizer.begin_step()
        self.optimizer.update(self.master, grad, 0)

    def state(self):
        """The predecessor's state as its own ``state()`` gives it."""
        return {"master": self.master.copy(), **self.optimizer.state()}

    def load_from_peers(self, state):
        """After a load (every rank at once): hand this rank's ``state`` to the successor,
        take the predecessor's into the copy."""
        mine = {k: np.ascontiguousarray(v, np.float32) for k, v in state.items() if np.ndim(v)}
        sends = [self.comm.send(mine[k], self.succ, tag=TAG, async_op=True) for k in sorted(mine)]
        theirs = {k: np.empty_like(mine[k]) for k in sorted(mine)}
        for k in sorted(mine):
            self.comm.recv(theirs[k], self.pred, tag=TAG)
        for work in sends:
            work.wait()
        copy_into(self.master, theirs.pop("master"))
        self.optimizer.load_state({**theirs, "t": state["t"]})
