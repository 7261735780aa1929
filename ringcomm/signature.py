"""The signature of one collective call: what every rank must agree on.

A signature is 16 bytes carried in every data frame: collective, dtype, op, algorithm, root
and element count. A rank that receives a frame whose signature differs from its own knows
the ranks called different collectives (or the same one with different arguments) and says
so in words, with :func:`describe`.

The dtype byte holds the wire dtype (its low four bits) and, in its high four bits, the
*view*: the type the caller's data has where it is not the wire dtype (a bfloat16 tensor
travels as int16 or float32, a complex one as pairs of reals). Calls made inside
:func:`viewed_as` sign their view, so a bfloat16 broadcast meets an int16 one as a mismatch.

>>> describe(pack("all_reduce", np.float32, "sum", "ring", 0, 10))
'all_reduce(count=10, dtype=float32, op=sum, algorithm=ring)'
>>> with viewed_as("bfloat16"):          # the torch backend, around a bfloat16 tensor's call
...     sig = pack("broadcast", np.int16, None, "ring", 0, 8, current_view())
>>> describe(sig)
'broadcast(count=8, dtype=bfloat16 as int16, algorithm=ring, root=0)'
"""
import contextlib
import functools
import struct
import threading

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
# what data travelling as a wire dtype stands for; new views go at the end (at most 15)
VIEWS = ("", "bfloat16", "complex")
_calling = threading.local()


@contextlib.contextmanager
def viewed_as(view):
    """Within the block, this thread's calls sign ``view`` (one of :data:`VIEWS`) with
    their wire dtype. Nested blocks restore the outer view on exit."""
    outer = current_view()
    _calling.view = VIEWS.index(view)
    try:
        yield
    finally:
        _calling.view = outer


def current_view():
    """The view code this thread's calls sign now (0: the data is its wire dtype)."""
    return getattr(_calling, "view", 0)


def dtype_supported(dtype):
    return (dtype if isinstance(dtype, np.dtype) else np.dtype(dtype)) in _SUPPORTED


@functools.lru_cache(maxsize=4096)  # a training loop signs the same few calls again and again
def pack(collective, dtype, op, algorithm, root, count, view=0):
    """16 bytes naming one collective call; ``dtype``/``op`` may be ``None``; ``view`` is a
    code of :data:`VIEWS` (see :func:`current_view`)."""
    return _LAYOUT.pack(
        COLLECTIVES.index(collective),
        0 if dtype is None else (view << 4) | (DTYPES.index(np.dtype(dtype)) + 1),
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
        wire, view = name(DTYPES, (d & 15) - 1), d >> 4
        parts.append(f"dtype={name(VIEWS, view)} as {wire}" if view else f"dtype={wire}")
    if o:
        parts.append(f"op={name(OPS, o)}")
    if a:
        parts.append(f"algorithm={name(ALGORITHMS, a)}")
    if name(COLLECTIVES, c) in ("broadcast", "reduce", "gather", "scatter"):
        parts.append(f"root={root}")
    return f"{name(COLLECTIVES, c)}({', '.join(parts)})"
