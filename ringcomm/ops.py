"""Reduction operators and the element-wise functions that apply them.

Every reduction in ringcomm goes through :func:`reduce_into` or :func:`reduced`, so the order
of operands is fixed: ``acc = acc (op) incoming``. The final division of ``avg`` happens once,
where a result is finished (:func:`finalize`), so every rank that copies that result holds
identical bits.

>>> acc = np.array([1.0, 5.0]); reduce_into(ReduceOp.MAX, acc, np.array([3.0, 2.0])); acc
array([3., 5.])
"""
from enum import Enum

import numpy as np

from . import kernels
from .arrays import array_module
from .kernels.reference import BITWISE, UFUNCS


class ReduceOp(str, Enum):
    """How a collective combines the ranks' values. ``str`` members: ``"sum" == ReduceOp.SUM``.

    ``band``, ``bor``, ``bxor``: bitwise and, or, exclusive or, on integer and bool arrays
    only. On bool arrays ``sum`` and ``max`` are a logical or, ``prod`` and ``min`` an and
    (numpy's bool arithmetic)."""

    SUM = "sum"
    AVG = "avg"
    MAX = "max"
    MIN = "min"
    PROD = "prod"
    BAND = "band"
    BOR = "bor"
    BXOR = "bxor"


_UFUNC = {op: UFUNCS[op.value] for op in ReduceOp}  # by member: `.value` is a slow descriptor
_PARSED = {}  # (op as given, dtype) -> ReduceOp: parsed once, looked up on every call


Op = str | ReduceOp  # what a verb's ``op`` takes: a name ("sum", "max", ...) or a member


def parse_op(op, dtype):
    """Return the :class:`ReduceOp` for ``op`` (a name or member), checked against ``dtype``.

    Raises ``ValueError`` for an unknown op, ``TypeError`` for ``avg`` on integers or bools
    and for a bitwise op on floats.
    """
    try:
        return _PARSED[(op, dtype)]
    except (KeyError, TypeError):  # TypeError: an unhashable op, refused below
        pass
    parsed = _parse_op(op, dtype)
    if len(_PARSED) < 1024:  # spellings and dtypes are few; never let odd callers grow it
        _PARSED[(op, dtype)] = parsed
    return parsed


def _parse_op(op, dtype):
    try:
        op = ReduceOp(op.lower() if isinstance(op, str) and not isinstance(op, ReduceOp) else op)
    except ValueError:
        names = ", ".join(repr(o.value) for o in ReduceOp)
        raise ValueError(f"unknown reduce op {op!r}; expected one of {names}") from None
    if op is ReduceOp.AVG and not np.issubdtype(dtype, np.floating):
        raise TypeError(f"op 'avg' needs a floating dtype, got {np.dtype(dtype).name}")
    if op.value in BITWISE and not (np.issubdtype(dtype, np.integer) or np.issubdtype(dtype, np.bool_)):
        raise TypeError(f"op {op.value!r} needs an integer or bool dtype, got {np.dtype(dtype).name}")
    return op


def reduce_into(op, acc, incoming):
    """In place: ``acc = acc (op) incoming``; returns ``acc``. On a GPU: kernels/reduce.cu."""
    if not isinstance(acc, np.ndarray):
        return kernels.reduce(op.value, acc, incoming)
    return _UFUNC[op](acc, incoming, out=acc)


def reduced(op, a, b, out=None, reuse_b=False):
    """``a (op) b`` into ``out`` (which may be ``a`` or ``b``), or into a new array when
    ``out`` is None; ``reuse_b``: ``b`` is a device buffer the caller is done with (a received
    segment in a landing buffer), which takes the result instead of a new array. On a GPU
    one pass (kernels/reduce.cu's ``reduce_out_*``), with no copy of ``a`` first."""
    if not isinstance(a, np.ndarray):
        if out is None:
            out = b if reuse_b else array_module(a).empty_like(a)
        return kernels.reduce(op.value, a, b, out=out)
    return _UFUNC[op](a, b, out=out)


def finalize(op, acc, n):
    """In place: turn a finished sum over ``n`` ranks into the result of ``op`` (avg divides)."""
    if not isinstance(acc, np.ndarray):
        return kernels.finalize(op.value, acc, n)
    if op is ReduceOp.AVG and acc.size:
        np.true_divide(acc, n, out=acc)
    return acc
