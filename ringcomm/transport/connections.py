"""The ZeroMQ transport's connections to its peers: made at start-up, proven, and lost.

:class:`Connections` owns them; :class:`~.zmq_transport.ZmqTransport` makes one (as it makes
its :class:`~.same_host.SameHost`), polls the sockets and pidfds it holds, and calls it: one
PUSH socket to every peer, each with a monitor socket in the transport's poll
(:meth:`~Connections.on_monitor`); the wait until every connection has proven the job secret
(:meth:`~Connections.connected`); the goodbyes at close (:meth:`~Connections.say_goodbye`,
:meth:`~Connections.close`); and what every wait checks, whether the peer it waits for or
sends to is gone (:meth:`~Connections.check_peers`, ``said_bye``).

Every peer is connected at start-up, so a peer that dies is noticed even when this rank was
not talking to it: the monitor on its PUSH socket reports the disconnection, and unless that
peer said BYE first, every wait raises :class:`PeerLost` naming it within ``grace`` seconds.
A disconnect is not proof of death, nor its absence proof of life: a child forked from a rank
holds copies of its connections, so a SIGKILLed rank with a child drops none. Peers on this
host are therefore also watched as processes (:mod:`.liveness`): a pidfd per peer sits in the
same poll as the sockets (or, where none can be opened, ``/proc`` is read every
``liveness.PROC_LOOK_S`` at most), and a peer whose process ended counts as disconnected from
that moment, with the same grace. Peers on other hosts have their disconnects and, at a
deadline, the liveness check (PING/PONG, see :mod:`ringcomm.session`).

Goodbyes say why. A rank that closes after a call of its own failed puts in its BYE what that
failure blamed (``first_failure``: the first error a call failed with here, which
:mod:`ringcomm.collective` keeps), so that a peer waiting for it blames the rank that failed
first, not the survivor that closed (the encoding is :mod:`.goodbye`'s). A receiver waiting
for (or sending to) a rank whose BYE blames another raises :class:`PeerLost` naming the
blamed rank.

>>> # rank 0 of 3 waits for rank 2, SIGKILLed; rank 1, which lost rank 2 too, has closed:
>>> session.recv(2, key, sig, deadline, "all_reduce")     # (ringcomm.session, over this wire)
PeerLost: all_reduce: rank 0 lost rank 2 (its process, pid 4242, ended without a goodbye: ...)
>>> session.recv(1, key, sig, deadline, "all_reduce")     # blames rank 2, not rank 1
PeerLost: all_reduce: rank 1 closed after losing rank 2, before sending what rank 0 waits for
"""
import contextlib
import math
import time

import zmq
from zmq.utils.monitor import recv_monitor_message

from ..errors import CommError, CommTimeout, PeerLost
from . import frame, goodbye, liveness
from .frame import Kind

_MONITOR_EVENTS = (zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED |
                   zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL |
                   zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
_HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_AUTH, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
                     zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)


