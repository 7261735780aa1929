"""Messages that arrived before anyone asked for them.

Messages from different peers arrive interleaved on one socket; the mailbox keeps each one
under its full identity (src, comm, space, seq, step, segment) until the algorithm asks for
exactly that one. It also remembers, per collective, the signature each peer announced, so a
rank that waits for one peer learns of a mismatch sent by any other, and the abort reasons
other ranks sent.

A collective that finished is *retired*: late messages for it (from a collective that failed
half-way) are dropped, never delivered to a later collective.
"""
import logging
from collections import defaultdict

from ..errors import CollectiveMismatch, CommError, CommTimeout, PeerLost, SignatureMismatch
from .frame import Kind

log = logging.getLogger(__name__)

ABORT_CLASSES = {1: CollectiveMismatch, 2: CommTimeout, 3: PeerLost, 4: CommError}
ABORT_CODES = {cls: code for code, cls in ABORT_CLASSES.items()}


def abort_code(exc):
    """The wire code of an exception's class (its most specific known base)."""
    for cls in type(exc).__mro__:
        if cls in ABORT_CODES:
            return ABORT_CODES[cls]
    return 4


class Mailbox:
    def __init__(self):
        self._messages = {}
        self._signatures = defaultdict(dict)  # (comm, seq) -> {src: sig}
        self._aborts = {}                     # (comm, seq) -> exception to raise
        self._retired = {}                    # comm -> highest retired seq
        self.dropped = 0

    def put(self, header, payload):
        """File one validated message."""
        key = header.key
        if header.kind == Kind.ABORT:
            code = header.sig[0] if header.sig else 4
            reason = bytes(payload).decode("utf-8", "replace")
            exc = ABORT_CLASSES.get(code, CommError)(f"rank {header.src} aborted: {reason}")
            exc.remote = True
            self._aborts[(key.comm_id, key.seq)] = exc
            return
        if key.space == 0 and key.seq <= self._retired.get(key.comm_id, -1):
            self.dropped += 1
            return
        ident = (header.src, *key)
        if ident in self._messages:
            log.warning("dropping duplicate message %s from rank %d", key, header.src)
            self.dropped += 1
            return
        self._messages[ident] = (header.sig, payload)
        if key.space == 0:
            self._signatures[(key.comm_id, key.seq)].setdefault(header.src, header.sig)

    def take(self, src, key, sig):
        """The payload of message ``key`` from ``src``, or ``None`` if it has not arrived.

        Raises the abort another rank sent for this collective, or :class:`SignatureMismatch`
        when any peer announced a different signature for it.
        """
        if key.space == 0:
            abort = self._aborts.get((key.comm_id, key.seq))
            if abort is not None:
                raise abort
            for peer, theirs in self._signatures.get((key.comm_id, key.seq), {}).items():
                if theirs != sig:
                    raise SignatureMismatch(peer, theirs, sig)
        item = self._messages.pop((src, *key), None)
        if item is None:
            return None
        if item[0] != sig:
            raise SignatureMismatch(src, item[0], sig)
        return item[1]

    def retire(self, comm_id, seq):
        """Collective ``seq`` of ``comm_id`` is over: forget it and drop its stragglers."""
        self._retired[comm_id] = max(seq, self._retired.get(comm_id, -1))
        self._signatures.pop((comm_id, seq), None)
        self._aborts.pop((comm_id, seq), None)
        stale = [i for i in self._messages if i[1] == comm_id and i[2] == 0 and i[3] <= seq]
        for ident in stale:
            del self._messages[ident]
        self.dropped += len(stale)
