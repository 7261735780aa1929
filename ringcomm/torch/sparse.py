"""All-reduce of sparse COO tensors for the torch backend: the sum, as Gloo computes it.

A sparse tensor's *entries* are its ``nnz`` (index, value) pairs; a *value* is one element,
or a dense block when the tensor has dense dimensions. Each rank coalesces its tensor (sums
duplicate indices); one all-gather of a fixed-size *header* (nnz, sparse dimensions, shape,
dtype) tells every rank what every other holds, so ranks whose tensors differ in shape or
dtype all raise ``CollectiveMismatch`` before any data moves; then two all-gathers, padded to
the largest nnz, carry the indices and the values, and each rank adds the n tensors in rank
order and writes the coalesced sum into the caller's tensor (its nnz may grow). Every rank
adds the same entries in the same order, so all hold the same bits.

Cost per rank: three all-gathers; (n−1)·max_nnz·(8·sparse_dim + value bytes) bytes
received, whatever the overlap between ranks' indices (a dense all-reduce is the better
choice once the nnz nears the tensor's size).

>>> t = torch.sparse_coo_tensor([[rank]], [1.0], (4,))   # rank 0: {0: 1}, rank 1: {1: 1}
>>> dist.all_reduce(t)                                    # both: {0: 1, 1: 1}
"""
import numpy as np
import torch

from ..errors import CollectiveMismatch

MAX_DIMS = 12  # sizes a header has room for
HEADER = 4 + MAX_DIMS  # nnz, sparse_dim, dtype code, ndim, then the sizes (-1 past ndim)
_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8,
           torch.int16, torch.int32, torch.int64, torch.bool, torch.complex64, torch.complex128)


def header(tensor):
    """The int64 header of a coalesced sparse ``tensor``. What this backend cannot reduce
    (a CUDA tensor, a dtype not in the list, too many dimensions) is written into it, not
    raised here, so that every rank refuses the call alike (:func:`check_alike`)."""
    head = np.full(HEADER, -1, np.int64)
    supported = tensor.dtype in _DTYPES and not tensor.is_cuda
    head[:4] = tensor._nnz(), tensor.sparse_dim(), _DTYPES.index(tensor.dtype) if supported else -1, tensor.dim()
    if tensor.dim() <= MAX_DIMS:
        head[4:4 + tensor.dim()] = tensor.shape
    return head


def _describe(head):
    ndim = int(head[3])
    if head[2] < 0 or ndim > MAX_DIMS:
        return f"a tensor this backend does not all-reduce ({ndim} dimensions)"
    return (f"{_DTYPES[head[2]]} of shape {tuple(int(s) for s in head[4:4 + ndim])} with "
            f"{int(head[1])} sparse dimensions")


def check_alike(heads, me):
    """Raise on every rank alike (all read the same ``heads``) unless every rank's tensor is
    one this backend reduces (else ValueError), with the same shape, sparse dimensions and
    dtype as the others' (else CollectiveMismatch), naming which rank holds what."""
    odd = [r for r, h in enumerate(heads) if h[2] < 0 or h[3] > MAX_DIMS]
    if odd:
        raise ValueError(f"ringcomm sparse all_reduce: rank(s) {odd} hold sparse tensors it cannot "
                         f"reduce (CUDA, a dtype other than {', '.join(str(d) for d in _DTYPES)}, or "
                         f"more than {MAX_DIMS} dimensions); seen from rank {me}")
    kinds = {}
    for r, head in enumerate(heads):
        kinds.setdefault(_describe(head), []).append(r)
    if len(kinds) > 1:
        held = "; ".join(f"rank(s) {ranks}: {kind}" for kind, ranks in kinds.items())
        raise CollectiveMismatch(f"ringcomm sparse all_reduce: the ranks' tensors differ ({held}); "
                                 f"seen from rank {me}")


def padded(tensor, max_nnz):
    """A coalesced sparse ``tensor``'s indices (sparse_dim, max_nnz) and values (max_nnz,
    *dense shape), zero past its nnz: every rank's pieces have one size."""
    nnz = tensor._nnz()
    indices = torch.zeros((tensor.sparse_dim(), max_nnz), dtype=torch.int64)
    indices[:, :nnz] = tensor._indices()
    values = torch.zeros((max_nnz, *tensor.shape[tensor.sparse_dim():]), dtype=tensor.dtype)
    values[:nnz] = tensor._values()
    return indices, values


def summed(like, heads, indices, values):
    """The coalesced sum of every rank's entries: ``indices`` (n, sparse_dim, max_nnz) and
    ``values`` (n, max_nnz, *dense) as the all-gathers left them, ``heads`` their nnz."""
    nnz = [int(h[0]) for h in heads]
    every_index = torch.cat([indices[r, :, :k] for r, k in enumerate(nnz)], dim=1)
    every_value = torch.cat([values[r, :k] for r, k in enumerate(nnz)], dim=0)
    return torch.sparse_coo_tensor(every_index, every_value, like.shape, dtype=like.dtype).coalesce()
