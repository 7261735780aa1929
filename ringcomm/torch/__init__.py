"""ringcomm as a torch.distributed backend: PyTorch's own DDP, FSDP2 and
ZeroRedundancyOptimizer run on ringcomm's collectives unchanged.

    import ringcomm.torch                          # registers the backend "ringcomm"
    torch.distributed.init_process_group("ringcomm")
    model = DistributedDataParallel(model)         # or fully_shard(model), ...

Under ``python -m ringcomm.launch``, ``torchrun`` or any ``env://`` / ``tcp://`` start; see
:mod:`ringcomm.torch.backend` for how the ranks meet, :mod:`ringcomm.torch.process_group`
for the verbs (:mod:`~ringcomm.torch.arguments` for what their arguments become,
:mod:`~ringcomm.torch.monitored` for monitored_barrier) and :mod:`ringcomm.torch.tensors`
for which tensors are lent without a copy.
Needs PyTorch (``pip install ringcomm[torch]``); the rest of ringcomm does not. Importing it
also makes ``torch.distributed.monitored_barrier`` take ringcomm's groups (torch's own takes
Gloo's only).
"""
import torch.distributed as dist

from .backend import create
from .process_group import ProcessGroupRingcomm, monitored_barrier
from .work import inline_futures

BACKEND = "ringcomm"

dist.Backend.register_backend(BACKEND, create, extended_api=True, devices=["cpu", "cuda"])
# torch's monitored_barrier refuses every backend but Gloo; this one also takes ringcomm's
dist.monitored_barrier = dist.distributed_c10d.monitored_barrier = monitored_barrier

__all__ = ["BACKEND", "ProcessGroupRingcomm", "create", "inline_futures", "monitored_barrier"]