class Connections:
    """Owns this rank's connections to the other ranks of ``world_size``: one PUSH socket to every
    peer r (``push``), connected to ``endpoints[r]`` (a ``guard`` proves the job secret to
    the socket that published ``socket_ids[r]``), its monitor socket (``monitors``, monitor ->
    peer) for the transport's poll; the processes of the same-host peers in ``processes``
    watched (``watch``, a :class:`~.liveness.Watch`, whose pidfds the transport polls too);
    and what became of each peer: ``said_bye`` (the peers that said goodbye), when each was
    lost, and why. ``drain()`` lets in what has arrived (a BYE may sit unread behind a
    disconnection); a peer lost for longer than ``grace`` seconds fails every wait.

    >>> # rank 0 of 2; rank 1 makes its own to rank 0
    >>> connections = Connections(rank=0, world_size=2, context=ctx, endpoints=endpoints,
    ...                           grace=1.0, drain=transport._drain)
    >>> while not connections.connected(deadline):  # raises if rank 1 refused or ended
    ...     transport.pump(0.05)                     # which calls on_monitor(monitor)
    >>> connections.check_peers("all_reduce", 1)     # raises PeerLost once rank 1 is gone
    """

    def __init__(self, *, rank, world_size, context, endpoints, socket_ids=None, guard=None,
                 processes=None, grace=1.0, drain):
        self.rank, self.world_size, self.grace, self._drain = rank, world_size, grace, drain
        self.push, self.monitors = {}, {}  # peer -> PUSH socket; monitor socket -> peer
        for peer, endpoint in enumerate(endpoints):
            if peer == rank:
                continue
            sock = context.socket(zmq.PUSH)
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.setsockopt(zmq.LINGER, 0)
            # one connection per peer, never remade: a reconnect would replay the one-time
            # proof (refused by design), and a dropped connection means a lost peer
            sock.setsockopt(zmq.RECONNECT_IVL, -1)
            if guard is not None:
                guard.client(sock, rank, socket_ids[peer])
            monitor = sock.get_monitor_socket(_MONITOR_EVENTS)
            sock.connect(endpoint)
            self.push[peer] = sock
            self.monitors[monitor] = peer
        self.said_bye = set()
        self._gone_since = {}  # peer -> time its connection dropped (or its process ended)
        self._ready = set()  # peers whose connection completed the security handshake
        self._refused = {}   # peer -> handshake failure event
        self._bye_why = {}   # peer -> what its goodbye said went wrong (see goodbye.reason)
        # same-host peers watched as processes: a pidfd each in the poll, else /proc
        self.watch = liveness.Watch(processes or {})
        self._exited = set()  # peers whose process was seen to end
        self._next_look = 0.0  # when /proc may be read again (Watch.look)
        self.forgotten = set()  # lost peers the survivors agreed on (see forget)
        for peer in self.watch.gone:
            self._on_exited(peer)

    def connected(self, deadline):
        """True once every peer connection completed its handshake (secret proven); False
        while some have not. Raises when one was refused, its peer ended, or ``deadline``
        passed."""
        if len(self._ready) >= len(self.push):
            return True
        if self._refused:
            peer = next(iter(self._refused))
            raise CommError(f"rank {self.rank}: rank {peer} refused the connection "
                            f"(handshake failed: the ranks do not share the job secret "
                            f"RINGCOMM_SECRET, or disagree on RINGCOMM_ENCRYPT)")
        ended = sorted(self._exited - self._ready)
        if ended:
            raise PeerLost(f"rank {self.rank}: rank {ended[0]} (pid {self.watch.pids[ended[0]]}) "
                           f"ended before its connection was made", rank=ended[0])
        if time.monotonic() > deadline:
            missing = sorted(set(self.push) - self._ready)
            raise CommTimeout(f"rank {self.rank}: no secure connection to ranks {missing}")
        return False

    def refuse_send(self, dst):
        """Raise :class:`PeerLost`: ``dst`` said goodbye (the caller checked ``said_bye``)."""
        words, blamed = self._how_closed(dst)
        raise PeerLost(f"rank {self.rank} cannot send to rank {dst}: it {words}", rank=blamed)

    def _how_closed(self, peer):
        """``peer``'s goodbye in words, and the rank to blame (see .goodbye)."""
        return goodbye.how_closed(self._bye_why.get(peer), peer, self.rank)

    def on_bye(self, peer, sig):
        """``peer`` said goodbye; ``sig`` is what its BYE said went wrong (see .goodbye)."""
        self.said_bye.add(peer)
        if sig != goodbye.PLAIN:
            self._bye_why[peer] = goodbye.reason(sig, self.world_size)

    def on_monitor(self, monitor):
        """``monitor`` woke the poll: take in its event."""
        event = recv_monitor_message(monitor, zmq.NOBLOCK)["event"]
        peer = self.monitors[monitor]
        if event == zmq.EVENT_DISCONNECTED:
            self._gone_since.setdefault(peer, time.monotonic())
        elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            if peer not in self._exited:
                self._gone_since.pop(peer, None)
            self._ready.add(peer)
        elif event in _HANDSHAKE_FAILED:
            self._refused[peer] = event

    def on_pidfd(self, fd):
        """The pidfd ``fd`` (of ``watch.fds``) woke the poll: that peer's process ended (the
        pidfd is closed: it leaves the poll)."""
        self._on_exited(self.watch.exited(fd))

    def check_peers(self, what, src=None, members=None):
        """Raise :class:`PeerLost` if ``src`` said goodbye, or a peer (of ``members``, the
        waiting call's communicator, when given) is lost since longer than ``grace``."""
        if src in self.said_bye:
            words, blamed = self._how_closed(src)
            raise PeerLost(f"{what}: rank {src} {words}{',' if blamed != src else ''} before "
                           f"sending what rank {self.rank} waits for", rank=blamed)
        now = time.monotonic()
        if now >= self._next_look:
            self._look(now)
        if not self._gone_since:
            return
        forgotten = self.forgotten
        overdue = [p for p, t in self._gone_since.items()
                   if p not in self.said_bye and now - t > self.grace and (p not in forgotten or p == src)
                   and (members is None or p in members)]
        if overdue:
            self._drain()  # a BYE may still sit unread behind the disconnection
            overdue = [p for p in overdue if p not in self.said_bye]
        if overdue:
            peer = overdue[0]
            if peer in self._exited:
                raise PeerLost(f"{what}: rank {self.rank} lost rank {peer} (its process, pid "
                               f"{self.watch.pids[peer]}, ended without a goodbye: it died or "
                               f"was killed)", rank=peer)
            raise PeerLost(f"{what}: rank {self.rank} lost rank {peer} (its connection dropped "
                           f"without a goodbye: the process died or was killed, or the network "
                           f"failed)", rank=peer)

    def _look(self, now):
        """Read /proc for the peers no pidfd watches (none: never again)."""
        self._next_look = now + liveness.PROC_LOOK_S if self.watch.polled else math.inf
        for peer in self.watch.look():
            self._on_exited(peer)

    def lost(self):
        """The peers definitely gone: those that said goodbye or whose process ended, and
        those whose connection dropped longer than ``grace`` ago (evidence, never a guess
        from silence: what :mod:`ringcomm.agreement` rests on)."""
        now = time.monotonic()
        if now >= self._next_look:
            self._look(now)
        gone = self._gone_since
        return frozenset({*self.said_bye, *self._exited, *(p for p in gone if now - gone[p] > self.grace)})

    def forget(self, peers):
        """``peers`` are lost and the survivors agreed on it: a wait for another peer no
        longer raises for them (a wait for one of them still does)."""
        self.forgotten |= set(peers)

    def _on_exited(self, peer):
        """``peer``'s process ended: from now on it counts as disconnected (see .liveness)."""
        self._exited.add(peer)
        self._gone_since.setdefault(peer, time.monotonic())

    # -- closing ---------------------------------------------------------------------------
    def say_goodbye(self, failure):
        """BYE to every peer, saying whom ``failure`` (this rank's first, or ``None``)
        blamed (the transport then waits while some are :meth:`owed_goodbye`)."""
        bye = frame.pack(Kind.BYE, self.rank, frame.Key(0, frame.COLLECTIVE, 0, 0, 0), 0,
                         goodbye.sig_for(failure))
        for sock in self.push.values():
            # that peer's connection is gone: nobody to say goodbye to
            with contextlib.suppress(zmq.Again):
                sock.send_multipart([bye, b""], zmq.NOBLOCK)

    def owed_goodbye(self):
        """The peers that neither said goodbye nor are gone."""
        return [p for p in self.push if p not in self.said_bye and p not in self._gone_since]

    def close(self):
        """Close the PUSH sockets (a peer still owed a goodbye gets 500 ms of linger for its
        BYE), their monitors and the pidfds."""
        linger = 500 if self.owed_goodbye() else 0
        for sock in self.push.values():
            sock.disable_monitor()
            sock.close(linger=linger)
        for monitor in self.monitors:
            monitor.close(linger=0)
        self.watch.close()
