"""Argument checks of the public verbs, made before anything is sent.

Every check raises ``TypeError`` (wrong kind of thing) or ``ValueError`` (wrong value) on
the calling rank alone; what the ranks must agree on (sizes, dtypes, roots) is checked
across ranks by the signature (:mod:`ringcomm.signature`), not here.

>>> flat = check_array(np.zeros((2, 3)), "x")     # the flat view the algorithms get
>>> check_rank(5, 4, "root")                      # ValueError: root 5 is not a rank ...
"""
import numpy as np

from . import signature
from .errors import CollectiveMismatch
from .kernels import reference


# numpy subclasses whose values are more than their bytes: a masked array's mask, a matrix's
# 2-D rules. Any other subclass (np.memmap, a subclass that only adds attributes) is its bytes.
MORE_THAN_BYTES = (np.ma.MaskedArray, np.matrix)


def check_array(x, name, writable=True, device=None):
    """The flat view of ``x``, a C-contiguous numpy array (or a CuPy array of ``device``) of a
    supported dtype, writable when ``writable``. A numpy subclass (np.memmap...) is taken as
    its bytes, and its flat view is a plain ndarray over them, unless it is one of
    :data:`MORE_THAN_BYTES`."""
    if isinstance(x, MORE_THAN_BYTES):
        raise TypeError(f"{name} is a {_kind(x)}, whose values are more than its bytes; pass a plain "
                        f"numpy array (np.asarray(x) gives the plain array of its data)")
    if not isinstance(x, np.ndarray) and not (device is not None and device.is_array(x)):
        on_gpu = " or a CuPy array on this device" if device is not None and device.kind == "gpu" else ""
        raise TypeError(f"{name} must be a numpy array{on_gpu}, got {type(x).__name__}")
    if not signature.dtype_supported(x.dtype):
        names = ", ".join(d.name for d in signature.DTYPES)
        raise TypeError(f"{name} has unsupported dtype {x.dtype}; supported: {names}")
    if not x.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous (use np.ascontiguousarray)")
    if writable and not getattr(x.flags, "writeable", True):
        raise ValueError(f"{name} is read-only, but this collective writes into it")
    # a subclass's own indexing and __array_finalize__ stay out of the algorithms' slicing
    return (x.view(np.ndarray) if isinstance(x, np.ndarray) else x).reshape(-1)


def check_device_reduce(x, op, device):
    """A reduction of a GPU array runs in ``kernels/reduce.cu``: refuse, before anything is
    sent, an op and dtype it has no kernel for (rather than failing half-way through)."""
    if device.kind == "gpu" and device.is_array(x) \
            and not reference.device_reduces(op, x.dtype):
        raise TypeError(f"op {getattr(op, 'value', op)!r} on a GPU array of dtype {x.dtype} has no "
                        f"reduce kernel. On the GPU: sum/max/min/prod on float16/32/64, int32, "
                        f"int64; avg on float16/32/64; band/bor/bxor on int32, int64 (or reduce a "
                        f"numpy copy on the host)")


def check_rank(value, size, name, group="the group"):
    # (a bool is an int to Python: True would silently name rank 1)
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or \
            not 0 <= value < size:
        raise ValueError(f"{name} {value!r} is not a rank of {group} (size {size})")


def check_peer(peer, name, tag, rank, size, group="the group"):
    """A point-to-point peer: a rank of the group other than this one; a 32-bit tag."""
    check_rank(peer, size, name, group)
    if peer == rank:
        raise ValueError(f"{name}={peer} is this rank itself")
    check_tag(tag)


def check_source(src, tag, rank, size, group="the group"):
    """A receive's source: a peer (:func:`check_peer`), or None (any other rank of a group
    that has one)."""
    if src is not None:
        check_peer(src, "src", tag, rank, size, group)
        return
    check_tag(tag)
    if size < 2:
        raise ValueError(f"recv from any source on {group}: it has no other rank")


