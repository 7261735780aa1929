"""What torch.distributed's arguments become for ringcomm: the reduce op's name (and
PREMUL_SUM's factor), the signature of a call's wire elements, and the checks of tensor
lists and split sizes that every rank makes alike before any message.

A *piece* is one tensor of a per-rank list (allgather's outputs, reduce_scatter's inputs,
a root's gather outputs or scatter inputs): there are as many pieces as ranks, each with as
many elements as the call's own tensor.

>>> reduce_op(ReduceOp.SUM)                  # ('sum', None)
>>> reduce_op(dist._make_nccl_premul_sum(0.5))   # ('sum', 0.5)
"""
import torch
from torch.distributed import ReduceOp

from .. import signature
from .tensors import wire_count

OPS = {ReduceOp.SUM: "sum", ReduceOp.AVG: "avg", ReduceOp.PRODUCT: "prod", ReduceOp.MIN: "min",
       ReduceOp.MAX: "max", ReduceOp.BAND: "band", ReduceOp.BOR: "bor", ReduceOp.BXOR: "bxor"}


def reduce_op(op):
    """ringcomm's op name and the PREMUL_SUM factor (None for the others)."""
    kind = getattr(op, "op", op)
    if kind == ReduceOp.PREMUL_SUM:
        # torch 2.13 shows the factor as an attribute; 2.11 and 2.12 only in the op's state
        factor = op.factor if hasattr(op, "factor") else op.__getstate__()[1]
        return "sum", factor.item() if isinstance(factor, torch.Tensor) else float(factor)
    if kind not in OPS:
        raise ValueError(f"ringcomm has no reduce op {kind}")
    return OPS[kind], None


def viewed_as(loans):
    """Sign the call with what its tensors' wire elements stand for (one dtype per call)."""
    views = {loan.view for loan in loans if loan.tensors}
    if len(views) > 1:
        raise ValueError(f"ringcomm: tensors of several dtypes in one call: "
                         f"{sorted({str(t.dtype) for loan in loans for t in loan.tensors})}")
    return signature.viewed_as(views.pop() if views else "")


def one(tensors, verb):
    """The single tensor of a list that ``verb`` takes one of."""
    if len(tensors) != 1:
        raise ValueError(f"ringcomm {verb} takes one tensor per call, got {len(tensors)}")
    return tensors[0]


def rows(tensor, splits, n, name):
    """Element counts of ``splits`` (rows of dim 0; empty: equal), or None for equal splits."""
    if not splits:
        return None
    if len(splits) != n:
        raise ValueError(f"ringcomm all_to_all_single: {name} has {len(splits)} entries for {n} ranks")
    per_row = wire_count(tensor) // tensor.shape[0] if tensor.dim() and tensor.shape[0] else 0
    return [int(s) * per_row for s in splits]


def check_pieces(pieces, tensor, n, verb, side):
    """``n`` pieces (``side`` of ``verb``), each with as many elements as ``tensor``."""
    if len(pieces) != n:
        raise ValueError(f"ringcomm {verb}: {n} {side} tensors expected, got {len(pieces)}")
    if any(p.numel() != tensor.numel() for p in pieces):
        raise ValueError(f"ringcomm {verb}: every {side} tensor must have {tensor.numel()} "
                         f"elements, got {[p.numel() for p in pieces]}")
