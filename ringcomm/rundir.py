"""This user's private run directory: where a job's local sockets and secret files live.

Other users must not reach a rank's ``ipc://`` socket (a flood of connections could exhaust
its file descriptors) nor read a job's secret, so both live in one directory that only this
user can open: ``$XDG_RUNTIME_DIR/ringcomm`` when that exists, else
``<tmp>/ringcomm-<uid>``, created with mode 0700. A directory found there that another user
owns, or that others may open, is refused rather than used.

Files are named after the process that made them (``<pid namespace>.<pid>-...``, see
:func:`owner`), so one left behind by a killed process is recognised and removed at the next
start-up (:func:`remove_stale`) and by the launcher when its workers end
(:func:`remove_owned_by`). A file made in another pid namespace (another container sharing
the directory) is never judged: its pid means nothing here.
"""
import os
import re
import stat
import tempfile

from .errors import CommError

_OWNED = re.compile(r"(\d+)\.(\d+)-")


def _namespace():
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def owner(pid=None):
    """``<pid namespace>.<pid>``: who made a file, as its name (or content) records it."""
    return f"{_namespace()}.{os.getpid() if pid is None else pid}"


def owner_gone(tag):
    """True if ``tag`` (from :func:`owner`) names a process of this namespace that is gone."""
    match = _OWNED.match(tag + "-")
    return bool(match) and int(match.group(1)) == _namespace() and not alive(int(match.group(2)))


def path():
    """The directory (created if missing); raises :class:`CommError` if it is not private."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isdir(runtime) and os.access(runtime, os.W_OK):
        directory = os.path.join(runtime, "ringcomm")
    else:
        directory = os.path.join(tempfile.gettempdir(), f"ringcomm-{os.getuid()}")
    try:
        os.mkdir(directory, 0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        raise CommError(f"cannot create the private run directory {directory}: {exc}") from None
    info = os.lstat(directory)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise CommError(f"{directory} is not a private directory of this user (it must be a "
                        f"directory owned by uid {os.getuid()} with mode 0700, not a link); "
                        f"remove it, or set XDG_RUNTIME_DIR to a private directory")
    return directory


def alive(pid):
    """True if a process ``pid`` exists (possibly another user's)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_where(directory, doomed):
    """Remove every file of ``directory`` whose name ``doomed(name)`` condemns."""
    for name in os.listdir(directory):
        if doomed(name):
            try:
                os.unlink(os.path.join(directory, name))
            except OSError:
                pass


def remove_stale(directory):
    """Remove files that processes which no longer exist left in ``directory``."""
    remove_where(directory, lambda name: owner_gone(name.split("-", 1)[0]))


def remove_owned_by(pids):
    """Remove what the (ended) processes ``pids`` left in the run directory."""
    try:
        directory = path()
    except CommError:
        return
    prefixes = tuple(f"{owner(pid)}-" for pid in pids)
    remove_where(directory, lambda name: name.startswith(prefixes))
