"""Whether a same-host peer's process still runs, whatever its sockets say; and what a child
forked from a rank may not touch.

A socket disconnect is not proof of death, nor its absence proof of life: a child made by
``fork()`` (a DataLoader worker, ``multiprocessing`` with the fork start method) inherits its
rank's ZeroMQ connections and shared-memory bells, so when the rank is SIGKILLed the child
keeps them open and its peers see neither a disconnect nor a bell hanging up. What the child
does not inherit is the rank's process. So every rank announces at the rendezvous (see
:func:`identity`) its pid, its start time (field 22 of ``/proc/<pid>/stat``, clock ticks
since boot: with the pid it names one process for the life of the host, whatever pid reuse
does) and its pid namespace; a rank watches each peer of its host and pid namespace
(:func:`watched`) through a :class:`Watch`:

- a **pidfd** (``os.pidfd_open``, Linux 5.3 or later), opened once at start-up and checked
  against the announced start time (a pid reused before it was opened is caught). It turns
  readable when the process has exited (a zombie included), and sits in the transport's poll
  beside its sockets, so a death wakes a waiting rank at once and costs nothing otherwise;
- where a pidfd cannot be opened, **/proc**: ``/proc/<pid>/stat`` read at most every
  ``PROC_LOOK_S`` seconds (gone, another start time, or state Z or X: the process ended).

Peers on other hosts, and peers whose announcement lacks a usable pid and start time, are
left to the transport's disconnect and heartbeat checks. The transport treats a watched peer
found dead like a dropped connection: unless its goodbye turns up within the grace, every
wait raises :class:`~ringcomm.errors.PeerLost` naming it.

The other half is the child: :func:`guard_fork` registers a transport, and in every child
forked from this process (``os.register_at_fork``) that transport's ``_forked_child`` runs
(see :mod:`.zmq_transport`): it closes the child's copies of the bells and pidfds (so a dead
rank's bells hang up even while its child lives) and makes the transport refuse use, since
ZeroMQ sockets cannot be closed safely in a forked child and must never be sent on from it.

>>> me = identity()            # {"pid": ..., "start": ..., "pidns": "pid:[4026531836]"}
>>> watch = Watch(watched(rank, table))
>>> watch.fds                  # {pidfd: peer}: poll them; readable -> watch.exited(fd)
>>> watch.look()               # the /proc-watched peers found gone (every PROC_LOOK_S at most)
"""
import contextlib
import logging
import os
import select
import weakref

log = logging.getLogger(__name__)

PROC_LOOK_S = 0.1  # how often /proc is read for a peer no pidfd watches (s)
# False: same-host peers are left to the disconnect and heartbeat checks, as peers on other
# hosts are (tests turn it off to see what a rank learns without it)
WATCH = True
_STARTTIME = 19  # field 22 of /proc/<pid>/stat, counted from field 3 (the state)


def _stat(pid):
    """``(state, start time)`` of process ``pid`` from ``/proc/<pid>/stat``, or ``None`` if
    there is no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            line = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # the command name (field 2) sits in parentheses and may hold spaces or ")": cut at the last
    fields = line[line.rfind(b")") + 2:].split()
    return fields[0].decode(), int(fields[_STARTTIME])


def start_time(pid):
    """Process ``pid``'s start time (clock ticks since boot), or ``None`` if unknown."""
    try:
        stat = _stat(pid)
    except (OSError, ValueError, IndexError):
        return None
    return None if stat is None else stat[1]


def _pid_namespace():
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def identity():
    """What this rank announces about its process at the rendezvous (JSON-ready)."""
    return {"pid": os.getpid(), "start": start_time(os.getpid()), "pidns": _pid_namespace()}


def _count(value):
    return type(value) is int and value >= 0


