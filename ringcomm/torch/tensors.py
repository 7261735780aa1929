"""Torch tensors lent to ringcomm's collectives, and what is copied back afterwards.

A *loan* is the flat array (numpy, or CuPy on the GPU) one collective works on in place of
one or more tensors, with ``finish()`` to run once the collective completed:

- a contiguous CPU tensor whose dtype numpy has is lent as it is: ``tensor.numpy()`` shares
  its memory, nothing is copied and ``finish()`` has nothing to do;
- bfloat16 has no numpy dtype: it travels as its 16-bit pattern where the collective only
  moves data, and as float32 (exact) where it reduces, rounded back once at the end;
- complex tensors travel as their real view (pairs of floats): sums and averages are the
  complex ones; products, maxima, minima and bitwise ops of complex numbers are refused;
- a non-contiguous tensor, or a list of tensors that one collective takes as one buffer
  (an all-gather's outputs, a reduce-scatter's inputs, an all-to-all's blocks), is copied
  into one contiguous buffer, and outputs are copied back by ``finish()``;
- a CUDA tensor is lent to CuPy through DLPack, on a communicator whose device is the GPU.

A loan's ``view`` ("bfloat16", "complex" or "") is what its wire elements stand for; the
group signs it with each call, so ranks whose tensors differ in dtype but not on the wire
(bfloat16 against int16 or float32; a complex tensor that reaches the backend as one against
a real one) raise ``CollectiveMismatch``.

>>> loan = lend([t], reducing=True)     # t: a contiguous float32 CPU tensor
>>> comm.all_reduce(loan.array); loan.finish()   # t holds the sum; no copy was made
"""
import numpy as np
import torch

_MOVE_AS = {torch.bfloat16: torch.int16, torch.complex32: torch.float16,
            torch.complex64: torch.float32, torch.complex128: torch.float64}
_COMPLEX_OPS = ("sum", "avg")


def check_op(tensors, op, factor=None):
    """Refuse a reduction ``op`` ringcomm cannot do for these tensors' dtype (``factor``:
    PREMUL_SUM's, which scales floating-point tensors only)."""
    if not tensors:
        return
    dtype = tensors[0].dtype
    if dtype.is_complex and op not in _COMPLEX_OPS:
        raise ValueError(f"ringcomm reduces complex tensors with sum or avg only, not {op!r}")
    if factor is not None and not (dtype.is_floating_point or dtype.is_complex):
        raise ValueError(f"ringcomm: PREMUL_SUM scales floating-point tensors, not {dtype}")


def _view_of(tensor):
    """What ``tensor``'s wire elements stand for (ringcomm.signature.VIEWS). torch.distributed
    hands most verbs (all-reduce, broadcast, all-gather, send/recv, ...) a complex tensor as
    ``torch.view_as_real(t)``, a real tensor: there, as on Gloo and NCCL, complex and real
    cannot be told apart (a view's storage root says nothing reliable: ``z.real`` is a view
    of complex memory, ``view_as_complex`` makes complex views of real memory)."""
    if tensor.is_complex():
        return "complex"
    return "bfloat16" if tensor.dtype is torch.bfloat16 else ""


def _device(tensors, gpu, device_index=None):
    """True for CUDA tensors (on ``device_index``, the rank's GPU, when given), False for CPU
    ones; ValueError for anything else or a mix."""
    for t in tensors:
        if t.layout != torch.strided:
            raise ValueError(f"ringcomm: {t.layout} tensors are not supported (dense tensors only)")
    cuda = {t.is_cuda for t in tensors}
    if len(cuda) > 1:
        raise ValueError("ringcomm: CPU and CUDA tensors mixed in one collective")
    if cuda == {True} and not gpu:
        raise ValueError("ringcomm: a CUDA tensor, but this process's ringcomm communicator runs "
                         "on the CPU (init with RINGCOMM_DEVICE=gpu and CuPy installed)")
    if cuda == {True} and device_index is not None:
        others = sorted({t.device.index for t in tensors} - {device_index})
        if others:  # its streams and events are the rank's GPU's: another's would not be ordered
            raise ValueError(f"ringcomm: a tensor on cuda:{others[0]}, but this rank's communicator "
                             f"runs on cuda:{device_index} (LOCAL_RANK % device count; "
                             f"torch.cuda.set_device(that) first)")
    return cuda == {True}


def _as_array(tensor, cuda):
    """The array over ``tensor``'s memory (contiguous, of a dtype numpy or CuPy has)."""
    if cuda:
        import cupy
        return cupy.from_dlpack(tensor.detach()).reshape(-1)
    return tensor.detach().numpy().reshape(-1)