def check_tag(tag):
    if isinstance(tag, (bool, np.bool_)) or not isinstance(tag, (int, np.integer)) or \
            not 0 <= tag < 2 ** 32:
        raise ValueError(f"tag must be an integer in [0, 2**32), got {tag!r}")


def check_pair(out, x, rank, got, want, got_name, want_name, allow_in_place=True):
    """``out`` and ``x`` of a reduce-scatter, all-gather, gather, scatter or all-to-all: same
    dtype, both on the host (numpy, subclasses included) or both on the device, sizes that
    fit (``got == want``), and no overlap except NCCL's in-place form (see :func:`in_place`;
    none at all without ``allow_in_place``)."""
    if out.dtype != x.dtype:
        raise TypeError(f"out has dtype {out.dtype}, x has {x.dtype}; they must match")
    if got != want:
        raise ValueError(f"{got_name} = {got} but {want_name} = {want}")
    if isinstance(out, np.ndarray) != isinstance(x, np.ndarray):
        raise TypeError(f"out is a {_kind(out)}, x a {_kind(x)}; both must be numpy arrays or both "
                        f"arrays of the device")
    if _overlap(out, x) and not (allow_in_place and in_place(out, x, rank)):
        raise ValueError("out and x overlap; they may only overlap in place, with the small "
                         "buffer being exactly this rank's slice of the large one")


def split_sizes(splits, size, n, name, param):
    """The ``n`` block lengths of buffer ``name`` of ``size`` elements: ``splits`` (the
    argument ``param``) checked (whole numbers >= 0 that sum to ``size``), or equal blocks
    when ``splits`` is None."""
    if splits is None:
        if size % n:
            raise ValueError(f"{name}.size = {size} is not divisible by the world size {n}; "
                             f"pass {param} for uneven blocks")
        return (size // n,) * n
    values = list(splits)
    if len(values) != n or not all(isinstance(v, (int, np.integer)) and v >= 0 for v in values):
        raise ValueError(f"{param} must be {n} whole numbers >= 0, got {splits!r}")
    if sum(values) != size:
        raise ValueError(f"{param} sum to {sum(values)}, but {name}.size = {size}")
    return tuple(int(v) for v in values)


def in_place(out, x, rank):
    """NCCL's in-place forms: reduce_scatter with ``out`` = this rank's slice of ``x``,
    all_gather with ``x`` = this rank's slice of ``out``."""
    big, small = (x, out) if x.size > out.size else (out, x)
    return _address(small) == _address(big) + rank * small.size * small.itemsize


def _kind(a):
    return f"{type(a).__module__}.{type(a).__name__}"


def _address(a):
    """Start address of an array's data (numpy or CuPy)."""
    return a.ctypes.data if isinstance(a, np.ndarray) else a.data.ptr


def _overlap(a, b):
    if isinstance(a, np.ndarray):
        return np.shares_memory(a, b)
    lo_a, lo_b = _address(a), _address(b)
    return lo_a < lo_b + b.nbytes and lo_b < lo_a + a.nbytes


def agree_splits(comm, outs, ins):
    """Every rank's all-to-all splits, all-gathered over ``comm``: CollectiveMismatch on every
    rank if any rank r's ``in_splits[s]`` differs from rank s's ``out_splits[r]``. One
    all-gather of 2n² int64."""
    n = comm.world_size
    mine = np.array(list(ins) + list(outs), np.int64)
    table = np.empty(2 * n * n, np.int64)
    comm.all_gather(table, mine)
    table = table.reshape(n, 2, n)  # [rank, in/out, peer]
    bad = [(r, s) for r in range(n) for s in range(n) if table[r, 0, s] != table[s, 1, r]]
    if bad:
        r, s = bad[0]
        raise CollectiveMismatch(f"all_to_all on {comm.name}: rank {r} sends {table[r, 0, s]} elements "
                                 f"to rank {s}, which expects {table[s, 1, r]} from it")
