"""The signature of one collective call: what every rank must agree on.

A signature is 16 bytes carried in every data frame: collective, dtype, op, algorithm, root
and element count. A rank that receives a frame whose signature differs from its own knows
the ranks called different collectives (or the same one with different arguments) and says
so in words, with :func:`describe`.

>>> describe(pack("all_reduce", np.float32, "sum", "ring", 0, 10))
'all_reduce(count=10, dtype=float32, op=sum, algorithm=ring)'
"""
import functools
import struct

import numpy as np

# both ends of a point-to-point transfer sign it "point_to_point": a receiver checks each
# frame's signature against its own, so a send and its recv must sign alike
COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce",
               "barrier", "point_to_point", "gather", "scatter", "all_to_all")
ALGORITHMS = ("none", "ring", "ps", "rd", "hier")
# new codes go at the end: a code's meaning never changes
OPS = ("none", "sum", "avg", "max", "min", "prod", "band", "bor", "bxor")
DTYPES = tuple(np.dtype(d) for d in (
    "float16", "float32", "float64", "int8", "int16", "int32", "int64",
    "uint8", "uint16", "uint32", "uint64", "bool"))

_LAYOUT = struct.Struct("<BBBBiQ")
SIZE = _LAYOUT.size  # 16
assert SIZE == 16


_SUPPORTED = frozenset(DTYPES)


def dtype_supported(dtype):
    return (dtype if isinstance(dtype, np.dtype) else np.dtype(dtype)) in _SUPPORTED


@functools.lru_cache(maxsize=4096)  # a training loop signs the same few calls again and again
def pack(collective, dtype, op, algorithm, root, count):
    """16 bytes naming one collective call; ``dtype``/``op`` may be ``None``."""
    return _LAYOUT.pack(
        COLLECTIVES.index(collective),
        0 if dtype is None else DTYPES.index(np.dtype(dtype)) + 1,
        OPS.index(getattr(op, "value", op) or "none"),
        ALGORITHMS.index(algorithm or "none"),
        root, count)


def describe(sig):
    """A signature in words, for error messages; unknown codes are shown as numbers."""
    try:
        c, d, o, a, root, count = _LAYOUT.unpack(sig)
    except struct.error:
        return f"<malformed signature {bytes(sig).hex()}>"

    def name(table, i):
        return table[i] if 0 <= i < len(table) else f"?{i}"

    parts = [f"count={count}"]
    if d:
        parts.append(f"dtype={name(DTYPES, d - 1)}")
    if o:
        parts.append(f"op={name(OPS, o)}")
    if a:
        parts.append(f"algorithm={name(ALGORITHMS, a)}")
    if name(COLLECTIVES, c) in ("broadcast", "reduce", "gather", "scatter"):
        parts.append(f"root={root}")
    return f"{name(COLLECTIVES, c)}({', '.join(parts)})"