def _wire_dtype(dtype, reducing):
    """The dtype a tensor of ``dtype`` travels as; the tensor is viewed (or, for reducing
    bfloat16, converted) as it."""
    if dtype is torch.bfloat16 and reducing:
        return torch.float32
    return _MOVE_AS.get(dtype, dtype)


def wire_count(tensor):
    """How many wire elements ``tensor`` takes: a complex element travels as two reals."""
    return tensor.numel() * (2 if tensor.is_complex() else 1)


def _wire_source(tensor, wire):
    """``tensor``'s elements as flat ``wire`` elements: a view of its memory when it is
    contiguous (and not bfloat16 reduced as float32), else a copy."""
    t = tensor.detach()
    if t.is_complex():
        t = torch.view_as_real(t.resolve_conj())
    elif t.dtype != wire and t.dtype.itemsize == wire.itemsize:
        t = t.view(wire)
    elif t.dtype != wire:
        t = t.to(wire)
    return t.reshape(-1)


def _shares_memory(tensor, wire):
    return tensor.is_contiguous() and not tensor.is_conj() and \
        (tensor.is_complex() or tensor.dtype.itemsize == wire.itemsize)


@torch.no_grad()  # a collective's write is not an operation of the autograd graph (as Gloo's)
def _copy_back(tensor, flat):
    """Write the flat ``flat`` (wire elements) into ``tensor``."""
    if tensor.is_complex():
        tensor.copy_(torch.view_as_complex(flat.view(*tensor.shape, 2)))
    elif tensor.dtype.itemsize == flat.dtype.itemsize and tensor.dtype != flat.dtype:
        tensor.copy_(flat.view(tensor.dtype).view(tensor.shape))
    else:
        tensor.copy_(flat.view(tensor.shape))  # rounds float32 to bfloat16 once


class Loan:
    """The array a collective works on for ``tensors``; ``finish()`` copies it back into the
    tensors (outputs only) once the collective has completed. Idempotent."""

    def __init__(self, tensors, *, reducing=False, output=True, copy_in=True, gpu=False, device_index=None):
        self.tensors = list(tensors)
        cuda = _device(self.tensors, gpu, device_index)
        if len({t.dtype for t in self.tensors}) > 1:
            raise ValueError(f"ringcomm: tensors of several dtypes in one collective: "
                             f"{sorted({str(t.dtype) for t in self.tensors})}")
        wire = _wire_dtype(self.tensors[0].dtype, reducing) if self.tensors else torch.uint8
        # what the wire elements stand for, signed with the call (ringcomm.signature.VIEWS)
        self.view = _view_of(self.tensors[0]) if self.tensors else ""
        self.bounds, start = [], 0  # (tensor, start, stop): each tensor's wire elements in the buffer
        for t in self.tensors:
            stop = start + wire_count(t)
            self.bounds.append((t, start, stop))
            start = stop
        shared = len(self.tensors) == 1 and _shares_memory(self.tensors[0], wire)
        # the buffer: the tensor itself, or a copy kept alive while ringcomm works on it
        self._flat = _wire_source(self.tensors[0], wire) if shared else self._concatenate(wire, start, copy_in)
        self._owed = output and not shared  # finish() still owes the tensors the buffer's values
        self.array = _as_array(self._flat, cuda) if start else _empty(wire, cuda)

    def _concatenate(self, wire, count, copy_in):
        device = self.tensors[0].device if self.tensors else "cpu"
        flat = torch.empty(count, dtype=wire, device=device)
        if copy_in:
            for t, start, stop in self.bounds:
                flat[start:stop] = _wire_source(t, wire)
        return flat

    def finish(self):
        if self._owed:
            self._owed = False
            for tensor, start, stop in self.bounds:
                _copy_back(tensor, self._flat[start:stop])


def _empty(wire, cuda):
    if cuda:
        import cupy
        return cupy.empty(0, dtype=torch.empty(0, dtype=wire).numpy().dtype)
    return np.empty(0, dtype=torch.empty(0, dtype=wire).numpy().dtype)


def lend(tensors, *, reducing=False, output=True, copy_in=True, gpu=False, device_index=None):
    """A :class:`Loan` of ``tensors`` (one buffer for all of them, in order); ``device_index``:
    the rank's GPU, which CUDA tensors must be on."""
    return Loan(tensors, reducing=reducing, output=output, copy_in=copy_in, gpu=gpu,
                device_index=device_index)
