"""The ZeroMQ transport's connections to its peers: made at start-up, proven, and lost.

:class:`Connections` is a part of :class:`~.zmq_transport.ZmqTransport`, as
:class:`~.same_host.SameHost` is (the transport's constructor calls ``_connect``, which makes
its attributes): one PUSH socket to every peer, each with a monitor in the transport's poll
(``_on_monitor``); the wait until every connection has proven the job secret
(``await_connections``); the goodbyes at close (``_say_goodbye``, ``_hang_up``); and what
every wait checks, whether the peer it waits for or sends to is gone (``_check_peers``,
``_check_open_to``).

Every peer is connected at start-up, so a peer that dies is noticed even when this rank was
not talking to it: the monitor on its PUSH socket reports the disconnection, and unless that
peer said BYE first, every wait raises :class:`PeerLost` naming it within ``grace`` seconds.
A disconnect is not proof of death, nor its absence proof of life: a child forked from a rank
holds copies of its connections, so a SIGKILLed rank with a child drops none. Peers on this
host are therefore also watched as processes (:mod:`.liveness`): a pidfd per peer sits in the
same poll as the sockets (or, where none can be opened, ``/proc`` is read every
``liveness.PROC_LOOK_S`` at most), and a peer whose process ended counts as disconnected from
that moment, with the same grace. Peers on other hosts have their disconnects and, at a
deadline, the liveness check (PING/PONG, see :mod:`.base`).

Goodbyes say why. A rank that closes after a call of its own failed puts in its BYE what that
failure blamed (``first_failure``: the first error a call failed with here, which
:mod:`ringcomm.collective` keeps), so that a peer waiting for it blames the rank that failed
first, not the survivor that closed (the encoding is :mod:`.goodbye`'s). A receiver waiting
for (or sending to) a rank whose BYE blames another raises :class:`PeerLost` naming the
blamed rank.

>>> # rank 0 of 3 waits for rank 2, SIGKILLed; rank 1, which lost rank 2 too, has closed:
>>> transport.recv(2, key, sig, deadline, "all_reduce")
PeerLost: all_reduce: rank 0 lost rank 2 (its process, pid 4242, ended without a goodbye: ...)
>>> transport.recv(1, key, sig, deadline, "all_reduce")   # blames rank 2, not rank 1
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
    def _connect(self, context, endpoints, socket_ids, guard, processes):
        """Connect one PUSH socket to every other rank r, at ``endpoints[r]``, with its monitor
        in the poll (a ``guard`` proves the job secret to the socket that published
        ``socket_ids[r]``), and watch the processes of the same-host peers in ``processes``
        (:func:`.liveness.watched`)."""
        self._push, self._monitor_peer = {}, {}
        for peer, endpoint in enumerate(endpoints):
            if peer == self.rank:
                continue
            sock = context.socket(zmq.PUSH)
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.setsockopt(zmq.LINGER, 0)
            # one connection per peer, never remade: a reconnect would replay the one-time
            # proof (refused by design), and a dropped connection means a lost peer
            sock.setsockopt(zmq.RECONNECT_IVL, -1)
            if guard is not None:
                guard.client(sock, self.rank, socket_ids[peer])
            monitor = sock.get_monitor_socket(_MONITOR_EVENTS)
            sock.connect(endpoint)
            self._push[peer] = sock
            self._monitor_peer[monitor] = peer
            self._poll_all.append((monitor, zmq.POLLIN))
        self._said_bye = set()
        self._gone_since = {}  # peer -> time its connection dropped (or its process ended)
        self._ready = set()  # peers whose connection completed the security handshake
        self._refused = {}   # peer -> handshake failure event
        self._bye_why = {}   # peer -> what its goodbye said went wrong (see goodbye.reason)
        # same-host peers watched as processes: a pidfd each in the poll, else /proc
        self._watch = liveness.Watch(processes or {})
        self._exited = set()  # peers whose process was seen to end
        self._next_look = 0.0  # when /proc may be read again (Watch.look)
        self._poll_all += [(fd, zmq.POLLIN) for fd in self._watch.fds]
        for peer in self._watch.gone:
            self._on_exited(peer)

    def await_connections(self, deadline):
        """Block until every peer connection completed its handshake (secret proven)."""
        while len(self._ready) < len(self._push):
            if self._refused:
                peer = next(iter(self._refused))
                raise CommError(f"rank {self.rank}: rank {peer} refused the connection "
                                f"(handshake failed: the ranks do not share the job secret "
                                f"RINGCOMM_SECRET, or disagree on RINGCOMM_ENCRYPT)")
            ended = sorted(self._exited - self._ready)
            if ended:
                raise PeerLost(f"rank {self.rank}: rank {ended[0]} (pid {self._watch.pids[ended[0]]}) "
                               f"ended before its connection was made", rank=ended[0])
            if time.monotonic() > deadline:
                missing = sorted(set(self._push) - self._ready)
                raise CommTimeout(f"rank {self.rank}: no secure connection to ranks {missing}")
            self._pump(0.05)

    def _check_open_to(self, dst):
        if dst in self._said_bye:
            words, blamed = self._how_closed(dst)
            raise PeerLost(f"rank {self.rank} cannot send to rank {dst}: it {words}", rank=blamed)

    def _how_closed(self, peer):
        """``peer``'s goodbye in words, and the rank to blame (see .goodbye)."""
        return goodbye.how_closed(self._bye_why.get(peer), peer, self.rank)

    def _on_monitor(self, monitor):
        event = recv_monitor_message(monitor, zmq.NOBLOCK)["event"]
        peer = self._monitor_peer[monitor]
        if event == zmq.EVENT_DISCONNECTED:
            self._gone_since.setdefault(peer, time.monotonic())
        elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            if peer not in self._exited:
                self._gone_since.pop(peer, None)
            self._ready.add(peer)
        elif event in _HANDSHAKE_FAILED:
            self._refused[peer] = event

    def _check_peers(self, what, src=None):
        if src in self._said_bye:
            words, blamed = self._how_closed(src)
            raise PeerLost(f"{what}: rank {src} {words}{',' if blamed != src else ''} before "
                           f"sending what rank {self.rank} waits for", rank=blamed)
        now = time.monotonic()
        if now >= self._next_look:  # /proc, for the peers no pidfd watches (none: never again)
            self._next_look = now + liveness.PROC_LOOK_S if self._watch.polled else math.inf
            for peer in self._watch.look():
                self._on_exited(peer)
        if not self._gone_since:
            return
        overdue = [p for p, t in self._gone_since.items()
                   if p not in self._said_bye and now - t > self.grace]
        if overdue:
            self._drain()  # a BYE may still sit unread behind the disconnection
            overdue = [p for p in overdue if p not in self._said_bye]
        if overdue:
            peer = overdue[0]
            if peer in self._exited:
                raise PeerLost(f"{what}: rank {self.rank} lost rank {peer} (its process, pid "
                               f"{self._watch.pids[peer]}, ended without a goodbye: it died or "
                               f"was killed)", rank=peer)
            raise PeerLost(f"{what}: rank {self.rank} lost rank {peer} (its connection dropped "
                           f"without a goodbye: the process died or was killed, or the network "
                           f"failed)", rank=peer)

    def _on_exited(self, peer):
        """``peer``'s process ended: from now on it counts as disconnected (see .liveness)."""
        self._exited.add(peer)
        self._gone_since.setdefault(peer, time.monotonic())

    # -- closing ---------------------------------------------------------------------------
    def _say_goodbye(self, deadline):
        """BYE to every peer, then wait until each said BYE too or is gone, or ``deadline``."""
        bye = frame.pack(Kind.BYE, self.rank, frame.Key(0, frame.COLLECTIVE, 0, 0, 0), 0,
                         goodbye.sig_for(self.first_failure))
        for sock in self._push.values():
            # that peer's connection is gone: nobody to say goodbye to
            with contextlib.suppress(zmq.Again):
                sock.send_multipart([bye, b""], zmq.NOBLOCK)
        while self._no_goodbye_yet() and time.monotonic() < deadline and self.stopping is None:
            self._pump(0.05)

    def _no_goodbye_yet(self):
        return [p for p in self._push if p not in self._said_bye and p not in self._gone_since]

    def _hang_up(self):
        """Close the PUSH sockets (a peer still owed a goodbye gets 500 ms of linger for its
        BYE) and their monitors."""
        linger = 500 if self._no_goodbye_yet() else 0
        for sock in self._push.values():
            sock.disable_monitor()
            sock.close(linger=linger)
        for monitor in self._monitor_peer:
            monitor.close(linger=0)
