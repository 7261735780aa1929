"""Optimizers on flat fp32 buffers, dynamic loss scaling, and global-norm clipping.

All optimizers work in place on flat fp32 *master* slices (a whole model, or pieces of one
rank's shard) with fp32 gradients of the same length: ``begin_step()`` once per step, then
``update(param, grad, offset)`` for each slice, whose state starts at ``offset``. Every
strategy, replicated or sharded, uses the same code.

- :class:`Adam`: PyTorch's ``torch.optim.Adam`` (betas 0.9/0.999, eps 1e-8, L2 weight decay
  added to the gradient), one fused step (:func:`ringcomm.kernels.adam_step`: numpy on the
  host, one CUDA kernel on a GPU). State: m and v, 8 bytes per parameter.
- :class:`SGD`: ``p -= lr·(g + wd·p)``; no state.
- :class:`LossScaler`: DeepSpeed's dynamic fp16 loss scale: start 2^16, double after
  ``window`` clean steps, on overflow skip the step and halve the scale once ``hysteresis``
  overflows have been absorbed, never below ``min_scale``.
"""
import math

import numpy as np

from .. import kernels
from ..arrays import copy_into


class Adam:
    state_bytes = 8  # m and v, fp32

    def __init__(self, size, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, alloc=None):
        alloc = alloc or (lambda name, n: np.zeros(n, np.float32))
        self.lr, self.betas, self.eps, self.weight_decay = lr, betas, eps, weight_decay
        self.m = alloc("adam.m", size)
        self.v = alloc("adam.v", size)
        self.t = 0

    def begin_step(self):
        self.t += 1

    def update(self, param, grad, offset=0):
        """In place on the fp32 slice ``param`` whose state starts at ``offset``; call
        :meth:`begin_step` once per step first. ``grad`` (fp32, already unscaled and clipped)
        is not modified. The order of operations is torch.optim.Adam's."""
        b1, b2 = self.betas
        m, v = self.m[offset:offset + param.size], self.v[offset:offset + param.size]
        # nothing is checked here: whether to step was agreed across ranks before (Strategy.update)
        kernels.adam_step(param, grad, m, v, self.lr, b1, b2, self.eps, self.weight_decay, self.t)

    def state(self):
        return {"m": self.m, "v": self.v, "t": np.array(self.t)}

    def load_state(self, state):
        copy_into(self.m, state["m"])
        copy_into(self.v, state["v"])
        self.t = int(state["t"])


class SGD:
    state_bytes = 0

    def __init__(self, size, lr=1e-2, weight_decay=0.0, alloc=None):
        self.lr, self.weight_decay, self.t = lr, weight_decay, 0

    def begin_step(self):
        self.t += 1

    def update(self, param, grad, offset=0):
        if self.weight_decay:
            grad += self.weight_decay * param
        param -= self.lr * grad

    def state(self):
        return {"t": np.array(self.t)}

    def load_state(self, state):
        self.t = int(state["t"])


def make_optimizer(name, size, lr, weight_decay, alloc):
    if name == "adam":
        return Adam(size, lr=lr, weight_decay=weight_decay, alloc=alloc)
    if name == "sgd":
        return SGD(size, lr=lr, weight_decay=weight_decay, alloc=alloc)
    raise ValueError(f"unknown optimizer {name!r}; expected adam or sgd")


class LossScaler:
    """Dynamic loss scale for fp16 (a fixed scale of 1 when ``enabled`` is False)."""

    def __init__(self, enabled, initial=2.0 ** 16, window=1000, hysteresis=2, min_scale=1.0):
        self.enabled = enabled
        self.scale = initial if enabled else 1.0
        self.window, self.hysteresis, self.min_scale = window, hysteresis, min_scale
        self._hysteresis_left = hysteresis
        self._clean_steps = 0
        self.skipped = 0

    def update(self, overflow):
        """Record one step's outcome (the same on every rank); True if it must be skipped."""
        if not self.enabled:
            return False
        if overflow:
            self.skipped += 1
            self._clean_steps = 0
            if self._hysteresis_left <= 1:
                self.scale = max(self.scale / 2, self.min_scale)
            else:
                self._hysteresis_left -= 1
            return True
        self._clean_steps += 1
        if self._clean_steps % self.window == 0:
            self.scale *= 2
            self._hysteresis_left = self.hysteresis
        return False

    def state(self):
        return {"scale": np.array(self.scale), "clean": np.array(self._clean_steps),
                "hysteresis": np.array(self._hysteresis_left), "skipped": np.array(self.skipped)}

    def load_state(self, state):
        self.scale = float(state["scale"])
        self._clean_steps = int(state["clean"])
        self._hysteresis_left = int(state["hysteresis"])
        self.skipped = int(state["skipped"])


def clip_coefficient(total_sq_norm, max_norm):
    """The factor (≤ 1) that brings the global gradient norm down to ``max_norm``."""
    norm = math.sqrt(total_sq_norm)
    return min(1.0, max_norm / (norm + 1e-6))
