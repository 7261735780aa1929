"""Tensor parallelism: one layer's matrices split across the T ranks of a tp group.

Layers alternate (by global index) between the two halves of Megatron-LM's conjugate pair:

- **column-parallel** (even layers): ``W`` split by output columns, ``b`` likewise. Input
  replicated, output split: no communication in forward; in backward the input gradient
  ``dY_t @ W_tᵀ`` is a partial sum and is **all-reduced** (Megatron's *f*: identity forward,
  all-reduce backward).
- **row-parallel** (odd layers): ``W`` split by input rows, so it consumes the column layer's
  split output directly; the partial outputs ``X_t @ W_t`` are **all-reduced** in forward
  (Megatron's *g*), then the replicated bias is added; backward needs no communication.

An MLP whose last layer is column-parallel all-gathers its logits for the loss. A column
layer's input is a tp region's entry and a row layer's output its exit: every byte goes
through :class:`.regions.Regions`, the GPT's path too (here without ``--sp``, in float32).
What crosses the wire is activations and their gradients (B × width per layer), never
parameters — the source document's contrast with ZeRO-3; how many bytes, by formula, is
:func:`ringcomm.train.accounting.traffic.mlp_layer_tp`.

>>> layer = TPLayer(index=0, fan_in=64, fan_out=256, tp=2, t=1, last=False)
>>> layer.kind, layer.out_local      # columns [128, 256) of W0 live on tp rank 1
('column', 128)
"""
import numpy as np

from ...algorithms.chunks import split
from ...arrays import array_module


class TPLayer:
    def __init__(self, index, fan_in, fan_out, tp, t, last):
        self.index, self.fan_in, self.fan_out, self.tp, self.t, self.last = index, fan_in, fan_out, tp, t, last
        self.kind = "full" if tp == 1 else ("column" if index % 2 == 0 else "row")
        if self.kind == "column":
            self.cols = slice(*split(0, fan_out, tp)[t])
            self.rows = slice(0, fan_in)
        elif self.kind == "row":
            self.rows = slice(*split(0, fan_in, tp)[t])
            self.cols = slice(0, fan_out)
        else:
            self.rows, self.cols = slice(0, fan_in), slice(0, fan_out)
        self.in_local = self.rows.stop - self.rows.start
        self.out_local = self.cols.stop - self.cols.start

    # -- parameters ---------------------------------------------------------------------------
    def shard(self, W, b):
        """This rank's pieces of the full ``W`` (in, out) and ``b`` (out,)."""
        return np.ascontiguousarray(W[self.rows, self.cols]), np.ascontiguousarray(b[self.cols])

    def owns_bias(self):
        """A row layer's bias is replicated: only tp rank 0 reports it when assembling."""
        return self.kind != "row" or self.t == 0

    @property
    def output_split(self):
        return self.kind == "column" and not self.last

    # -- compute ------------------------------------------------------------------------------
    def forward(self, h, W, b, regions, relu):
        """``h`` is this rank's input (split for row layers); returns this rank's output
        (split for column layers, except a last layer's logits, which are all-gathered).
        ``regions``: the tp group's :class:`.regions.Regions`, which does all the talking."""
        out = h @ W
        if self.kind == "row":  # the region's exit: the partial sums all-reduced
            out = regions.exit_forward(out)
        out += b
        if self.kind == "column" and self.last:
            out = regions.gather_columns(out, self.widths())
        if relu:
            array_module(out).maximum(out, 0, out=out)
        return out

    def widths(self):
        """Every tp rank's output columns, in tp rank order."""
        return [hi - lo for lo, hi in split(0, self.fan_out, self.tp)]

    def backward(self, h, W, out, dout, regions, relu, need_dh):
        """Gradients from ``dout`` (the gradient of this rank's output as ``forward`` returned
        it). Returns ``(dW, db, dh)``, ``dh`` in the layout of this rank's input."""
        d = dout.copy()
        if relu:  # a where, not a boolean mask: see models.mlp.linear_backward
            array_module(d).copyto(d, 0, where=out <= 0)
        if self.kind == "column" and self.last:
            d = array_module(d).ascontiguousarray(d[:, self.cols])
        dW = h.T @ d
        db = d.sum(axis=0)
        dh = None
        if need_dh:
            dh = d @ W.T
            if self.kind == "column":  # the region's entry, backward: the partial sums all-reduced
                dh = regions.enter_backward(dh)
        return dW, db, dh
