"""The MLP: forward and backward, layer by layer, in the array module (numpy or cupy).

The model is exactly ``h = x``; for each layer i ``h = h @ W_i + b_i`` with ``W_i`` of shape
(in, out), ReLU between layers and none after the last; the loss is the mean softmax
cross-entropy over the *global* batch. A rank that holds ``B/N`` samples of a global batch
of ``B`` returns its *share* of the loss (sum over its samples / B), so summing the shares
and the gradients over ranks gives exactly the global loss and gradient.

Parameters are listed in *model order* ``W0, b0, W1, b1, ...``. Precision: activations and
parameters are stored in the given dtype (float16 in mixed precision); numpy has no fast
fp16 matrix product, so products are computed in float32 from the stored values and the
results stored back in the storage dtype.

The layers (:class:`MLPLayer`) are what the trainer places on pipeline stages and splits
over tensor parallelism (the split: :class:`ringcomm.train.parallel.tensor.TPLayer`). Layer
i holds ``W{i}`` (in, out) and ``b{i}``. With ``tp > 1`` even layers are column-parallel
(``W`` and ``b`` split by output columns) and odd ones row-parallel (``W`` split by input
rows, ``b`` replicated); with tp the last layer's logits are all-gathered, so every tp rank
computes the same loss.

>>> layers = [64, 256, 10]
>>> params = init_params(layers, seed=0)          # [W0 (64,256), b0 (256,), W1, b1], fp32
>>> [layer.params for layer in mlp_layers(layers, tp_group=None, dtype=np.float32)]
[[0, 1], [2, 3]]
"""
import numpy as np

from ...arrays import array_module
from ..parallel.regions import Regions
from ..parallel.tensor import TPLayer
from .functional import f32
from .specs import ParamSpec


def param_specs(layers):
    """``[(name, shape), ...]`` in model order."""
    specs = []
    for i, (fan_in, fan_out) in enumerate(zip(layers[:-1], layers[1:], strict=False)):
        specs += [(f"W{i}", (fan_in, fan_out)), (f"b{i}", (fan_out,))]
    return specs


def init_params(layers, seed):
    """fp32 parameters, deterministic from ``seed``: U(−1/√in, 1/√in) as torch.nn.Linear."""
    rng = np.random.default_rng(seed)
    params = []
    for fan_in, fan_out in zip(layers[:-1], layers[1:], strict=False):
        bound = 1.0 / np.sqrt(fan_in)
        params.append(rng.uniform(-bound, bound, (fan_in, fan_out)).astype(np.float32))
        params.append(rng.uniform(-bound, bound, (fan_out,)).astype(np.float32))
    return params


def linear_forward(h, W, b, relu):
    """``act(h @ W + b)`` in float32 arithmetic, stored in ``W``'s dtype."""
    out = h.astype(np.float32, copy=False) @ W.astype(np.float32, copy=False)
    out += b.astype(np.float32, copy=False)
    if relu:
        np.maximum(out, 0, out=out)
    return out.astype(W.dtype, copy=False)


def linear_backward(h, W, out, dout, relu, need_dh):
    """Gradients of one layer from the gradient ``dout`` of its output.

    ``h`` is the layer input, ``out`` its (post-activation) output. Returns fp32
    ``(dW, db, dh)``; ``dh`` is None when not needed (first layer).
    """
    d = dout.astype(np.float32, copy=True)
    if relu:  # zeros where ReLU cut (a where, as torch's: inf or NaN there become 0 too);
        # not d[out <= 0] = 0, whose boolean mask CuPy counts on the host every time
        array_module(d).copyto(d, 0, where=out <= 0)
    dW = h.astype(np.float32, copy=False).T @ d
    db = d.sum(axis=0)
    dh = d @ W.astype(np.float32, copy=False).T if need_dh else None
    return dW, db, dh


def softmax_cross_entropy(logits, y, global_batch):
    """This rank's share of the mean loss over the global batch, and d(share)/d(logits)."""
    xp = array_module(logits)
    z = logits.astype(np.float32)
    z = z - z.max(axis=1, keepdims=True)
    logsum = xp.log(xp.exp(z).sum(axis=1))
    rows = xp.arange(len(y))
    # fp64, where it is (no host read): the step's one decision brings it over with the rest
    loss_share = (logsum - z[rows, y]).sum().astype(np.float64) / global_batch
    grad = xp.exp(z - logsum[:, None])
    grad[rows, y] -= 1.0
    grad /= global_batch
    return loss_share, grad


def predict(params, x):
    """Class predictions of the fp32 model (model-order ``params``) for ``x``."""
    h = x.astype(np.float32)
    n = len(params) // 2
    for i in range(n):
        h = linear_forward(h, params[2 * i], params[2 * i + 1], relu=i < n - 1)
    return h.argmax(axis=1)


# -- the layers the trainer places and splits ---------------------------------------------
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
    def __init__(self, split, regions, dtype):
        self.split, self.regions, self.dtype = split, regions, np.dtype(dtype)
        self.index = split.index
        self.name = f"layer {self.index}"
        self.params = [2 * self.index, 2 * self.index + 1]
        self.relu = not split.last

    def forward(self, ps, h):
        W, b = ps
        if self.split.tp == 1:
            out = linear_forward(h, W, b, relu=self.relu)
        else:
            out = self.split.forward(f32(h), f32(W), f32(b), self.regions, relu=self.relu).astype(self.dtype)
        return out, (h, out)

    def backward(self, ps, cache, dout):
        (W, _), (h, out) = ps, cache
        need_dh = self.index > 0
        if self.split.tp == 1:
            dW, db, dh = linear_backward(h, W, out, dout, relu=self.relu, need_dh=need_dh)
        else:
            dW, db, dh = self.split.backward(f32(h), f32(W), f32(out), f32(dout), self.regions,
                                             relu=self.relu, need_dh=need_dh)
        return [dW, db], (None if dh is None else dh.astype(self.dtype))


def mlp_layers(widths, tp_group, dtype):
    tp, t = (tp_group.world_size, tp_group.rank) if tp_group is not None else (1, 0)
    n = len(widths) - 1
    regions = Regions(tp_group, sp=False, dtype=np.float32)  # the MLP's activations cross in float32
    return [MLPLayer(TPLayer(i, widths[i], widths[i + 1], tp, t, i == n - 1), regions, dtype) for i in range(n)]


def mlp_loss(logits, y, denominator):
    return softmax_cross_entropy(logits, y, denominator)
