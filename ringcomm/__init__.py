"""ringcomm: ring collectives over ZeroMQ, from scratch.

>>> import ringcomm
>>> comm = ringcomm.init()                    # under `python -m ringcomm.launch --nproc 4`
>>> comm.all_reduce(x)                        # in place, ring by default for large x

Public names: :func:`init`, :class:`Communicator`, :class:`ReduceOp`, :data:`ANY_SOURCE`
(``comm.recv(x, ringcomm.ANY_SOURCE, tag)``: from any rank; it is None), and the errors
:class:`CommError`, :class:`CommTimeout`, :class:`PeerLost`, :class:`CollectiveMismatch`,
:class:`Revoked`, :class:`RanksLost`.
Imports are lazy so that ``python -m ringcomm.launch`` starts fast.
"""
import importlib

_LAZY = {
    "init": "ringcomm.world",
    "Communicator": "ringcomm.comm",
    "Work": "ringcomm.engine",
    "ReduceOp": "ringcomm.ops",
    "ANY_SOURCE": "ringcomm.receives",
    "CommError": "ringcomm.errors",
    "CommTimeout": "ringcomm.errors",
    "PeerLost": "ringcomm.errors",
    "CollectiveMismatch": "ringcomm.errors",
    "FrameError": "ringcomm.errors",
    "Revoked": "ringcomm.errors",
    "RanksLost": "ringcomm.errors",
}

__all__ = sorted(_LAZY)
__version__ = "0.1.0"


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'ringcomm' has no attribute {name!r}")
