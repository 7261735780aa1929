"""Joining the job: :func:`init` builds the world communicator."""
from __future__ import annotations

import atexit
import dataclasses
import json
import os
import sys

from . import env, torchrun
from . import secret as job_secret
from .comm import Communicator
from .device import select as select_device
from .engine import Engine
from .errors import CommError
from .session import Session
from .transport.local import LocalHub
from .transport.tuning import tune_malloc


def init(timeout: float | None = None, *, rank: int | None = None, world_size: int | None = None,
         master_addr: str | None = None, master_port: int | None = None, segment_bytes: int | None = None,
         encrypt: bool | None = None, device: str | None = None) -> Communicator:
    """Join the job and return the world :class:`~ringcomm.comm.Communicator`.

    Reads the launcher's environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
    ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``; or those of ``mpirun`` or
    ``srun``, see :mod:`ringcomm.env`); keyword arguments override it. ``timeout`` (seconds,
    default ``RINGCOMM_TIMEOUT`` or 300) bounds every wait. ``encrypt`` (default
    ``RINGCOMM_ENCRYPT``, else on exactly when the ranks span several hosts) turns CURVE
    encryption of every peer connection on or off; either way a peer must prove the job secret (``RINGCOMM_SECRET``; :mod:`ringcomm.secret` says where it
    comes from when that is not set). ``device``: ``"auto"`` (default,
    or ``RINGCOMM_DEVICE``: GPU ``LOCAL_RANK % device_count`` if CuPy sees one and can run a probe kernel on it, else the
    CPU), ``"cpu"``, ``"gpu"``, ``"emulated"`` (CPU arrays through the GPU staging path, for
    tests); ``comm.device`` says which. Ranks described by keywords alone (no launcher
    variables) are taken to share this host. Returns after every rank joined
    and a barrier passed. Without any launcher it returns a 1-rank world.
    """
    info = env.from_environ()
    overrides = dict(rank=rank, world_size=world_size, master_addr=master_addr,
                     master_port=master_port, timeout=timeout, segment_bytes=segment_bytes,
                     encrypt=encrypt)
    info = dataclasses.replace(info, **{k: v for k, v in overrides.items() if v is not None})
    if world_size is not None and info.source == "none":
        # ranks described by keywords alone are taken to share this host (ipc, lanes, a
        # secret agreed locally); ranks on several hosts need the launcher's variables
        info.local_rank, info.local_world_size = info.rank, info.world_size
    if segment_bytes is None and not os.environ.get("RINGCOMM_SEGMENT_BYTES"):
        info.segment_bytes = env.default_segment_bytes(info)  # for the overridden layout
    env.validate(info)
    tune_malloc()  # every job, one process too: its arrays are as large as its messages
    info.encrypt = env.encrypts(info)
    if os.environ.get("RINGCOMM_ERROR_FILE"):
        _report_to_launcher(os.environ["RINGCOMM_ERROR_FILE"])
    forget = None  # a published rendezvous port, to delete once every rank has joined
    if info.world_size > 1 and master_port is None and torchrun.uses_agent_store(os.environ):
        info.master_port, forget = torchrun.rendezvous_port(info, os.environ)  # MASTER_PORT is torch's
    if info.world_size > 1:
        info.secret, info.secret_file = job_secret.resolve(info)
    if info.world_size == 1:
        engine = Engine(lambda: Session(LocalHub(1).transport(0)), name="ringcomm-comm")
    else:
        from .transport import connect
        engine = Engine(lambda: Session(connect(info), info.collective_window), name=f"ringcomm-comm-{info.rank}")
    dev = select_device(device, info.local_rank, slot_bytes=info.segment_bytes)
    comm = Communicator(engine, ranks=range(info.world_size), rank=info.rank, comm_id=0, name="world",
                        timeout=info.timeout, segment_bytes=info.segment_bytes, is_world=True, device=dev,
                        local_rank=info.local_rank, local_world_size=info.local_world_size)
    atexit.register(comm.close)
    if info.world_size > 1:
        comm.barrier()
    if forget is not None and info.rank == 0:
        forget()
    return comm


def _report_to_launcher(path):
    """On an uncaught exception, write what it was (and which rank it blames) to ``path``, for
    ``ringcomm.launch`` to name the rank that caused a failure rather than its victims."""
    previous = sys.excepthook
    if getattr(previous, "ringcomm_report", False):
        return

    def hook(kind, exc, tb):
        blames = getattr(exc, "rank", None) if isinstance(exc, CommError) else None
        try:
            with open(path, "w") as f:
                json.dump({"type": kind.__name__, "message": str(exc)[:2000], "blames": blames,
                           "cause": getattr(exc, "cause", None) if isinstance(exc, CommError) else None}, f)
        except OSError:
            pass
        previous(kind, exc, tb)
    hook.ringcomm_report = True
    sys.excepthook = hook
