"""The small differentiable pieces the models are built of, forward and backward by hand,
in float32 on numpy or CuPy arrays (whichever module the inputs come from).

Each ``*_forward`` returns its output and a *cache* (the activations its backward needs,
never a parameter); each ``*_backward`` takes that cache (and the parameters) and the
gradient of the output and returns the gradients of the inputs and parameters. Nothing here
communicates.

>>> y, cache = layer_norm_forward(x, w, b)           # x (..., d), w and b (d,)
>>> dx, dw, db = layer_norm_backward(cache, w, dy)
"""
import math

import numpy as np

from ...arrays import array_module

LN_EPS = 1e-5
GELU_C = math.sqrt(2.0 / math.pi)
GELU_CUBE = 0.044715


def f32(a):
    """``a`` as float32, without a copy when it already is."""
    return a.astype(np.float32, copy=False)


def sum_rows(a):
    """Sum over every axis but the last: the gradient of a bias broadcast over rows."""
    return a.reshape(-1, a.shape[-1]).sum(axis=0)


def residual(h, y, b):
    """``h + y + b`` (a residual, a layer's output ``y`` and its bias), written into ``y``,
    which the caller gives up; the same bits as the three-operand sum."""
    y += f32(h)  # h + y == y + h exactly
    y += f32(b)
    return y


def matmul_weight_grad(x, dy):
    """``xᵀ dy`` over all leading axes: the gradient of ``W`` in ``y = x @ W``."""
    return x.reshape(-1, x.shape[-1]).T @ dy.reshape(-1, dy.shape[-1])


# -- LayerNorm -----------------------------------------------------------------------------
def layer_norm_forward(x, w, b):
    """``(x − mean) / sqrt(var + 1e-5) · w + b`` over the last axis (biased variance)."""
    xp = array_module(x)
    x = f32(x)
    xhat = x - x.mean(axis=-1, keepdims=True)
    var = xp.square(xhat).mean(axis=-1, keepdims=True)
    var += LN_EPS
    rstd = xp.sqrt(var, out=var)
    xp.divide(1.0, rstd, out=rstd)
    xhat *= rstd
    y = xhat * f32(w)
    y += f32(b)
    return y, (xhat, rstd)


def layer_norm_backward(cache, w, dy):
    """``(dx, dw, db)``; ``dx`` a new array."""
    xhat, rstd = cache
    dy = f32(dy)
    t = dy * xhat
    dw = sum_rows(t)
    db = sum_rows(dy)
    dx = dy * f32(w)  # d xhat, turned into dx in place below
    xp = array_module(dx)
    xp.multiply(dx, xhat, out=t)
    c2 = t.mean(axis=-1, keepdims=True)
    c1 = dx.mean(axis=-1, keepdims=True)
    xp.multiply(xhat, c2, out=t)
    dx -= c1
    dx -= t
    dx *= rstd
    return dx, dw, db


# -- GELU (tanh approximation, as GPT-2) ------------------------------------------------------
def gelu_forward(u):
    """``0.5·u·(1 + tanh(√(2/π)·(u + 0.044715·u³)))``; two arrays the size of ``u`` made."""
    xp = array_module(u)
    t = u * u
    t *= GELU_CUBE
    t += 1.0
    t *= u
    t *= GELU_C
    xp.tanh(t, out=t)
    g = t + 1.0
    g *= u
    g *= 0.5
    return g, (u, t)


def gelu_backward(cache, dy):
    """``dy · (0.5·(1 + t) + 0.5·u·(1 − t²)·√(2/π)·(1 + 3·0.044715·u²))`` with ``t`` the
    forward's tanh; two arrays the size of ``u`` made."""
    u, t = cache
    xp = array_module(u)
    d = t * t
    xp.subtract(1.0, d, out=d)
    d *= u
    d *= 0.5 * GELU_C
    slope = u * u
    slope *= 3 * GELU_CUBE
    slope += 1.0
    d *= slope
    xp.add(t, 1.0, out=slope)
    slope *= 0.5
    d += slope
    d *= f32(dy)
    return d


# -- cross-entropy ---------------------------------------------------------------------------
def cross_entropy(logits, y, denominator):
    """This rank's *share* of a mean cross-entropy: ``Σ −log softmax(logits)[y] / denominator``
    over the rows here, and its gradient by ``logits``. ``logits`` is ``(..., classes)`` and
    ``y`` the integer targets of the leading axes. Summing the shares of every rank that holds
    a disjoint part of the global batch gives the global mean when ``denominator`` is the
    global number of rows."""
    xp = array_module(logits)
    z = f32(logits).reshape(-1, logits.shape[-1])
    z = z - z.max(axis=1, keepdims=True)
    logsum = xp.log(xp.exp(z).sum(axis=1))
    rows = xp.arange(z.shape[0])
    target = xp.asarray(y).reshape(-1)
    # fp64, where it is (no host read): the step's one decision brings it over with the rest
    share = (logsum - z[rows, target]).sum().astype(np.float64) / denominator
    grad = xp.exp(z - logsum[:, None])
    grad[rows, target] -= 1.0
    grad /= denominator
    return share, grad.reshape(logits.shape)
