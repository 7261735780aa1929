"""The job secret: where it comes from, never from public values unless the user says so.

Every connection between ranks proves the job secret (see
:mod:`ringcomm.transport.security`), so a process that does not know it cannot join or
inject frames. The secret comes from, in this order:

1. ``RINGCOMM_SECRET`` (``ringcomm.launch`` sets a random one for a one-host job);
2. ``RINGCOMM_SECRET_FILE``, a file holding it (readable by this user only, ideally);
3. a job of one process: none is needed;
4. every rank on this host (``LOCAL_WORLD_SIZE == WORLD_SIZE``), started by another launcher
   (torchrun, ``mpirun``, ``srun``): local rank 0 draws a random secret and writes it to a
   file in this user's private run directory (:mod:`ringcomm.rundir`), named after what the
   ranks of one launch share (the rendezvous address, the launcher process they are
   children of, and its start time); the other ranks wait for it. The file is removed as
   soon as every rank has joined;
5. ranks on several hosts: :func:`resolve` refuses, naming ``RINGCOMM_SECRET`` and
   ``RINGCOMM_SECRET_FILE``, unless ``RINGCOMM_INSECURE=1`` accepts a secret derived from
   ``MASTER_ADDR`` and ``MASTER_PORT`` (which anyone who knows them can compute) with a
   warning.
"""
import hashlib
import logging
import os
import secrets
import time

from . import env, rundir
from .errors import CommTimeout

log = logging.getLogger(__name__)
INSECURE_WARNING = ("RINGCOMM_INSECURE=1: the job secret is derived from MASTER_ADDR and "
                    "MASTER_PORT; any process that knows them can join this job or forge its data")


def derived(master_addr, master_port):
    """The secret anyone can compute from the rendezvous address (``RINGCOMM_INSECURE=1``)."""
    return hashlib.sha256(f"ringcomm:{master_addr}:{master_port}".encode()).hexdigest()[:32]


def insecure(environ):
    return environ.get("RINGCOMM_INSECURE", "").lower() in ("1", "true", "yes", "on")


def missing_secret_message(what):
    return (f"{what} and no job secret is set: set RINGCOMM_SECRET (the same value for every "
            f"rank) or RINGCOMM_SECRET_FILE (a file every rank can read and nobody else), or "
            f"RINGCOMM_INSECURE=1 to accept a secret anyone who knows MASTER_ADDR and "
            f"MASTER_PORT can compute")


def from_file(path):
    """The secret held in ``path`` (surrounding whitespace stripped)."""
    try:
        with open(path) as f:
            value = f.read().strip()
        mode = os.stat(path).st_mode
    except OSError as exc:
        raise ValueError(f"RINGCOMM_SECRET_FILE={path!r} cannot be read: {exc}") from None
    if not value:
        raise ValueError(f"RINGCOMM_SECRET_FILE={path!r} is empty")
    if mode & 0o077:
        log.warning("RINGCOMM_SECRET_FILE %s may be read by other users (mode %o)", path, mode & 0o777)
    return value


def resolve(info, environ=None):
    """The job secret for ``info`` (a :class:`ringcomm.env.JobInfo`), and the file this rank
    made to share it ("" if none; remove it once every rank has joined)."""
    environ = os.environ if environ is None else environ
    if environ.get("RINGCOMM_SECRET"):
        return environ["RINGCOMM_SECRET"], ""
    if environ.get("RINGCOMM_SECRET_FILE"):
        return from_file(environ["RINGCOMM_SECRET_FILE"]), ""
    if info.world_size == 1:
        return secrets.token_hex(16), ""
    if not env.spans_hosts(info):
        return _agree_on_this_host(info)
    if insecure(environ):
        log.warning(INSECURE_WARNING)
        return derived(info.master_addr, info.master_port), ""
    raise ValueError(missing_secret_message(
        f"the job spans several hosts (LOCAL_WORLD_SIZE {info.local_world_size} < "
        f"WORLD_SIZE {info.world_size})"))


def _start_time(pid):
    """A process's start time in clock ticks since boot (tells a reused pid apart)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return ""


def _launch_key(info):
    """What every rank of one launch on this host shares, and no other launch does: the
    rendezvous address, the launcher process (pid and start time) and the job's name with its
    restart round (:func:`ringcomm.env.job_id`)."""
    parent = os.getppid()
    raw = f"{info.master_addr}:{info.master_port}:{parent}:{_start_time(parent)}:{info.job}"
    return hashlib.sha256(raw.encode()).hexdigest()[:24]


def _read(path):
    """(creator, secret) from a shared secret file (creator: :func:`rundir.owner`), or None
    if absent or unreadable."""
    try:
        with open(path) as f:
            creator, value = f.read().split()
        return creator, value
    except (OSError, ValueError):
        return None


def _agree_on_this_host(info):
    directory = rundir.path()
    path = os.path.join(directory, f"secret-{_launch_key(info)}")
    if info.local_rank == 0:
        def stale(name):  # left by a local rank 0 killed before everyone joined
            found = _read(os.path.join(directory, name)) if name.startswith("secret-") else None
            return bool(found) and rundir.owner_gone(found[0])
        rundir.remove_where(directory, stale)
        value = secrets.token_hex(16)
        temporary = os.path.join(directory, f"{rundir.owner()}-secret.tmp")
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(f"{rundir.owner()} {value}\n")
        os.replace(temporary, path)
        return value, path
    deadline = time.monotonic() + info.timeout
    while time.monotonic() < deadline:
        found = _read(path)
        if found and not rundir.owner_gone(found[0]):
            return found[1], ""
        time.sleep(0.02)
    raise CommTimeout(
        f"rank {info.rank}: no job secret from local rank 0 within {info.timeout:g} s (it is "
        f"shared through {path}, which only ranks started by the same launcher process find); "
        f"set RINGCOMM_SECRET to the same value for every rank")
