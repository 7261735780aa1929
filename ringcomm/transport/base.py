"""The wire: what a transport does, and nothing about collectives.

A transport moves (header, payload) messages between ranks identified by global rank
numbers; the keys and signatures it carries are opaque to it. It hands every arrival but its
own bookkeeping (goodbyes, lane announcements) to one ``deliver(header, payload)`` callback,
which its owner (:class:`ringcomm.session.Session`) sets with :meth:`attach`; what arrives
before that is held and delivered then. A new transport (plain TCP, UCX) implements these:

- ``post(dst, header, payload, copy)``: queue one message, never blocking;
- ``pump(timeout)``: deliver what arrived, waiting at most ``timeout`` seconds;
- ``flush(deadline, what)``: wait until every payload handed over may be reused;
- ``check_peers(what, src, members)``: raise :class:`PeerLost` for a peer known gone; ``lost()`` the
  peers gone for certain, ``forget(peers)`` those the survivors agreed on (see
  :mod:`ringcomm.elastic`);
- ``close(failure, waiting)``: goodbye to every peer, then release everything;
- and, where it has shared-memory lanes, the slots a device fills and reads directly.

>>> wire = LocalHub(2).transport(0)
>>> wire.attach(deliver, check)                # deliver(header, payload); check(what) raises
>>> wire.post(1, frame.pack(Kind.DATA, 0, key, 3, sig), b"abc")
"""
from abc import ABC, abstractmethod

from . import frame
from .frame import Kind


class Transport(ABC):
    lane_peers = frozenset()  # ranks reached through shared memory (see .zmq_transport)
    rejected = 0  # frames refused (malformed, or from the wrong sender)

    def __init__(self, rank, world_size):
        self.rank = rank
        self.world_size = world_size
        # global rank -> the name of its host (see rendezvous.host_id); one host unless told
        self.host_ids = (0,) * world_size
        # whether a thread waits for what this thread is waiting for: then a wait spins
        # before it sleeps; else it yields the core and the GIL to the caller's compute (the
        # engine sets it: see Engine.eager)
        self.eager = lambda: True
        self.before_unmap = []  # called before shared memory is unmapped at close (see ringcomm.device)
        self._early = []  # what arrived before attach()
        self.deliver = lambda header, payload: self._early.append((header, payload))
        self.check = lambda what: None  # what a wait inside the wire checks (see attach)

    def attach(self, deliver, check):
        """Hand every arrival to ``deliver(header, payload)`` from now on (and what came
        before, now); ``check(what)``: what a wait inside the wire (:meth:`flush`) checks as
        it goes round, raising to end it."""
        early, self._early = self._early, []
        self.deliver, self.check = deliver, check
        for header, payload in early:
            deliver(header, payload)

    # -- what every transport provides --------------------------------------------------
    @abstractmethod
    def post(self, dst, header, payload, copy=False):
        """Queue one message for ``dst``; must not block. ``payload`` stays untouched by
        the caller until :meth:`flush` returns. Returns a tracker (``.done``, ``.wait()``)
        when ZeroMQ reads ``payload`` in place, ``None`` when it was copied (always with
        ``copy=True``)."""

    @abstractmethod
    def pump(self, timeout):
        """Deliver arrived messages, waiting at most ``timeout`` seconds."""

    def send_data(self, dst, key, sig, payload, nbytes, copy):
        """One DATA message of ``nbytes`` (a transport may carry it another way)."""
        return self.post(dst, frame.pack(Kind.DATA, self.rank, key, nbytes, sig), payload, copy)

    def check_peers(self, what, src=None, members=None):  # noqa: B027 (a wire without it has nothing to do)
        """Raise :class:`PeerLost` if ``src`` (the one waited on), or a peer of ``members``
        (the waiting call's communicator; None: any peer), is known gone."""

    def lost(self):
        """The peers known gone for certain (said goodbye, process ended, connection dropped
        past a grace); a wire that cannot tell returns none."""
        return frozenset()

    def forget(self, peers):  # noqa: B027 (a wire that reports no losses has none to forget)
        """``peers`` are agreed lost: :meth:`check_peers` raises for them only when asked
        about one of them (``src``)."""

    def has_left(self, peer):
        """True once ``peer`` said goodbye (a wire that carries goodbyes says so)."""
        return False

    def flush(self, deadline, what):  # noqa: B027 (a wire without it has nothing to do)
        """Block until every payload handed to :meth:`post` may be reused by the caller."""

    def wake(self):  # noqa: B027 (a wire that never sleeps has nothing to cut short)
        """Safe from any thread: cut short the sleep of a wait in progress (a revocation
        then reaches it at once); a transport whose waits are short need do nothing."""

    def close(self, failure=None, waiting=lambda: True):  # noqa: B027 (a wire without it has nothing to do)
        """Tell peers this rank is done (``failure``: the first error a call failed with here,
        whose blame a goodbye carries) and release every resource; while ``waiting()`` (asked
        again at each pass: another thread may stop the owner meanwhile), flush and wait
        (bounded) for the peers' goodbyes first."""

    # -- lane slots a device copies into and out of (see ringcomm.device) -------------------
    def take_slot(self, dst, key, nbytes):
        """A lane slot to ``dst`` for an ``nbytes`` segment of ``key`` that would go through a
        lane: ``(slot, writable uint8 array over the whole slot)``; ``None`` where there is
        none (no lane, the wrong size, every slot in use). Fill it, then :meth:`send_slot`,
        or :meth:`give_back_slot`."""
        return None

    def send_slot(self, dst, key, sig, slot, nbytes):
        """Send the ``nbytes`` segment written into the taken ``slot`` to ``dst``."""
        raise NotImplementedError("this transport has no lanes")

    def give_back_slot(self, dst, slot):  # noqa: B027 (a wire without lanes has no slots)
        """Free a slot taken with :meth:`take_slot` and never sent."""

    def slot_of(self, payload):
        """The whole lane slot (a uint8 array) a received ``payload`` lies in, or ``None``."""
        return None
