"""Where this process sits in the job: rank, world size, and how to reach rank 0.

Read from the environment that a launcher leaves, in this order:

- ``ringcomm.launch`` and torchrun: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``;
- Open MPI's ``mpirun``: ``OMPI_COMM_WORLD_RANK``, ``_SIZE``, ``_LOCAL_RANK``, ``_LOCAL_SIZE``;
- SLURM's ``srun``: ``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID``, and this node's
  (``SLURM_NODEID``) count in ``SLURM_STEP_TASKS_PER_NODE`` (or ``SLURM_NTASKS_PER_NODE``,
  ``SLURM_TASKS_PER_NODE``);
- none of them: a single process (rank 0 of 1).

``MASTER_ADDR`` (default 127.0.0.1) and ``MASTER_PORT`` name rank 0's rendezvous. Settings:
``RINGCOMM_TIMEOUT`` (seconds, default 300), ``RINGCOMM_SEGMENT_BYTES`` (default 4 MiB when
every rank shares this host's shared-memory lanes, else 1 MiB), ``RINGCOMM_SECRET`` (the job
secret; see :mod:`ringcomm.secret` for where it comes from otherwise), ``RINGCOMM_JOB_ID``
(names the launch; see :func:`job_id`), ``RINGCOMM_TRANSPORT=tcp`` (TCP even between
ranks of one host), ``RINGCOMM_ENCRYPT`` (``1``: CURVE encryption of every peer connection,
``0``: none; unset: encrypted when the job spans several hosts; see
:mod:`ringcomm.transport.security`), ``RINGCOMM_SHM=0`` (no shared-memory lanes: every byte
through ZeroMQ), ``RINGCOMM_SHM_SLOTS`` (slots per lane, default 4; see
:mod:`ringcomm.transport.shm`), ``RINGCOMM_CHANNEL_MAX_BYTES`` (messages to a rank of this
host below this size go through its shared-memory channel, larger ones through a lane;
default 256 KiB; see :mod:`ringcomm.transport.channel`).
"""
import math
import os
import re
import socket
from dataclasses import dataclass

DEFAULT_TIMEOUT = 300.0
DEFAULT_SEGMENT_BYTES = 1 << 20
# Through shared memory each segment costs a ZeroMQ notice and a hop; on two cores fewer,
# larger segments measured faster (4 MiB all-reduce at N=2: 1.0 ms vs 1.4 ms with 1 MiB;
# 64 MiB at N=4: 53 ms vs 65 ms). ZeroMQ alone prefers 1 MiB (bench/RESULTS.md).
DEFAULT_LANE_SEGMENT_BYTES = 4 << 20
# A record in a channel, copied out by the receiver, beats a lane slot's bookkeeping up to
# about this size (N = 2 all-reduce in a loop, lane against channel: 64 KiB 46 against 33
# µs, 128 KiB 56 against 42, 256 KiB 76 against 57, 448 KiB 101 against 98), and stays at
# most a quarter of the channel's 1 MiB ring.
DEFAULT_CHANNEL_MAX_BYTES = 256 << 10

