"""What a model's parameter is, and which piece of it a tensor-parallel rank holds.

A :class:`ParamSpec` names a parameter (the name used by ``--save`` and checkpoints), gives
its full shape and, for a tensor-parallel rank, the indices it holds along one axis (None:
the whole parameter, replicated over tp).

>>> spec = ParamSpec("h0.mlp.w_in", (8, 32), axis=1, index=np.arange(16, 32))
>>> spec.local_shape, spec.shard(np.zeros((8, 32))).shape
((8, 16), (8, 16))
"""
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, eq=False)
class ParamSpec:
    name: str
    shape: tuple
    axis: int = None           # the axis tp shards, or None
    index: np.ndarray = None   # this tp rank's indices along ``axis``

    @property
    def local_shape(self):
        if self.axis is None:
            return tuple(self.shape)
        shape = list(self.shape)
        shape[self.axis] = len(self.index)
        return tuple(shape)

    @property
    def replicated(self):
        """Whether every tp rank holds the whole parameter."""
        return self.axis is None

    def shard(self, full):
        """This rank's piece of the full array (a new contiguous array)."""
        if self.axis is None:
            return np.array(full, copy=True)
        return np.ascontiguousarray(np.take(full, self.index, axis=self.axis))

    def place(self, full, piece):
        """Write this rank's ``piece`` into its places in ``full``."""
        if self.axis is None:
            full[...] = piece
        else:
            where = [slice(None)] * len(self.shape)
            where[self.axis] = self.index
            full[tuple(where)] = piece