def watched(rank, table):
    """``{peer: (pid, start time)}`` of the peers in the rendezvous ``table`` that share this
    rank's host and pid namespace and announced a usable pid and start time."""
    me = table[rank]
    if not WATCH or not me.get("pidns") or not _count(me.get("start")):
        return {}
    found = {}
    for peer, entry in enumerate(table):
        if peer == rank or entry.get("host") != me.get("host") or entry.get("pidns") != me["pidns"]:
            continue
        pid, start = entry.get("pid"), entry.get("start")
        if _count(pid) and pid > 0 and pid != me.get("pid") and _count(start):
            found[peer] = (pid, start)
        else:
            log.warning("rank %d: rank %d announced no usable pid and start time; only its "
                        "connection tells whether it lives", rank, peer)
    return found


class Watch:
    """The processes of some peers, ``processes = {peer: (pid, start time)}``: ``fds`` maps
    each pidfd (poll it; readable: the process exited) to its peer, ``gone`` lists the peers
    whose process had already ended when the watch began; the rest are read in /proc by
    :meth:`look`."""

    def __init__(self, processes):
        self.fds = {}      # pidfd -> peer
        self.pids = {}     # peer -> pid
        self.gone = []     # peers found ended at start-up
        self._polled = {}  # peer -> (pid, start time): no pidfd, /proc is read instead
        for peer, (pid, start) in processes.items():
            self.pids[peer] = pid
            try:
                fd = os.pidfd_open(pid)
            except ProcessLookupError:
                self.gone.append(peer)
                continue
            except (AttributeError, OSError):  # an old kernel or Python, or a sandbox refusing it
                fd = None
            # the process with the pid now is the announced one only if it has the announced
            # start time (then it had the pid throughout, and the pidfd names it)
            try:
                stat = _stat(pid)
            except (OSError, ValueError, IndexError):
                stat = None
            reused = stat is not None and stat[1] != start
            if fd is not None:
                # (where /proc does not show it, the pidfd alone: a pid reused in the seconds
                # since the rendezvous would go unnoticed)
                if reused or _readable(fd):
                    os.close(fd)
                    self.gone.append(peer)
                else:
                    self.fds[fd] = peer
            elif reused:
                self.gone.append(peer)
            elif stat is not None:
                self._polled[peer] = (pid, start)
            else:  # neither a pidfd nor /proc shows it (hidden, or gone): its connection tells
                log.warning("cannot watch the process of rank %d (pid %d): no pidfd, and /proc "
                            "does not show it", peer, pid)

    @property
    def polled(self):
        """Whether some peer is watched through /proc (:meth:`look` has work)."""
        return bool(self._polled)

    def exited(self, fd):
        """The pidfd ``fd`` turned readable: close it and return its peer."""
        peer = self.fds.pop(fd)
        os.close(fd)
        return peer

    def look(self):
        """The /proc-watched peers whose process has ended since the last look."""
        ended = []
        for peer, (pid, start) in list(self._polled.items()):
            try:
                stat = _stat(pid)
            except (OSError, ValueError, IndexError):
                continue  # unreadable now: no verdict
            if stat is None or stat[1] != start or stat[0] in ("Z", "X"):
                del self._polled[peer]
                ended.append(peer)
        return ended

    def close(self):
        for fd in self.fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self.fds, self._polled = {}, {}


def _readable(fd):
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(0))


# -- forked children ----------------------------------------------------------------------
_guarded = weakref.WeakSet()  # transports of this process that a forked child must not use


def guard_fork(transport):
    """Make every child forked from now on call ``transport._forked_child()`` (until
    :func:`unguard_fork`)."""
    _guarded.add(transport)


def unguard_fork(transport):
    _guarded.discard(transport)


def _after_fork_in_child():
    guarded = list(_guarded)
    _guarded.clear()  # the child's own transports, if it makes any, register anew
    for transport in guarded:
        try:
            transport._forked_child()
        except Exception:  # noqa: BLE001 - a fork must never fail because of ringcomm
            log.exception("could not disarm a transport inherited through fork")


os.register_at_fork(after_in_child=_after_fork_in_child)
