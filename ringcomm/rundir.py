"""This user's private run directory: where a job's local sockets and secret files live.

Other users must not reach a rank's ``ipc://`` socket (a flood of connections could exhaust
its file descriptors) nor read a job's secret, so both live in one directory that only this
user can open, created with mode 0700:

1. ``RINGCOMM_RUN_DIR`` when set (the launcher sets it for its workers when it had to fall
   back, see 3.); refused if it is not a private directory of this user, as whoever set it
   chose it;
2. else ``$XDG_RUNTIME_DIR/ringcomm`` when that exists, else ``<tmp>/ringcomm-<uid>``;
3. when that one is not private (another user made it first, or others may open it), it is
   left alone, nothing in it used or removed, and a warning says so. The first private one
   of ``<it>-1`` ... ``<it>-4`` is used instead, or made: every process of a job reaches the
   same one on its own, as the ranks that share a secret file (:mod:`ringcomm.secret`) and
   the launcher that cleans up after its workers must. When another user holds those too, a
   fresh ``tempfile.mkdtemp`` directory is made, which only this process knows. Either way
   ``RINGCOMM_RUN_DIR`` is set to the one taken, so this process and those it starts (the
   launcher's workers) keep to it; ranks that another launcher (torchrun, mpirun) started
   each make their own fresh one, and then need ``RINGCOMM_SECRET`` (or
   ``RINGCOMM_RUN_DIR``) to share a job secret on one host.

Files are named after the process that made them (``<pid namespace>.<pid>-...``, see
:func:`owner`), so one left behind by a killed process is recognised and removed at the next
start-up (:func:`remove_stale`) and by the launcher when its workers end
(:func:`remove_owned_by`). A file made in another pid namespace (another container sharing
the directory) is never judged: its pid means nothing here.
"""
import contextlib
import logging
import os
import re
import stat
import tempfile

from .errors import CommError

ENV = "RINGCOMM_RUN_DIR"
FALLBACKS = 4  # <expected>-1 ... -4, tried in order before an unpredictable name
log = logging.getLogger(__name__)
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
    """The directory (created if missing; see the module for which); raises
    :class:`CommError` if ``RINGCOMM_RUN_DIR`` names one that is not private, or if none
    can be made."""
    chosen = os.environ.get(ENV)
    if chosen:
        why = _unsafe(chosen)
        if why:
            raise CommError(f"{ENV}={chosen} is not a private directory of this user ({why}; it "
                            f"must be a directory owned by uid {os.getuid()} with mode 0700, not a "
                            f"link); remove it, or unset {ENV}")
        return chosen
    expected = _expected()
    why = _unsafe(expected)
    if not why:
        return expected
    for n in range(1, FALLBACKS + 1):
        if not _unsafe(f"{expected}-{n}"):
            directory = f"{expected}-{n}"
            break
    else:
        try:
            directory = tempfile.mkdtemp(prefix=f"{os.path.basename(expected)}-",
                                         dir=os.path.dirname(expected))
        except OSError as exc:
            raise CommError(f"{expected} is not usable ({why}), nor is a fresh directory beside "
                            f"it: {exc}; set {ENV} to a private directory") from None
    # kept (an unpredictable name is known to this process alone) and passed on to the
    # processes it starts; the warning is given once
    os.environ[ENV] = directory
    log.warning("the private run directory %s is not usable (%s); using %s instead",
                expected, why, directory)
    return directory


def _expected():
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isdir(runtime) and os.access(runtime, os.W_OK):
        return os.path.join(runtime, "ringcomm")
    return os.path.join(tempfile.gettempdir(), f"ringcomm-{os.getuid()}")


def _unsafe(directory):
    """Why ``directory`` (created with mode 0700 if missing) is not this user's private
    directory, or "" when it is."""
    try:
        os.mkdir(directory, 0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        return f"cannot be created: {exc.strerror}"
    info = os.lstat(directory)
    if not stat.S_ISDIR(info.st_mode):
        return "not a directory"
    if info.st_uid != os.getuid():
        return f"owned by uid {info.st_uid}"
    if info.st_mode & 0o077:
        return f"mode {info.st_mode & 0o777:o} lets others in"
    return ""


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
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(directory, name))


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
