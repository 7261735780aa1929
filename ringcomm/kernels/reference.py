"""numpy references for the CUDA kernels of this package: what the CPU path computes.

Each function has the semantics of its kernel in ``kernels/`` (see the header of each ``.cu``) and
the arithmetic of the CPU code it stands for, bit for bit:

- :func:`reduce`, :func:`scale`, :func:`divide`, :func:`finalize` -- ``reduce.cu``;
  ``ringcomm.ops.reduce_into`` / ``ringcomm.ops.finalize``.
- :func:`adam_step` -- ``adam.cu``; ``ringcomm.train.optim.Adam.update`` calls it
  (torch.optim.Adam's order of operations).
- :func:`cast_to_half`, :func:`unscale`, :func:`found_nonfinite` -- ``cast.cu``.
- :func:`sq_norm_partial`, :func:`sq_norm` -- ``norm.cu``; the squared norm the strategy
  computes for clipping.

Arrays are modified in place where the kernel modifies them. Scalars are taken as Python
floats so that numpy rounds them to the array's dtype (NEP 50 "weak" scalars), exactly as the
CPU path's Python-float arithmetic does; the CUDA wrappers pass the same roundings. The
references take any dtype numpy does; the kernels only the ones ringcomm uses (named below).

"""
import math

import numpy as np

# -- reduce.cu ---------------------------------------------------------------------------------

# which numpy ufunc each reduce op is (avg adds; finalize divides once): the one table
# ringcomm.ops and the self-check use too
UFUNCS = {"sum": np.add, "avg": np.add, "max": np.maximum, "min": np.minimum, "prod": np.multiply,
          "band": np.bitwise_and, "bor": np.bitwise_or, "bxor": np.bitwise_xor}
BITWISE = ("band", "bor", "bxor")  # integer and bool dtypes only

REDUCE_DTYPES = tuple(np.dtype(t) for t in ("float16", "float32", "float64", "int32", "int64"))
DIVIDE_DTYPES = tuple(np.dtype(t) for t in ("float16", "float32", "float64"))  # divide_<dtype>: avg


def device_reduces(op, dtype):
    """Whether reduce.cu has a kernel for ``op`` on ``dtype`` (the bitwise ops: int32, int64)."""
    dtype = np.dtype(dtype)
    if op_name(op) in BITWISE:
        return dtype in (np.dtype(np.int32), np.dtype(np.int64))
    return dtype in REDUCE_DTYPES


def op_name(op):
    """``"sum"`` for ``"sum"``, ``"SUM"`` or ``ReduceOp.SUM``; ValueError for anything else."""
    name = getattr(op, "value", op)
    if not isinstance(name, str) or name.lower() not in UFUNCS:
        raise ValueError(f"unknown reduce op {op!r}; expected one of {sorted(UFUNCS)}")
    return name.lower()


def reduce(op, acc, incoming, out=None):
    """In place: ``acc = acc (op) incoming``; returns ``acc``. ``avg`` adds (see :func:`finalize`).
    With ``out`` (which may be ``incoming``): ``out = acc (op) incoming``; returns ``out``.

    fp16 is computed by numpy as fp32 rounded once to fp16, integers wrap, max/min propagate
    NaN -- the kernel's ``reduce_<op>_<dtype>`` (``reduce_out_<op>_<dtype>`` with ``out``).
    """
    return UFUNCS[op_name(op)](acc, incoming, out=acc if out is None else out)


def scale(x, factor):
    """In place: ``x *= factor`` with ``factor`` rounded to ``x.dtype`` first; returns ``x``
    (``scale_f32`` on fp32: clipping's ``grad *= coefficient``)."""
    return np.multiply(x, x.dtype.type(float(factor)), out=x)


def divide(x, divisor):
    """In place: ``x /= divisor`` with ``divisor`` rounded to ``x.dtype`` first; returns ``x``
    (``divide_<dtype>``: for fp16 one fp32 quotient rounded once, which is numpy's result)."""
    return np.true_divide(x, x.dtype.type(float(divisor)), out=x)


def finalize(op, acc, n):
    """In place: a finished sum over ``n`` ranks becomes the result of ``op`` (avg divides)."""
    if op_name(op) == "avg" and acc.size:
        divide(acc, n)
    return acc


# -- adam.cu -----------------------------------------------------------------------------------

def adam_scalars(lr, beta1, beta2, eps, weight_decay, step):
    """The scalars ``adam_step_f32`` takes, as the CPU path computes them (Python doubles):
    the kernel receives each rounded to fp32, which is what numpy does with them."""
    lr, beta1, beta2, eps, step = float(lr), float(beta1), float(beta2), float(eps), int(step)
    return {
        "weight_decay": float(weight_decay),
        "use_weight_decay": bool(weight_decay),
        "beta1": beta1,
        "one_minus_beta1": 1 - beta1,
        "beta2": beta2,
        "one_minus_beta2": 1 - beta2,
        "step_size": lr / (1 - beta1 ** step),
        "bias_correction2_sqrt": math.sqrt(1 - beta2 ** step),
        "eps": eps,
    }


ADAM_BLOCK = 1 << 16  # elements of one pass of the CPU step (256 KiB a stream: it stays in cache)


