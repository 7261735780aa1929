"""Megatron-LM's communication at the edges of a tensor-parallel region, with and without
sequence parallelism.

A tensor-parallel region starts with a column-parallel matmul (each of the T tp ranks holds
some output columns) and ends with a row-parallel one (each holds the matching input rows,
so each produces a *partial sum* of the output). Two conjugate operations sit at its edges:

===============  ================================  =====================================
                 without ``--sp``                  with ``--sp`` (sequence parallelism)
===============  ================================  =====================================
``enter``        forward identity,                 forward all-gather along the sequence,
                 backward all-reduce               backward reduce-scatter
``exit``         forward all-reduce,               forward reduce-scatter along the
                 backward identity                 sequence, backward all-gather
===============  ================================  =====================================

Outside the region (LayerNorms, residual adds, dropout-free GPT here) every tp rank holds
the same activations of all its rows without ``--sp``; with ``--sp`` tp rank t holds rows
``[t·R/T, (t+1)·R/T)`` of the R rows (sequence positions) and computes only those, so those
activations take 1/T of the memory. A ring all-reduce sends as many bytes as its
reduce-scatter plus all-gather halves, so ``--sp`` costs no extra traffic: per region and
direction 2(T−1)/T·S bytes, S = b·s·h·e.

Parameters outside the region (replicated over tp) get identical gradients on every tp rank
without ``--sp``; with it each rank's gradient covers its rows only, and
:meth:`Regions.sum_partial` all-reduces them over the tp group.

Activations cross the wire in the region's dtype: the GPT's storage dtype (float16 in mixed
precision), float32 for the MLP. The GPT's shapes are ``(batch, rows, width)``; the MLP's
tensor-parallel layers (:mod:`.tensor`) use the same edges on ``(rows, width)`` without
``--sp``, and :meth:`Regions.gather_columns` for the logits of a last column-parallel layer.
"""
import numpy as np

from ...arrays import array_module


class Regions:
    def __init__(self, group, sp, dtype):
        self.group, self.sp = group, bool(sp) and group is not None
        self.tp = group.world_size if group is not None else 1
        self.t = group.rank if group is not None else 0
        self.dtype = np.dtype(dtype)

    def rows(self, count):
        """The slice of ``count`` rows this tp rank computes outside the region."""
        if not self.sp:
            return slice(0, count)
        if count % self.tp:
            raise ValueError(f"--sp needs the rows per rank ({count}) to divide by --tp {self.tp}")
        size = count // self.tp
        return slice(self.t * size, (self.t + 1) * size)

    # -- the two edges -------------------------------------------------------------------------
    def enter_forward(self, x):
        return self._gather(x) if self.sp else x

    def enter_backward(self, dx):
        if self.tp == 1:
            return dx
        return self._scatter(dx) if self.sp else self._all_reduce(dx)

    def exit_forward(self, y):
        if self.tp == 1:
            return y
        return self._scatter(y) if self.sp else self._all_reduce(y)

    def exit_backward(self, dy):
        return self._gather(dy) if self.sp else dy

    def sum_partial(self, grads):
        """The gradients of replicated parameters summed over tp (``--sp`` only: new float32
        arrays; without it the list as it is)."""
        if not self.sp or not grads:
            return grads
        return all_reduce_arrays(self.group, grads)

    def gather_columns(self, local, widths):
        """(rows, widths[t]) columns of every tp rank -> (rows, Σ widths), tp rank order along
        the columns (the MLP's last, column-parallel, layer: its logits for the loss). The
        widths may differ (a width tp does not divide): every rank sends its piece padded
        to the widest."""
        xp = array_module(local)
        pad = max(widths)
        padded = xp.zeros((local.shape[0], pad), self.dtype)
        padded[:, :local.shape[1]] = local
        gathered = xp.empty((self.tp, local.shape[0], pad), self.dtype)
        self.group.all_gather(gathered.reshape(-1), padded.reshape(-1))
        return xp.concatenate([gathered[i, :, :w] for i, w in enumerate(widths)], axis=1)

    # -- collectives along the sequence ----------------------------------------------------------
    def _all_reduce(self, x):
        buf = x.astype(self.dtype)  # a copy: the caller's array stays as it was
        self.group.all_reduce(buf)
        return buf.astype(np.float32, copy=False)  # the sum itself when it is float32 already

    def _gather(self, x):
        """(b, r, h) rows of every tp rank -> (b, T·r, h), tp rank order along the rows."""
        xp = array_module(x)
        b, r, h = x.shape
        out = xp.empty((self.tp, b, r, h), self.dtype)
        self.group.all_gather(out.reshape(-1), xp.ascontiguousarray(x, dtype=self.dtype).reshape(-1))
        return out.transpose(1, 0, 2, 3).reshape(b, self.tp * r, h).astype(np.float32)

    def _scatter(self, x):
        """(b, T·r, h) partial sums -> this tp rank's (b, r, h) rows of their sum."""
        xp = array_module(x)
        b, rows, h = x.shape
        r = rows // self.tp
        src = xp.ascontiguousarray(x.reshape(b, self.tp, r, h).transpose(1, 0, 2, 3), dtype=self.dtype)
        out = xp.empty((b, r, h), self.dtype)
        self.group.reduce_scatter(out.reshape(-1), src.reshape(-1))
        return out.astype(np.float32)


def all_reduce_arrays(group, arrays):
    """New float32 arrays: ``arrays`` summed over ``group``, in one all-reduce."""
    xp = array_module(arrays[0])
    flat = xp.concatenate([a.reshape(-1) for a in arrays]).astype(np.float32)
    group.all_reduce(flat)
    out, offset = [], 0
    for a in arrays:
        out.append(flat[offset:offset + a.size].reshape(a.shape))
        offset += a.size
    return out
