"""Every rank's inputs and the result a collective must give on them, computed with numpy
on each rank, without communication.

Inputs are a pure function of (seed, rank, dtype, length, kind), so every rank can build
every other rank's buffer and reduce them itself:

>>> inputs = Inputs(n=4, seed=SEED)
>>> stack = inputs.stack(np.dtype(np.float32), 1009, kind_of("sum"))  # row r: rank r's input
>>> expected, tol = reduction(stack, "sum")
>>> compare(result, expected, tol)              # None, or a sentence on the first wrong element
"""
import numpy as np

from ringcomm.kernels.reference import BITWISE, UFUNCS

SEED = 20240521
OPS = tuple(UFUNCS)  # every reduce op
DTYPES = (np.dtype(np.float32), np.dtype(np.float64), np.dtype(np.int32), np.dtype(np.float16))
KINDS = ("sum", "extreme", "prod")  # input value ranges, chosen by op


class Inputs:
    """Every rank's input buffer; row r of ``stack(...)`` is what rank r passes in."""

    def __init__(self, n, seed):
        self.n, self.seed, self._cache = n, seed, {}

    def stack(self, dtype, length, kind):
        key = (dtype, length, kind)
        if key not in self._cache:
            rows = [self._make(r, dtype, length, kind) for r in range(self.n)]
            self._cache[key] = np.stack(rows)
        return self._cache[key]

    def clear(self):
        self._cache.clear()

    def _make(self, rank, dtype, length, kind):
        rng = np.random.default_rng([self.seed, rank, length, dtype.num, KINDS.index(kind)])
        if dtype.kind == "i":
            low, high = {"sum": (-1000, 1001), "extreme": (-2 ** 30, 2 ** 30), "prod": (-3, 4)}[kind]
            return rng.integers(low, high, length, dtype=dtype)
        if kind == "prod":  # magnitudes near 1 so that products stay in range
            values = rng.uniform(0.5, 1.5, length) * rng.choice([-1.0, 1.0], length)
        else:
            values = rng.uniform(-1.0, 1.0, length) * (100.0 if kind == "extreme" else 1.0)
        return values.astype(dtype)


def kind_of(op):
    return {"sum": "sum", "avg": "sum", "prod": "prod"}.get(op, "extreme")


def ops_for(dtype):
    return [op for op in OPS if (op != "avg" or dtype.kind == "f") and (op not in BITWISE or dtype.kind != "f")]


def reduction(stack, op):
    """The expected result of ``op`` over the rows of ``stack`` and an elementwise tolerance
    (None: must match exactly). Floats are reduced in float64; ranks may reduce in another
    order and in the buffer's own precision, hence about 2n ulps per operand magnitude."""
    n, dtype = stack.shape[0], stack.dtype
    if dtype.kind != "f":
        return UFUNCS[op].reduce(stack, axis=0), None
    wide = stack.astype(np.float64)
    expected = UFUNCS[op].reduce(wide, axis=0)
    if op in ("max", "min"):
        return expected, None
    eps = float(np.finfo(dtype).eps)
    scale = np.abs(expected) if op == "prod" else np.abs(wide).sum(axis=0)
    if op == "avg":
        expected, scale = expected / n, scale / n
    return expected, 2 * n * eps * scale + eps * np.abs(expected) + float(np.finfo(dtype).tiny)


def compare(got, expected, tol=None):
    """None if ``got`` matches, else a sentence naming the first wrong element."""
    if got.shape != expected.shape:
        return f"shape {got.shape}, expected {expected.shape}"
    # with a tolerance, NaN counts as wrong: it is never within one
    bad = (got.astype(expected.dtype) != expected if tol is None
           else ~(np.abs(got.astype(np.float64) - expected) <= tol))
    if not bad.any():
        return None
    i = int(np.flatnonzero(bad)[0])
    return (f"{int(bad.sum())} of {bad.size} elements wrong; first at index {i}: "
            f"expected {expected[i].item()!r}, got {got[i].item()!r}")