def adam_step(master, grad, m, v, lr, beta1, beta2, eps, weight_decay, step):
    """One Adam step (step number ``step`` >= 1), in place on the fp32 ``master`` and its fp32
    state ``m``, ``v``, from the fp32 ``grad`` (already unscaled and clipped; not modified).

    There is no check: the caller has already decided to take the step (the trainer agrees
    on overflow across ranks first), so an inf or NaN in ``grad`` reaches the weights, as it
    does in fp32 training, which has no loss scaler and skips no step.

    The arrays are taken ``ADAM_BLOCK`` elements at a time through two scratch blocks, each
    element by the same operations in the same order as ``adam.cu``'s thread: no temporary
    the size of the model (a model of 25 M parameters made seven of 100 MB each a step),
    and each block's five streams stay in cache between the operations.
    """
    s = adam_scalars(lr, beta1, beta2, eps, weight_decay, step)
    b1, c1, b2, c2 = s["beta1"], s["one_minus_beta1"], s["beta2"], s["one_minus_beta2"]
    bc2, eps, step_size, wd = s["bias_correction2_sqrt"], s["eps"], s["step_size"], s["weight_decay"]
    n = master.size
    work = np.empty((2, min(n, ADAM_BLOCK)), np.float32)
    for lo in range(0, n, ADAM_BLOCK):
        hi = min(n, lo + ADAM_BLOCK)
        p, mb, vb = master[lo:hi], m[lo:hi], v[lo:hi]
        g, t = work[0, :hi - lo], work[1, :hi - lo]
        if s["use_weight_decay"]:
            np.multiply(p, wd, out=g)
            g += grad[lo:hi]      # g = grad + wd·master
        else:
            g = grad[lo:hi]       # read, never written
        mb *= b1
        np.multiply(g, c1, out=t)
        mb += t                   # m = b1·m + (1 − b1)·g
        vb *= b2
        np.multiply(g, c2, out=t)
        t *= g
        vb += t                   # v = b2·v + (1 − b2)·g·g
        np.sqrt(vb, out=t)
        t /= bc2
        t += eps                  # denom = sqrt(v) / sqrt(1 − b2^t) + eps
        np.divide(mb, t, out=t)
        t *= step_size
        p -= t                    # master −= step_size · m / denom


# -- cast.cu -----------------------------------------------------------------------------------

def cast_to_half(src, dst):
    """``dst[...] = src`` from fp32 to fp16 (``cast_f32_to_f16``), each value rounded to nearest
    even once: the CPU path's ``flat_params[...] = master``. Returns ``dst``."""
    dst[...] = src
    return dst


def unscale(src, dst, loss_scale):
    """``dst[...] = fp32(src) / loss_scale``; True if some result is inf or NaN (the CPU
    path's ``grad /= scale; not np.isfinite(grad).all()``; ``unscale_f16_to_f32`` for an fp16
    ``src``). ``src`` may be ``dst``."""
    if src is not dst:
        dst[...] = src
    dst /= float(loss_scale)
    return not bool(np.isfinite(dst).all())


def found_nonfinite(x):
    """True if ``x`` holds an inf or NaN (``find_nonfinite_f32`` on fp32)."""
    return not bool(np.isfinite(x).all())


# -- norm.cu -----------------------------------------------------------------------------------

def default_blocks(n, threads=256, max_blocks=1024):
    """The grid ``sq_norm_partial`` uses for ``n`` elements: one block per ``threads``
    elements, at most ``max_blocks`` (then each block strides over the rest)."""
    return max(1, min(max_blocks, -(-n // threads)))


def _unscaled(x, loss_scale):
    compute = np.float64 if x.dtype == np.float64 else np.float32
    u = x.astype(compute)
    u /= float(loss_scale)
    return u


def sq_norm_partial(x, loss_scale=1.0, num_blocks=None, threads=256, acc_dtype=np.float64):
    """Per-block partial sums of ``(x / loss_scale) ** 2`` as ``sq_norm_partial_f32_f64``
    lays them out: block b sums the elements i with ``(i // threads) % num_blocks == b``.
    The quotient is taken in fp32 (fp64 for fp64 input), the square and the sum in
    ``acc_dtype`` (the kernel: fp32 input, fp64 sums). Returns an array of ``num_blocks``
    partial sums of dtype ``acc_dtype``."""
    x = np.ravel(x)
    if num_blocks is None:
        num_blocks = default_blocks(x.size, threads)
    u = _unscaled(x, loss_scale).astype(acc_dtype)
    blocks = (np.arange(x.size, dtype=np.int64) // threads) % num_blocks
    sums = np.bincount(blocks, weights=(u * u).astype(np.float64), minlength=num_blocks)
    return sums.astype(acc_dtype)


def sq_norm(x, loss_scale=1.0):
    """The squared L2 norm of ``x / loss_scale`` (the strategy's, for clipping):
    ``float(np.dot(u.astype(np.float64), u))`` with ``u`` the unscaled fp32 (fp64) values."""
    u = _unscaled(np.ravel(x), loss_scale)
    return float(np.dot(u.astype(np.float64), u))
