"""One worker's processes, as the supervision in :mod:`.workers` handles them: started in a
session (process group) of its own that the kernel kills when the launcher dies, its output
relayed line by line behind a ``[rank R]: `` prefix, its group signalled and looked at for
live members, and how it ended put in words.

>>> worker = Worker(local_rank=0, rank=0, proc=spawn(cfg.command(), env, capture=True))
>>> worker.relay_output()                     # [rank 0]: ... on our stdout and stderr
>>> worker.signal_group(signal.SIGTERM); worker.group_alive()       # False once it has gone
>>> describe_exit(worker.proc.wait())         # 'killed by signal 15 (SIGTERM)'
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass, field

from .config import PROG, _stderr_lock, _stdout_lock, _write


def describe_exit(returncode: int) -> str:
    if returncode >= 0:
        return f"exit code {returncode}"
    try:
        name = signal.Signals(-returncode).name
    except ValueError:
        name = "unknown"
    return f"killed by signal {-returncode} ({name})"


def has_live_member(pgid: int) -> bool:
    """Whether process group ``pgid`` has a member that is not a zombie.

    Orphaned grandchildren stay zombies until init reaps them (slowly in some
    containers, never if we are PID 1); they must not hold up the grace wait.
    Without a readable /proc we assume the group is alive.
    """
    try:
        entries = [e for e in os.listdir("/proc") if e.isdigit()]
    except OSError:
        return True
    for entry in entries:
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if len(fields) > 2 and int(fields[2]) == pgid and fields[0] != b"Z":
            return True
    return False


def relay_lines(pipe, stream_name: str, prefix: bytes) -> None:
    """Copy one worker pipe line by line to our stdout/stderr, with a prefix."""
    lock = _stdout_lock if stream_name == "stdout" else _stderr_lock
    try:
        for line in iter(pipe.readline, b""):
            if not line.endswith(b"\n"):
                line += b"\n"
            _write(getattr(sys, stream_name), lock, prefix + line)
    finally:
        pipe.close()


# Linux: prctl(PR_SET_PDEATHSIG) makes the kernel kill a worker when its launcher dies, even
# by SIGKILL, so workers never outlive it. Looked up here, in the parent, so that the forked
# child does as little as it can before exec (one foreign call, no import). The signal
# follows the thread that forks: WorkerGroup.run() spawns from the thread that calls it.
PR_SET_PDEATHSIG = 1
try:
    _PRCTL = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None
except (OSError, AttributeError):
    _PRCTL = None


def _die_with(parent):
    def preexec():
        if _PRCTL(PR_SET_PDEATHSIG, signal.SIGKILL) != 0:
            os.write(2, b"ringcomm.launch: prctl(PR_SET_PDEATHSIG) failed: this worker may outlive the launcher\n")
        if os.getppid() != parent:  # the launcher died before the signal was armed
            os._exit(1)
    return preexec


def spawn(command: list[str], env: dict[str, str], capture: bool) -> subprocess.Popen:
    """Start ``command`` in a session of its own, its stdout and stderr piped to us when
    ``capture``, and (on Linux) killed by the kernel if this process dies."""
    pipe = subprocess.PIPE if capture else None
    return subprocess.Popen(command, env=env, stdout=pipe, stderr=pipe,
                            stdin=subprocess.DEVNULL, start_new_session=True,
                            preexec_fn=_die_with(os.getpid()) if _PRCTL is not None else None)


@dataclass
class Worker:
    local_rank: int
    rank: int
    proc: subprocess.Popen
    readers: list[threading.Thread] = field(default_factory=list)

    def relay_output(self) -> None:
        """Start the threads that copy the worker's pipes to our stdout and stderr."""
        tag = f"[rank {self.rank}]: ".encode()
        for pipe_obj, name in ((self.proc.stdout, "stdout"), (self.proc.stderr, "stderr")):
            thread = threading.Thread(target=relay_lines, args=(pipe_obj, name, tag),
                                      name=f"{PROG}-{self.rank}-{name}", daemon=True)
            thread.start()
            self.readers.append(thread)

    def group_alive(self) -> bool:
        self.proc.poll()  # reap the leader if it exited, so it does not count
        try:
            os.killpg(self.proc.pid, 0)
        except (ProcessLookupError, PermissionError):
            return False
        return has_live_member(self.proc.pid)

    def signal_group(self, signum: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signum)
