"""What every transport offers the layers above, and the receive loop they share.

A transport moves (header, payload) messages between ranks identified by global rank
numbers. It knows nothing about collectives: the keys and signatures it carries are opaque
to it. Subclasses implement how bytes move (``_post``, ``_pump``) and how a lost peer is
noticed (``_check_peers``); the waiting, deadlines and mailbox logic live here once.
"""
import time
from abc import ABC, abstractmethod

from ..errors import CommTimeout
from . import frame
from .frame import Kind
from .mailbox import ABORT_SIG, NO_RANK, Mailbox, abort_code


class Transport(ABC):
    lane_peers = frozenset()  # ranks reached through shared memory (see .zmq_transport)

    def __init__(self, rank, world_size):
        self.rank = rank
        self.world_size = world_size
        self.mailbox = Mailbox()

    # -- what subclasses provide -------------------------------------------------------
    @abstractmethod
    def _post(self, dst, header, payload, copy=False):
        """Queue one message for ``dst``; must not block. ``payload`` stays untouched by
        the caller until :meth:`flush` returns. Returns a tracker (``.done``, ``.wait()``)
        when ZeroMQ reads ``payload`` in place, ``None`` when it was copied (always with
        ``copy=True``)."""

    @abstractmethod
    def _pump(self, timeout):
        """Move arrived messages into the mailbox, waiting at most ``timeout`` seconds."""

    def _check_peers(self, what, src=None):
        """Raise :class:`PeerLost` if a peer (or ``src``, the one waited on) is known gone."""

    def flush(self, deadline, what):
        """Block until every payload handed to :meth:`send` may be reused by the caller."""

    def close(self):
        """Tell peers this rank is done and release every resource."""

    # -- the shared part ---------------------------------------------------------------
    def send(self, dst, key, sig, payload, copy=False):
        """Send ``payload`` (a contiguous array or bytes) to global rank ``dst``; returns
        the tracker of a zero-copy send, else ``None``. ``copy=True``: never zero-copy."""
        nbytes = payload.nbytes if hasattr(payload, "nbytes") else len(payload)
        return self._post(dst, frame.pack(Kind.DATA, self.rank, key, nbytes, sig), payload, copy)

    def pump(self, timeout):
        """Let arrived messages in (used by the engine while deferred work waits)."""
        self._pump(timeout)

    def poll(self, src, key, sig, deadline, what):
        """Like :meth:`recv` but never waits: the payload, or ``None`` if not here yet."""
        payload = self.mailbox.take(src, key, sig)
        if payload is None:
            self._check_peers(what, src)
            if time.monotonic() > deadline:
                raise CommTimeout(f"{what}: timed out waiting for rank {src}; rank {self.rank} gave up")
        return payload

    def recv(self, src, key, sig, deadline, what):
        """The payload of message ``key`` from global rank ``src`` (a buffer), waiting
        until ``deadline`` (``time.monotonic()``) at most."""
        while True:
            payload = self.mailbox.take(src, key, sig)
            if payload is not None:
                return payload
            self._check_peers(what, src)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise CommTimeout(
                    f"{what}: timed out waiting for rank {src} "
                    f"(step {key.step}, segment {key.segment}); rank {self.rank} gave up")
            self._pump(min(remaining, 0.1))

    def abort(self, peers, comm_id, seq, exc):
        """Tell ``peers`` (global ranks) that collective ``seq`` failed here, and why."""
        reason = str(exc).encode("utf-8")[: frame.MAX_ABORT_BYTES]
        lost = getattr(exc, "rank", None)
        sig = ABORT_SIG.pack(abort_code(exc), NO_RANK if lost is None else lost)
        key = frame.Key(comm_id, 0, seq, 0, 0)
        for dst in peers:
            if dst != self.rank:
                self._post(dst, frame.pack(Kind.ABORT, self.rank, key, len(reason), sig), reason)

    def retire(self, comm_id, seq, failed=False):
        self.mailbox.retire(comm_id, seq, failed)
