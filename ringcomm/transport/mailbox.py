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
import struct
from collections import defaultdict

from ..errors import TIMEOUT_CAUSES, CollectiveMismatch, CommError, CommTimeout, PeerLost, SignatureMismatch
from .frame import Kind

log = logging.getLogger(__name__)

# an abort's signature field: error class, the rank it blames, why (a timeout's cause)
ABORT_SIG = struct.Struct("<BIB10x")
NO_RANK = 0xFFFFFFFF
# No rank finishes a collective before every rank has started it (broadcast and reduce
# agree first), so an honest peer sends for at most the collective after the one running
# here: data further ahead is refused (the real transport sets this; unit tests number freely)
MAX_LEAD = 2
ABORT_CLASSES = {1: CollectiveMismatch, 2: CommTimeout, 3: PeerLost, 4: CommError}
ABORT_CODES = {cls: code for code, cls in ABORT_CLASSES.items()}


def abort_code(exc):
    """The wire code of an exception's class (its most specific known base)."""
    for cls in type(exc).__mro__:
        if cls in ABORT_CODES:
            return ABORT_CODES[cls]
    return 4


class Mailbox:
    def __init__(self, window=None, max_lead=None):
        self.window = window  # point-to-point bytes a sender may leave unreceived here
        self.max_lead = max_lead  # how far past the last retired collective data may come
        self._p2p_pending = defaultdict(int)  # (src, comm, tag) -> point-to-point bytes not taken
        self._flooded = {}                    # (src, comm, tag) -> why its data was refused
        self._too_early = {}                  # (comm, seq) -> rank whose data for it was refused
        self._messages = {}
        self._signatures = defaultdict(dict)  # (comm, seq) -> {src: sig}
        self._aborts = {}                     # (comm, seq) -> exception to raise
        self._retired = {}                    # comm -> highest retired seq
        self._poison = {}                     # comm -> error for its next collective
        self._failed_upto = {}                # comm -> highest seq that failed here
        self.dropped = 0

    def put(self, header, payload):
        """File one validated message."""
        key = header.key
        if header.kind == Kind.ABORT and key.space != 0:
            self.dropped += 1  # aborts concern collectives only
            return
        if header.kind == Kind.ABORT:
            code, lost, cause = ABORT_SIG.unpack(header.sig)
            reason = bytes(payload).decode("utf-8", "replace")
            base = ABORT_CLASSES.get(code, CommError)

            def cls(message):
                exc = base(message)
                if lost != NO_RANK:
                    exc.rank = lost
                if base is CommTimeout and cause < len(TIMEOUT_CAUSES):
                    exc.cause = TIMEOUT_CAUSES[cause]
                return exc
            if key.seq <= self._failed_upto.get(key.comm_id, -1):
                # this rank failed that collective, or a later one: it has already told
                # its caller that something went wrong, and poisoning the next collective
                # would fail it on every rank a second time
                return
            if key.seq <= self._retired.get(key.comm_id, -1):
                # this rank already finished that collective without noticing (it only
                # sent); its next collective on the communicator fails instead, and is
                # itself aborted on every rank, so no rank goes on as if nothing happened
                self._poison[key.comm_id] = cls(
                    f"collective #{key.seq} on this communicator failed on rank {header.src}: {reason}")
                return
            exc = cls(f"rank {header.src} aborted: {reason}")
            exc.remote = True
            self._aborts[(key.comm_id, key.seq)] = exc
            return
        retired = self._retired.get(key.comm_id, -1) if key.space == 0 else None
        if retired is not None and key.seq <= retired:
            self.dropped += 1
            return
        if retired is not None and self.max_lead is not None and key.seq > retired + self.max_lead:
            # (after failures a rank may honestly run ahead: only that collective fails)
            if (key.comm_id, key.seq) not in self._too_early:
                log.error("rank %d sends data for collective #%d, more than one ahead of this "
                          "rank: refusing it", header.src, key.seq)
            self._too_early[(key.comm_id, key.seq)] = header.src
            self.dropped += 1
            return
        ident = (header.src, *key)
        if ident in self._messages:
            log.warning("dropping duplicate message %s from rank %d", key, header.src)
            self.dropped += 1
            return
        if key.space == 1 and self.window is not None:
            flow = (header.src, key.comm_id, key.step)  # a window per peer, communicator and tag
            nbytes, pending = memoryview(payload).nbytes, self._p2p_pending[flow]
            if pending and pending + nbytes > self.window:  # a sender ignoring its window
                if flow not in self._flooded:
                    log.error("rank %d sends point-to-point data with tag %d past the "
                              "flow-control window (%d bytes unreceived): refusing it",
                              header.src, key.step, pending)
                self._flooded[flow] = (f"{pending} bytes of point-to-point data with tag {key.step} "
                                       f"unreceived, past the flow-control window of {self.window}")
                self.dropped += 1
                return
            self._p2p_pending[flow] = pending + nbytes
        self._messages[ident] = (header.sig, payload)
        if key.space == 0:
            self._signatures[(key.comm_id, key.seq)].setdefault(header.src, header.sig)

    def raise_poison(self, comm_id):
        """Raise the error left for ``comm_id`` by an abort of a collective it finished."""
        if comm_id in self._poison:
            raise self._poison.pop(comm_id)

    def raise_abort(self, comm_id, seq):
        """Raise the abort another rank sent for collective ``seq``, if one has arrived."""
        abort = self._aborts.get((comm_id, seq))
        if abort is not None:
            raise abort

    def take(self, src, key, sig):
        """The payload of message ``key`` from ``src``, or ``None`` if it has not arrived.

        Raises the abort another rank sent for this collective, or :class:`SignatureMismatch`
        when any peer announced a different signature for it.
        """
        if key.space == 0:
            self.raise_poison(key.comm_id)
            early = self._too_early.get((key.comm_id, key.seq)) if self._too_early else None
            if early is not None:
                raise CommError(f"rank {early} sent data for this collective while this rank was "
                                f"more than one collective behind; it was refused")
            abort = self._aborts.get((key.comm_id, key.seq))
            if abort is not None:
                raise abort
            for peer, theirs in self._signatures.get((key.comm_id, key.seq), {}).items():
                if theirs != sig:
                    raise SignatureMismatch(peer, theirs, sig)
        if key.space == 1 and self._flooded and (src, key.comm_id, key.step) in self._flooded:
            raise CommError(f"rank {src} sent more than a well-behaved rank can "
                            f"({self._flooded[(src, key.comm_id, key.step)]}); its data was refused")
        item = self._messages.pop((src, *key), None)
        if item is None:
            return None
        if key.space == 1 and self.window is not None:
            self._p2p_pending[(src, key.comm_id, key.step)] -= memoryview(item[1]).nbytes
        if item[0] != sig:
            raise SignatureMismatch(src, item[0], sig)
        return item[1]

    def retired(self, comm_id):
        """The highest retired sequence number of ``comm_id`` (-1: none yet)."""
        return self._retired.get(comm_id, -1)

    def retire(self, comm_id, seq, failed=False):
        """Collective ``seq`` of ``comm_id`` is over: forget it and drop its stragglers."""
        self._retired[comm_id] = max(seq, self._retired.get(comm_id, -1))
        if failed:
            self._failed_upto[comm_id] = max(seq, self._failed_upto.get(comm_id, -1))
        self._signatures.pop((comm_id, seq), None)
        self._aborts.pop((comm_id, seq), None)
        if self._too_early:
            self._too_early = {k: v for k, v in self._too_early.items() if k[0] != comm_id or k[1] > seq}
        stale = [i for i in self._messages if i[1] == comm_id and i[2] == 0 and i[3] <= seq]
        for ident in stale:
            del self._messages[ident]
        self.dropped += len(stale)