_SOURCES = (
    ("launcher", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"),
    ("mpirun", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
     "OMPI_COMM_WORLD_LOCAL_SIZE"),
    ("srun", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", None),  # see _slurm_tasks_here
)


@dataclass
class JobInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    source: str = "none"
    timeout: float = DEFAULT_TIMEOUT
    segment_bytes: int = DEFAULT_SEGMENT_BYTES
    secret: str = ""
    secret_file: str = ""  # made by this rank to share the secret; removed once all joined
    job: str = ""          # names this launch at the rendezvous (see job_id)
    force_tcp: bool = False
    encrypt: bool | None = None  # None: encrypt when the job spans several hosts (see encrypts)
    shared_memory: bool = True  # same-host segments through /dev/shm lanes
    shm_slots: int = 4          # slots per lane (each one segment)
    channel_max_bytes: int = DEFAULT_CHANNEL_MAX_BYTES  # smaller messages: channel, not lane
    collective_window: int = 16  # collectives a rank may run ahead of a peer (ringcomm.transport.credit)


def _int(environ, name, default=None):
    value = environ.get(name)
    if value is None or value == "":
        if default is None:
            raise ValueError(f"environment variable {name} is not set")
        return default
    if not re.fullmatch(r"\d+", value):
        raise ValueError(f"environment variable {name}={value!r} is not a non-negative integer")
    return int(value)


_SLURM_COUNTS = re.compile(r"\d+(\(x\d+\))?(,\d+(\(x\d+\))?)*")


def _slurm_tasks_here(environ, world_size):
    """The tasks of this step on this node (``SLURM_NODEID``): this node's entry of the
    per-node counts SLURM writes like ``2(x3),1`` (three nodes of 2 tasks, then one of 1), in
    ``SLURM_STEP_TASKS_PER_NODE`` (what srun sets) or ``SLURM_TASKS_PER_NODE``; else the one
    count ``SLURM_NTASKS_PER_NODE`` asks of every node; else every task."""
    for name in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE"):
        value = environ.get(name)
        if not value:
            continue
        if not _SLURM_COUNTS.fullmatch(value):
            raise ValueError(f"environment variable {name}={value!r} is not a SLURM task count list")
        runs = [(int(count), int(times.rstrip(")") or 1))
                for count, _, times in (part.partition("(x") for part in value.split(","))]
        nodes = sum(times for _, times in runs)
        if name == "SLURM_NTASKS_PER_NODE":
            return runs[0][0]  # a request: the same count on every node
        if "SLURM_NODEID" not in environ and nodes > 1:
            raise ValueError(f"{name}={value!r} names {nodes} nodes but SLURM_NODEID is not set")
        node = _int(environ, "SLURM_NODEID", 0)
        for count, times in runs:
            if node < times:
                return count
            node -= times
        raise ValueError(f"SLURM_NODEID={environ['SLURM_NODEID']} but {name}={value!r} names {nodes} nodes")
    return world_size


def job_id(environ):
    """A name for this launch that every rank of it shares: ``RINGCOMM_JOB_ID``, or what the
    launcher says (torchrun's run id, SLURM's job and step, Open MPI's namespace), with the
    restart round. A rank of another launch on the same port is refused at the rendezvous."""
    parts = [environ.get("RINGCOMM_JOB_ID") or environ.get("TORCHELASTIC_RUN_ID") or
             environ.get("PMIX_NAMESPACE") or environ.get("OMPI_MCA_ess_base_jobid") or "",
             environ.get("SLURM_JOB_ID", ""), environ.get("SLURM_STEP_ID", ""),
             environ.get("TORCHELASTIC_RESTART_COUNT") or environ.get("RINGCOMM_RESTART_COUNT") or ""]
    return ":".join(parts).strip(":")


def spans_hosts(info):
    """Whether the job's ranks run on several hosts (the launcher says fewer share this one)."""
    return info.local_world_size < info.world_size


def default_segment_bytes(info):
    """The segment size when the user sets none: larger when every rank shares lanes."""
    one_host = not spans_hosts(info) and info.shared_memory and not info.force_tcp
    return DEFAULT_LANE_SEGMENT_BYTES if one_host else DEFAULT_SEGMENT_BYTES


def from_environ(environ=None):
    """The :class:`JobInfo` described by ``environ`` (default ``os.environ``)."""
    environ = os.environ if environ is None else environ
    info = JobInfo()
    for source, rank, size, local_rank, local_size in _SOURCES:
        if rank in environ:
            info.source = source
            info.rank = _int(environ, rank)
            info.world_size = _int(environ, size)
            info.local_rank = _int(environ, local_rank, 0)
            info.local_world_size = (_int(environ, local_size, info.world_size) if local_size
                                     else _slurm_tasks_here(environ, info.world_size))
            break
    info.master_addr = environ.get("MASTER_ADDR") or "127.0.0.1"
    info.master_port = _int(environ, "MASTER_PORT", 0)
    info.timeout = timeout(environ)
    info.force_tcp = environ.get("RINGCOMM_TRANSPORT", "").lower() == "tcp"
    info.shared_memory = environ.get("RINGCOMM_SHM", "1").lower() not in ("0", "false", "no", "off")
    info.shm_slots = _int(environ, "RINGCOMM_SHM_SLOTS", 4)
    info.channel_max_bytes = _int(environ, "RINGCOMM_CHANNEL_MAX_BYTES", DEFAULT_CHANNEL_MAX_BYTES)
    info.segment_bytes = _int(environ, "RINGCOMM_SEGMENT_BYTES", default_segment_bytes(info))
    info.collective_window = _int(environ, "RINGCOMM_COLLECTIVE_WINDOW", 16)
    info.secret = environ.get("RINGCOMM_SECRET", "")  # else ringcomm.secret.resolve at init
    info.job = job_id(environ)
    info.encrypt = _switch(environ, "RINGCOMM_ENCRYPT")
    return info


def timeout(environ):
    """``RINGCOMM_TIMEOUT`` in seconds, else ``DEFAULT_TIMEOUT``."""
    if not environ.get("RINGCOMM_TIMEOUT"):
        return DEFAULT_TIMEOUT
    try:
        return float(environ["RINGCOMM_TIMEOUT"])
    except ValueError:
        raise ValueError(f"environment variable RINGCOMM_TIMEOUT={environ['RINGCOMM_TIMEOUT']!r} "
                         "is not a number of seconds") from None


def _switch(environ, name):
    """A yes/no setting: True, False, or None when it is not set."""
    value = environ.get(name, "").strip().lower()
    if not value:
        return None
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{name}={environ[name]!r}: expected 1 or 0")


def encrypts(info):
    """Whether this job's peer connections are encrypted: as ``info.encrypt`` says, else
    when its ranks span several hosts (their TCP connections cross a network)."""
    return info.encrypt if info.encrypt is not None else spans_hosts(info)


def validate(info):
    """Raise ``ValueError`` for a job description that cannot work."""
    if info.world_size < 1:
        raise ValueError(f"world size must be >= 1, got {info.world_size}")
    if not 0 <= info.rank < info.world_size:
        raise ValueError(f"rank {info.rank} is outside world size {info.world_size}")
    if info.world_size > 1 and not info.master_port:
        raise ValueError("MASTER_PORT is not set: ranks cannot find rank 0's rendezvous "
                         "(start the job with `python -m ringcomm.launch`, or set "
                         "MASTER_ADDR and MASTER_PORT)")
    if not 0 <= info.local_rank < info.local_world_size:
        raise ValueError(f"local rank {info.local_rank} is outside local world size {info.local_world_size}")
    if not 0 <= info.master_port <= 65535:
        raise ValueError(f"MASTER_PORT {info.master_port} is not a TCP port")
    if not 0 < info.timeout < math.inf:  # also rejects NaN
        raise ValueError(f"timeout must be a finite number of seconds > 0, got {info.timeout}")
    if info.shm_slots < 1:
        raise ValueError(f"RINGCOMM_SHM_SLOTS must be at least 1, got {info.shm_slots}")
    if info.segment_bytes < 1024:
        raise ValueError(f"segment size must be at least 1024 bytes, got {info.segment_bytes}")
    if info.collective_window < 2:
        raise ValueError(f"RINGCOMM_COLLECTIVE_WINDOW must be at least 2, got {info.collective_window}")


def free_port(addr: str) -> int:
    """A TCP port that is free right now on ``addr`` (bind port 0, read it back)."""
    for host in (addr, ""):
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                sock.bind((host, 0))
                return sock.getsockname()[1]
        except OSError:
            continue
    raise RuntimeError(f"cannot find a free TCP port on {addr!r}")
