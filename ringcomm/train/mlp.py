"""The MLP as layers the trainer can place on pipeline stages and split over tensor
parallelism (the maths is in :mod:`.model`, the tensor-parallel split in :mod:`.tensor`).

Layer i holds ``W{i}`` (in, out) and ``b{i}``; ReLU after every layer but the last. With
``tp > 1`` even layers are column-parallel (``W`` and ``b`` split by output columns) and odd
ones row-parallel (``W`` split by input rows, ``b`` replicated). The loss is the mean softmax
cross-entropy over the global batch; with tp the last layer's logits are all-gathered, so
every tp rank computes the same loss.

>>> layers = mlp_layers((64, 256, 10), tp_group=None, dtype=np.float32)
>>> [layer.params for layer in layers]
[[0, 1], [2, 3]]
"""
import numpy as np

from .functional import f32
from .model import linear_backward, linear_forward, softmax_cross_entropy
from .specs import ParamSpec
from .tensor import TPLayer


def mlp_specs(widths, tp=1, t=0):
    """Every parameter in model order, with this tp rank's piece of it."""
    specs = []
    for i in range(len(widths) - 1):
        layer = TPLayer(i, widths[i], widths[i + 1], tp, t, i == len(widths) - 2)
        rows, cols = (np.arange(s.start, s.stop) for s in (layer.rows, layer.cols))
        w_shape, b_shape = (widths[i], widths[i + 1]), (widths[i + 1],)
        if layer.kind == "column":
            specs += [ParamSpec(f"W{i}", w_shape, 1, cols), ParamSpec(f"b{i}", b_shape, 0, cols)]
        elif layer.kind == "row":
            specs += [ParamSpec(f"W{i}", w_shape, 0, rows), ParamSpec(f"b{i}", b_shape)]
        else:
            specs += [ParamSpec(f"W{i}", w_shape), ParamSpec(f"b{i}", b_shape)]
    return specs


class MLPLayer:
    def __init__(self, split, tp_group, dtype):
        self.split, self.group, self.dtype = split, tp_group, np.dtype(dtype)
        self.index = split.index
        self.name = f"layer {self.index}"
        self.params = [2 * self.index, 2 * self.index + 1]
        self.relu = not split.last

    def forward(self, ps, h):
        W, b = ps
        if self.split.tp == 1:
            out = linear_forward(h, W, b, relu=self.relu)
        else:
            out = self.split.forward(f32(h), f32(W), f32(b), self.group, relu=self.relu).astype(self.dtype)
        return out, (h, out)

    def backward(self, ps, cache, dout):
        (W, _), (h, out) = ps, cache
        need_dh = self.index > 0
        if self.split.tp == 1:
            dW, db, dh = linear_backward(h, W, out, dout, relu=self.relu, need_dh=need_dh)
        else:
            dW, db, dh = self.split.backward(f32(h), f32(W), f32(out), f32(dout), self.group,
                                             relu=self.relu, need_dh=need_dh)
        return [dW, db], (None if dh is None else dh.astype(self.dtype))


def mlp_layers(widths, tp_group, dtype):
    tp, t = (tp_group.world_size, tp_group.rank) if tp_group is not None else (1, 0)
    n = len(widths) - 1
    return [MLPLayer(TPLayer(i, widths[i], widths[i + 1], tp, t, i == n - 1), tp_group, dtype) for i in range(n)]


def mlp_loss(logits, y, denominator):
    return softmax_cross_entropy(logits, y, denominator)
