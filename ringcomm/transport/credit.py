"""Collective flow control: a rank that runs ahead of a slow peer waits, it is never refused.

Ranks of a communicator run its collectives in one order, but not in step. A collective
that succeeds needs every rank's part (rooted ones first exchange signatures with every
rank), so a rank finishes #s only once every peer has started it and runs at most about two
collectives ahead; but a collective can *fail* early on some ranks (a size mismatch between
two of them, an abort) while a slow peer (descheduled, stopped, on a loaded core) is still
collectives behind, and a queue of ``async_op`` calls that fail that way lets a rank run
arbitrarily far ahead. The peer must buffer whatever arrives early, so the sender is held back by a
*window* of ``W`` collectives per peer and communicator (``RINGCOMM_COLLECTIVE_WINDOW``,
default 16, the same on every rank): it sends data of collective ``s`` to peer ``p`` only
once it knows ``p`` has finished collective ``s − W`` or later. What a rank buffers for one
peer on one communicator is therefore bounded by

    W × (the most bytes that peer sends this rank in one collective)

plus point-to-point data (its own window of bytes per tag; see ``ringcomm.p2p``). A receiver
refuses collective data further ahead than that: only a peer that ignores its credits (a bug,
or someone holding the job secret) meets the refusal, and the error names it.

A sender learns how far its peer got by asking. Half a window before it would have to
stop, it sends a WANT naming the collective it is at; the peer answers with a GRANT carrying
how many collectives it has finished, at once if that already lets the sender on, otherwise
as soon as it finishes enough. Ranks that run in step thus exchange one WANT and one GRANT
per peer every ``W/2`` collectives and never wait; a rank far ahead waits, pumping messages,
until the GRANT comes or its collective's deadline passes, which then names the peer that
held it back.

>>> # on rank 0, window 16, about to send data of collective #40 to rank 1:
>>> credit.room(1, comm_id=0, seq=40)  # rank 1 last said it finished 20: False (WANT sent)
>>> credit.on_grant(1, comm_id=0, done=30)
>>> credit.room(1, comm_id=0, seq=40)  # True: 40 < 30 + 16
"""
import contextlib
import os

from ..errors import CommError
from . import frame
from .frame import Kind

# point-to-point bytes in flight to one peer before a send waits (see ringcomm.p2p and
# ringcomm.session; the rendezvous checks every rank has the same)
P2P_WINDOW_BYTES = int(os.environ.get("RINGCOMM_P2P_WINDOW_BYTES", 64 << 20))


class CollectiveCredit:
    """Both sides of the window for one rank: what it knows of its peers (as a sender) and
    the WANTs it has not answered yet (as a receiver). ``post(dst, header)`` queues a control
    message; ``finished(comm_id)`` is how many collectives of ``comm_id`` this rank finished."""

    def __init__(self, rank, window, post, finished):
        self.rank, self.window = rank, window
        self._post, self._finished = post, finished
        self._granted = {}  # (peer, comm) -> collectives that peer has finished, as last told
        self._asked = {}    # (peer, comm) -> the collective of this rank's WANT not yet granted
        self._wants = {}    # (peer, comm) -> the collective a peer waits to send data of
        self.stalls = 0     # times a send had to wait for a GRANT (for tests and reports)

    def room(self, dst, comm_id, seq):
        """True if data of collective ``seq`` may go to ``dst`` now. Asks for more (a WANT)
        when the window is half used, or used up, and nobody asked yet."""
        flow = (dst, comm_id)
        done = self._granted.get(flow, 0)
        if seq < done + self.window // 2:
            return True
        asked = self._asked.get(flow)
        open_now = seq < done + self.window
        if asked is None or (not open_now and asked < seq):
            self._asked[flow] = seq
            self._send(Kind.WANT, dst, comm_id, seq)
        return open_now

    def on_want(self, src, comm_id, seq):
        """Peer ``src`` waits to send data of collective ``seq``: grant it when it may."""
        done = self._finished(comm_id)
        if seq < done + self.window:
            self._send(Kind.GRANT, src, comm_id, done)
        else:
            flow = (src, comm_id)
            self._wants[flow] = max(seq, self._wants.get(flow, -1))

    def on_grant(self, src, comm_id, done):
        """Peer ``src`` has finished ``done`` collectives of ``comm_id``."""
        flow = (src, comm_id)
        done = max(done, self._granted.get(flow, 0))
        self._granted[flow] = done
        asked = self._asked.get(flow)
        if asked is not None and asked < done + self.window:
            del self._asked[flow]

    def on_retire(self, comm_id):
        """This rank finished another collective of ``comm_id``: answer the WANTs it allows."""
        if not self._wants:
            return
        done = self._finished(comm_id)
        for flow, seq in list(self._wants.items()):
            if flow[1] == comm_id and seq < done + self.window:
                del self._wants[flow]
                self._send(Kind.GRANT, flow[0], comm_id, done)

    def _send(self, kind, dst, comm_id, seq):
        header = frame.pack(kind, self.rank, frame.Key(comm_id, frame.COLLECTIVE, seq, 0, 0), 0, bytes(16))
        # that peer is gone: its liveness check reports it, not this
        with contextlib.suppress(CommError):
            self._post(dst, header, b"")
